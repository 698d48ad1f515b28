"""Test-process settings that must precede the first TensorFlow import.

The suite runs with TensorFlow's default kernels (oneDNN on x86 CPUs), as
users do: TensorFlow 2.21's oneDNN batch matmul is wrong for the broadcasts
that `tf.vectorized_map` makes, and running the tests without oneDNN hid that
from them (`tf_dpadam/vectorization.py`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
