"""The remove-one sensitivity of a private model's clipped sum, measured.

What the guarantee needs is that adding or removing one example moves the
clipped sum S(D) = sum_i clip(g_i, C) by at most C, whatever the model, the
loss, the dtypes and the data. Exactness against one-example tapes does not
prove it: a loss or a layer that mixes examples can be "exact" per example
and still move every other example's gradient.

`remove_one_sensitivity` measures it directly, without noise: S(D) and
S(D without row j) are read from a `make_private(diagnostics=True)` model's
clean gradients (float32 whatever the policy), with the denominator B = 1 and
a learning rate of 0, so the weights do not move between the steps. Row j is
really removed (the batch shrinks by one), not masked: a layer that mixes
examples then shows.
"""

import keras
import numpy as np

import tf_dpadam


def _rows(structure, keep):
    if structure is None:
        return None
    return keras.tree.map_structure(lambda v: np.asarray(v)[keep], structure)


def clipped_sum(model, x, y, sample_weight=None):
    """S of one batch: the clean gradient of one `train_on_batch` step.

    `model` is a compiled `make_private(..., diagnostics=True)` model whose
    optimizer has `batch_size=1`, `noise_multiplier=0` and
    `learning_rate=0`.
    """
    model.train_on_batch(x, y, sample_weight=sample_weight)
    return [np.asarray(keras.ops.convert_to_numpy(v), "float64")
            for v in model.clean_gradients]


def distance(a, b):
    """The global L2 distance between two lists of arrays."""
    return float(np.sqrt(sum(np.sum(np.square(u - v)) for u, v in zip(a, b))))


def private_probe(model, loss, l2_norm_clip, clipping="auto",
                  jit_compile=False, **make_private_kwargs):
    """`model` made private and compiled for `clipped_sum` (noise 0)."""
    private = tf_dpadam.make_private(
        model, seed=0, clipping=clipping, diagnostics=True,
        **make_private_kwargs)
    private.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=l2_norm_clip, noise_multiplier=0.0, batch_size=1,
            learning_rate=0.0),
        loss=loss, jit_compile=jit_compile)
    return private


def remove_one_sums(model, loss, x, y, l2_norm_clip, *, sample_weight=None,
                    removed=(0, 1, 2), clipping="auto", jit_compile=False,
                    **make_private_kwargs):
    """`(S(D), [S(D without j) for j in removed])` as float64 arrays.

    The arguments are those of `remove_one_sensitivity`.
    """
    private = private_probe(model, loss, l2_norm_clip, clipping=clipping,
                            jit_compile=jit_compile, **make_private_kwargs)
    full = clipped_sum(private, x, y, sample_weight)
    n = len(keras.tree.flatten(x)[0])
    withouts = []
    for j in removed:
        keep = np.array([i != j for i in range(n)])
        withouts.append(clipped_sum(private, _rows(x, keep), _rows(y, keep),
                                    _rows(sample_weight, keep)))
    return full, withouts


def remove_one_sensitivity(model, loss, x, y, l2_norm_clip, **kwargs):
    """max over j in `removed` of ||S(D) - S(D without j)|| / C.

    Must be <= 1 (to float32 rounding) for the guarantee to hold.

    Args:
        model: an unwrapped Keras model (it is made private here).
        loss: the compiled loss.
        x, y: the batch D (NumPy arrays or structures).
        l2_norm_clip: C.
        **kwargs: `remove_one_sums`' keyword arguments: `sample_weight`
            (part of D), `removed` (the rows j to remove, one at a time),
            `clipping` and `jit_compile` (the private step's path), and
            the rest is passed on to `make_private`.

    Returns:
        `(sensitivity, full_sum)`: the ratio and S(D) as float64 arrays.
    """
    full, withouts = remove_one_sums(model, loss, x, y, l2_norm_clip,
                                     **kwargs)
    worst = max((distance(full, w) / l2_norm_clip for w in withouts),
                default=0.0)
    return worst, full
