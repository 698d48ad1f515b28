"""`make_private`: a Keras model whose train step is differentially private.

The returned model wraps the user's model (same layers, same weight objects)
and replaces only `train_step`: per-example gradients, clipping to C, one
Gaussian noise draw of std sigma * C, division by B, then the optimizer. C,
sigma and B come from the compiled tf_dpadam optimizer. Evaluation,
prediction, metrics, callbacks and saving are Keras' own.
"""

import warnings

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam import ghost_clipping
from tf_dpadam import optimizers as dp_optimizers
from tf_dpadam import privatizer

# How the clipped sum of per-example gradients is computed (`make_private`'s
# `clipping`): "ghost" from the batched forward and backward pass
# (`ghost_clipping`), "vectorized" by a vectorized map of one-example backward
# passes, "auto" ghost where the model allows it, else vectorized.
CLIPPING_METHODS = ("auto", "ghost", "vectorized")

# Layers that mix the examples of a batch while training: with them one
# example's gradient depends on the others, so per-example clipping does not
# bound one example's influence.
_EXAMPLE_MIXING_LAYERS = (keras.layers.BatchNormalization,)

# Shown whenever a model with `diagnostics=True` is made (or loaded).
DIAGNOSTICS_WARNING = (
    "make_private(diagnostics=True) is NOT differentially private. Every"
    " step also stores the clipped but un-noised mean gradient of the batch"
    " (`model.clean_gradients`), and tf_dpadam.diagnostics.MomentDiagnostics"
    " builds Adam moments from it: these variables and everything computed"
    " from them (tables, histograms) reveal information about individual"
    " training examples that no epsilon accounts for. The weights follow the"
    " same private trajectory as without diagnostics. Use it for research on"
    " public or synthetic data only, and never release its outputs."
)


