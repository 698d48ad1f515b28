"""The private train step of a `PrivateModel`, top to bottom.

`train_step(model, data, ...)` is `PrivateModel.train_step`:

1. checks (a DP optimizer, no layer that mixes examples, a gradient path);
2. the rows the step clips (`views`: augmentation and its multiplicity);
3. phases 1 and 2, the sum of clipped per-example gradients (`clipped_sum`:
   ghost clipping where the model allows it, else a vectorized map of
   one-example backward passes; float32, non-finite examples adding
   nothing);
4. phases 3 to 5, noise once, divide by B, apply, with gradient
   accumulation and `tf.distribute` replicas (`update.apply_clipped_sum`);
5. the loss and the metrics that `fit` reports.

Audit canaries and diagnostics take part through `hooks.StepHooks`.
"""

import warnings
import weakref
from typing import Sequence

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer import adaptive_clipping
from tf_dpadam.training import augmentation
from tf_dpadam.common import compat
from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.optimizers import base as dp_optimizers
from tf_dpadam.training import train_step_checks
from tf_dpadam.privatizer import vectorized_clipping
from tf_dpadam.privatizer.ghost_clipping import registry
from tf_dpadam.privatizer import clipping
from tf_dpadam.privatizer import dp_math
from tf_dpadam.training import update as update_lib


def train_step(model, data, *, noise_seeds, hooks: Sequence = (),
               ledger=None, noise_history=None) -> dict:
    """One DP step of `model` (a `PrivateModel`) on the batch `data`.

    Args:
        model: the `PrivateModel`.
        data: `(x, y, sample_weight)` as Keras' `train_step` gets it.
        noise_seeds: the model's `seeds.NoiseSeeds`.
        hooks: the model's `hooks.StepHooks`.
        ledger: the model's `model_ledger.ModelLedger`, which counts every
            logical step where its noise is drawn.
        noise_history: the model's `noise_history.NoiseHistory` (for
            correlated noise).

    Returns:
        The logs (loss and metrics), as Keras' `train_step`.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    optimizer = model.optimizer
    require_dp_optimizer(optimizer)
    check_no_example_mixing(model.base_model)
    build_on_first_call(model, x)
    variables = model.trainable_variables
    if not variables:
        warnings.warn("The model does not have any trainable weights.")
        return train_step_checks.step_without_trainable_weights(
            model, x, y, sample_weight)
    # As Keras: no gradient for any weight is an error, not noise.
    train_step_checks.check_gradient_path(model, x, y, sample_weight,
                                          variables)
    if not optimizer.built:
        optimizer.build(variables)
    for hook in hooks:
        hook.build(variables)
    x, y, sample_weight, present = views(model, x, y, sample_weight)

    # Phases 1 and 2: per-example gradients, clipped and summed (in
    # float32; an example with a NaN or infinite gradient or loss
    # contributes nothing, counted by the diagnostics only).
    # With per-layer clipping, one clip norm per group of variables.
    clip = update_lib.clip_for_sum(optimizer, hooks)
    summed, norms, losses, y_pred = clipped_sum(
        model, x, y, sample_weight, present,
        dp_math.GroupClip.of(clip, optimizer.variable_groups()),
    )
    # Adaptive clipping: each group's count of unclipped examples.
    unclipped = None
    if optimizer.adaptive_clipping is not None:
        unclipped = adaptive_clipping.shifted_unclipped_counts(
            ops.reshape(norms, (-1, ops.shape(present)[0])), clip, present)
    norms = dp_math.global_norms(norms)
    for hook in hooks:
        hook.after_clipping(norms, losses, present)

    # Phases 3 to 5: noise, scale, update (once per logical step).
    update_lib.apply_clipped_sum(
        update_lib.Update(optimizer, variables, noise_seeds, tuple(hooks),
                          model.secure_mode, ledger, noise_history,
                          xla=model.jit_compile is True),
        summed, ops.sum(present), unclipped,
    )

    compile_loss = compat.compile_loss(model)
    if compile_loss is not None and compile_loss.metrics:
        compile_loss(y, y_pred, sample_weight)
    # A NaN or infinite example loss counts as 0 in the logged loss, so
    # that the log does not show such an example.
    losses = ops.where(ops.isfinite(losses), losses, ops.zeros_like(losses))
    compat.loss_tracker(model).update_state(
        ops.sum(losses) / ops.maximum(ops.sum(present), 1.0),
        sample_weight=ops.sum(present),
    )
    compat.update_compile_metrics(
        model, y, y_pred, sample_weight,
        present_examples(x, sample_weight) if sample_weight is not None
        else None,
    )
    return logs_for_keras_reduction(model.get_metrics_result())


def per_example_norms(model, data) -> tuple:
    """`(norms, present)` of one batch, without an update: every example's
    gradient norm before clipping, as the train step computes it (NOT
    private)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    build_on_first_call(model, x)
    x, y, sample_weight, present = views(model, x, y, sample_weight)
    # C does not change the norms. Under tf.function the clipped sum,
    # pure and not an output, is pruned from the graph.
    _, norms, _, _ = clipped_sum(model, x, y, sample_weight, present, 1.0)
    return norms, present


