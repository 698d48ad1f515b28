"""Two cases of the private train step that plain Keras handles its own way.

* A model whose loss has no gradient path to its trainable weights (an
  integer cast, `argmax` or `round` between the weights and the output):
  Keras refuses it ("No gradients provided for any variable"), while the
  private step would clip zero gradients and move the weights by the noise
  alone. `check_gradient_path` refuses it the same way, when the step is
  first traced (or run eagerly), naming the weights.
* A model with nothing trainable: Keras takes no step but still logs the
  loss of the batch; `step_without_trainable_weights` does the same.
"""

import weakref

import tensorflow as tf

from tf_dpadam.common import compat

# Models whose gradient path was checked, and for which (compiled loss,
# trainable variables): a retrace of the same step does not check again.
_CHECKED = weakref.WeakKeyDictionary()

# How many weights the error names before "and N more".
_NAMED = 8


def variables_without_gradient(model, x, y, sample_weight, variables):
    """The `variables` whose gradient of the batched loss is None.

    Traces one forward and backward pass of `model.compute_loss` in a
    separate `tf.function` graph (`get_concrete_function`: nothing runs, so
    no random state, metric or weight changes); a gradient is None exactly
    when no differentiable operation connects the variable to the loss.
    """
    missing = []

    def trace(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                                      sample_weight=sample_weight,
                                      training=True)
        gradients = tape.gradient(loss, variables)
        missing[:] = [v for v, g in zip(variables, gradients) if g is None]
        return tf.constant(0)

    tf.function(trace, autograph=False).get_concrete_function(
        x, y, sample_weight)
    return missing


def no_gradient_message(model, variables, missing):
    """The `ValueError` text for a model whose weights get no gradient."""
    names = [v.path if hasattr(v, "path") else v.name for v in missing]
    shown = ", ".join(names[:_NAMED])
    if len(names) > _NAMED:
        shown += f", and {len(names) - _NAMED} more"
    return (
        "No gradients provided for any variable: the loss of model"
        f" {model.name!r} has no gradient path to any of its"
        f" {len(variables)} trainable weights ({shown}), so the private"
        " step would move them by the noise alone. An operation between"
        " the weights and the loss cuts the gradient (an integer cast,"
        " argmax, round, a comparison, stop_gradient): keep the model's"
        " output differentiable, or freeze what should not train. Keras"
        " refuses such a model the same way."
    )


def check_gradient_path(model, x, y, sample_weight, variables):
    """Raises `ValueError` if the loss has no gradient for any variable.

    Checked once per model, compiled loss and set of trainable variables.
    Skipped inside a `tf.distribute` strategy other than the default.

    Raises:
        ValueError: naming the weights, if every gradient is None.
    """
    if tf.distribute.has_strategy():
        return
    key = (id(compat.compile_loss(model)),
           tuple(id(v) for v in variables))
    if _CHECKED.get(model) == key:
        return
    missing = variables_without_gradient(model, x, y, sample_weight,
                                         variables)
    if len(missing) == len(variables):
        raise ValueError(no_gradient_message(model, variables, missing))
    _CHECKED[model] = key


def step_without_trainable_weights(model, x, y, sample_weight):
    """Keras' train step for a model with nothing trainable: no update, the
    batch's loss in the `loss` log (Keras 3.15's TensorFlow trainer, which
    logs it with the batch size as weight), and the compiled metrics."""
    y_pred = model(x, training=True)
    loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                              sample_weight=sample_weight, training=True)
    num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if num_replicas > 1:  # keras' unscale_loss_for_distribution
        loss = loss * tf.cast(num_replicas, loss.dtype)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    compat.loss_tracker(model).update_state(
        loss, sample_weight=tf.shape(first)[0])
    return model.compute_metrics(x, y, y_pred, sample_weight)
