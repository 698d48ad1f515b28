"""What the check compares: one batch through the private step's own code.

`Probe(model)` gives, for the rows the step clips (after `augment` and
`augmult`), the training-mode predictions and per-example losses of one
batched forward pass (`outputs`), and every example's gradient norm as the
train step computes it (`norms`: (ghost clipping or the
vectorized map, with the optimizer's per-example transform; the norm before
clipping, which clipping then maps to the example's contribution). Each is
a `tf.function`, compiled with XLA when the model's train step is, traced
again when the compiled loss, the trainable weights or `augment` change.
"""

import tensorflow as tf

from tf_dpadam.privatizer.ghost_clipping import per_example_loss
from tf_dpadam.privatizer import dp_math
from tf_dpadam.training import train_step as train_step_lib


def state_key(model):
    """What the step was traced for (`train_step.StepState`: the compiled
    loss, the optimizer, the trainable weights, which a `layer.trainable`
    set during training changes, the augmentation and the clipping)."""
    return train_step_lib.StepState(model)


class Probe:
    """`outputs(x, y, w)` -> `(y_pred, losses)` and `norms(x, y, w)` of a
    batch; see the module docstring. Two functions, so that a model whose
    outputs already mix is named by them before its gradients are
    computed (which may fail for such a model)."""

    def __init__(self, model):
        self._model = model
        self._functions = None
        self._key = None

    def _make(self):
        model = self._model

        def outputs(x, y, sample_weight, given=False):
            if not given:  # Else x, y and the weights are the step's rows.
                x, y, sample_weight, _ = train_step_lib.views(
                    model, x, y, sample_weight)
            y_pred = model.base_model(x, training=True)
            losses = per_example_loss.compiled_loss_fn(model)(
                y, y_pred, sample_weight)
            return y_pred, losses

        def norms(x, y, sample_weight, present=None):
            if present is None:  # Else x, y and the weights are the rows.
                x, y, sample_weight, present = train_step_lib.views(
                    model, x, y, sample_weight)
            # The norms do not depend on the clip norm. Through the step's
            # own function where it has one (traced once for both).
            groups = model.optimizer.variable_groups()
            shared = train_step_lib.shared_clipped_sum(model, groups)
            if shared is None:
                _, found, _, _ = train_step_lib.clipped_sum_by_mode(
                    model, x, y, sample_weight, present, 1.0)
            else:
                ones = tf.ones([] if groups is None else [max(groups) + 1])
                _, found, _, _ = shared(x, y, sample_weight, present, ones)
            return dp_math.global_norms(found)

        def scoped(function):
            # Not a root name scope: a model named "__x" cannot be one.
            def call(*args, **kwargs):
                with tf.name_scope("independence_probe"):
                    return function(*args, **kwargs)
            return call

        jit_compile = model.jit_compile is True
        return [tf.function(scoped(f), jit_compile=jit_compile,
                            reduce_retracing=True)
                for f in (outputs, norms)] + [outputs]

    def _function(self, index):
        key = state_key(self._model)
        if self._functions is None or key != self._key:
            self._functions, self._key = self._make(), key
        return self._functions[index]

    def outputs(self, x, y, sample_weight, eager=False, given=False):
        """Eagerly for a single call (no trace), else compiled; `given`:
        `x`, `y` and `sample_weight` are the step's rows already (the views
        of an `augment` whose draws cannot be replayed)."""
        return self._function(2 if eager else 0)(x, y, sample_weight,
                                                 given=given)

    def norms(self, x, y, sample_weight, present=None):
        """`present` given: `x`, `y` and `sample_weight` are the step's
        rows already, `present` per example."""
        return self._function(1)(x, y, sample_weight, present=present)
