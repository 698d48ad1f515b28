"""Checks, before the first private step, that the examples are independent.

Per-example clipping bounds one example's influence on the clipped sum by C
only if example i's gradient depends on example i alone. A layer that mixes
the examples of a batch in training (batch statistics, attention over the
batch axis, a transpose that puts the examples on another axis) or a loss
that does (in-batch negatives, a normalization by batch statistics) breaks
that: removing example j then moves every other example's gradient, and the
measured remove-one sensitivity exceeds C (tests/sensitivity_zoo_test.py).
Under `clipping="vectorized"` the same model or loss silently trains on
batches of one instead. A list of known layers cannot cover user code, so
`check` tests the property itself, on the user's model, loss and first
training batch, eagerly:

1. The model in training mode (with `augment` and `augmult` as the step
   applies them): example j's input is replaced by example k's, and no other
   example's output may change. The random state of every
   `keras.random.SeedGenerator` (Dropout, GaussianNoise, random
   augmentations, Keras' global generator) and every non-trainable variable
   (BatchNormalization's moving statistics, seed states) is restored before
   each pass and after the check, so random layers give no false alarm and
   the model is left as it was. On a failure the first layer (in the order
   of a functional or Sequential model) whose outputs mix is named, else the
   model.
2. The loss: the per-example losses the step uses
   (`ghost_clipping.compiled_loss_fn` on the whole batch) must not change
   for the other examples when example j changes, and must equal those of
   one-example slices; and the gradient of the compiled loss w.r.t. the
   predictions of the other examples must not change when example j's
   `(y, y_pred)` does (this catches a contrastive loss even where the step
   would evaluate it one example at a time).

"Unchanged" means `max |a' - a| <= rtol * max |a| + atol` per tensor, with
`rtol = RELATIVE_TOLERANCE` (1e-4) for 32- and 64-bit floats and
`LOW_PRECISION_RELATIVE_TOLERANCE` (1e-2) for 16-bit ones: float32
rounding (~1e-7) cannot trip it, while a mixing layer moves the other rows
by about |x_j - x_k| / B (centering a batch of 256 moves them by ~4e-3 of
their scale).

What it cannot catch: mixing that only shows in the backward pass (a custom
gradient), in `add_loss` of a layer, in a random op outside
`keras.random` (the outputs are then not reproducible and the check raises
a `ValueError` saying so rather than guessing), or only in batches other
than the first (e.g. a layer that mixes only above some batch size), or for
examples identical to the one that replaces them. A first batch with fewer
than two distinct examples cannot be checked (a warning says so).

Cost: once per model and compiled loss (`compile` with another loss checks
again), on the first training batch: three forward passes in training mode
(a fourth and a per-layer probe only when it fails), the compiled loss a few
times and two gradients of it w.r.t. the predictions, all eager; measured
by benchmarks/guard_cost.py. `make_private(check_independence=False)` turns
it off, for models the user has verified.
"""

import itertools
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_dpadam import augmentation
from tf_dpadam import compat
from tf_dpadam.ghost_clipping import per_example_loss

RELATIVE_TOLERANCE = 1e-4
LOW_PRECISION_RELATIVE_TOLERANCE = 1e-2
ABSOLUTE_TOLERANCE = 1e-12
# The rows whose one-example loss is compared with the batched one.
SLICED_ROWS = 3

_TURN_OFF = (
    " If you have verified yourself that the examples of a batch are"
    " independent, make_private(..., check_independence=False) turns this"
    " check off."
)


# --------------------------------------------------------------------------
# Pure helpers on structures of [rows, ...] tensors.


def num_rows(structure):
    """The leading dimension of the first leaf of `structure`."""
    return int(tf.shape(tf.nest.flatten(structure)[0])[0])


def replace_row(structure, j, k):
    """`structure` with row j of every leaf replaced by row k (dense or
    ragged tensors; None stays None)."""
    def replace(t):
        if t is None:
            return None
        t = tf.convert_to_tensor(t) if not isinstance(
            t, tf.RaggedTensor) else t
        return tf.concat([t[:j], t[k:k + 1], t[j + 1:]], axis=0)

    return tf.nest.map_structure(replace, structure)


def replace_rows(structure, rows_j, rows_k):
    """`replace_row` for several (j, k) pairs, in order."""
    for j, k in zip(rows_j, rows_k):
        structure = replace_row(structure, j, k)
    return structure


