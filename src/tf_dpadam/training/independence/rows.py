"""Pure helpers of the independence check on structures of `[rows, ...]`
tensors, and the tolerance that decides "unchanged" (see the package
docstring).
"""

import keras
import numpy as np
import tensorflow as tf

# "Unchanged" is `|a' - a| <= ROUNDING_ULPS * eps(dtype) * scale + atol`:
# the same row computed twice by the same program (same shapes, same random
# draws) differs by float rounding at most (and in practice by nothing),
# while a row that depends on the other rows of its batch moves by a
# fraction of its scale once ALL of them are replaced.
ROUNDING_ULPS = 64
ABSOLUTE_TOLERANCE = 1e-30


def num_rows(structure):
    """The leading dimension of the first leaf of `structure`."""
    return int(tf.shape(tf.nest.flatten(structure)[0])[0])


def _gather_rows(t, indices):
    if t is None:
        return None
    if isinstance(t, tf.SparseTensor):
        return tf.sparse.concat(0, [
            tf.sparse.slice(t, [i] + [0] * (t.shape.rank - 1),
                            [1] + list(t.dense_shape[1:].numpy()))
            for i in indices], expand_nonconcat_dims=False)
    if not isinstance(t, (tf.RaggedTensor, tf.Tensor)):
        t = tf.convert_to_tensor(t)
    return tf.gather(t, indices)


def tiled_rows(structure, first, group):
    """`structure` with its rows replaced by rows `first` to
    `first + group - 1` (example i's K views), repeated."""
    if structure is None:
        return None
    n = num_rows(structure)
    indices = [first + r % group for r in range(n)]
    return tf.nest.map_structure(
        lambda t: _gather_rows(t, indices), structure)


def copies_of_row(structure, i):
    """`structure` with every row of every leaf replaced by row i (dense,
    ragged or sparse tensors; None stays None): the batch in which example i
    has no other example beside it, at the batch's own shape."""
    n = num_rows(structure)
    return tf.nest.map_structure(
        lambda t: _gather_rows(t, [i] * n), structure)


def _differs_from_row(t, i):
    """Whether some row of leaf `t` differs from its row i."""
    if isinstance(t, tf.SparseTensor):
        t = tf.sparse.to_dense(t)
    if isinstance(t, tf.RaggedTensor):
        rows = t.to_list()
        return any(row != rows[i] for row in rows)
    values = np.asarray(t)
    if values.ndim == 0:
        return False
    flat = values.reshape(values.shape[0], -1)
    return bool(np.any(flat != flat[i]))


def has_distinct_row(structure, i):
    """Whether some row differs from row i in some leaf (else the copies of
    row i are the batch itself, and nothing can be learned from them)."""
    return any(_differs_from_row(t, i)
               for t in tf.nest.flatten(structure) if t is not None)


# The unit in the last place (at 1) of each float type.
_EPSILON = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
            "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def relative_tolerance(dtype):
    """`ROUNDING_ULPS` units in the last place of `dtype` (float32's for
    anything that is not a float)."""
    name = tf.as_dtype(dtype).name
    return ROUNDING_ULPS * _EPSILON.get(name, _EPSILON["float32"])


def _as_float64(t):
    if isinstance(t, tf.SparseTensor):
        t = tf.sparse.to_dense(t)
    if isinstance(t, tf.RaggedTensor):
        t = t.to_tensor()
    return np.asarray(keras.ops.convert_to_numpy(t)).astype("float64")


def change_of_rows(before, after, rows):
    """How much rows `rows` changed between two structures, relative to the
    tolerance.

    Returns the largest `abs(a' - a) / (rtol * scale + atol)` over the
    leaves (`scale`: the largest finite absolute value of a or a' in the
    compared rows of the leaf; `rtol`: `relative_tolerance` of the leaf's dtype); > 1 means
    changed. Leaves whose shapes differ count as changed (inf); NaNs in the
    same places are equal; scalar leaves are compared whole.
    """
    worst = 0.0
    for a, b in zip(tf.nest.flatten(before), tf.nest.flatten(after)):
        if a is None or b is None:
            continue
        rtol = relative_tolerance(getattr(a, "dtype", "float32"))
        a, b = _as_float64(a), _as_float64(b)
        if a.shape != b.shape:
            return float("inf")
        if a.ndim > 0:
            a, b = a[list(rows)], b[list(rows)]
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        with np.errstate(invalid="ignore"):
            diff = np.where(same, 0.0, np.abs(a - b))
        if np.isnan(diff).any():
            return float("inf")
        finite = np.abs(np.concatenate([a[np.isfinite(a)],
                                        b[np.isfinite(b)]]))
        scale = float(finite.max()) if finite.size else 0.0
        if diff.size:
            worst = max(worst, float(diff.max())
                        / (rtol * scale + ABSOLUTE_TOLERANCE))
    return worst


def example_rows(example, augmult):
    """The rows of example `example` once `augmult` views are made of each."""
    return list(range(example * augmult, (example + 1) * augmult))