def check_no_example_mixing(model) -> None:
    """Raises if a trainable layer of `model` mixes examples in training.

    The layers are `ghost_clipping.registry.EXAMPLE_MIXING_LAYERS`. A frozen
    BatchNormalization (`trainable=False`) runs in inference mode in Keras 3
    and is allowed.

    Raises:
        ValueError: naming the first offending layer.
    """
    for layer in compat.all_layers(model):
        if registry.mixes_examples(layer):
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) mixes the"
                " examples of a batch in training, so per-example clipping"
                " would not bound one example's influence and training would"
                " not be differentially private. Replace it (for instance by"
                " LayerNormalization or GroupNormalization) or freeze it"
                " (`layer.trainable = False` runs it in inference mode)."
            )


def require_dp_optimizer(optimizer) -> None:
    """Raises a `ValueError` unless `optimizer` is a tf_dpadam optimizer."""
    if not dp_optimizers.is_dp_optimizer(optimizer):
        raise ValueError(
            "A model made private needs a tf_dpadam optimizer (DPSGD, DPAdam"
            " or DPAdamCorrected), which carries l2_norm_clip and"
            f" noise_multiplier. Received optimizer={optimizer!r}."
        )


def build_on_first_call(model, x) -> None:
    """Calls `model` once on `x` if some layer is not built yet.

    A model without `keras.Input` builds on its first call: make that call
    here, on the first trace, so that its weights (and the optimizer's)
    exist before the step reads them.
    """
    if not all(layer.built
               for layer in compat.all_layers(model.base_model)):
        model(x, training=False)


def present_examples(x, sample_weight) -> tf.Tensor:
    """1.0 for each example of the batch, 0.0 for absent ones.

    An example whose sample weight is 0 (e.g. the padding of
    `tf_dpadam.data.poisson_batches`) is absent: it contributes nothing to
    the gradient, not even the gradient of a regularization loss, and is not
    counted in the denominator when `batch_size=None`.
    """
    num_examples = tf.shape(tf.nest.flatten(x)[0])[0]
    if sample_weight is None or tf.nest.is_nested(sample_weight):
        return tf.ones((num_examples,), "float32")
    weight = ops.reshape(sample_weight, (num_examples, -1))
    return ops.cast(ops.any(ops.not_equal(weight, 0), axis=1), "float32")


def views(model, x, y, sample_weight) -> tuple:
    """`(x, y, sample_weight, present)`: the rows the step clips.

    `present` is per example (K views of an example are one example).
    With `augment` or K > 1, the rows are the K views of each example,
    in consecutive rows (made once, outside the per-example gradients);
    y and the weights follow.
    """
    present = present_examples(x, sample_weight)
    if model.augment is not None or model.augmult > 1:
        x = augmentation.views(model.augment, x, model.augmult)
        y, sample_weight = augmentation.repeat_examples(
            (y, sample_weight), model.augmult
        )
    return x, y, sample_weight, present


