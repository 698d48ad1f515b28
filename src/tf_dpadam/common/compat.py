"""tf_dpadam's compatibility layer: every private Keras or TensorFlow API it uses.

Everything here reads, calls or patches a private attribute or module of
Keras 3 or TensorFlow (stable across the releases setup.py pins); the rest
of the library only calls these functions, and
`tests/package_structure_test.py` checks that. If a release moves one of
them, this is the only file to change (the privacy zoo test fails loudly).
"""

import contextlib

from absl import logging
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

# The base class of objects that Keras saves with a model (`LoraFactors`).
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402

__all__ = [
    "any_symbolic_tensors", "get_keras_mask", "set_keras_mask",
    "in_stateless_scope", "KerasSaveable",
]


def all_layers(model):
    """`model` and every layer below it, each once."""
    return model._flatten_layers(include_self=True, recursive=True)


def direct_sublayers(layer):
    """The layers `layer` tracks directly (one level down)."""
    return layer._layers


def rebuildable(model):
    """Whether `keras.models.clone_model` can rebuild `model` layer by layer
    (a Sequential or functional model, not a subclassed one)."""
    from keras.src.models.functional import Functional
    return isinstance(model, (keras.Sequential, Functional))


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


def global_seed_generator_states():
    """The state variable of Keras' global seed generator, in a list (empty
    if it does not exist yet)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover
        return []
    generator = global_state.get_global_attribute("global_seed_generator")
    state = getattr(generator, "state", None)
    return [] if state is None else [state]


def dataset_inputs(dataset):
    """The datasets a `tf.data.Dataset` reads from (tf.data's `_inputs()`)."""
    return dataset._inputs()  # pylint: disable=protected-access


def distributed_dataset_fn(data):
    """The `dataset_fn` a `strategy.distribute_datasets_from_function`
    dataset was made from (tf.distribute's `_dataset_fn`), else None."""
    return getattr(data, "_dataset_fn", None)


def pfor_converter_registry():
    """`(registry, wrap)` of TensorFlow's vectorizer (pfor), or `(None, None)`.

    `registry` maps an op's name to its converter (`tf.vectorized_map` reads
    it); `wrap(tensor, stacked)` builds a converter's output. Used by
    `vectorization.py`, which checks them with a known-answer test.
    """
    try:
        from tensorflow.python.ops.parallel_for import pfor
        return pfor._pfor_converter_registry, pfor.wrap
    except (ImportError, AttributeError):
        return None, None


def track_optimizer_variable(optimizer, variable):
    """Makes `optimizer` save and restore `variable` with its own state.

    For variables that `optimizer.add_variable` cannot make (it has no
    `synchronization` argument).
    """
    optimizer._track_variable(variable)


def lora_frozen_kernel(layer):
    """The frozen kernel W of a LoRA `Dense`/`EinsumDense` (Keras' `kernel`
    property is W + s A B)."""
    return layer._kernel


def in_cross_replica_context():
    """Whether a `tf.distribute` strategy is on and this is cross-replica."""
    return (tf.distribute.has_strategy()
            and tf.distribute.in_cross_replica_context())


class OptimizerOverrides:
    """The Keras optimizer hooks (private) that the DP optimizers override.

    A mixin placed before the Keras optimizer class:

    - `_backend_update_step` and `_apply_weight_decay`: in cross-replica
      context (the logical step of gradient accumulation under
      `tf.distribute`, `tf_dpadam.training.update`), where Keras' TensorFlow
      optimizer would ask for a `merge_call`, the gradients are already
      summed over the replicas: every copy of the variables is updated with
      them. In replica context, Keras' own.
    - `_clip_gradients`: calls the public `check_gradient_clipping()` first
      (a subclass refuses Keras' clipping there), then Keras'.
    """

    def check_gradient_clipping(self):
        """Raises if Keras' gradient clipping must not run (default: never)."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if not in_cross_replica_context():
            return super()._backend_update_step(
                grads, trainable_variables, learning_rate
            )
        self._distributed_tf_update_step(
            tf.distribute.get_strategy(),
            [(g, v.value) for g, v in zip(grads, trainable_variables)],
            learning_rate,
        )

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None or not in_cross_replica_context():
            return super()._apply_weight_decay(variables)
        strategy = tf.distribute.get_strategy()

        def decay(variable):
            lr = tf.cast(self.learning_rate, variable.dtype)
            wd = tf.cast(self.weight_decay, variable.dtype)
            variable.assign_sub(variable * wd * lr)

        for variable in variables:
            if self._use_weight_decay(variable):
                strategy.extended.update(variable.value, decay, group=False)

    def _clip_gradients(self, grads):
        self.check_gradient_clipping()
        return super()._clip_gradients(grads)


class LocalBatchSymbolicBuild:
    """A `keras.Model` mixin: builds the model, its compiled metrics and loss
    before the first trace of a step, on one device as on several.

    On one device Keras' TensorFlow trainer builds them in the first trace
    of the train function; variables created there make `tf.function`
    trace the whole step a second time (for a private step, the doubled
    trace was up to half of a first `train_on_batch`). Here they are built
    from the batch's specs, symbolically, as Keras does under a
    distribution strategy; a model that cannot be built so is built in the
    trace, as before.

    Keras' TensorFlow trainer takes the shapes of a distributed batch from
    one `strategy.reduce` of the whole (x, y) structure, which
    MultiWorkerMirroredStrategy refuses for a structure (Keras 3.15, TF
    2.21). The first local replica's batch has the same shapes and needs no
    communication.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:
            self._symbolic_build_on_one_device(iterator, data_batch)
            self.after_symbolic_build()
            return None
        if iterator is not None and self._distribute_strategy is not None:
            strategy = self._distribute_strategy
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0],
                    next(batches),
                )
                break
            iterator = None
        result = super()._maybe_symbolic_build(
            iterator=iterator, data_batch=data_batch
        )
        self.after_symbolic_build()
        return result

    def after_symbolic_build(self) -> None:
        """Called once the model is built before a step's first trace (or
        not, if it cannot be built so: `self.built` says); subclasses make
        here what a step's trace cannot (none by default)."""

    def _symbolic_build_on_one_device(self, iterator, data_batch) -> None:
        unbuilt = [
            part is not None and not part.built
            for part in (self._compile_metrics, self._compile_loss)
        ]
        if not any(unbuilt) and self.built:
            return
        if data_batch is None:
            # The specs of `fit`'s dataset: no batch is consumed.
            dataset = getattr(iterator, "_distributed_dataset", None)
            data_batch = getattr(dataset, "element_spec", None)
            if data_batch is None:
                return
        try:
            self._symbolic_build(data_batch=data_batch)
        except Exception as error:  # pylint: disable=broad-except
            # Built in the first trace instead, as Keras does on one
            # device (e.g. inputs whose specs are not dense tensors): only
            # a second trace of the first step is lost, so a log line
            # (not a warning) says why.
            logging.info("The private model is built in its first step's"
                         " trace, not before it (%s: %s); that step traces"
                         " twice.", type(error).__name__, error)
