"""The random state the check restores, the check of `augment`, and the
layer that mixes (package docstring, 1 and 3).

Every random and non-trainable state is restored around each pass, so
random layers draw the same numbers for a row in both batches (no false
alarm) and the model is left as it was.
"""

import warnings

import keras
import tensorflow as tf

from tf_dpadam.training import augmentation
from tf_dpadam.common import compat
from tf_dpadam.training.independence import errors
from tf_dpadam.training.independence.rows import change_of_rows
from tf_dpadam.training.independence.rows import copies_of_row
from tf_dpadam.training.independence.rows import num_rows

# --------------------------------------------------------------------------
# Random and other state, restored around the passes.


class StateSnapshot:
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
# The augmentation and the layers.

# The random draws of `augment` the check tries at each checked batch: an
# augmentation that mixes examples only in some batches (MixUp with
# probability p per batch) escapes all of them with probability
# (1 - p) ** AUGMENT_DRAWS.
AUGMENT_DRAWS = 16


def layers_of(augment, model):
    """The layers whose state the check restores."""
    layers = [model]
    if isinstance(augment, keras.layers.Layer):
        layers.append(augment)
    return layers


def _views(augment, augmult, x):
    if augment is None and augmult == 1:
        return x
    return augmentation.views(augment, x, augmult)


def check_augment(augment, augmult, x, copies, rows, snapshot):
    """Raises if `augment`'s view of example i (in `rows`) differs between
    the batch and the copies of example i, in any of `AUGMENT_DRAWS` random
    draws. Returns False (and warns) if its draws cannot be replayed, else
    True."""
    if augment is None:
        return True
    try:
        for _ in range(AUGMENT_DRAWS):
            # This draw's state (each draw starts where the last ended).
            draw = StateSnapshot([augment] if isinstance(
                augment, keras.layers.Layer) else [])
            draw.add(compat.global_seed_generator_states())
            views = _views(augment, augmult, x)
            for i, batch in zip(rows, copies):
                draw.restore()
                again = _views(augment, augmult, batch)
                view_rows = list(range(i * augmult, (i + 1) * augmult))
                score = change_of_rows(views, again, view_rows)
                if score <= 1.0:
                    continue
                draw.restore()
                if change_of_rows(views, _views(augment, augmult, x),
                                  view_rows) > 1.0:
                    # Random state the guard cannot see (random ops
                    # outside keras.random): the model is still checked.
                    warnings.warn(
                        f"make_private(augment={augment!r}): could not check"
                        " that the augmentation treats each example on its"
                        " own (its random draws are not reproducible with"
                        " its keras.random.SeedGenerators restored; pass a"
                        " Keras layer or model as `augment` so that they"
                        " are). It must not mix examples (no MixUp or"
                        " CutMix).", stacklevel=5)
                    return False
                raise errors.mixing_error(
                    f"make_private(augment={augment!r})", score,
                    "The augmentation must transform each example on its"
                    " own (no MixUp or CutMix).", errors.replaced_evidence(i))
    finally:
        snapshot.restore()
    return True


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


def first_mixing_layer(model, views, views_copies, rows, snapshot):
    """The first layer of `model` (functional or Sequential) whose training-
    mode outputs for `rows` differ between the two batches, or None."""
    found = _intermediate_outputs_model(model)
    if found is None:
        return None
    layers, probe = found
    total = num_rows(views)
    try:
        snapshot.restore()
        before = probe(views, training=True)
        snapshot.restore()
        after = probe(views_copies, training=True)
    except Exception:  # noqa: BLE001 - fall back to naming the model
        return None
    finally:
        snapshot.restore()
    for layer, a, b in zip(layers, before, after):
        leaves = [t for t in tf.nest.flatten(a) if t is not None]
        if not leaves or any(
                len(t.shape) == 0 or t.shape[0] != total for t in leaves):
            continue  # Not one row per example: cannot be judged alone.
        if change_of_rows(a, b, rows) > 1.0:
            return layer
    return None


def layer_error(model, views, views_copies, rows, i, score, snapshot):
    """The error for example i (rows `rows` of the step), whose outputs
    differ: names the first layer of `model` whose outputs for it differ,
    else the model."""
    layer = first_mixing_layer(model, views, views_copies, rows, snapshot)
    what = (f"Model {model.name!r} ({type(model).__name__})"
            if layer is None else
            f"Layer {layer.name!r} ({type(layer).__name__}) of model"
            f" {model.name!r}")
    return errors.mixing_error(what, score, errors.LAYER_CURE,
                               errors.replaced_evidence(i))


def views_of(augment, augmult, x, snapshot):
    """The rows the step clips for `x`, from the restored random state."""
    snapshot.restore()
    try:
        return _views(augment, augmult, x)
    finally:
        snapshot.restore()


def check_outputs(model, x, rows):
    """Raises if `model`'s training-mode outputs for an example of `rows`
    change when the other rows of `x` are copies of it (the model alone,
    without a loss or a step; `tf_dpadam.validate`)."""
    snapshot = StateSnapshot([model])
    snapshot.add(compat.global_seed_generator_states())
    try:
        base = model(x, training=True)
        for i in rows:
            snapshot.restore()
            copies = copies_of_row(x, i)
            score = change_of_rows(base, model(copies, training=True), [i])
            if score > 1.0:
                raise layer_error(model, x, copies, [i], i, score, snapshot)
    finally:
        snapshot.restore()
