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

This module knows no layer; the rules know no clipping.
"""

import contextlib

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam import dp_math
from tf_dpadam import compat
from tf_dpadam.ghost_clipping import blocks as blocks_lib
from tf_dpadam.ghost_clipping import plan as plan_lib
from tf_dpadam.ghost_clipping import sums


class GhostClippingUnsupportedError(Exception):
    """The model (or this trace of it) cannot use ghost clipping.

    Raised while tracing, before anything is applied; the caller falls back to
    the vectorized path. (Derives from `Exception` without its own `__init__`
    so that AutoGraph re-raises it with its type instead of wrapping it in a
    `StagingError`.)
    """


class Recording:
    """What the rules see of the forward pass they record.

    Attributes:
        tape: the step's tape (rules watch their taps on it).
        batch_size: the batch size (a scalar tensor).
        static_batch_size: the batch size if known at trace time, else None.
        active: whether the rules record (True inside `recorded`).
        errors: problems found while recording (the step raises them).
    """

    def __init__(self, tape, batch_size, static_batch_size):
        self.tape = tape
        self.batch_size = batch_size
        self.static_batch_size = static_batch_size
        self.graph = tf.compat.v1.get_default_graph()
        self.errors = []
        self.active = False

    def same_graph(self):
        """False inside control flow (a `tf.while_loop`'s body, ...)."""
        return tf.compat.v1.get_default_graph() is self.graph

    def error(self, message):
        self.errors.append(message)

    def check_batch(self, t, layer):
        """`t` with its leading axis checked to be the batch axis."""
        if not tf.is_tensor(t):
            return t
        t = tf.convert_to_tensor(t)
        if t.shape.rank == 0:
            self.error(f"layer {layer.name!r} receives a scalar tensor")
            return t
        static = t.shape[0]
        # A statically known leading size must be the batch size (an unknown
        # one is checked at run time below).
        if static is not None and static != self.static_batch_size:
            self.error(
                f"layer {layer.name!r} receives a tensor of shape {t.shape}"
                " whose leading axis is not the batch axis (batch size"
                f" {self.static_batch_size})"
            )
            return t
        # Fails at run time if the leading axis is not the batch size.
        return tf.reshape(
            t, tf.concat([[self.batch_size], tf.shape(t)[1:]], axis=0)
        )


@contextlib.contextmanager
def recorded(rules, recording):
    """Installs the rules' interceptions; removes them on exit."""
    installed = []
    try:
        for rule in rules:
            rule.reset()
            rule.install(recording)
            installed.append(rule)
        recording.active = True
        yield
    finally:
        recording.active = False
        for rule in reversed(installed):
            rule.uninstall()


@tf.autograph.experimental.do_not_convert
def clipped_gradient_sum(model, per_example_loss_fn, x, y, sample_weight,
                         l2_norm_clip, mask=None, training=True,
                         group_size=1, scales=None):
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
            `tf_dpadam.preclip`): each example's gradient is then S * grad_i
            (the norms are those of the scaled gradients, from each block's
            `scale_sq`, and the sums are of the scaled gradients).

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
    )
    return result


def _clipped_gradient_sum(model, per_example_loss_fn, x, y, sample_weight,
                          l2_norm_clip, mask=None, training=True,
                          group_size=1, scales=None):
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

    # 1. Record.
    with tf.GradientTape() as tape:
        recording = Recording(tape, rows, first.shape[0])
        with recorded(plan.rules, recording):
            y_pred = model(x, training=training)
        losses = ops.cast(per_example_loss_fn(y, y_pred, sample_weight),
                          "float32")
        total = ops.sum(losses)
        if group_size > 1:
            total = total / group_size  # each row weighs 1/K of its example
    _check_recording(model, recording, losses)
    # 2. Backward to the taps.
    tap_grads = _tap_gradients(tape, total, plan, variables)
    # 3. Norms.
    blocks = _blocks(plan, recording, tap_grads)
    if group_size > 1:
        blocks = _grouped(blocks, group_size)
        losses = ops.mean(ops.reshape(losses, (-1, group_size)), axis=1)
    regularization, reg_grads = _regularization(model)
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
    # is NaN or infinite.
    finite = ops.isfinite(losses)
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


def _check_recording(model, recording, losses):
    if recording.errors:
        raise GhostClippingUnsupportedError("; ".join(recording.errors))
    if compat.losses_added_in_call(model):
        raise GhostClippingUnsupportedError(
            "the model adds losses in call (add_loss or activity"
            " regularization); they are per-example terms this module does"
            " not decompose"
        )
    if len(losses.shape) != 1:
        raise ValueError(
            f"per_example_loss_fn must return a [batch] vector, got shape"
            f" {losses.shape}"
        )


def _tap_gradients(tape, total, plan, variables):
    """The gradients of the loss w.r.t. every rule's taps.

    Ghost rules compute with stopped weights, so a ghost variable with a
    gradient of its own is used outside its layer's call: refused.
    """
    ghost_variables = [
        v for v in variables if plan.owner[id(v)].kind == "ghost"
    ]
    taps = [rule.taps() for rule in plan.rules]
    tap_grads, unexpected = tape.gradient(
        total, (taps, ghost_variables),
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    )
    leaked = [v.path for v, g in zip(ghost_variables, unexpected)
              if g is not None]
    if leaked:
        raise GhostClippingUnsupportedError(
            f"variables {leaked} are used outside their layer's call (e.g."
            " tied weights, or a per_example_loss_fn that includes"
            " regularization losses); their gradients would be incomplete"
        )
    # A tap the loss does not depend on has gradient zero.
    return [
        [[g if g is not None or t is None else tf.zeros_like(t)
          for t, g in zip(record_taps, record_grads)]
         for record_taps, record_grads in zip(rule_taps, rule_grads)]
        for rule_taps, rule_grads in zip(taps, tap_grads)
    ]


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


def _regularization(model):
    """`(R, {id(var): grad R})` over trainable weights with a regularizer.

    As in the vectorized path, every example's loss includes the whole
    regularization term R, so example i's gradient is `h_i + grad R`: its
    squared norm is `||h_i||^2 + 2 h_i . grad R + ||grad R||^2` and the
    clipped sum `sum_i c_i h_i + (sum_i c_i) grad R`.
    """
    regularized = [
        v for v in model.trainable_weights
        if getattr(v, "regularizer", None) is not None
    ]
    if not regularized:
        return None, {}
    with tf.GradientTape() as tape:
        terms = []
        for v in regularized:
            loss = v.regularizer(v)
            if not loss.dtype.is_floating:
                loss = ops.cast(loss, keras.config.floatx())
            terms.append(ops.sum(loss))
        total = ops.sum(ops.stack(terms))
    grads = tape.gradient(total, regularized)
    return total, {
        id(v): g for v, g in zip(regularized, grads) if g is not None
    }


def format_problems(problems):
    """One message from the plan's `(name, reason)` problems."""
    return "ghost clipping does not support: " + "; ".join(
        f"{name}: {reason}" for name, reason in problems
    )
