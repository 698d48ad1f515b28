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

from tf_dpadam import augmentation
from tf_dpadam import clean_gradients as clean_gradients_lib
from tf_dpadam import ghost_clipping
from tf_dpadam import independence
from tf_dpadam import compat
from tf_dpadam import lora_state
from tf_dpadam import optimizers as dp_optimizers
from tf_dpadam import pipeline
from tf_dpadam import private_fit
from tf_dpadam import privatizer
from tf_dpadam import train_step_checks
from tf_dpadam import vectorized_clipping
from tf_dpadam.ghost_clipping import registry

# How the clipped sum of per-example gradients is computed (`make_private`'s
# `clipping`): "ghost" from the batched forward and backward pass
# (`ghost_clipping`), "vectorized" by a vectorized map of one-example backward
# passes, "auto" ghost where the model allows it, else vectorized.
CLIPPING_METHODS = ("auto", "ghost", "vectorized")

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

    The layers are `ghost_clipping.registry.EXAMPLE_MIXING_LAYERS`. A frozen
    BatchNormalization (`trainable=False`) runs in inference mode in Keras 3
    and is allowed.

    Raises:
        ValueError: naming the first offending layer.
    """
    for layer in compat.all_layers(model):
        if registry.mixes_examples(layer):
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


def _logs_for_keras_reduction(logs):
    """The step's logs, as Keras can average them over several workers.

    With several workers Keras' TensorFlow trainer averages each log with
    `strategy.reduce("MEAN", value, axis=0)`, which fails on the scalars
    that metrics are (Keras 3.15, tensorflow/tensorflow#72388). Shape [1]
    reduces to the same scalar mean over the replicas.
    """
    strategy = tf.distribute.get_strategy()
    try:
        local = len(strategy.extended.worker_devices)
    except RuntimeError:  # The default strategy.
        return logs
    if strategy.num_replicas_in_sync == local:  # One worker.
        return logs
    return tf.nest.map_structure(lambda v: ops.reshape(v, (1,)), logs)


def _require_dp_optimizer(optimizer):
    if not dp_optimizers.is_dp_optimizer(optimizer):
        raise ValueError(
            "A model made private needs a tf_dpadam optimizer (DPSGD, DPAdam"
            " or DPAdamCorrected), which carries l2_norm_clip and"
            f" noise_multiplier. Received optimizer={optimizer!r}."
        )


class _Untracked:
    """Holds a value out of sight of Keras' and TensorFlow's tracking.

    The noise seed state and the diagnostics variables live here so that
    they are not model weights: not in `model.weights`, and never written by
    `model.save` (a saved model must carry neither).
    """

    def __init__(self, value):
        self.value = value


@keras.saving.register_keras_serializable(package="tf_dpadam")
class PrivateModel(private_fit.SamplingFitMixin, pipeline.PreprocessingMixin,
                   keras.Model):
    """A model whose `fit` privatizes each step; see `make_private`."""

    def __init__(self, base_model, seed=None, clipping="auto",
                 diagnostics=False, secure_mode=False, augment=None,
                 augmult=1, *, check_independence=True, **kwargs):
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
        augmentation.check_arguments(augment, augmult)
        if not isinstance(check_independence, bool):
            raise ValueError(
                f"Expected check_independence={check_independence!r} to be"
                " True or False."
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
        registry.warn_data_adapted_layers(base_model, stacklevel=3)
        self.base_model = base_model
        # LoRA factors are saved unmerged and restored after the layers.
        self._lora_factors = lora_state.LoraFactors(base_model)
        # The noise key: secret unless `seed` is given (a warning says so).
        key = privatizer.resolve_seed(
            seed, what="make_private", drawn="every noise vector",
            effect="the DP noise",
        )
        self.seed = seed
        self.secure_mode = secure_mode
        self.clipping = clipping
        self.diagnostics = diagnostics
        # Training only (`augmentation.views`); a Keras layer is tracked, so
        # that its state is saved with the model.
        self.augment = augment
        self.augmult = augmult
        self._clean_gradients = _Untracked(clean_gradients_lib.CleanGradients())
        # The method the last traced train step used, and why ghost clipping
        # was not ("auto" only): set at trace time, for users and tests.
        self.clipping_used = None
        self.ghost_unsupported_reason = None
        # Out of sight of tracking: never in `weights`, a saved model or a
        # checkpoint; a loaded or resumed model draws a fresh key.
        self._noise_seeds = _Untracked(privatizer.NoiseSeeds(key))
        # Set only by `tf_dpadam.audit`: its gradient canaries and, for
        # testing the auditor, deliberate breaks of the privatizer.
        self._audit = _Untracked(None)
        # `independence.check` on the first training batch, once per
        # compiled loss (the last one that passed is kept here).
        self.check_independence = check_independence
        self._independence_checked = _Untracked(None)
        if base_model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.base_model(inputs, training=training)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        _require_dp_optimizer(optimizer)
        super().compile(optimizer, *args, **kwargs)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            # Keras wraps it under "mixed_float16"; the private step applies
            # float32 privatized gradients through the DP optimizer itself
            # (loss scaling would scale what is clipped).
            self.optimizer = self.optimizer.inner_optimizer
        if (self.built and self.trainable_variables
                and not self.optimizer.built):
            # Now rather than in the first train step: creating the
            # optimizer's variables there makes tf.function trace the step
            # twice (3-7 s each for the larger models of the tests).
            self.optimizer.build(self.trainable_variables)
        if self.diagnostics and self.built:
            self._clean_gradients.value.build(self.trainable_variables)

    def compile_from_config(self, config):
        # Keras skips models that override `compile`; ours only adds a check.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)  # builds the optimizer of a built model

    def make_train_function(self, force=False):
        # `fit` and `train_on_batch` both train through `train_function`:
        # its first call checks that the examples are independent, eagerly
        # on the very batch it trains on (`independence`), before the
        # compiled step (graph or XLA) runs.
        made = self.train_function
        result = super().make_train_function(force=force)
        if self.check_independence and self.train_function is not made:
            self.train_function = independence.checked_on_first_call(
                self.train_function, self._check_independence_once,
                self.steps_per_execution,
            )
        return result

    def _check_independence_once(self, data):
        compile_loss = compat.compile_loss(self)
        if self._independence_checked.value is compile_loss:
            return
        if independence.check(self, data):
            self._independence_checked.value = compile_loss

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras' TensorFlow trainer takes the shapes of a distributed batch
        # from one `strategy.reduce` of the whole (x, y) structure, which
        # MultiWorkerMirroredStrategy refuses for a structure (Keras 3.15,
        # TF 2.21). The first local replica's batch has the same shapes and
        # needs no communication.
        if iterator is not None and self._distribute_strategy is not None:
            strategy = self._distribute_strategy
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0],
                    next(batches),
                )
                break
            iterator = None
        return super()._maybe_symbolic_build(
            iterator=iterator, data_batch=data_batch
        )

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        _require_dp_optimizer(optimizer)
        check_no_example_mixing(self.base_model)
        config = optimizer.dp_config
        self._build_on_first_call(x)
        variables = self.trainable_variables
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
            return train_step_checks.step_without_trainable_weights(
                self, x, y, sample_weight)
        # As Keras: no gradient for any weight is an error, not noise.
        train_step_checks.check_gradient_path(self, x, y, sample_weight,
                                              variables)
        if not optimizer.built:
            optimizer.build(variables)
        if self.diagnostics:
            self._clean_gradients.value.build(variables)
        x, y, sample_weight, present = self._views(x, y, sample_weight)

        # Phases 1 and 2: per-example gradients, clipped and summed (in
        # float32; an example with a NaN or infinite gradient or loss
        # contributes nothing, counted by the diagnostics only).
        summed, norms, losses, y_pred = self._sum_of_clipped_gradients(
            x, y, sample_weight, present, self._clip_norm(config)
        )
        if self.diagnostics:
            self._clean_gradients.value.record_non_finite(
                norms, losses, present
            )
        count = ops.sum(present)
        accumulator = optimizer.dp_accumulator  # None unless k > 1

        # Phases 3 to 5: noise, scale, update (once per logical step).
        if accumulator is not None and tf.distribute.has_strategy():
            # Each replica accumulates its own sums; the logical step
            # all-reduces them once (accumulation.py).
            accumulator.add_on_replicas(
                summed, count,
                lambda strategy, sums, count: self._logical_step_on_replicas(
                    strategy, sums, count, variables
                ),
            )
        else:
            if privatizer.num_replicas() > 1:
                summed, count = privatizer.sum_over_replicas((summed, count))

            def noise_scale_apply(summed, count):
                self._noise_scale_apply(summed, count, variables)

            if accumulator is None:
                noise_scale_apply(summed, count)
            else:
                accumulator.add(summed, count, noise_scale_apply)

        compile_loss = compat.compile_loss(self)
        if compile_loss is not None and compile_loss.metrics:
            compile_loss(y, y_pred, sample_weight)
        # A NaN or infinite example loss counts as 0 in the logged loss, so
        # that the log does not show such an example.
        losses = ops.where(ops.isfinite(losses), losses,
                           ops.zeros_like(losses))
        compat.loss_tracker(self).update_state(
            ops.sum(losses) / ops.maximum(ops.sum(present), 1.0),
            sample_weight=ops.sum(present),
        )
        compat.update_compile_metrics(
            self, y, y_pred, sample_weight,
            _present_examples(x, sample_weight) if sample_weight is not None
            else None,
        )
        return _logs_for_keras_reduction(self.get_metrics_result())

    def _build_on_first_call(self, x):
        if not all(layer.built
                   for layer in compat.all_layers(self.base_model)):
            # A model without `keras.Input` builds on its first call: make
            # that call here, on the first trace, so that its weights (and
            # the optimizer's) exist before the step reads them.
            self(x, training=False)

    def _views(self, x, y, sample_weight):
        """`(x, y, sample_weight, present)`: the rows the step clips.

        `present` is per example (K views of an example are one example).
        With `augment` or K > 1, the rows are the K views of each example,
        in consecutive rows (made once, outside the per-example gradients);
        y and the weights follow.
        """
        present = _present_examples(x, sample_weight)
        if self.augment is not None or self.augmult > 1:
            x = augmentation.views(self.augment, x, self.augmult)
            y, sample_weight = augmentation.repeat_examples(
                (y, sample_weight), self.augmult
            )
        return x, y, sample_weight, present

    def per_example_norms_step(self, data):
        """`(norms, present)` of one batch, without an update: every
        example's gradient norm before clipping, as the train step computes
        it (see `tf_dpadam.per_example_gradient_norms`; NOT private)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._build_on_first_call(x)
        x, y, sample_weight, present = self._views(x, y, sample_weight)
        # C does not change the norms. Under tf.function the clipped sum,
        # pure and not an output, is pruned from the graph.
        _, norms, _, _ = self._sum_of_clipped_gradients(
            x, y, sample_weight, present, 1.0
        )
        return norms, present

    def _sum_of_clipped_gradients(self, x, y, sample_weight, present,
                                  l2_norm_clip):
        """The sum of clipped per-example gradients (phases 1 and 2), in
        float32, an example with a NaN or infinite gradient or loss adding
        nothing.

        Such an example gets the clip factor 0; should its 0 * inf make a
        sum NaN anyway, the sums are computed again with it replaced by a
        finite example marked absent (`privatizer.without_non_finite`; one
        `tf.cond` for the step: only a batch holding such an example pays,
        and nothing is held for it otherwise). Returns as
        `_clipped_sum_by_mode`, the norms, losses and predictions being
        those of the first computation.
        """
        summed, norms, losses, y_pred = self._clipped_sum_by_mode(
            x, y, sample_weight, present, l2_norm_clip)

        def recompute():
            (x2, y2, w2), present2 = privatizer.without_non_finite(
                (x, y, sample_weight), present, norms, losses,
                self.augmult)
            return tf.cond(
                tf.reduce_any(present2 > 0),
                lambda: self._clipped_sum_by_mode(
                    x2, y2, w2, present2, l2_norm_clip)[0],
                lambda: [tf.zeros_like(s) for s in summed])

        summed = tf.cond(privatizer.all_finite(summed), lambda: summed,
                         recompute)
        return summed, norms, losses, y_pred

    def _clipped_sum_by_mode(self, x, y, sample_weight, present,
                             l2_norm_clip):
        """The sum of clipped per-example gradients, by the clipping mode.

        Ghost clipping where the model allows it (decided while tracing),
        else per-example gradients by a vectorized map. Both give the same
        sum up to float rounding (tests/privacy_zoo_test.py).

        With augmentation multiplicity K, `x`, `y` and `sample_weight` hold
        the K views of each example in consecutive rows and `present` is per
        example.

        Returns:
            `(summed, norms, losses, y_pred)`: one sum per trainable
            variable, the per-example gradient norms before clipping, the
            per-example losses and the predictions (one per row).
        """
        if self.clipping != "vectorized":
            try:
                summed, norms, losses, y_pred = (
                    ghost_clipping.clipped_gradient_sum(
                        self, ghost_clipping.compiled_loss_fn(self), x, y,
                        sample_weight, l2_norm_clip, mask=present,
                        group_size=self.augmult,
                    )
                )
                self.clipping_used = "ghost"
                return summed, norms, losses, y_pred
            except ghost_clipping.GhostClippingUnsupportedError as error:
                if self.clipping == "ghost":
                    raise ValueError(
                        "make_private(clipping='ghost'): " + str(error)
                    ) from error
                self.ghost_unsupported_reason = str(error)
        summed, norms, losses, y_pred = (
            vectorized_clipping.clipped_gradient_sum(
                self, x, y, sample_weight, l2_norm_clip, mask=present,
                group_size=self.augmult,
            )
        )
        self.clipping_used = "vectorized"
        return summed, norms, losses, y_pred

    def _noise_scale_apply(self, summed, count, variables):
        """Noise once, divide by B, apply.

        `summed` is the clipped sum over all examples of the (logical) step
        and all replicas, the same on every replica; `count` their number.
        """
        optimizer = self.optimizer
        config = optimizer.dp_config
        audit = self._audit.value
        if audit is not None:
            # Gradient canaries: extra examples, clipped like the others.
            summed, count = audit.add_canaries(
                summed, count, variables, self._clip_norm(config),
                optimizer.iterations,
            )
        denominator = config.denominator(count)
        if self.diagnostics:
            self._clean_gradients.value.record(summed, denominator)
        noise_stddev = config.noise_stddev
        if audit is not None:
            noise_stddev = audit.noise_stddev(noise_stddev)
        noised = privatizer.add_noise(
            privatizer.replica_share(summed),
            noise_stddev,
            self._noise_seeds.value.next(optimizer.iterations),
            share=privatizer.first_replica_share(),
            secure_mode=self.secure_mode,
        )
        private_grads = privatizer.scale(noised, denominator)
        if audit is not None:
            audit.observe(private_grads, variables)
        optimizer.apply_private(private_grads, variables, denominator)

    def _logical_step_on_replicas(self, strategy, sums, count, variables):
        """Noise once, all-reduce once, divide by B, apply (cross-replica).

        The logical step of accumulation under `tf.distribute`: `sums` and
        `count` are the accumulators, one copy per replica. The noise is
        added to the copy of the replica with global id 0 before the one
        all-reduce (`privatizer.sum_replica_copies`), so it is drawn once in
        total and every worker applies the same gradient.
        """
        optimizer = self.optimizer
        config = optimizer.dp_config
        if self._audit.value is not None:
            raise ValueError(
                "tf_dpadam.audit supports one replica only; it is not"
                " available with gradient accumulation under tf.distribute."
            )
        seed = self._noise_seeds.value.next(optimizer.iterations)

        def add_noise(values):
            noised = privatizer.add_noise(
                values[:-1], config.noise_stddev, seed,
                secure_mode=self.secure_mode,
            )
            return noised + [values[-1]]

        reduced = privatizer.sum_replica_copies(
            strategy, list(sums) + [count], first_replica=add_noise
        )
        noised, total = reduced[:-1], reduced[-1]
        denominator = config.denominator(total)
        if self.diagnostics:
            # The clean sum needs an all-reduce of its own (research only).
            clean = privatizer.sum_replica_copies(strategy, list(sums))
            self._clean_gradients.value.record(clean, denominator)
        optimizer.apply_private(
            privatizer.scale(noised, denominator), variables, denominator
        )

    def _clip_norm(self, config):
        """C, unless a `tf_dpadam.audit` test deliberately breaks it."""
        audit = self._audit.value
        if audit is None:
            return config.l2_norm_clip
        return audit.clip_norm(config.l2_norm_clip)

    @property
    def clean_gradients(self):
        """The clean gradient of the last DP step, or None (NOT private).

        With `diagnostics=True`: one variable per trainable variable holding
        the clipped but un-noised gradient sum_i clip(g_i) / B of the last DP
        (logical) step, B being the very denominator of the private
        gradient. Not model weights and not saved. None before they exist
        and always with `diagnostics=False`.
        """
        return self._clean_gradients.value.variables

    @property
    def non_finite_examples(self):
        """The number of examples with a NaN or infinite gradient or loss
        in all DP steps so far, or None (NOT private).

        Such an example gets the clip factor 0 and contributes nothing to
        the private gradient; this count, kept with `diagnostics=True` only
        (a float32 scalar variable, summed over replicas, not saved), is the
        only place that shows it was there. None with `diagnostics=False`
        and before the variables exist.
        """
        return self._clean_gradients.value.non_finite_count

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "seed": self.seed,
            "clipping": self.clipping,
            "diagnostics": self.diagnostics,
            "secure_mode": self.secure_mode,
            "augmult": self.augmult,
            "check_independence": self.check_independence,
            # Raises for a callable that a saved model could not hold.
            "augment": augmentation.serialize(self.augment),
            "base_model": keras.saving.serialize_keras_object(self.base_model),
            "lora": lora_state.lora_config(self.base_model),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        base_model = keras.saving.deserialize_keras_object(
            config.pop("base_model"), custom_objects=custom_objects
        )
        lora_state.restore_lora(base_model, config.pop("lora", None))
        augment = augmentation.deserialize(
            config.pop("augment", None), custom_objects=custom_objects
        )
        return cls(base_model, augment=augment, **config)


def make_private(model, *, seed=None, clipping="auto", diagnostics=False,
                 secure_mode=False, augment=None, augmult=1,
                 check_independence=True):
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
        augment: None (default) or a callable that augments a batch of
            inputs, in training only: a Keras layer or model (e.g.
            `keras.Sequential([keras.layers.RandomFlip("horizontal"),
            keras.layers.RandomTranslation(0.1, 0.1)])`, called with
            `training=True`) or a function of `x` (given `training=True` if
            it takes a `training` argument). It must transform each row on
            its own (MixUp and CutMix are refused) and keep the shape the
            model expects; evaluation and prediction see the inputs
            unaugmented. Saved with the model if it is a Keras layer or a
            registered function (`keras.saving.register_keras_serializable`);
            saving a model with any other callable raises.
        augmult: K >= 1, the augmentation multiplicity (De et al. 2022,
            "Unlocking High-Accuracy Differentially Private Image
            Classification through Scale"). Each step makes the views
            `v_i1..v_iK = augment(x_i repeated K times)` once, and example
            i's gradient is that of its mean loss over them, clipped ONCE:

                g_i = grad [(1/K) sum_k loss(v_ik, y_i)] + grad R,
                update = (sum_i min(1, C / ||g_i||) g_i
                          + N(0, sigma^2 C^2 I)) / B

            (R the weight regularization; the sample weight and the mask of
            absent examples apply to the example; losses added in call, on
            the vectorized path only, are those of the example's K views as
            one batch). Each example's sensitivity is still C, so the noise,
            B and epsilon are those of K = 1; K costs K times the forward
            and backward compute. Ghost clipping handles the K views of an
            example as one group (their cross terms are in its norm), the
            vectorized path maps over the examples with their K views as a
            batch. K > 1 needs `augment`; with K = 1, `augment` is plain
            data augmentation inside the private step.
        check_independence: True (default): before the first training step
            (of `fit` or `train_on_batch`, and again after `compile` with
            another loss), check eagerly on that step's batch that the
            examples are independent (`tf_dpadam.independence`): replacing
            one example must change no other example's training-mode
            outputs (random layers replayed with the same seeds), and the
            compiled loss must be a per-example loss (no in-batch negatives
            as in a CLIP-style contrastive loss, no batch statistics).
            Otherwise training would not be differentially private (or,
            with clipping="vectorized", would train on batches of one), and
            a `ValueError` names the layer or the loss. It costs a few
            forward passes, once. False turns the check off: only for a
            model and loss you have verified yourself.

    Returns:
        A `PrivateModel`.

    Raises:
        ValueError: if a layer mixes examples (the layer is named), or for
            an invalid argument (named); when training starts, if the model
            or the loss mixes examples (`check_independence`).
    """
    return PrivateModel(
        model, seed=seed, clipping=clipping, diagnostics=diagnostics,
        secure_mode=secure_mode, augment=augment, augmult=augmult,
        check_independence=check_independence,
        name=f"private_{model.name}",
    )
