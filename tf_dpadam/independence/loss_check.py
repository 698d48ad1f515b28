"""The loss's part of the independence check (package docstring, 2)."""

import tensorflow as tf

from tf_dpadam import augmentation
from tf_dpadam import compat
from tf_dpadam.ghost_clipping import per_example_loss
from tf_dpadam.independence import errors
from tf_dpadam.independence.rows import SLICED_ROWS
from tf_dpadam.independence.rows import change_of_other_rows
from tf_dpadam.independence.rows import example_rows
from tf_dpadam.independence.rows import num_rows
from tf_dpadam.independence.rows import replace_rows


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
    return errors.mixing_error(f"The compiled loss {name!r}", score,
                               errors.LOSS_CURE, evidence)


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


def check_loss(model, augmult, y, sample_weight, y_pred, y_pred_changed,
               j, k):
    """Raises if the compiled loss mixes examples (package docstring, 2)."""
    compile_loss = compat.compile_loss(model)
    if compile_loss is None:
        return
    y, sample_weight = augmentation.repeat_examples(
        (y, sample_weight), augmult)
    rows_j, rows_k = example_rows(j, augmult), example_rows(k, augmult)
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

