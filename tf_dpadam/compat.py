"""tf_dpadam's compatibility layer: every private Keras or TensorFlow API it uses.

Everything here reads, calls or patches a private attribute or module of
Keras 3 or TensorFlow (stable across the releases setup.py pins); the rest
of the library only calls these functions, and
`tests/package_structure_test.py` checks that. If a release moves one of
them, this is the only file to change (the privacy zoo test fails loudly).
"""

import contextlib

import keras
import tensorflow as tf

try:
    from keras.src.backend.common.keras_tensor import any_symbolic_tensors
    from keras.src.backend.common.masking import get_keras_mask
    from keras.src.backend.common.masking import set_keras_mask
    from keras.src.backend.common.stateless_scope import in_stateless_scope
except ImportError:  # pragma: no cover
    def any_symbolic_tensors(args=None, kwargs=None):
        leaves = tf.nest.flatten((args, kwargs))
        return any(isinstance(x, keras.KerasTensor) for x in leaves)

    def get_keras_mask(x):
        return getattr(x, "_keras_mask", None)

    def in_stateless_scope():
        return False

    def set_keras_mask(x, mask):
        x._keras_mask = mask

__all__ = [
    "any_symbolic_tensors", "get_keras_mask", "set_keras_mask",
    "in_stateless_scope",
]


def all_layers(model):
    """`model` and every layer below it, each once."""
    return model._flatten_layers(include_self=True, recursive=True)


def direct_sublayers(layer):
    """The layers `layer` tracks directly (one level down)."""
    return layer._layers


def own_variables(layer):
    """The variables `layer` creates itself (not its sublayers')."""
    return (list(layer._trainable_variables)
            + list(layer._non_trainable_variables))


def seed_generators(layer):
    """The random states (`keras.random.SeedGenerator`) of `layer`'s tree."""
    return [
        generator
        for sub in layer._flatten_layers(include_self=True)
        for generator in sub._seed_generators
    ]


def losses_added_in_call(model):
    """The losses the layers of `model` added during the last call."""
    return [
        loss for layer in model._flatten_layers(include_self=True)
        for loss in layer._get_own_losses()
    ]


def rematerialized(layer):
    """Whether `layer` recomputes its forward pass in the backward pass."""
    return getattr(layer, "_remat_mode", None) is not None


def causal_padding(layer):
    """The padding a causal convolution applies before a "valid" one."""
    return layer._compute_causal_padding()


def compile_loss(model):
    """The model's compiled loss object (None if compiled without a loss)."""
    return model._compile_loss


def single_loss(compile_loss_object):
    """`(loss, loss_weight)` if the compiled loss is one loss, else None."""
    flat = compile_loss_object._flat_losses
    if len(flat) != 1:
        return None
    path, loss, loss_weight, _ = flat[0]
    if path:
        return None
    return loss, loss_weight


@contextlib.contextmanager
def loss_metrics_paused(compile_loss_object):
    """Per-output loss metrics off while per-example losses are computed.

    Multi-output models keep a metric per output loss; computing the loss one
    example at a time must not update it (it is updated once on the batch).
    """
    saved = None
    if (compile_loss_object is not None
            and getattr(compile_loss_object, "_metrics", None)):
        saved = compile_loss_object._metrics
        compile_loss_object._metrics = [None] * len(saved)
    try:
        yield
    finally:
        if saved is not None:
            compile_loss_object._metrics = saved


def compute_loss(model, x, y, y_pred, sample_weight):
    """The model's training loss on a batch, as `fit` computes it.

    Under tf.distribute Keras divides it by the number of replicas.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model):
    """The metric behind the `loss` that `fit` reports."""
    return model._loss_tracker


def update_compile_metrics(model, y, y_pred, sample_weight, row_mask):
    """`model.compute_metrics`'s update of the compiled metrics, except that
    the unweighted ones (`compile(metrics=...)`) count only the rows where
    `row_mask` (a `[rows]` 0/1 tensor, or None for all rows) is 1.

    Keras gives `metrics` no sample weight, so the padding rows of Poisson
    batches (sample weight 0) would count as examples; `weighted_metrics`
    get the sample weights as in Keras.
    """
    metrics = model._compile_metrics
    if metrics is None:
        return
    if not metrics.built:
        metrics.build(y, y_pred)
    flat_y = metrics._flatten_y(y)
    flat_pred = metrics._flatten_y(y_pred)
    for metric, y_t, y_p in zip(metrics._flat_metrics, flat_y, flat_pred):
        if metric:
            if row_mask is None:
                metric.update_state(y_t, y_p)
            else:
                metric.update_state(y_t, y_p, sample_weight=row_mask)
    if sample_weight is not None:
        weights = metrics._flatten_y(sample_weight)
        if len(weights) < len(flat_y):
            weights = [weights[0]] * len(flat_y)
    else:
        weights = [None] * len(flat_y)
    for metric, y_t, y_p, weight in zip(metrics._flat_weighted_metrics,
                                        flat_y, flat_pred, weights):
        if metric:
            metric.update_state(y_t, y_p, weight)
