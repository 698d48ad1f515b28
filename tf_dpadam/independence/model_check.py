"""The model's part of the independence check (package docstring, 1).

In training mode (with `augment` and `augmult` as the step applies them),
example j's input is replaced by example k's, and no other example's output
may change; every random and non-trainable state is restored around each
pass, so random layers give no false alarm and the model is left as it was.
"""

import warnings

import keras
import tensorflow as tf

from tf_dpadam import augmentation
from tf_dpadam import compat
from tf_dpadam.independence import errors
from tf_dpadam.independence.rows import change_of_other_rows
from tf_dpadam.independence.rows import example_rows
from tf_dpadam.independence.rows import num_rows
from tf_dpadam.independence.rows import replace_row
from tf_dpadam.independence.rows import replace_rows

# --------------------------------------------------------------------------
# Random and other state, restored around the passes.


class _StateSnapshot:
    """The values of every non-trainable variable and seed state of the
    given layers (and Keras' global seed generator), to restore."""

    def __init__(self, layers):
        variables, seen = [], set()
        for layer in layers:
            found = list(layer.non_trainable_variables) + [
                g.state for g in compat.seed_generators(layer)]
            for v in found:
                if id(v) not in seen:
                    seen.add(id(v))
                    variables.append(v)
        self._pairs = []
        self.add(variables)

    def add(self, variables):
        for v in variables:
            self._pairs.append((v, keras.ops.convert_to_numpy(v.value)))

    def restore(self):
        for v, value in self._pairs:
            v.assign(value)


# --------------------------------------------------------------------------
# The model.


def _layers_of(augment, model):
    layers = [model]
    if isinstance(augment, keras.layers.Layer):
        layers.append(augment)
    return layers


def _views(augment, augmult, x):
    if augment is None and augmult == 1:
        return x
    return augmentation.views(augment, x, augmult)


def _intermediate_outputs_model(model):
    """`([layers], probe)`: a functional model that returns the output of
    every layer of `model` called once (in `model.layers` order), or None
    if `model` is not functional or Sequential."""
    try:
        pairs = []
        for layer in model.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            if len(getattr(layer, "_inbound_nodes", ())) != 1:
                continue
            pairs.append((layer, layer.output))
        if not pairs:
            return None
        try:
            inputs = model.input  # The structure the model is called with.
        except AttributeError:  # A Sequential model that was never called.
            inputs = (model.inputs[0] if len(model.inputs) == 1
                      else model.inputs)
        probe = keras.Model(inputs, [out for _, out in pairs])
        return [layer for layer, _ in pairs], probe
    except Exception:  # noqa: BLE001 - any model the probe cannot rebuild
        return None


def _first_mixing_layer(model, x, x_changed, skipped, snapshot):
    """The first layer of `model` whose outputs mix, or None."""
    found = _intermediate_outputs_model(model)
    if found is None:
        return None
    layers, probe = found
    rows = num_rows(x)
    try:
        before = probe(x, training=True)
        snapshot.restore()
        after = probe(x_changed, training=True)
        snapshot.restore()
    except Exception:  # noqa: BLE001 - fall back to naming the model
        return None
    for layer, a, b in zip(layers, before, after):
        leaves = [t for t in tf.nest.flatten(a) if t is not None]
        if not leaves or any(
                len(t.shape) == 0 or t.shape[0] != rows for t in leaves):
            continue  # Not one row per example: cannot be judged alone.
        if change_of_other_rows(a, b, skipped) > 1.0:
            return layer
    return None


def check_model(model, augment, augmult, x, j, k):
    """Training-mode outputs for x and x with example j := k; raises if the
    other examples' outputs differ."""
    snapshot = _StateSnapshot(_layers_of(augment, model))
    try:
        snapshot.add(compat.global_seed_generator_states())
        views = _views(augment, augmult, x)
        snapshot.restore()
        x_changed = replace_row(x, j, k)
        views_changed = _views(augment, augmult, x_changed)
        snapshot.restore()
        skipped = example_rows(j, augmult)
        if augment is not None:
            score = change_of_other_rows(views, views_changed, skipped)
            if score > 1.0:
                again = _views(augment, augmult, x)
                snapshot.restore()
                if change_of_other_rows(views, again, ()) <= 1.0:
                    raise errors.mixing_error(
                        f"make_private(augment={augment!r})", score,
                        "The augmentation must transform each example on"
                        " its own (no MixUp or CutMix).")
                # Random state the guard cannot see (e.g. random layers
                # inside a plain function): the augmentation cannot be
                # checked, the model still is, on the same views.
                warnings.warn(
                    f"make_private(augment={augment!r}): could not check"
                    " that the augmentation treats each example on its own"
                    " (its random draws are not reproducible with the"
                    " model's keras.random.SeedGenerators restored; pass a"
                    " Keras layer or model as `augment` so that they are)."
                    " It must not mix examples (no MixUp or CutMix).",
                    stacklevel=4)
                views_changed = replace_rows(
                    views, skipped, example_rows(k, augmult))
        y_pred = model(views, training=True)
        snapshot.restore()
        y_pred_changed = model(views_changed, training=True)
        snapshot.restore()
        score = change_of_other_rows(y_pred, y_pred_changed, skipped)
        if score > 1.0:
            again = model(views, training=True)
            snapshot.restore()
            if change_of_other_rows(y_pred, again, ()) > 1.0:
                raise ValueError(
                    f"Cannot check that model {model.name!r} treats the"
                    " examples of a batch independently: its training-mode"
                    " outputs are not reproducible even with every"
                    " keras.random.SeedGenerator restored (a random op"
                    " outside keras.random, e.g. tf.random.*?). Draw random"
                    " numbers with keras.random and a"
                    " keras.random.SeedGenerator." + errors.TURN_OFF
                )
            layer = _first_mixing_layer(model, views, views_changed,
                                        skipped, snapshot)
            if layer is None:
                what = f"Model {model.name!r} ({type(model).__name__})"
            else:
                what = (f"Layer {layer.name!r} ({type(layer).__name__}) of"
                        f" model {model.name!r}")
            raise errors.mixing_error(what, score, errors.LAYER_CURE)
        return y_pred, y_pred_changed
    finally:
        snapshot.restore()