def _row_values(t, i):
    row = t[i]
    if isinstance(row, tf.RaggedTensor):
        return row.to_list()
    return np.asarray(row)


def distinct_row(structure, j):
    """The first row k != j that differs from row j in some leaf, or None."""
    leaves = [t for t in tf.nest.flatten(structure) if t is not None]
    for k in range(num_rows(structure)):
        if k == j:
            continue
        for t in leaves:
            a, b = _row_values(t, j), _row_values(t, k)
            if isinstance(a, list):
                if a != b:
                    return k
            elif a.shape != b.shape or not np.array_equal(a, b):
                return k
    return None


def relative_tolerance(dtype):
    """The check's rtol for a tensor of `dtype` (see the module docstring)."""
    dtype = tf.as_dtype(dtype)
    if dtype.is_floating and dtype.size <= 2:
        return LOW_PRECISION_RELATIVE_TOLERANCE
    return RELATIVE_TOLERANCE


def _as_float64(t):
    if isinstance(t, tf.RaggedTensor):
        t = t.to_tensor()
    return np.asarray(keras.ops.convert_to_numpy(t)).astype("float64")


def change_of_other_rows(before, after, skipped):
    """How much the rows not in `skipped` changed, relative to the tolerance.

    Returns the largest `max |a' - a| / (rtol * max |a| + atol)` over the
    leaves of the structures (compared over all rows but `skipped`); > 1
    means changed. Leaves whose leading dimension differs between `before`
    and `after` count as changed (inf); NaNs in the same places are equal.
    """
    worst = 0.0
    for a, b in zip(tf.nest.flatten(before), tf.nest.flatten(after)):
        if a is None or b is None:
            continue
        rtol = relative_tolerance(getattr(a, "dtype", "float32"))
        a, b = _as_float64(a), _as_float64(b)
        if a.shape != b.shape:
            return float("inf")
        if a.ndim == 0:
            keep_a, keep_b = a, b
        else:
            keep = np.ones(a.shape[0], bool)
            keep[[i for i in skipped if i < a.shape[0]]] = False
            keep_a, keep_b = a[keep], b[keep]
        both_nan = np.isnan(keep_a) & np.isnan(keep_b)
        diff = np.where(both_nan, 0.0, np.abs(keep_a - keep_b))
        if np.isnan(diff).any():
            return float("inf")
        finite = np.abs(a[np.isfinite(a)])
        scale = float(finite.max()) if finite.size else 0.0
        if diff.size:
            worst = max(worst, float(diff.max())
                        / (rtol * scale + ABSOLUTE_TOLERANCE))
    return worst


# --------------------------------------------------------------------------
# Random and other state, restored around the passes.


def _global_seed_generator_state():
    """The state variable of Keras' global seed generator, if it exists."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover
        return []
    generator = global_state.get_global_attribute("global_seed_generator")
    state = getattr(generator, "state", None)
    return [] if state is None else [state]


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


def _example_rows(example, augmult):
    return list(range(example * augmult, (example + 1) * augmult))


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


def _mixing_error(what, score, cure, evidence=None):
    evidence = evidence or (
        "replacing one example of the first training batch by another"
        " changed the outputs of the other examples")
    return ValueError(
        f"{what} mixes the examples of a batch in training: {evidence}"
        f" ({score:.3g} times the tolerance of the check). Per-example"
        " clipping then does not bound one example's influence, and training"
        " would not be differentially private (with"
        " clipping='vectorized' the model would silently train on batches"
        f" of one instead). {cure}" + _TURN_OFF
    )


_LAYER_CURE = (
    "Use layers that treat each example on its own and keep the examples on"
    " axis 0: e.g. LayerNormalization or GroupNormalization instead of batch"
    " statistics, no transpose or reduction over the batch axis."
)
_LOSS_CURE = (
    "Use a per-example loss: example i's loss may depend on (y_i, y_pred_i)"
    " only, not on other examples (no in-batch negatives as in a CLIP-style"
    " contrastive loss, no normalization by batch statistics)."
)


def _check_model(model, augment, augmult, x, j, k):
    """Training-mode outputs for x and x with example j := k; raises if the
    other examples' outputs differ."""
    snapshot = _StateSnapshot(_layers_of(augment, model))
    try:
        snapshot.add(_global_seed_generator_state())
        views = _views(augment, augmult, x)
        snapshot.restore()
        x_changed = replace_row(x, j, k)
        views_changed = _views(augment, augmult, x_changed)
        snapshot.restore()
        skipped = _example_rows(j, augmult)
        if augment is not None:
            score = change_of_other_rows(views, views_changed, skipped)
            if score > 1.0:
                again = _views(augment, augmult, x)
                snapshot.restore()
                if change_of_other_rows(views, again, ()) <= 1.0:
                    raise _mixing_error(
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
                    views, skipped, _example_rows(k, augmult))
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
                    " keras.random.SeedGenerator." + _TURN_OFF
                )
            layer = _first_mixing_layer(model, views, views_changed,
                                        skipped, snapshot)
            if layer is None:
                what = f"Model {model.name!r} ({type(model).__name__})"
            else:
                what = (f"Layer {layer.name!r} ({type(layer).__name__}) of"
                        f" model {model.name!r}")
            raise _mixing_error(what, score, _LAYER_CURE)
        return y_pred, y_pred_changed
    finally:
        snapshot.restore()