def check_no_example_mixing(model):
    """Raises if a trainable layer of `model` mixes examples in training.

    A frozen BatchNormalization (`trainable=False`) runs in inference mode in
    Keras 3 and is allowed.

    Raises:
        ValueError: naming the first offending layer.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, _EXAMPLE_MIXING_LAYERS) and layer.trainable:
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) mixes the"
                " examples of a batch in training, so per-example clipping"
                " would not bound one example's influence and training would"
                " not be differentially private. Replace it (for instance by"
                " LayerNormalization or GroupNormalization) or freeze it"
                " (`layer.trainable = False` runs it in inference mode)."
            )


def _present_examples(x, sample_weight):
    """1.0 for each example of the batch, 0.0 for absent ones.

    An example whose sample weight is 0 (e.g. the padding of
    `tf_dpadam.data.poisson_batches`) is absent: it contributes nothing to
    the gradient, not even the gradient of a regularization loss, and is not
    counted in the denominator when `batch_size=None`.
    """
    num_examples = tf.shape(tf.nest.flatten(x)[0])[0]
    if sample_weight is None or tf.nest.is_nested(sample_weight):
        return tf.ones((num_examples,), "float32")
    weight = ops.reshape(sample_weight, (num_examples, -1))
    return ops.cast(ops.any(ops.not_equal(weight, 0), axis=1), "float32")


def _require_dp_optimizer(optimizer):
    if not dp_optimizers.is_dp_optimizer(optimizer):
        raise ValueError(
            "A model made private needs a tf_dpadam optimizer (DPSGD, DPAdam"
            " or DPAdamCorrected), which carries l2_norm_clip and"
            f" noise_multiplier. Received optimizer={optimizer!r}."
        )


class _Untracked:
    """Holds a value out of sight of Keras' and TensorFlow's tracking.

    The diagnostics variables live here so that they are not model weights:
    not in `model.weights`, and never written by `model.save` (a saved model
    must not carry a clean gradient).
    """

    def __init__(self, value):
        self.value = value


@keras.saving.register_keras_serializable(package="tf_dpadam")
class PrivateModel(keras.Model):
    """A model whose `fit` privatizes each step; see `make_private`."""

    def __init__(self, base_model, seed=None, clipping="auto",
                 diagnostics=False, secure_mode=False, **kwargs):
        super().__init__(**kwargs)
        if clipping not in CLIPPING_METHODS:
            raise ValueError(
                f"Expected clipping={clipping!r} to be one of"
                f" {CLIPPING_METHODS}."
            )
        if not isinstance(secure_mode, bool):
            raise ValueError(
                f"Expected secure_mode={secure_mode!r} to be True or False."
            )
        if secure_mode and seed is not None:
            raise ValueError(
                f"make_private(secure_mode=True) draws the noise seed from the"
                f" operating system's entropy; expected seed=None, got"
                f" seed={seed!r}."
            )
        if not isinstance(diagnostics, bool):
            raise ValueError(
                f"Expected diagnostics={diagnostics!r} to be True or False."
            )
        if diagnostics:
            warnings.warn(DIAGNOSTICS_WARNING, stacklevel=2)
        if not isinstance(base_model, keras.Model):
            raise ValueError(
                f"Expected base_model to be a keras.Model, got {base_model!r}."
            )
        if isinstance(base_model, PrivateModel):
            raise ValueError("Expected base_model not to be private already.")
        check_no_example_mixing(base_model)
        self.base_model = base_model
        # The noise key: secret unless `seed` is given (a warning says so).
        key = privatizer.resolve_seed(
            seed, what="make_private", drawn="every noise vector",
            effect="the DP noise",
        )
        self.seed = seed
        self.secure_mode = secure_mode
        self.clipping = clipping
        self.diagnostics = diagnostics
        self._clean_gradients = _Untracked(None)
        # The method the last traced train step used, and why ghost clipping
        # was not ("auto" only): set at trace time, for users and tests.
        self.clipping_used = None
        self.ghost_unsupported_reason = None
        # Out of sight of tracking: never in `weights`, a saved model or a
        # checkpoint; a loaded or resumed model draws a fresh key.
        self._noise_seeds = _Untracked(privatizer.NoiseSeeds(key))
        if base_model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.base_model(inputs, training=training)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        _require_dp_optimizer(optimizer)
        super().compile(optimizer, *args, **kwargs)
        if (self.built and self.trainable_variables
                and not self.optimizer.built):
            # Now rather than in the first train step: creating the
            # optimizer's variables there makes tf.function trace the step
            # twice (3-7 s each for the larger models of the tests).
            self.optimizer.build(self.trainable_variables)
        if self.diagnostics and self.built:
            self._build_clean_gradients()

    def compile_from_config(self, config):
        # Keras skips models that override `compile`; ours only adds a check.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)  # builds the optimizer of a built model

    def _layer_seed_generators(self):
        """The random states of the wrapped model's layers (e.g. Dropout)."""
        return [
            generator
            for layer in self.base_model._flatten_layers(include_self=True)
            for generator in layer._seed_generators
        ]

    # Phase 0: the loss of one example (a batch of one).
    def _example_loss(self, x, y, sample_weight, index):
        # Inside the vectorized map a layer's seed state is the same for every
        # example, which would give all examples one dropout mask. Each
        # example reads its own state (offset by its index in the first
        # component; steps advance the second), and the generators'
        # advance is returned so that the step can apply it once.
        generators = self._layer_seed_generators()
        if not generators:
            loss, y_pred = self._forward_loss(x, y, sample_weight)
            return loss, (y_pred, [])
        offset = ops.stack(
            [ops.cast(index[0], "int64") + 1, ops.zeros((), "int64")]
        )
        mapping = [(g.state, g.state.value + offset) for g in generators]
        # Regularizers read their variable through the scope too.
        mapping += [
            (v, v.value) for v in self.trainable_variables if v.regularizer
        ]
        with keras.StatelessScope(
            state_mapping=mapping, collect_losses=True
        ) as scope:
            loss, y_pred = self._forward_loss(x, y, sample_weight)
        # With a batch axis, as `per_example_gradients` expects of `aux`.
        advances = [
            (scope.get_current_value(g.state) - value)[None]
            for g, (_, value) in zip(generators, mapping)
        ]
        return loss, (y_pred, advances)

    def _forward_loss(self, x, y, sample_weight):
        y_pred = self(x, training=True)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        # Keras divides the loss by the number of tf.distribute replicas;
        # a per-example gradient must be the example's own, so undo it.
        return loss * privatizer.num_replicas(), y_pred

    def _per_example_gradients(self, x, y, sample_weight, variables):
        compile_loss = self._compile_loss
        # Per-output loss metrics (multi-output models) are updated once on
        # the batch below, not per example inside the vectorized map.
        saved_metrics = None
        if compile_loss is not None and getattr(compile_loss, "_metrics", None):
            saved_metrics = compile_loss._metrics
            compile_loss._metrics = [None] * len(saved_metrics)
        index = tf.range(tf.shape(tf.nest.flatten(x)[0])[0])
        try:
            grads, losses, (y_pred, advances) = (
                privatizer.per_example_gradients(
                    self._example_loss, variables, (x, y, sample_weight, index)
                )
            )
        finally:
            if saved_metrics is not None:
                compile_loss._metrics = saved_metrics
        for generator, advance in zip(self._layer_seed_generators(), advances):
            generator.state.assign(generator.state.value + advance[0])
        return grads, losses, y_pred

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        _require_dp_optimizer(optimizer)
        check_no_example_mixing(self.base_model)
        config = optimizer.dp_config
        if not all(layer.built for layer in self._flatten_layers()):
            # A model without `keras.Input` builds on its first call: make
            # that call here, on the first trace, so that its weights (and
            # the optimizer's) exist before the step reads them.
            self(x, training=False)
        variables = self.trainable_variables
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
            return self.compute_metrics(x, y, self(x), sample_weight)
        if not optimizer.built:
            optimizer.build(variables)
        if self.diagnostics:
            self._build_clean_gradients()
        present = _present_examples(x, sample_weight)

        # Phases 1 and 2: per-example gradients, clipped and summed.
        summed, losses, y_pred = self._clipped_sum(
            x, y, sample_weight, present, config.l2_norm_clip
        )
        count = ops.sum(present)
        if privatizer.num_replicas() > 1 or config.accumulation_steps > 1:
            summed, count = privatizer.sum_over_replicas((summed, count))
            summed = [g / privatizer.num_replicas() for g in summed]
        # Phases 3 to 5: noise, scale, update (once per logical step).
        if config.accumulation_steps == 1:
            self._noise_scale_apply(summed, count, variables)
        elif privatizer.num_replicas() > 1:
            # The conditional update would need a merge_call inside control
            # flow, which tf.distribute does not support.
            raise ValueError(
                "gradient_accumulation_steps > 1 is not supported with"
                f" {privatizer.num_replicas()} tf.distribute replicas: give"
                " each replica a larger batch instead (the logical batch is"
                " split over the replicas and the noise is added once)."
            )
        else:
            self._accumulate(summed, count, variables)

        if self._compile_loss is not None and self._compile_loss.metrics:
            self._compile_loss(y, y_pred, sample_weight)
        self._loss_tracker.update_state(
            ops.sum(losses) / ops.maximum(ops.sum(present), 1.0),
            sample_weight=ops.sum(present),
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _clipped_sum(self, x, y, sample_weight, present, l2_norm_clip):
        """The sum of clipped per-example gradients (phases 1 and 2).

        Ghost clipping where the model allows it (decided while tracing),
        else per-example gradients by a vectorized map. Both give the same
        sum up to float rounding (tests/ghost_clipping_test.py).

        Returns:
            `(summed, losses, y_pred)`: one sum per trainable variable, the
            per-example losses and the batch's predictions.
        """
        if self.clipping != "vectorized":
            try:
                summed, _, losses, y_pred = ghost_clipping.clipped_sum(
                    self, self._ghost_loss_fn(), x, y, sample_weight,
                    l2_norm_clip, mask=present,
                )
                self.clipping_used = "ghost"
                return summed, losses, y_pred
            except ghost_clipping.GhostClippingUnsupportedError as error:
                if self.clipping == "ghost":
                    raise ValueError(
                        "make_private(clipping='ghost'): " + str(error)
                    ) from error
                self.ghost_unsupported_reason = str(error)
        grads, losses, y_pred = self._per_example_gradients(
            x, y, sample_weight, self.trainable_variables
        )
        summed, _ = privatizer.clip_and_sum(grads, l2_norm_clip, mask=present)
        self.clipping_used = "vectorized"
        return summed, losses, y_pred

    def _ghost_loss_fn(self):
        """Per-example compiled losses, un-scaled from Keras' 1/replicas."""
        loss_fn = ghost_clipping.compiled_loss_fn(self)

        def per_example_loss(y, y_pred, sample_weight):
            losses = loss_fn(y, y_pred, sample_weight)
            return losses * privatizer.num_replicas()

        return per_example_loss

    def _noise_scale_apply(self, summed, count, variables):
        """Noise once, divide by B, apply.

        `summed` is this replica's share: with R replicas Keras adds the
        gradients of all replicas, so each hands in 1/R of the clipped sum
        of all replicas, and only the first one carries the noise. `count`
        is the number of examples of the whole (logical) step.
        """
        optimizer = self.optimizer
        config = optimizer.dp_config
        denominator = config.denominator(count)
        if self.diagnostics:
            self._record_clean_gradients(summed, denominator)
        noised = privatizer.add_noise(
            summed,
            config.noise_stddev,
            self._noise_seeds.value.next(optimizer.iterations),
            share=privatizer.first_replica_share(),
            secure_mode=self.secure_mode,
        )
        private_grads = privatizer.scale(noised, denominator)
        optimizer.apply_private(private_grads, variables, denominator)

    # Diagnostics (diagnostics=True only; NOT private).
    @property
    def clean_gradients(self):
        """The clean gradient of the last DP step, or None (NOT private).

        With `diagnostics=True`: one variable per trainable variable holding
        the clipped but un-noised gradient sum_i clip(g_i) / B of the last DP
        (logical) step, B being the very denominator of the private
        gradient. Not model weights and not saved. None before they exist
        and always with `diagnostics=False`.
        """
        return self._clean_gradients.value

    def _build_clean_gradients(self):
        """Creates the clean-gradient variables (anew after model changes)."""
        variables = self.trainable_variables
        existing = self._clean_gradients.value
        if existing is not None and [v.shape for v in existing] == [
            v.shape for v in variables
        ]:
            return
        if (tf.distribute.has_strategy()
                and not tf.distribute.in_cross_replica_context()):
            # In a replica's train step: too late to create mirrored state.
            raise ValueError(
                "make_private(diagnostics=True) under tf.distribute needs the"
                " model built before `compile` (e.g. start it with"
                " keras.Input), so that its clean-gradient variables are"
                " created in the strategy's scope."
            )
        self._clean_gradients.value = [
            keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=v.shape,
                dtype=v.dtype,
                trainable=False,
                # The value is the same on every replica (see below).
                aggregation="only_first_replica",
                name=f"dp_diagnostics_clean_gradient_{i}",
            )
            for i, v in enumerate(variables)
        ]

    def _record_clean_gradients(self, summed, denominator):
        """Stores sum_i clip(g_i) / B, the private gradient without noise.

        Under tf.distribute `summed` has been summed over the replicas and
        divided by R (see `_noise_scale_apply`), so R times it is the whole
        clipped sum, the same on every replica.
        """
        replicas = privatizer.num_replicas()
        for variable, g in zip(
            self._clean_gradients.value, privatizer.scale(summed, denominator)
        ):
            variable.assign(g * replicas if replicas > 1 else g)

    def _accumulate(self, summed, count, variables):
        """Adds a micro-batch to the logical step; steps at every k-th one.

        `summed` and `count` are already summed over replicas (and `summed`
        divided by R), so the accumulators agree on every replica.
        """
        optimizer = self.optimizer
        accumulators = optimizer._dp_accumulators
        for accumulator, g in zip(accumulators, summed):
            accumulator.assign(accumulator + g)
        optimizer._dp_accumulated_count.assign(
            optimizer._dp_accumulated_count + count
        )
        optimizer._dp_micro_step.assign(optimizer._dp_micro_step + 1)
        steps = optimizer.dp_config.accumulation_steps

        def step():
            self._noise_scale_apply(
                [a.value for a in accumulators],
                optimizer._dp_accumulated_count.value,
                variables,
            )
            for accumulator in accumulators:
                accumulator.assign(ops.zeros_like(accumulator))
            optimizer._dp_accumulated_count.assign(0.0)
            return ops.zeros(())

        ops.cond(
            optimizer._dp_micro_step % steps == 0, step, lambda: ops.zeros(())
        )

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "seed": self.seed,
            "clipping": self.clipping,
            "diagnostics": self.diagnostics,
            "secure_mode": self.secure_mode,
            "base_model": keras.saving.serialize_keras_object(self.base_model),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        base_model = keras.saving.deserialize_keras_object(
            config.pop("base_model"), custom_objects=custom_objects
        )
        return cls(base_model, **config)


