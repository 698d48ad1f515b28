"""Per-example losses from a model's compiled loss, for the batched pass.

Ghost clipping differentiates `sum_i loss_i` once, so it needs every
example's own loss as a `[B]` vector: the compiled loss (reduction, sample
weights, loss weights, masks) applied to a batch of one, as in the vectorized
path. Under tf.distribute Keras scales a reduced loss by 1 / replicas; these
are the examples' own losses, without that scaling.
"""

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import replicas
from tf_dpadam.privatizer import vectorization


def compiled_loss_fn(model):
    """`f(y, y_pred, sample_weight) -> [B]` from `model`'s compiled loss.

    Example i's loss is the compiled loss on the batch of one example i (same
    reduction, sample weights, loss weights, masks), not scaled by
    tf.distribute's 1 / replicas; regularization losses are not included.
    Per-output loss metrics are not updated.
    """

    @tf.autograph.experimental.do_not_convert
    def per_example_loss(y, y_pred, sample_weight):
        compile_loss = compat.compile_loss(model)
        if compile_loss is None:
            raise ValueError("The model was not compiled with a loss.")
        direct = direct_per_example_loss(compile_loss, y, y_pred,
                                          sample_weight)
        if direct is not None:
            return direct
        # Keras' reduced loss is divided by the replicas: undo it.
        return _mapped_per_example_loss(
            compile_loss, y, y_pred, sample_weight
        ) * replicas.num_replicas()

    return per_example_loss


def _mapped_per_example_loss(compile_loss, y, y_pred, sample_weight):
    """The compiled loss of each example, by a vectorized map (any loss)."""
    flat_pred = tf.nest.flatten(y_pred)
    masks = [compat.get_keras_mask(t) for t in flat_pred]
    mask_index = [i for i, m in enumerate(masks) if m is not None]
    examples = (y, y_pred, sample_weight,
                [masks[i] for i in mask_index] or None)
    present = [i for i, e in enumerate(examples) if e is not None]

    def one(packed):
        example = [None] * len(examples)
        for i, e in zip(present, packed):
            example[i] = tf.nest.map_structure(lambda t: t[None], e)
        y1, pred1, weight1, masks1 = example
        if mask_index:
            flat = list(tf.nest.flatten(pred1))
            for i, m in zip(mask_index, masks1):
                flat[i] = tf.identity(flat[i])
                compat.set_keras_mask(flat[i], m)
            pred1 = tf.nest.pack_sequence_as(pred1, flat)
        return ops.cast(compile_loss(y1, pred1, weight1), "float32")

    with compat.loss_metrics_paused(compile_loss):
        return vectorization.vectorized_map(
            one, tuple(examples[i] for i in present),
            what="the per-example compiled loss",
        )


def direct_per_example_loss(compile_loss, y, y_pred, sample_weight):
    """`[B]` per-example losses without a vectorized map, or None.

    The common case: one output, one `keras.losses.Loss` with the default
    "sum_over_batch_size" reduction, no output mask, and no sample weight
    or one weight per example. Then example i's compiled loss (on a batch
    of one, before tf.distribute's scaling) is
    `loss_weight * w_i * mean(loss.call(y_i, y_pred_i))`: the unreduced
    values averaged over their non-batch axes. This avoids
    `tf.vectorized_map`, whose graph XLA compiles very slowly. Anything else
    returns None (the caller maps the compiled loss over the examples).
    """
    if tf.nest.is_nested(y) or tf.nest.is_nested(y_pred):
        return None
    if compat.get_keras_mask(y_pred) is not None:
        return None
    if sample_weight is not None and (
        tf.nest.is_nested(sample_weight) or sample_weight.shape.rank != 1
    ):
        return None
    if not compile_loss.built:
        compile_loss.build(y, y_pred)
    single = compat.single_loss(compile_loss)
    if single is None:
        return None
    loss, loss_weight = single
    if not isinstance(loss, keras.losses.Loss):
        return None
    if loss.reduction != "sum_over_batch_size":
        return None
    y_pred = ops.convert_to_tensor(y_pred, dtype=loss.dtype)
    y = ops.convert_to_tensor(y, dtype=y_pred.dtype)
    values = ops.cast(loss.call(y, y_pred), "float32")
    if values.shape.rank is None or values.shape.rank < 1:
        return None
    if values.shape.rank > 1:
        values = ops.mean(values, axis=tuple(range(1, values.shape.rank)))
    if sample_weight is not None:
        values = values * ops.cast(sample_weight, "float32")
    if loss_weight is not None:
        values = values * ops.cast(loss_weight, "float32")
    return values
