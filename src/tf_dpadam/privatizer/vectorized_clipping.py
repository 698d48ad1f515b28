"""The vectorized path: every example's full gradient, then clip and sum.

`tf.vectorized_map` of a one-example backward pass over the whole model
(`step.clipping.per_example_gradients`), then `step.clipping.clip_and_sum`.
Works for any model TensorFlow can vectorize; slower than ghost clipping for
convolutions (TensorFlow loops over the examples for the filter gradient).
"""

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import preclip
from tf_dpadam.privatizer import clipping
from tf_dpadam.privatizer import replicas
from tf_dpadam.privatizer.ghost_clipping import per_example_loss


def clipped_gradient_sum(model, x, y, sample_weight, l2_norm_clip,
                         mask=None, group_size=1, transform=None):
    """The sum of clipped per-example gradients of a compiled `model`.

    The same contract as `ghost_clipping.clipped_gradient_sum` with the
    model's compiled loss (`group_size` included): returns `(summed, norms,
    losses, y_pred)`, one float32 sum per `model.trainable_variables`, the
    per-example norms before clipping, the per-example losses (with
    regularization) and the batch's predictions (one row per row of `x`).
    An example whose gradient or loss is NaN or infinite contributes
    nothing (its norm is then NaN or inf).

    With a `preclip.PerExampleTransform`, each example's gradient is
    transformed before clipping (the optimizer's scales, or the combination
    with its gradient at shifted weights, computed with the same dropout
    masks); the norms and the sum are then those of the transformed
    gradients.
    """
    shifted = None
    if transform is not None and transform.shifts is not None:
        # First, without advancing the seed generators: both passes draw
        # the same dropout masks.
        shifted, shifted_losses, _ = per_example_gradients(
            model, x, y, sample_weight, group_size=group_size,
            shifts=transform.shifts, advance_seeds=False)
    grads, losses, y_pred = per_example_gradients(
        model, x, y, sample_weight, group_size=group_size
    )
    finite = ops.isfinite(losses)
    if transform is not None:
        grads = preclip.transform_gradients(grads, transform, shifted)
        if shifted is not None:
            finite = ops.logical_and(finite, ops.isfinite(shifted_losses))
    # An example with a NaN or infinite loss contributes nothing, as one
    # with a non-finite gradient (`step.clipping.clip_and_sum`).
    summed, norms = clipping.clip_and_sum(
        grads, l2_norm_clip, mask=mask, finite=finite
    )
    return summed, norms, losses, y_pred


def per_example_gradients(model, x, y, sample_weight, group_size=1,
                          shifts=None, advance_seeds=True):
    """`(grads, losses, y_pred)`: `[B, *shape]` per trainable variable.

    Each example's loss is the compiled loss (with regularization) on a
    batch of one. Layers that draw random numbers (dropout) draw
    independently per example; their seed states advance once per step.

    With `group_size` K > 1, `x`, `y` and `sample_weight` hold K consecutive
    rows (views) per example, and example i's loss is

        L_i = (1/K) sum_k loss(view_ik) + (losses added in call) + R:

    the mean of its views' compiled losses, each on a batch of one, as in
    the ghost path; the model runs once on the example's K views as one
    batch, so losses added in call are those of that batch (Keras' activity
    regularizers average over it: the mean over the views); the weight
    regularization R is in once. Only B gradients are formed, not B K.

    With `shifts` (one tensor per trainable variable), the gradients are
    taken at the weights plus `shifts` (regularization included). With
    `advance_seeds=False` the layers' seed generators are left where they
    are, so that a second call draws the same dropout masks.
    """
    generators = compat.seed_generators(model)
    examples = (x, y, sample_weight)
    if group_size > 1:
        examples = tuple(
            None if e is None
            else tf.nest.map_structure(lambda t: _group(t, group_size), e)
            for e in examples
        )
    index = tf.range(tf.shape(tf.nest.flatten(examples[0])[0])[0])
    with compat.loss_metrics_paused(
            compat.compile_loss(model)):
        # Per-output loss metrics (multi-output models) are updated once on
        # the batch by the caller, not per example inside the map.
        grads, losses, (y_pred, advances) = clipping.per_example_gradients(
            lambda *example: _example_loss(model, generators, group_size,
                                           shifts, *example),
            model.trainable_variables, (*examples, index),
        )
    if advance_seeds:
        for generator, advance in zip(generators, advances):
            generator.state.assign(generator.state.value + advance[0])
    if group_size > 1:
        y_pred = tf.nest.map_structure(_ungroup, y_pred)
    return grads, losses, y_pred


