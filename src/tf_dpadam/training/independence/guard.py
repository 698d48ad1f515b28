"""The check's entry point, and the hook that runs it on Keras' train
function: at the first call, whenever what the step was traced for changes,
and at randomly chosen later calls."""

import itertools
import secrets
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_dpadam.training import augmentation
from tf_dpadam.common import compat
from tf_dpadam.training.independence import errors
from tf_dpadam.training.independence import loss_check
from tf_dpadam.training.independence import model_check
from tf_dpadam.training.independence import probe as probe_lib
from tf_dpadam.training.independence.rows import change_of_rows
from tf_dpadam.training.independence.rows import copies_of_row
from tf_dpadam.training.independence.rows import example_rows
from tf_dpadam.training.independence.rows import has_distinct_row
from tf_dpadam.training.independence.rows import num_rows
from tf_dpadam.training.independence.rows import tiled_rows
from tf_dpadam.training import train_step as train_step_lib

composite_types = (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)

# The examples of a checked batch whose gradients are checked.
CHECKED_ROWS = 2
# The probability that a train-function call (`steps_per_execution` steps)
# after the first is checked.
CHECK_RATE = 0.01


def _present_rows(x, sample_weight):
    n = num_rows(x)
    if sample_weight is None or tf.nest.is_nested(sample_weight):
        return list(range(n))
    weight = np.asarray(sample_weight).reshape(n, -1)
    return [int(i) for i in np.flatnonzero(np.any(weight != 0, axis=1))]


def _rows_to_check(data, x, sample_weight, rng):
    """Up to `CHECKED_ROWS` present examples, drawn at random, that differ
    from some other example of the batch."""
    rows = []
    for i in rng.permutation(_present_rows(x, sample_weight)):
        if has_distinct_row(data, int(i)):
            rows.append(int(i))
            if len(rows) == CHECKED_ROWS:
                break
    return rows


def _not_reproducible(model):
    return ValueError(
        f"Cannot check that model {model.base_model.name!r} treats the"
        " examples of a batch independently: its training-mode outputs are"
        " not reproducible even with every keras.random.SeedGenerator"
        " restored (a random op outside keras.random, e.g. tf.random.*?)."
        " Draw random numbers with keras.random and a"
        " keras.random.SeedGenerator." + errors.TURN_OFF)


def _passes(model, probe, batch, rows, snapshot, replayable):
    """`(batch, copies, outputs, norms, views)`: the arguments of the
    probe's two functions for the batch and for each example's copies, and
    a function of the arguments that gives the step's rows of x.

    With an `augment` whose draws cannot be replayed, its views are made
    once and the copies are copies of example i's views (the augmentation
    itself is then not checked; a warning said so)."""
    if replayable:
        def views(args):
            return model_check.views_of(model.augment, model.augmult,
                                        args[0], snapshot)

        return (batch, [copies_of_row(batch, i) for i in rows],
                probe.outputs, probe.norms, views)
    x, y, sample_weight = batch
    group = model.augmult
    snapshot.restore()
    rows_of_step = (model_check.views_of(model.augment, group, x, snapshot),
                    *augmentation.repeat_examples((y, sample_weight), group))
    present = train_step_lib.present_examples(x, sample_weight)
    copies = [tuple(tiled_rows(part, i * group, group)
                    for part in rows_of_step) + (tf.ones_like(present),)
              for i in rows]
    return (rows_of_step + (present,), copies,
            lambda x, y, w, _, **kw: probe.outputs(x, y, w, given=True,
                                                   **kw),
            probe.norms, lambda args: args[0])


def _compare(model, function, batch, copies, rows, snapshot, raise_for):
    """`function` on the batch and on each copies batch (from the same
    random state), rows compared; `raise_for(i, base, other)` raises for a
    row that changed, after checking that `function` is reproducible."""
    snapshot.restore()
    base = function(*batch)
    for i, copy in zip(rows, copies):
        snapshot.restore()
        other = function(*copy)
        if raise_for(i, base, other, check_only=True):
            snapshot.restore()
            if change_of_rows(base, function(*batch),
                              range(num_rows(base))) > 1.0:
                raise _not_reproducible(model)
            raise_for(i, base, other, check_only=False)
    return base


