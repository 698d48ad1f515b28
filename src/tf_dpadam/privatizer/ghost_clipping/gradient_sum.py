"""The ghost clipping step: record, backward to the taps, norms, factors, sum.

1. **record**: one batched forward pass with every rule intercepting its
   layer's call (`Recording`), and the per-example losses;
2. **backward**: one gradient of `sum_i loss_i` to the recorded taps (no
   layer mixes examples, so the tap gradient of example i is its own);
3. **norms**: the rules turn records and tap gradients into blocks; each
   example's squared norm is the sum of its blocks' squared norms (plus the
   regularization terms);
4. **factors**: `c_i = min(1, C / norm_i)` times the mask;
5. **sum**: each variable's `sum_i c_i grad_i` from its blocks.

Steps 3 to 5 compute in float32 whatever the model's dtype policy (the
rules cast what they recorded), and the sums are float32. An example whose
gradient or loss is NaN or infinite (its norm is then NaN or inf) gets the
clip factor 0; should its 0 * inf make a sum NaN, the private train step
recomputes the sums without it (`step.clipping.without_non_finite`).

With augmentation multiplicity (`group_size` K) the batch holds K rows (views)
per example: the rules record rows, each row's loss weighs 1/K, and step 3
first turns each row block into the block of the groups of K rows
(`grouped`), so that an example's norm includes the cross terms between its
views.

With shifts (DiSK: example i's gradient is (1 - w) g_i(theta) +
w g_i(theta + d)), steps 1 and 2 run again at theta + d with the same random
draws, the loss weighted w (and the first pass's 1 - w); the rules keep both
passes' records, as they keep the records of a layer called twice, so each
block stands for the combination and its norm has the cross terms.

This module knows no layer; the rules know no clipping.
"""

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer import dp_math
from tf_dpadam.common import compat
from tf_dpadam.privatizer import preclip
from tf_dpadam.privatizer.ghost_clipping import blocks as blocks_lib
from tf_dpadam.privatizer.ghost_clipping import plan as plan_lib
from tf_dpadam.privatizer.ghost_clipping import recording as recording_lib
from tf_dpadam.privatizer.ghost_clipping import sums
from tf_dpadam.privatizer.ghost_clipping.recording import GhostClippingUnsupportedError


@tf.autograph.experimental.do_not_convert
def clipped_gradient_sum(model, per_example_loss_fn, x, y, sample_weight,
                         l2_norm_clip, mask=None, training=True,
                         group_size=1, scales=None, shifts=None,
                         shift_weight=0.0):
    """The sum of per-example gradients clipped to norm C, by ghost clipping.

    Args:
        model: a built Keras model.
        per_example_loss_fn: `f(y, y_pred, sample_weight) -> [B]` losses,
            WITHOUT regularization losses (they are added here, as every
            example's loss in the vectorized path includes them);
            `compiled_loss_fn(model)` builds it from the compiled loss.
        x, y, sample_weight: the batch (`sample_weight` may be `None`).
        l2_norm_clip: C, or a `dp_math.GroupClip` (per-layer clipping: each
            group of variables clipped to its own C_l; the norms returned
            are then per group, `[G, B]`).
        mask: optional `[B]` of 0/1; examples with 0 contribute nothing.
        training: passed to the model call.
        group_size: K (augmentation multiplicity): the batch holds K rows
            per example, example i's views in rows `i K` to `i K + K - 1`,
            and example i's loss is the mean of its rows' losses (plus the
            regularization term, once):

                L_i = (1/K) sum_k loss(row_{iK+k}) + R,

            so its gradient sums its rows' gradients (each scaled by 1/K)
            and its norm includes the cross terms between them (each block's
            `grouped`). `mask`, the norms and the losses are per example.
        scales: None, or a coordinate-wise scale S per trainable variable
            (its shape; scale-then-privatize's preconditioner, see
            `tf_dpadam.privatizer.preclip`): each example's gradient is then S * grad_i
            (the norms are those of the scaled gradients, from each block's
            `scale_sq`, and the sums are of the scaled gradients).
        shifts, shift_weight: None, or a shift d per trainable variable
            (its shape) and the weight w (DiSK, see `tf_dpadam.privatizer.preclip`):
            each example's gradient is then
            (1 - w) grad_i(theta) + w grad_i(theta + d), from a second
            forward and backward pass at theta + d (the same random draws
            as the first) whose records follow the first pass's, so that
            every block stands for the combination (a layer called twice
            is one rule with two records already). Only rules whose blocks
            come from their records alone (`Rule.shifted_pass`) allow it.

    Returns:
        `(summed, norms, losses, y_pred)`: one float32 tensor per
        `model.trainable_variables` (the sum over examples of
        `min(1, C / norm_i) * mask_i * grad_i`, an example with a NaN or
        infinite gradient or loss contributing nothing), the per-example
        gradient norms `[B]` before clipping (NaN or inf for such
        examples), the per-example losses `[B]` (with the regularization
        term) and the batched predictions.

    Raises:
        GhostClippingUnsupportedError: at trace time, if the model cannot use
            ghost clipping; nothing has been applied.
    """
    result, _ = _clipped_gradient_sum(
        model, per_example_loss_fn, x, y, sample_weight, l2_norm_clip,
        mask=mask, training=training, group_size=group_size, scales=scales,
        shifts=shifts, shift_weight=shift_weight,
    )
    return result


