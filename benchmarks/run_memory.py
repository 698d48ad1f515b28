"""Resident memory across consecutive training runs in one process.

    python -m benchmarks.run_memory [--megabytes=1000] [--runs=4]

A study process (`research.reproduce`) trains its runs one after another
on the same in-memory features. This trains `--runs` small DP runs
(`research.training.fit_private`, a Dense head, 40 steps) on one float32
array of about `--megabytes` and prints the process's resident memory
before and after each (after `keras.backend.clear_session`, the garbage
collector and glibc's `malloc_trim`), in MB.

Measured 2026-11-24 (1,000 MB array), when the pipeline held the array
in a tf.Variable: 1,635 MB before run 0, 2,811 after it (the variable),
3,744 after run 1, then flat (3,751, 3,757). The second run left one more
copy resident although no large tf.Variable was alive, and neither
malloc_trim nor MALLOC_MMAP_THRESHOLD_ changed it; with
TF_ENABLE_ONEDNN_OPTS=0 it went away, so it was oneDNN's CPU allocator
keeping the regions it frees. The SST-2 studies' processes rose once from
9 to 13 GB the same way (3.3 GB of features). Since the pipeline takes the
rows from the caller's array with NumPy (`sampling.gather_rows`): 1,763,
1,783, 1,797, 1,810 MB after runs 0-3.
"""

import ctypes
import gc

from absl import app
from absl import flags
import keras
import numpy as np

from research import common
from research import runs
from research import training

FLAGS = flags.FLAGS
flags.DEFINE_integer("megabytes", 1000, "Size of the training array.")
flags.DEFINE_integer("runs", 4, "Consecutive runs.")

_WIDTH = 4096
_STEPS = 40
_BATCH = 256


def resident_megabytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("No VmRSS in /proc/self/status.")


def main(argv):
    del argv
    rows = max(_BATCH, FLAGS.megabytes * 2**20 // (4 * _WIDTH))
    x = np.random.default_rng(0).standard_normal((rows, _WIDTH),
                                                 dtype=np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    print(f"array {x.nbytes / 2**20:.0f} MB; resident "
          f"{resident_megabytes():.0f} MB")
    base = common.base_config(
        "fashion_mnist", l2_norm_clip=1.0, noise_multiplier=1.0,
        batch_size=_BATCH, target_epsilon=0, epochs=_STEPS * _BATCH / rows,
        eval_every=_STEPS // 2)
    setting = runs.Setting("dpadam_corrected", 1e-3, None)
    for seed in range(FLAGS.runs):
        config = runs.run_config(base, setting, seed, model_dir=None)
        before = resident_megabytes()
        training.fit_private(
            lambda: keras.Sequential([keras.Input((_WIDTH,)),
                                      keras.layers.Dense(2)]),
            (x, y), (x[:500], y[:500]), config,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            verbose=0)
        keras.backend.clear_session()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(f"run {seed}: resident {before:.0f} MB before, "
              f"{resident_megabytes():.0f} MB after")


if __name__ == "__main__":
    app.run(main)
