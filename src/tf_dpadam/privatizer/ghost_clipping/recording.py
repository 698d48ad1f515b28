"""What ghost clipping's step records and differentiates.

`Recording` is what the rules see of a forward pass (its tape, the batch
size, the problems found); `recorded` installs the rules' interceptions for
one pass; `tap_gradients` differentiates a pass's loss to its records' taps;
`regularization` is the weights' regularization term and its gradient (at
the weights, or at the weights plus offsets: DiSK's second point).
"""

import contextlib

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import preclip


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
        offsets: None, or `{id(variable): shift}` in a pass at the weights
            plus those shifts (DiSK's second point): the forward pass runs
            at them, and a rule that replays a layer must too.
    """

    def __init__(self, tape, batch_size, static_batch_size):
        self.tape = tape
        self.batch_size = batch_size
        self.static_batch_size = static_batch_size
        self.graph = tf.compat.v1.get_default_graph()
        self.errors = []
        self.active = False
        self.offsets = None

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
def recorded(rules, recording, reset=True):
    """Installs the rules' interceptions; removes them on exit. With
    `reset=False` the rules keep their records of an earlier pass (the
    new records follow them)."""
    installed = []
    try:
        for rule in rules:
            if reset:
                rule.reset()
            rule.install(recording)
            installed.append(rule)
        recording.active = True
        yield
    finally:
        recording.active = False
        for rule in reversed(installed):
            rule.uninstall()


def check(model, recording, losses):
    """Raises what the pass's recording found (or the model's losses
    added in call, or losses that are not per example)."""
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


def tap_gradients(tape, total, plan, variables, first=None):
    """The gradients of the loss w.r.t. every rule's taps: per rule, one
    list per record (from record `first[k]` of rule k if given: the
    records of a later pass).

    Ghost rules compute with stopped weights, so a ghost variable with a
    gradient of its own is used outside its layer's call: refused.
    """
    ghost_variables = [
        v for v in variables if plan.owner[id(v)].kind == "ghost"
    ]
    first = first or [0] * len(plan.rules)
    taps = [rule.taps()[start:] for rule, start in zip(plan.rules, first)]
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


def regularization(model, offsets=None):
    """`(R, {id(var): grad R})` over trainable weights with a regularizer;
    at the weights plus `offsets[id(var)]` where `offsets` is given.

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
        points = regularized
        if offsets is not None:
            points = [preclip.shifted_value(v, offsets[id(v)])
                      for v in regularized]
            tape.watch(points)
        terms = []
        for v, point in zip(regularized, points):
            loss = v.regularizer(point)
            if not loss.dtype.is_floating:
                loss = ops.cast(loss, keras.config.floatx())
            terms.append(ops.sum(loss))
        total = ops.sum(ops.stack(terms))
    grads = tape.gradient(total, points)
    return total, {
        id(v): g for v, g in zip(regularized, grads) if g is not None
    }