def _group(t, group_size):
    """`[B K, ...]` as `[B, K, ...]`."""
    t = tf.convert_to_tensor(t)
    rest = [d if d is not None else tf.shape(t)[i + 1]
            for i, d in enumerate(t.shape[1:])]
    return tf.reshape(t, [-1, group_size, *rest])


def _ungroup(t):
    """`[B, K, ...]` as `[B K, ...]`."""
    rest = [d if d is not None else tf.shape(t)[i + 2]
            for i, d in enumerate(t.shape[2:])]
    return tf.reshape(t, [-1, *rest])


def _example_loss(model, generators, group_size, shifts, x, y, sample_weight,
                  index):
    """The loss of one example (a batch of one, or of its `group_size`
    views) and `(y_pred, advances)`, at the weights plus `shifts` if
    given."""
    # Inside the vectorized map a layer's seed state is the same for every
    # example, which would give all examples one dropout mask. Each
    # example reads its own state (offset by its index in the first
    # component; steps advance the second), and the generators'
    # advance is returned so that the step can apply it once.
    forward_loss = _forward_loss if group_size == 1 else _forward_group_loss
    if not generators and shifts is None:
        loss, y_pred = forward_loss(model, x, y, sample_weight)
        return loss, (y_pred, [])
    offset = ops.stack(
        [ops.cast(index[0], "int64") + 1, ops.zeros((), "int64")]
    )
    mapping = [(g.state, g.state.value + offset) for g in generators]
    if shifts is not None:
        # Read through the tape: the gradient is taken at v + shift.
        mapping += [
            (v, preclip.shifted_value(v, d))
            for v, d in zip(model.trainable_variables, shifts)
        ]
    else:
        # Regularizers read their variable through the scope too.
        mapping += [
            (v, v.value) for v in model.trainable_variables if v.regularizer
        ]
    with keras.StatelessScope(
        state_mapping=mapping, collect_losses=True
    ) as scope:
        loss, y_pred = forward_loss(model, x, y, sample_weight)
    # With a batch axis, as `per_example_gradients` expects of `aux`.
    advances = [
        (scope.get_current_value(g.state) - value)[None]
        for g, (_, value) in zip(generators, mapping)
    ]
    return loss, (y_pred, advances)


def _forward_loss(model, x, y, sample_weight):
    y_pred = model(x, training=True)
    loss = compat.compute_loss(model, x, y, y_pred, sample_weight)
    # Keras divides the loss by the number of tf.distribute replicas;
    # a per-example gradient must be the example's own, so undo it.
    return loss * replicas.num_replicas(), y_pred


def _forward_group_loss(model, x, y, sample_weight):
    """One example's loss and predictions from its `[1, K, ...]` views."""
    x, y, sample_weight = (
        None if e is None else tf.nest.map_structure(lambda t: t[0], e)
        for e in (x, y, sample_weight)
    )
    y_pred = model(x, training=True)
    # Each view's compiled loss on a batch of one (not scaled by replicas).
    views = per_example_loss.compiled_loss_fn(model)(y, y_pred, sample_weight)
    loss = ops.mean(views)
    for extra in model.losses:
        loss = loss + ops.sum(ops.cast(extra, loss.dtype))
    return loss, tf.nest.map_structure(lambda t: t[None], y_pred)
