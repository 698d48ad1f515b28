"""The loss's own part of the independence check (package docstring, 2).

The step evaluates the compiled loss of each example on its own where the
loss is not a `sum_over_batch_size` Keras loss (a batch of one), so a loss
with in-batch negatives (CLIP) would train silently on batches of one: the
gradient of the compiled loss on the whole batch w.r.t. example i's
prediction must not change when the other rows of `(y, y_pred)` are
replaced by copies of row i.

The predictions are compared as values: Keras computes a probability loss
from the logits it finds on the tensor a softmax or sigmoid returned
(`_keras_logits`), a shortcut that any slice or copy loses, so both sides
are given fresh tensors that hold the probabilities only (this shortcut,
seen on one side only, was the guard's false alarm on every softmax and
sigmoid head with its probability loss).
"""

import tensorflow as tf

from tf_dpadam.common import compat
from tf_dpadam.training.independence import errors
from tf_dpadam.training.independence.rows import change_of_rows
from tf_dpadam.training.independence.rows import tiled_rows


def _values(structure):
    """Fresh tensors with the values of `structure` only: no Keras mask (a
    masked `sum_over_batch_size` loss divides by the batch's count of
    unmasked entries, which the step's per-example losses do not) and no
    `_keras_logits`."""
    return tf.nest.map_structure(
        lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
        structure)


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


def loss_name(model):
    """The compiled loss's name, for the error."""
    compile_loss = compat.compile_loss(model)
    single = compat.single_loss(compile_loss)
    loss = single[0] if single is not None else compile_loss
    name = getattr(loss, "name", None) or type(loss).__name__
    fn = getattr(loss, "fn", None)
    if fn is not None:
        name = getattr(fn, "__name__", name)
    return name


def loss_error(model, score, evidence):
    return errors.mixing_error(f"The compiled loss {loss_name(model)!r}",
                               score, errors.LOSS_CURE, evidence)


def check_loss_gradients(model, y, sample_weight, y_pred, rows, group):
    """Raises if the compiled loss's gradient w.r.t. the predictions of the
    examples in `rows` depends on the other examples.

    `y`, `sample_weight` and `y_pred` are the step's rows (K = `group`
    views per example, consecutive).
    """
    compile_loss = compat.compile_loss(model)
    if compile_loss is None:
        return
    # Without the sample weights: they scale rows and cannot make a loss
    # mix, and a weight per example (as `fit`'s pipelines give) does not
    # broadcast against a loss kept per pixel or token.
    sample_weight = None
    y_pred = _values(y_pred)
    gradients = _prediction_gradients(compile_loss, y, y_pred, sample_weight)
    for i in rows:
        first = i * group
        copies = [tiled_rows(part, first, group)
                  for part in (y, y_pred, sample_weight)]
        changed = _prediction_gradients(
            compile_loss, copies[0], _values(copies[1]), copies[2])
        view_rows = list(range(first, first + group))
        score = change_of_rows(gradients, changed, view_rows)
        if score > 1.0:
            raise loss_error(model, score, (
                f"the gradient of the loss w.r.t. example {i}'s prediction"
                " changed when the other examples of the batch were replaced"
                " by copies of it"))
