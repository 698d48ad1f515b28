"""Pure helpers of the independence check on structures of `[rows, ...]`
tensors, and the tolerance that decides "unchanged" (see the package
docstring).
"""

import keras
import numpy as np
import tensorflow as tf

RELATIVE_TOLERANCE = 1e-4
LOW_PRECISION_RELATIVE_TOLERANCE = 1e-2
ABSOLUTE_TOLERANCE = 1e-12
# The rows whose one-example loss is compared with the batched one.
SLICED_ROWS = 3


def num_rows(structure):
    """The leading dimension of the first leaf of `structure`."""
    return int(tf.shape(tf.nest.flatten(structure)[0])[0])


def replace_row(structure, j, k):
    """`structure` with row j of every leaf replaced by row k (dense or
    ragged tensors; None stays None)."""
    def replace(t):
        if t is None:
            return None
        t = tf.convert_to_tensor(t) if not isinstance(
            t, tf.RaggedTensor) else t
        return tf.concat([t[:j], t[k:k + 1], t[j + 1:]], axis=0)

    return tf.nest.map_structure(replace, structure)


def replace_rows(structure, rows_j, rows_k):
    """`replace_row` for several (j, k) pairs, in order."""
    for j, k in zip(rows_j, rows_k):
        structure = replace_row(structure, j, k)
    return structure


def _row_values(t, i):
    row = t[i]
    if isinstance(row, tf.RaggedTensor):
        return row.to_list()
    return np.asarray(row)


def distinct_row(structure, j):
    """The first row k != j that differs from row j in some leaf, or None."""
    leaves = [t for t in tf.nest.flatten(structure) if t is not None]
    for k in range(num_rows(structure)):
        if k == j:
            continue
        for t in leaves:
            a, b = _row_values(t, j), _row_values(t, k)
            if isinstance(a, list):
                if a != b:
                    return k
            elif a.shape != b.shape or not np.array_equal(a, b):
                return k
    return None


def relative_tolerance(dtype):
    """The check's rtol for a tensor of `dtype` (package docstring)."""
    dtype = tf.as_dtype(dtype)
    if dtype.is_floating and dtype.size <= 2:
        return LOW_PRECISION_RELATIVE_TOLERANCE
    return RELATIVE_TOLERANCE


def _as_float64(t):
    if isinstance(t, tf.RaggedTensor):
        t = t.to_tensor()
    return np.asarray(keras.ops.convert_to_numpy(t)).astype("float64")


def change_of_other_rows(before, after, skipped):
    """How much the rows not in `skipped` changed, relative to the tolerance.

    Returns the largest `max |a' - a| / (rtol * max |a| + atol)` over the
    leaves of the structures (compared over all rows but `skipped`); > 1
    means changed. Leaves whose leading dimension differs between `before`
    and `after` count as changed (inf); NaNs in the same places are equal.
    """
    worst = 0.0
    for a, b in zip(tf.nest.flatten(before), tf.nest.flatten(after)):
        if a is None or b is None:
            continue
        rtol = relative_tolerance(getattr(a, "dtype", "float32"))
        a, b = _as_float64(a), _as_float64(b)
        if a.shape != b.shape:
            return float("inf")
        if a.ndim == 0:
            keep_a, keep_b = a, b
        else:
            keep = np.ones(a.shape[0], bool)
            keep[[i for i in skipped if i < a.shape[0]]] = False
            keep_a, keep_b = a[keep], b[keep]
        both_nan = np.isnan(keep_a) & np.isnan(keep_b)
        diff = np.where(both_nan, 0.0, np.abs(keep_a - keep_b))
        if np.isnan(diff).any():
            return float("inf")
        finite = np.abs(a[np.isfinite(a)])
        scale = float(finite.max()) if finite.size else 0.0
        if diff.size:
            worst = max(worst, float(diff.max())
                        / (rtol * scale + ABSOLUTE_TOLERANCE))
    return worst


def example_rows(example, augmult):
    """The rows of example `example` once `augmult` views are made of each."""
    return list(range(example * augmult, (example + 1) * augmult))
