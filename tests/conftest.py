"""Test-process settings that must precede the first TensorFlow import.

The suite runs with oneDNN's kernels (TensorFlow's default on Intel x86
CPUs), as most users do: TensorFlow 2.21's oneDNN batch matmul is wrong for
the broadcasts that `tf.vectorized_map` makes, and running the tests without
oneDNN hid that from them (`src/tf_dpadam/privatizer/vectorization.py`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN is TensorFlow's default on the Intel CPUs the suite was validated
# on, but not on every x86 CPU (an AMD EPYC here leaves it off). Without it,
# TensorFlow's vectorizer fails on the per-example filter gradient of a
# grouped convolution (InvalidArgumentError "filter_size does not have
# enough elements, requested 144, got 72", inside pfor's while loop: the
# vectorized path and ghost clipping's fallback units; the ghost rule for
# grouped convolutions works without it, tests/ghost_grouped_convolution_
# test.py), so the suite pins the kernels it checks. Subprocesses
# (examples, replicas) inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