def make_private(model, *, seed=None, clipping="auto", diagnostics=False,
                 secure_mode=False):
    """Returns a model whose `fit` is differentially private.

    The result wraps `model` (the same layers and weight objects) and
    replaces its train step: for each batch it computes every example's
    gradient (vectorized), clips each to global L2 norm `l2_norm_clip`, sums,
    adds N(0, (noise_multiplier * l2_norm_clip)^2) once, divides by B and hands
    that gradient to the optimizer. The DP hyperparameters come from the
    optimizer given to `compile`, which must be `DPSGD`, `DPAdam` or
    `DPAdamCorrected`. The compiled loss is applied to one example at a time:
    use the usual reduction, not `reduction=None`.

    Args:
        model: any Keras 3 model (Sequential, functional or subclassed). It
            must not contain a trainable layer that mixes examples in training
            (BatchNormalization).
        seed: None (default): the noise is seeded from the operating
            system's entropy (`secrets`), independent of
            `keras.utils.set_random_seed` and every other global seed; a
            loaded or resumed model draws a fresh seed. An int makes the
            noise reproducible, for research only: anyone who knows it can
            regenerate and remove the noise (a warning says so). Either way
            no noise state is saved with the model.
        clipping: how the sum of clipped per-example gradients is computed.
            "auto" (default): ghost clipping (`tf_dpadam.ghost_clipping`:
            per-example norms and the clipped sum from one batched forward
            and backward pass, with a vectorized map only over layers it does
            not know) where the model allows it, else "vectorized".
            "vectorized": every example's full gradient by `tf.vectorized_map`
            of a one-example backward pass. "ghost": ghost clipping or a
            `ValueError` saying why not. The privacy guarantee is the same.
        diagnostics: False (default) for ordinary DP training. True is a
            research mode that is NOT differentially private: every DP step
            also writes the clipped but un-noised mean gradient to
            `model.clean_gradients`, from which
            `tf_dpadam.diagnostics.MomentDiagnostics` compares Adam's clean
            and private moments (the paper's Table 2 and Figure 2). The
            weights follow the same trajectory (same noise) as without it,
            but the clean gradients and all that is computed from them leak
            private information; a warning says so.
        secure_mode: False (default) or True: each noise value is the sum of
            `privatizer.SECURE_MODE_DRAWS` normals (the same variance),
            against floating-point attacks on the Gaussian sampler (Holohan
            & Braghin 2021; as Opacus' `secure_mode`); needs `seed=None`.
            See the README for what it does and does not protect against.

    Returns:
        A `PrivateModel`.

    Raises:
        ValueError: if a layer mixes examples (the layer is named).
    """
    return PrivateModel(
        model, seed=seed, clipping=clipping, diagnostics=diagnostics,
        secure_mode=secure_mode, name=f"private_{model.name}",
    )
