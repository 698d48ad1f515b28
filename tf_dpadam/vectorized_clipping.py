"""The vectorized path: every example's full gradient, then clip and sum.

`tf.vectorized_map` of a one-example backward pass over the whole model
(`privatizer.per_example_gradients`), then `privatizer.clip_and_sum`. Works
for any model TensorFlow can vectorize; slower than ghost clipping for
convolutions (TensorFlow loops over the examples for the filter gradient).
"""

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam import keras_internals
from tf_dpadam import privatizer


def clipped_gradient_sum(model, x, y, sample_weight, l2_norm_clip,
                         mask=None):
    """The sum of clipped per-example gradients of a compiled `model`.

    The same contract as `ghost_clipping.clipped_gradient_sum` with the
    model's compiled loss: returns `(summed, norms, losses, y_pred)`, one
    sum per `model.trainable_variables`, the per-example norms before
    clipping, the per-example losses (with regularization) and the batch's
    predictions.
    """
    grads, losses, y_pred = per_example_gradients(model, x, y, sample_weight)
    summed, norms = privatizer.clip_and_sum(grads, l2_norm_clip, mask=mask)
    return summed, norms, losses, y_pred


def per_example_gradients(model, x, y, sample_weight):
    """`(grads, losses, y_pred)`: `[B, *shape]` per trainable variable.

    Each example's loss is the compiled loss (with regularization) on a
    batch of one. Layers that draw random numbers (dropout) draw
    independently per example; their seed states advance once per step.
    """
    generators = keras_internals.seed_generators(model)
    index = tf.range(tf.shape(tf.nest.flatten(x)[0])[0])
    with keras_internals.loss_metrics_paused(
            keras_internals.compile_loss(model)):
        # Per-output loss metrics (multi-output models) are updated once on
        # the batch by the caller, not per example inside the map.
        grads, losses, (y_pred, advances) = privatizer.per_example_gradients(
            lambda *example: _example_loss(model, generators, *example),
            model.trainable_variables, (x, y, sample_weight, index),
        )
    for generator, advance in zip(generators, advances):
        generator.state.assign(generator.state.value + advance[0])
    return grads, losses, y_pred


def _example_loss(model, generators, x, y, sample_weight, index):
    """The loss of one example (a batch of one) and `(y_pred, advances)`."""
    # Inside the vectorized map a layer's seed state is the same for every
    # example, which would give all examples one dropout mask. Each
    # example reads its own state (offset by its index in the first
    # component; steps advance the second), and the generators'
    # advance is returned so that the step can apply it once.
    if not generators:
        loss, y_pred = _forward_loss(model, x, y, sample_weight)
        return loss, (y_pred, [])
    offset = ops.stack(
        [ops.cast(index[0], "int64") + 1, ops.zeros((), "int64")]
    )
    mapping = [(g.state, g.state.value + offset) for g in generators]
    # Regularizers read their variable through the scope too.
    mapping += [
        (v, v.value) for v in model.trainable_variables if v.regularizer
    ]
    with keras.StatelessScope(
        state_mapping=mapping, collect_losses=True
    ) as scope:
        loss, y_pred = _forward_loss(model, x, y, sample_weight)
    # With a batch axis, as `per_example_gradients` expects of `aux`.
    advances = [
        (scope.get_current_value(g.state) - value)[None]
        for g, (_, value) in zip(generators, mapping)
    ]
    return loss, (y_pred, advances)


def _forward_loss(model, x, y, sample_weight):
    y_pred = model(x, training=True)
    loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight)
    # Keras divides the loss by the number of tf.distribute replicas;
    # a per-example gradient must be the example's own, so undo it.
    return loss * privatizer.num_replicas(), y_pred
