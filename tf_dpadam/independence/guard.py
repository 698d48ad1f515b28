"""The check's entry point, and the hook that runs it on Keras' train
function's first batch."""

import itertools
import warnings

import keras
import tensorflow as tf

from tf_dpadam.independence.loss_check import check_loss
from tf_dpadam.independence.model_check import check_model
from tf_dpadam.independence.rows import distinct_row
from tf_dpadam.independence.rows import num_rows

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
    y_pred, y_pred_changed = check_model(
        model.base_model, model.augment, model.augmult, x, j, k)
    check_loss(model, model.augmult, y, sample_weight, y_pred,
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
