"""Child of data_test: what `poisson_batches` holds beyond its data.

Usage: poisson_memory_check.py MEGABYTES

Makes a float32 array of MEGABYTES (the features of every example), then
three times in turn builds `poisson_batches` over it, takes a few batches
and lets the pipeline go, as a process training one run after another does.
Prints one line `RESULT {json}`: the array's bytes, the resident memory with
the array (VmRSS of /proc/self/status), after each pipeline (VmRSS) and its
peak meanwhile (VmHWM), and the sums of the batches (to check that they hold
the array's rows). A separate process, so that no other test's allocations
blur the measurement.
"""

import gc
import json
import sys
import warnings

import numpy as np

from data_source_memory_check import _reset_peak
from data_source_memory_check import _status
from tf_dpadam import data as dp_data


def main(argv):
    megabytes = int(argv[1])
    width = 1024
    rows = megabytes * 2**20 // (4 * width)
    x = np.ones((rows, width), np.float32)
    y = np.zeros(rows, np.int32)
    peak_reset = _reset_peak()
    before = _status("VmRSS")
    after, sums = [], []
    for seed in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the explicit seed's warning
            batches = dp_data.poisson_batches(
                (x, y), expected_batch_size=64, steps_per_epoch=5, seed=seed)
        sums += [float(np.sum(batch[0])) for batch in batches.dataset]
        del batches
        gc.collect()
        after.append(_status("VmRSS"))
    print("RESULT " + json.dumps({
        "array_bytes": x.nbytes, "width": width, "before": before,
        "after": after, "peak": _status("VmHWM"), "peak_reset": peak_reset,
        "sums": sums,
    }))


if __name__ == "__main__":
    main(sys.argv)