def clipped_sum(model, x, y, sample_weight, present, l2_norm_clip) -> tuple:
    """The sum of clipped per-example gradients (phases 1 and 2), in
    float32, an example with a NaN or infinite gradient or loss adding
    nothing.

    Such an example gets the clip factor 0; should its 0 * inf make a
    sum NaN anyway, the sums are computed again with it replaced by a
    finite example marked absent (`clipping.without_non_finite`; one
    `tf.cond` for the step: only a batch holding such an example pays,
    and nothing is held for it otherwise). Returns as
    `clipped_sum_by_mode`, the norms, losses and predictions being
    those of the first computation.

    In a graph, both computations call one nested `tf.function`, traced
    once: the step's trace, most of the cost of a first step, is not
    doubled by a branch that almost never runs. On one device without
    XLA that function is the model's `shared_clipped_sum`, which the
    independence guard's norms probe traced already.
    """
    compute = _clipped_sum_function(model, l2_norm_clip)
    summed, norms, losses, y_pred = compute(x, y, sample_weight, present)

    def recompute():
        rows, present2 = clipping.without_non_finite(
            (x, y, sample_weight), present, dp_math.global_norms(norms),
            losses, model.augmult)
        # The same static shapes as the first call's, so that the nested
        # function is not traced again.
        x2, y2, w2 = tf.nest.map_structure(
            lambda new, old: None if new is None else tf.ensure_shape(
                new, old.shape),
            rows, (x, y, sample_weight))
        present2 = tf.ensure_shape(present2, present.shape)
        return tf.cond(
            tf.reduce_any(present2 > 0),
            lambda: compute(x2, y2, w2, present2)[0],
            lambda: [tf.zeros_like(s) for s in summed])

    summed = tf.cond(clipping.all_finite(summed), lambda: summed, recompute)
    return summed, norms, losses, y_pred


def _clipped_sum_function(model, l2_norm_clip):
    """`compute(x, y, sample_weight, present)`: `clipped_sum_by_mode` with
    C = `l2_norm_clip`; eager in eager mode, else a `tf.function`."""
    if tf.executing_eagerly():
        return lambda *rows: clipped_sum_by_mode(model, *rows, l2_norm_clip)
    groups = None
    clip = l2_norm_clip
    if isinstance(l2_norm_clip, dp_math.GroupClip):
        groups, clip = l2_norm_clip.groups, l2_norm_clip.clip_norms
    shared = shared_clipped_sum(model, groups)
    if shared is None:
        return tf.function(
            lambda *rows: clipped_sum_by_mode(model, *rows, l2_norm_clip),
            autograph=False)
    clip = tf.cast(clip, "float32")
    return lambda *rows: shared(*rows, clip)


# model -> (what its function was traced for, the function).
_SHARED_SUMS = weakref.WeakKeyDictionary()


def shared_clipped_sum(model, groups=None):
    """`model`'s `clipped_sum_by_mode` as one `tf.function`, or None.

    `f(x, y, sample_weight, present, clip)` with `clip` a float32 tensor: C,
    or each group's C_l when `groups` (the group index of each trainable
    variable) is given. The train step and the independence guard's norms
    probe both call it, so that on a model's first step the per-example
    gradients are traced once for both, not twice. A new function is made
    when the compiled loss, the optimizer, the trainable weights,
    `augment`, `augmult`, the clipping method or `groups` change (compared
    by identity: the function holds them). None under a `tf.distribute`
    strategy or XLA (`jit_compile=True`), where each caller traces its own.
    """
    if tf.distribute.has_strategy() or model.jit_compile is True:
        return None
    state = StepState(model, groups)
    entry = _SHARED_SUMS.get(model)
    if entry is not None and entry[0] == state:
        return entry[1]
    model_ref = weakref.ref(model)  # The dictionary's value must not hold it.

    def clipped(x, y, sample_weight, present, clip):
        return clipped_sum_by_mode(
            model_ref(), x, y, sample_weight, present,
            dp_math.GroupClip.of(clip, groups))

    function = tf.function(clipped, autograph=False)
    _SHARED_SUMS[model] = (state, function)
    return function


