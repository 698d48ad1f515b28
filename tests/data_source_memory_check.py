"""Child of data_source_test: Poisson batches from a large ArrayRecord file.

Usage: data_source_memory_check.py FEATURES EXPECTED_BATCH STEPS SEED

Imports TensorFlow, then waits for the path of an ArrayRecord file on its
standard input (so that the parent can write the file meanwhile), and reads
that file (records: an int64 index, then FEATURES
float32 values, the first equal to the index and the others 1, 2, ...)
through `poisson_batches_from_source` for STEPS logical steps, and prints one
line `RESULT {json}` with the resident memory before and after (bytes of
VmRSS / VmHWM of /proc/self/status), the batch sizes, the histogram of the
per-example inclusion counts, the counts per block of 1,000 consecutive
examples, and the number of steps whose records were not exactly those that
the sampler drew for that step. A separate process, so that no other test's
allocations blur the measurement.
"""

import json
import os
import sys
import time
import warnings

import numpy as np
import tensorflow as tf
from array_record.python import array_record_data_source

from tf_dpadam import data as dp_data
from tf_dpadam.data import source as data_source
from tf_dpadam.data import sampling

_BLOCK = 1000


def _status(field):
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak():
    """Resets VmHWM to the current VmRSS (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def main(argv):
    features, expected_batch, steps, seed = map(int, argv[1:])
    path = sys.stdin.readline().strip()
    dtype = np.dtype([("index", "<i8"), ("x", "<f4", (features,))])
    pattern = np.arange(1, features, dtype=np.float32)

    def decode(records):
        rows = np.frombuffer(b"".join(records), dtype)
        return rows["x"], rows["index"]

    # The interpreter: Python, NumPy, TensorFlow, array_record, tf_dpadam.
    peak_reset = _reset_peak()
    before = _status("VmRSS")
    start = time.monotonic()

    source = array_record_data_source.ArrayRecordDataSource([path])
    num_examples = len(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the explicit seed's warning
        batches = dp_data.poisson_batches_from_source(
            source, expected_batch_size=expected_batch, decode=decode,
            steps_per_epoch=steps, seed=seed,
        )
    k = batches.accumulation_steps
    counts = np.zeros(num_examples, np.int32)
    sizes, mismatched_steps, bad_records = [], 0, 0
    sampled_rss = before
    # A fresh nonce stream starts where the pipeline's first pass does.
    nonces = iter(sampling.step_nonces().take(steps))
    step = []
    for bx, by, bw in batches.dataset:
        real = bw.numpy() > 0
        step.append((bx.numpy()[real], by.numpy()[real]))
        if len(step) < k:
            continue
        x = np.concatenate([rows for rows, _ in step])
        read = np.concatenate([index for _, index in step])
        step = []
        drawn = dp_data.poisson_subset(
            num_examples, batches.sampling_rate,
            data_source.step_generator(seed, int(next(nonces))),
        )
        mismatched_steps += not np.array_equal(read, drawn)
        # Each record holds its own index: the rows are the records read.
        bad_records += int(np.sum(x[:, 0] != read))
        bad_records += int(np.sum(np.any(x[:, 1:] != pattern, axis=1)))
        counts[read] += 1
        sizes.append(len(read))
        sampled_rss = max(sampled_rss, _status("VmRSS"))
    seconds = time.monotonic() - start
    after = _status("VmRSS")
    peak = max(sampled_rss, _status("VmHWM")) if peak_reset else sampled_rss
    result = {
        "num_examples": num_examples,
        "sampling_rate": batches.sampling_rate,
        "accumulation_steps": k,
        "capacity": batches.capacity,
        "rss_before": before,
        "rss_after": after,
        "rss_peak": peak,
        "peak_from_hwm": peak_reset,
        "seconds": seconds,
        "sizes": sizes,
        "mismatched_steps": mismatched_steps,
        "bad_records": bad_records,
        "count_histogram": np.bincount(counts).tolist(),
        "block_counts": counts.reshape(-1, _BLOCK).sum(axis=1).tolist(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access  # skips TF's teardown


if __name__ == "__main__":
    tf.get_logger().setLevel("ERROR")
    main(sys.argv)