def check(model, data, probe=None, rng=None, check_loss=True):
    """Raises `ValueError` if `model`'s training mixes the examples of `data`.

    Args:
        model: a compiled `PrivateModel` (its `base_model`, `augment`,
            `augmult`, clipping method and compiled loss are checked).
        data: a concrete training batch `(x, y, sample_weight)`, `(x, y)` or
            `x`.
        probe: the model's `probe.Probe` (a new one if None).
        rng: a `numpy.random.Generator` that draws the checked examples
            (from the operating system's entropy if None).
        check_loss: whether to check the compiled loss on the whole batch
            (package docstring, 2; `Guard` does once per compiled loss).

    Returns:
        True if checked, False if no present example of the batch differs
        from another one (a warning says so).

    Raises:
        ValueError: naming the layer (or the model, or `augment`) or the loss
            that mixes examples, and what to use instead.
    """
    data = tf.nest.map_structure(
        lambda t: t if t is None or isinstance(t, composite_types)
        else tf.convert_to_tensor(t), data)
    batch = keras.utils.unpack_x_y_sample_weight(data)
    x, y, sample_weight = batch
    rng = rng or np.random.default_rng(secrets.randbits(64))
    rows = _rows_to_check(batch, x, sample_weight, rng)
    if not rows:
        warnings.warn(
            "make_private(check_independence=True) could not check that the"
            " examples are independent: no example of the training batch"
            " differs from another one.", stacklevel=3)
        return False
    probe = probe or probe_lib.Probe(model)
    # Built eagerly, as by the step, not inside the probe's tf.function
    # (whose scopes would name the weights).
    train_step_lib.build_on_first_call(model, x)
    snapshot = model_check.StateSnapshot(
        model_check.layers_of(model.augment, model.base_model))
    snapshot.add(compat.global_seed_generator_states())
    group = model.augmult

    def outputs_changed(i, base, other, check_only):
        out = change_of_rows(base[0], other[0], example_rows(i, group))
        loss = change_of_rows(base[1], other[1], example_rows(i, group))
        if check_only:
            return max(out, loss) > 1.0
        if out > 1.0:
            raise model_check.layer_error(
                model.base_model, views(batch), views(copies[rows.index(i)]),
                example_rows(i, group), i, out, snapshot)
        raise loss_check.loss_error(model, loss,
                                    errors.replaced_evidence(i, "loss"))

    def compare_outputs():
        return _compare(model, outputs, batch, copies, rows, snapshot,
                        outputs_changed)[0]

    def norm_changed(i, base, other, check_only):
        score = change_of_rows(base, other, [i])
        if check_only:
            return score > 1.0
        compare_outputs()  # Names the layer or the loss if they mix.
        raise errors.mixing_error(
            f"Model {model.base_model.name!r}", score, errors.GRADIENT_CURE,
            errors.replaced_evidence(
                i, "gradient norm (as the private step computes it)"))

    try:
        replayable = model_check.check_augment(
            model.augment, group, x,
            [copies_of_row(x, i) for i in rows], rows, snapshot)
        batch, copies, outputs, norms, views = _passes(
            model, probe, batch, rows, snapshot, replayable)
        # Ghost clipping's norms come from the batch's own forward and
        # backward pass: a model or loss that mixes changes them, and the
        # outputs are compared only to say which. The vectorized path
        # computes each example alone: its outputs are compared first.
        y_pred = None
        if model.clipping == "vectorized":
            y_pred = compare_outputs()
        try:
            _compare(model, norms, batch, copies, rows, snapshot,
                     norm_changed)
        except (tf.errors.OpError, ValueError, TypeError) as error:
            if y_pred is not None or isinstance(error, ValueError) and (
                    "mixes the examples" in str(error)):
                raise
            compare_outputs()  # A model that mixes may fail in the step.
            raise
        if y_pred is None and model.clipping_used == "vectorized":
            y_pred = compare_outputs()
        if check_loss:
            if y_pred is None:  # Once per compiled loss: not traced.
                snapshot.restore()
                y_pred = outputs(*batch, eager=True)[0]
            y_rows, weight_rows = augmentation.repeat_examples(
                (y, sample_weight), group)
            loss_check.check_loss_gradients(model, y_rows, weight_rows,
                                            y_pred, rows, group)
    finally:
        snapshot.restore()
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


class Guard:
    """The check's schedule for one `PrivateModel` (package docstring, 4).

    `wrap(train_function, steps_per_execution)` returns Keras' train
    function, checking (eagerly, before the steps run) the first batch of a
    call that is due: the first call, every call after the compiled loss,
    the trainable weights, `augment` or the clipping method changed, and
    each later call with probability `rate` (`CHECK_RATE` by default; not
    under `MultiWorkerMirroredStrategy`, whose workers must check the same
    calls). The batches a checked
    call takes are the ones it then trains on, in order: the guard reads no
    batch that training would not. Until a check passes, every call checks.
    """

    def __init__(self, model, check_batch=None):
        self._model = model
        self._check_batch = check_batch
        self.probe = probe_lib.Probe(model)
        self._rng = np.random.default_rng(secrets.randbits(64))
        self._checked_key = None
        # The probability that a call after the first is checked.
        self.rate = CHECK_RATE
        self.checks = 0  # The batches checked so far.

    def check(self, data):
        """Checks `data` now (see `check`); True if checked."""
        key = probe_lib.state_key(self._model)
        if check(self._model, data, self.probe, self._rng,
                 check_loss=key != self._checked_key):
            self._checked_key = key
            self.checks += 1
            return True
        return False

    def _due(self, key):
        if key != self._checked_key:
            return True
        # Workers must call the train function alike: a check takes its
        # batch from the distributed iterator eagerly, whose collectives
        # would not match a worker that did not check (the first call and
        # changes are the same on every worker; random calls are not).
        if isinstance(self._model.distribute_strategy,
                      tf.distribute.MultiWorkerMirroredStrategy):
            return False
        return self._rng.random() < self.rate

    def wrap(self, function, steps_per_execution):
        """`function` (Keras' train function), checked as scheduled."""
        check_batch = self._check_batch or self.check
        traced = {"key": None, "warned": False}

        def train_function(iterator):
            key = probe_lib.state_key(self._model)
            if traced["key"] is None:
                traced["key"] = key  # The first call traces the step.
            elif (not key.same_variables(traced["key"])
                  and not traced["warned"]):
                traced["warned"] = True
                warnings.warn(_RETRACE_WARNING, stacklevel=2)
            if not self._due(key):
                return function(iterator)
            return _checked_call(function, iterator, check_batch,
                                 steps_per_execution)

        train_function.checks_independence = True
        return train_function


_RETRACE_WARNING = (
    "The model's trainable weights changed after its private train step was"
    " traced (a layer's `trainable` set during training): as in Keras, the"
    " step goes on training the weights it was traced with until the model"
    " is compiled again (`compile` also checks the new set, and refuses a"
    " trainable BatchNormalization)."
)


def _checked_call(function, iterator, check_batch, steps_per_execution):
    """`function(iterator)` after `check_batch` of its first batch."""
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
        return function(batches if replay is None else replay)
    iterator = iter(iterator)
    first = next(iterator)
    check_batch(_without_optionals(first))
    return function(itertools.chain([first], iterator))