class StepState:
    """What a traced private step depends on: the compiled loss, the
    optimizer, `augment` and the trainable weights, compared by identity
    (held here, so that a reused `id()` cannot pass for one of them), and
    `augmult`, the clipping method and the clip groups. The one key of
    `shared_clipped_sum` and of the independence guard (which checks a
    batch again when it changes, `independence.probe.state_key`).

    Attributes:
        variables: the trainable weights, in order.
        objects: the compiled loss, the optimizer and `augment`.
        values: `augmult`, the clipping method and the clip groups.
    """

    __hash__ = None

    def __init__(self, model, groups=None):
        self.variables = tuple(model.trainable_variables)
        self.objects = (compat.compile_loss(model), model.optimizer,
                         model.augment)
        self.values = (model.augmult, model.clipping,
                        None if groups is None else tuple(groups))

    def same_variables(self, other) -> bool:
        """Whether `other` has the very same trainable weights."""
        return len(self.variables) == len(other.variables) and all(
            a is b for a, b in zip(self.variables, other.variables))

    def __eq__(self, other):
        return (isinstance(other, StepState)
                and self.values == other.values
                and all(a is b for a, b in zip(self.objects,
                                               other.objects))
                and self.same_variables(other))

    def __ne__(self, other):
        return not self == other


def clipped_sum_by_mode(model, x, y, sample_weight, present,
                        l2_norm_clip) -> tuple:
    """The sum of clipped per-example gradients, by `model.clipping`.

    Ghost clipping where the model allows it (decided while tracing),
    else per-example gradients by a vectorized map. When the optimizer
    transforms each example's gradient before clipping
    (`optimizer.per_example_transform`), both paths take it: a
    coordinate-wise scale (scale-then-privatize) and shifted weights (DiSK;
    ghost clipping where every rule's blocks come from its records and
    replays, `ghost_clipping.rule.Rule.shifted_pass`). Both give the same
    sum up to float rounding (tests/privacy_zoo_test.py). Sets
    `model.clipping_used` and, when ghost clipping was refused,
    `model.ghost_unsupported_reason`.

    With augmentation multiplicity K, `x`, `y` and `sample_weight` hold
    the K views of each example in consecutive rows and `present` is per
    example.

    Returns:
        `(summed, norms, losses, y_pred)`: one sum per trainable
        variable, the per-example gradient norms before clipping, the
        per-example losses and the predictions (one per row).
    """
    transform = model.optimizer.per_example_transform(
        model.trainable_variables)
    scales = shifts = None
    shift_weight = 0.0
    if transform is not None:
        scales, shifts = transform.scales, transform.shifts
        shift_weight = transform.shift_weight
    if model.clipping != "vectorized":
        try:
            summed, norms, losses, y_pred = (
                ghost_clipping.clipped_gradient_sum(
                    model, ghost_clipping.compiled_loss_fn(model), x, y,
                    sample_weight, l2_norm_clip, mask=present,
                    group_size=model.augmult, scales=scales, shifts=shifts,
                    shift_weight=shift_weight,
                )
            )
            model.clipping_used = "ghost"
            return summed, norms, losses, y_pred
        except ghost_clipping.GhostClippingUnsupportedError as error:
            if model.clipping == "ghost":
                raise ValueError(
                    "make_private(clipping='ghost'): " + str(error)
                ) from error
            model.ghost_unsupported_reason = str(error)
    summed, norms, losses, y_pred = vectorized_clipping.clipped_gradient_sum(
        model, x, y, sample_weight, l2_norm_clip, mask=present,
        group_size=model.augmult, transform=transform,
    )
    model.clipping_used = "vectorized"
    return summed, norms, losses, y_pred


def logs_for_keras_reduction(logs: dict) -> dict:
    """The step's logs, as Keras can average them over several workers.

    With several workers Keras' TensorFlow trainer averages each log with
    `strategy.reduce("MEAN", value, axis=0)`, which fails on the scalars
    that metrics are (Keras 3.15, tensorflow/tensorflow#72388). Shape [1]
    reduces to the same scalar mean over the replicas.
    """
    strategy = tf.distribute.get_strategy()
    try:
        local = len(strategy.extended.worker_devices)
    except RuntimeError:  # The default strategy.
        return logs
    if strategy.num_replicas_in_sync == local:  # One worker.
        return logs
    return tf.nest.map_structure(lambda v: ops.reshape(v, (1,)), logs)