# --------------------------------------------------------------------------
# The loss.


def _slice_rows(structure, rows):
    """Rows `rows` (a slice) of each leaf, Keras masks kept."""
    def take(t):
        if t is None:
            return None
        part = t[rows]
        mask = compat.get_keras_mask(t)
        if mask is not None:
            part = tf.identity(part)
            compat.set_keras_mask(part, mask[rows])
        return part

    return tf.nest.map_structure(take, structure)


def _replace_keeping_masks(structure, rows_j, rows_k):
    changed = replace_rows(structure, rows_j, rows_k)

    def keep_mask(old, new):
        mask = None if old is None else compat.get_keras_mask(old)
        if mask is not None:
            compat.set_keras_mask(new, mask)
        return new

    return tf.nest.map_structure(keep_mask, structure, changed)


def _loss_error(model, score, evidence):
    compile_loss = compat.compile_loss(model)
    single = compat.single_loss(compile_loss)
    loss = single[0] if single is not None else compile_loss
    name = getattr(loss, "name", None) or type(loss).__name__
    fn = getattr(loss, "fn", None)
    if fn is not None:
        name = getattr(fn, "__name__", name)
    return _mixing_error(f"The compiled loss {name!r}", score, _LOSS_CURE,
                         evidence)


def _prediction_gradients(compile_loss, y, y_pred, sample_weight):
    """d loss(y, y_pred) / d y_pred for the floating leaves of y_pred."""
    leaves = [t for t in tf.nest.flatten(y_pred)
              if t is not None and t.dtype.is_floating]
    with tf.GradientTape() as tape:
        for t in leaves:
            tape.watch(t)
        with compat.loss_metrics_paused(compile_loss):
            loss = compile_loss(y, y_pred, sample_weight)
    return [g if g is not None else tf.zeros_like(t)
            for t, g in zip(leaves, tape.gradient(loss, leaves))]


def _check_loss(model, augmult, y, sample_weight, y_pred, y_pred_changed,
                j, k):
    """Raises if the compiled loss mixes examples (module docstring, 2)."""
    compile_loss = compat.compile_loss(model)
    if compile_loss is None:
        return
    y, sample_weight = augmentation.repeat_examples(
        (y, sample_weight), augmult)
    rows_j, rows_k = _example_rows(j, augmult), _example_rows(k, augmult)
    y_changed = replace_rows(y, rows_j, rows_k)
    per_example = per_example_loss.compiled_loss_fn(model)
    losses = per_example(y, y_pred, sample_weight)
    # The other examples' losses, with example j changed.
    score = change_of_other_rows(
        losses, per_example(y_changed, y_pred_changed, sample_weight), rows_j)
    if score > 1.0:
        raise _loss_error(model, score, (
            "replacing one example of the first training batch by another"
            " changed the other examples' losses"))
    # The batched losses against one-example slices.
    total = num_rows(y_pred)
    for i in sorted({0, rows_k[0], total - 1})[:SLICED_ROWS]:
        rows = slice(i, i + 1)
        alone = per_example(_slice_rows(y, rows), _slice_rows(y_pred, rows),
                            _slice_rows(sample_weight, rows))
        score = change_of_other_rows(losses[rows], alone, ())
        if score > 1.0:
            raise _loss_error(model, score, (
                f"example {i}'s loss in the first training batch differs from"
                " its loss in a batch of one"))
    # The gradient of the compiled loss w.r.t. the other predictions.
    gradients = _prediction_gradients(compile_loss, y, y_pred, sample_weight)
    changed = _prediction_gradients(
        compile_loss, y_changed,
        _replace_keeping_masks(y_pred, rows_j, rows_k), sample_weight)
    score = change_of_other_rows(gradients, changed, rows_j)
    if score > 1.0:
        raise _loss_error(model, score, (
            "replacing one example's (y, y_pred) in the first training batch"
            " changed the gradient of the loss w.r.t. the other examples'"
            " predictions"))