def _clipped_gradient_sum(model, per_example_loss_fn, x, y, sample_weight,
                          l2_norm_clip, mask=None, training=True,
                          group_size=1, scales=None, shifts=None,
                          shift_weight=0.0):
    """`clipped_gradient_sum`'s result, and the blocks it was computed from."""
    if compat.in_stateless_scope():
        raise GhostClippingUnsupportedError(
            "ghost clipping does not run inside a keras.StatelessScope"
        )
    plan = plan_lib.Plan(model)
    if plan.problems:
        raise GhostClippingUnsupportedError(format_problems(plan.problems))
    variables = model.trainable_variables
    first = tf.convert_to_tensor(tf.nest.flatten(x)[0])
    rows = tf.shape(first)[0]  # the rules see rows (K per example)
    w = float(shift_weight) if shifts is not None else 0.0
    if shifts is not None:
        _check_shifted_pass(plan)
        offsets = dict(zip(map(id, variables), shifts))
        # The second pass draws what the first drew (dropout masks): the
        # states read now, before the first pass advances them (`value`
        # alone would be the variable, read later).
        states = [(g.state, tf.identity(g.state.value))
                  for g in compat.seed_generators(model)]

    # 1. Record.
    with tf.GradientTape() as tape:
        recording = recording_lib.Recording(tape, rows, first.shape[0])
        with recording_lib.recorded(plan.rules, recording):
            y_pred = model(x, training=training)
        losses = ops.cast(per_example_loss_fn(y, y_pred, sample_weight),
                          "float32")
        # Each row weighs 1/K of its example; with shifts, the gradient
        # here weighs 1 - w.
        total = ops.sum(losses) * ((1.0 - w) / group_size)
    recording_lib.check(model, recording, losses)
    # 2. Backward to the taps.
    tap_grads = recording_lib.tap_gradients(tape, total, plan, variables)
    finite = ops.isfinite(losses)
    if shifts is not None:
        # 1 and 2 again at the weights plus the shifts, the records after
        # the first pass's: each rule's blocks then stand for
        # (1 - w) g_i(theta) + w g_i(theta + shift).
        shifted_grads, shifted_finite = _shifted_pass(
            model, per_example_loss_fn, x, y, sample_weight, training,
            plan, states, offsets, w, group_size, rows, first.shape[0])
        tap_grads = [a + b for a, b in zip(tap_grads, shifted_grads)]
        finite = ops.logical_and(finite, shifted_finite)
    # 3. Norms.
    blocks = _blocks(plan, recording, tap_grads)
    if group_size > 1:
        blocks = _grouped(blocks, group_size)
        losses = ops.mean(ops.reshape(losses, (-1, group_size)), axis=1)
        finite = ops.all(ops.reshape(finite, (-1, group_size)), axis=1)
    regularization, reg_grads = recording_lib.regularization(model)
    if shifts is not None and reg_grads:
        _, shifted_reg = recording_lib.regularization(model, offsets=offsets)
        reg_grads = {k: (1.0 - w) * g + w * shifted_reg[k]
                     for k, g in reg_grads.items()}
    scales = ({} if scales is None else
              {id(v): ops.cast(t, "float32") for v, t in zip(variables, scales)})
    # Per-layer clipping: one norm and one clip factor per group.
    grouped = isinstance(l2_norm_clip, dp_math.GroupClip)
    groups = l2_norm_clip.groups if grouped else [0] * len(variables)
    try:
        norms = ops.stack([
            sums.norms([v for v, g in zip(variables, groups) if g == index],
                       blocks, reg_grads, rows // group_size, scales)
            for index in range(max(groups, default=0) + 1)
        ])
    except blocks_lib.ScaledNormUnsupportedError as error:
        raise GhostClippingUnsupportedError(
            f"{error} (a per-example scale, as scale-then-privatize"
            " uses)") from error
    # 4. Clip factors: 0 for an example whose gradient (its norm) or loss
    # (at either point, with shifts) is NaN or infinite.
    norms = norms if grouped else norms[0]
    factors = (dp_math.group_clip_factors(norms, l2_norm_clip.clip_norms,
                                          finite=finite) if grouped else
               dp_math.clip_factors(norms, l2_norm_clip, finite=finite)[None])
    if mask is not None:
        factors = factors * ops.cast(mask, factors.dtype)
    # 5. The weighted sums.
    summed = sums.weighted_sums(variables, blocks, reg_grads,
                                [factors[g] for g in groups])
    # sum_i c_i S grad_i = S sum_i c_i grad_i.
    summed = [s * scales[id(v)] if id(v) in scales else s
              for s, v in zip(summed, variables)]

    if regularization is not None:
        losses = losses + ops.cast(regularization, losses.dtype)
    for rule in plan.rules:
        rule.reset()
    return (summed, norms, losses, y_pred), blocks


def _check_shifted_pass(plan):
    """Raises unless every rule's blocks come from its records alone."""
    refused = [rule.layer.name for rule in plan.rules
               if not rule.shifted_pass]
    if refused:
        raise GhostClippingUnsupportedError(
            f"layers {refused} have no ghost rule for gradients at shifted"
            " weights (DiSK): their rules read the weights after the"
            " forward pass")


def _shifted_pass(model, per_example_loss_fn, x, y, sample_weight, training,
                  plan, states, offsets, w, group_size, rows, static_rows):
    """Records a forward pass at the weights plus `offsets` (id -> shift)
    after the first pass's records, with the seed generators at `states`
    (their values before the first pass; their advance is dropped), and
    differentiates `w` times its loss to the new taps (`rows` and
    `static_rows`: the batch's rows, as the first pass's `Recording`).

    Returns:
        `(tap_grads, finite)`: per rule, the gradients of its new records'
        taps; per row, whether the loss at the shifted weights is finite.
    """
    variables = model.trainable_variables
    counts = [len(rule.records) for rule in plan.rules]
    mapping = list(states) + [
        (v, preclip.shifted_value(v, offsets[id(v)])) for v in variables]
    with tf.GradientTape() as tape:
        recording = recording_lib.Recording(tape, rows, static_rows)
        recording.offsets = offsets
        with keras.StatelessScope(state_mapping=mapping,
                                  collect_losses=True):
            with recording_lib.recorded(plan.rules, recording, reset=False):
                y_shifted = model(x, training=training)
        losses = ops.cast(per_example_loss_fn(y, y_shifted, sample_weight),
                          "float32")
        total = ops.sum(losses) * (w / group_size)
    recording_lib.check(model, recording, losses)
    grads = recording_lib.tap_gradients(tape, total, plan, variables,
                                        first=counts)
    return grads, ops.isfinite(losses)


def block_modes(model, per_example_loss_fn, x, y, sample_weight=None):
    """How ghost clipping computes each trainable variable's blocks.

    Traces the step once on batches shaped like `x` (nothing runs or is
    applied): `{variable path: [mode, ...]}`, one mode per block, "outer",
    "materialize" or "ghost" for a `blocks.LinearBlock` (`linear_mode`: the
    ghost norm costs T^2 per example, materializing d p), else the block's
    class name (e.g. "MaterializedBlock" for a bias or a fallback layer).
    """
    variables = model.trainable_variables
    modes = {}

    @tf.function(autograph=False)
    def trace(x, y, sample_weight):
        (_, norms, _, _), blocks = _clipped_gradient_sum(
            model, per_example_loss_fn, x, y, sample_weight, 1.0
        )
        for v in variables:
            modes[v.path] = [getattr(b, "mode", type(b).__name__)
                             for b in blocks.get(id(v), [])]
        return norms

    trace.get_concrete_function(x, y, sample_weight)
    return modes


def _blocks(plan, recording, tap_grads):
    """`{id(variable): [block, ...]}` over all rules that recorded a call."""
    blocks = {}
    for rule, grads in zip(plan.rules, tap_grads):
        if not rule.records:
            continue
        produced = rule.blocks(recording, grads)
        missing = [v.path for v in rule.variables if id(v) not in produced]
        if rule.kind == "ghost" and missing:
            # E.g. a subclass whose kernel is computed from other weights:
            # the rule would drop their gradients, not compute them.
            raise GhostClippingUnsupportedError(
                f"layer {rule.layer.name!r} has trainable weights"
                f" {missing} that its ghost rule does not know"
            )
        for key, value in produced.items():
            blocks.setdefault(key, []).extend(value)
    return blocks


def _grouped(blocks, group_size):
    """The blocks of examples made of `group_size` consecutive rows each."""
    grouped = {}
    for key, value in blocks.items():
        for block in value:
            if not hasattr(block, "grouped"):
                raise GhostClippingUnsupportedError(
                    f"{type(block).__name__} blocks cannot group the"
                    " augmented views of an example"
                )
        grouped[key] = [block.grouped(group_size) for block in value]
    return grouped


def format_problems(problems):
    """One message from the plan's `(name, reason)` problems."""
    return "ghost clipping does not support: " + "; ".join(
        f"{name}: {reason}" for name, reason in problems
    )
