"""Test-process settings that must precede the first TensorFlow import."""

import os

# TensorFlow 2.21's oneDNN batch-matmul kernel crashes the process (SIGSEGV)
# on the batched matmuls that `tf.vectorized_map` makes of attention layers,
# which the reference per-example path of several tests runs. Eigen's kernel
# computes the same thing; see README ("Known issues").
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