# --------------------------------------------------------------------------
# The entry point.


composite_types = (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)


def check(model, data):
    """Raises `ValueError` if `model`'s training mixes the examples of `data`.

    Args:
        model: a compiled `PrivateModel` (its `base_model`, `augment`,
            `augmult` and compiled loss are checked).
        data: a concrete training batch `(x, y, sample_weight)`, `(x, y)` or
            `x` (the first one `fit` or `train_on_batch` trains on).

    Returns:
        True if checked, False if the batch has fewer than two distinct
        examples (a warning says so).

    Raises:
        ValueError: naming the layer (or the model, or `augment`) or the loss
            that mixes examples, and what to use instead.
    """
    data = tf.nest.map_structure(
        lambda t: t if t is None or isinstance(t, composite_types)
        else tf.convert_to_tensor(t), data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    j = 0
    k = distinct_row(x, j) if num_rows(x) >= 2 else None
    if k is None:
        warnings.warn(
            "make_private(check_independence=True) could not check that the"
            " examples are independent: the first training batch has fewer"
            " than two distinct examples.", stacklevel=3)
        return False
    y_pred, y_pred_changed = _check_model(
        model.base_model, model.augment, model.augmult, x, j, k)
    _check_loss(model, model.augmult, y, sample_weight, y_pred,
                y_pred_changed, j, k)
    return True


# --------------------------------------------------------------------------
# The hook: Keras' train function, checked on its first call.


def _without_optionals(data):
    return tf.nest.map_structure(
        lambda t: None if isinstance(t, tf.experimental.Optional) else t,
        data)


def _first_replica(data):
    """The first local replica's part of a distributed batch (read outside
    the strategy's scope, where `get_strategy()` is the default one)."""
    def first(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return value.values[0]
        return value

    return tf.nest.map_structure(first, data)


def _same_spec_iterator(batches, element_spec):
    """An iterator over `batches` whose type is that of an iterator over a
    dataset of `element_spec` (so the train function is not traced again),
    or None where that cannot be made."""
    if not all(isinstance(t, tf.Tensor) for b in batches
               for t in tf.nest.flatten(b)):
        return None
    try:
        dataset = tf.data.Dataset.from_tensors({"b": batches[0]})
        for batch in batches[1:]:
            dataset = dataset.concatenate(
                tf.data.Dataset.from_tensors({"b": batch}))

        def relax(element):
            return tf.nest.map_structure(
                lambda t, spec: tf.compat.v1.placeholder_with_default(
                    t, spec.shape),
                element["b"], element_spec)

        dataset = dataset.map(relax)
        if dataset.element_spec != element_spec:
            return None
        return iter(dataset)
    except (TypeError, ValueError):
        return None


def _take_batches(iterator, count):
    """Up to `count` batches from a TensorFlow iterator (at least one)."""
    batches = [iterator.get_next()]
    for _ in range(count - 1):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        batches.append(optional.get_value())
    return batches


def checked_on_first_call(function, check_batch, steps_per_execution):
    """Keras' `train_function`, calling `check_batch(batch)` on its first
    training batch, eagerly, before the first step runs.

    The batches the first call takes (`steps_per_execution` of them) are the
    ones it then trains on, in order: the guard reads no batch that training
    would not (it never makes a new iterator). Until a check passes, every
    call checks.
    """
    state = {"checked": False}

    def train_function(iterator):
        if state["checked"]:
            return function(iterator)
        if isinstance(iterator, (tf.data.Iterator,
                                 tf.distribute.DistributedIterator)):
            batches = _take_batches(iterator, steps_per_execution)
            first = batches[0]
            if isinstance(iterator, tf.distribute.DistributedIterator):
                first = _first_replica(first)
                replay = None
            else:
                replay = _same_spec_iterator(batches, iterator.element_spec)
            check_batch(_without_optionals(first))
            state["checked"] = True
            return function(batches if replay is None else replay)
        iterator = iter(iterator)
        first = next(iterator)
        check_batch(_without_optionals(first))
        state["checked"] = True
        return function(itertools.chain([first], iterator))

    train_function.checks_independence = True
    return train_function
