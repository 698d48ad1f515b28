"""`make_private`: a Keras model whose train step is differentially private.

The returned model wraps the user's model (same layers, same weight objects)
and replaces only `train_step`: per-example gradients, clipping to C, one
Gaussian noise draw of std sigma * C, division by B, then the optimizer
(`tf_dpadam.training.train_step`, which reads top to bottom). C, sigma and B
come from the compiled tf_dpadam optimizer. Evaluation, prediction, metrics,
callbacks and saving are Keras' own. Audits and diagnostics take part in
the step through `StepHooks` (`PrivateModel.add_step_hooks`).
"""

import warnings
from typing import Callable, Optional

import keras

from tf_dpadam.training import augmentation
from tf_dpadam.training import clean_gradients as clean_gradients_lib
from tf_dpadam.common import compat
from tf_dpadam.training import independence
from tf_dpadam.training import lora_state
from tf_dpadam.training import model_ledger
from tf_dpadam.training import noise_history as noise_history_lib
from tf_dpadam.data import pipeline
from tf_dpadam.training import private_fit
from tf_dpadam.privatizer.ghost_clipping import registry
from tf_dpadam.training import hooks as hooks_lib
from tf_dpadam.common import seeds
from tf_dpadam.training import train_step as train_step_lib

# How the clipped sum of per-example gradients is computed (`make_private`'s
# `clipping`): "ghost" from the batched forward and backward pass
# (`ghost_clipping`), "vectorized" by a vectorized map of one-example backward
# passes, "auto" ghost where the model allows it, else vectorized.
CLIPPING_METHODS = ("auto", "ghost", "vectorized")

# Shown whenever a model with `diagnostics=True` is made (or loaded).
DIAGNOSTICS_WARNING = (
    "make_private(diagnostics=True) is NOT differentially private. Every"
    " step also stores the clipped but un-noised mean gradient of the batch"
    " (`model.clean_gradients`), and tf_dpadam.tools.diagnostics.MomentDiagnostics"
    " builds Adam moments from it: these variables and everything computed"
    " from them (tables, histograms) reveal information about individual"
    " training examples that no epsilon accounts for. The weights follow the"
    " same private trajectory as without diagnostics. Use it for research on"
    " public or synthetic data only, and never release its outputs."
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
class PrivateModel(compat.LocalBatchSymbolicBuild, model_ledger.LedgerMixin,
                   private_fit.SamplingFitMixin, pipeline.PreprocessingMixin,
                   keras.Model):
    """A model whose `fit` privatizes each step; see `make_private`."""

    def __init__(self, base_model: keras.Model, seed: Optional[int] = None,
                 clipping: str = "auto", diagnostics: bool = False,
                 secure_mode: bool = False, augment: Optional[Callable] = None,
                 augmult: int = 1, *, check_independence: bool = True,
                 privacy_ledger: Optional[dict] = None, **kwargs):
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
        train_step_lib.check_no_example_mixing(base_model)
        registry.warn_data_adapted_layers(base_model, stacklevel=3)
        self.base_model = base_model
        self._init_ledger(base_model, privacy_ledger)  # What training spent.
        # LoRA factors are saved unmerged and restored after the layers.
        self._lora_factors = lora_state.LoraFactors(base_model)
        # The noise key: secret unless `seed` is given (a warning says so).
        key = seeds.resolve_seed(
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
        self._clean_gradients = _Untracked(
            clean_gradients_lib.CleanGradients())
        # The method the last traced train step used, and why ghost clipping
        # was not ("auto" only): set at trace time, for users and tests.
        self.clipping_used = None
        self.ghost_unsupported_reason = None
        # Out of sight of tracking: never in `weights`, a saved model or a
        # checkpoint; a loaded or resumed model draws a fresh key.
        self._noise_seeds = _Untracked(seeds.NoiseSeeds(key))
        # The past noise of correlated noise, as secret as the noise.
        self._noise_history = _Untracked(noise_history_lib.NoiseHistory())
        # The `StepHooks` of the train step (`add_step_hooks`), untracked:
        # the diagnostics' clean gradients, `tf_dpadam.tools.audit`'s canaries.
        self._step_hooks = _Untracked(
            [self._clean_gradients.value] if diagnostics else [])
        # `independence.Guard`: checks training batches (first, on change,
        # at random later calls).
        self.check_independence = check_independence
        self._guard = _Untracked(independence.Guard(self))
        if base_model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.base_model(inputs, training=training)

    def compile(self, optimizer="rmsprop", *args, **kwargs) -> None:
        optimizer = keras.optimizers.get(optimizer)
        train_step_lib.require_dp_optimizer(optimizer)
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
        if self.built:
            for hook in self.step_hooks:
                hook.build(self.trainable_variables)

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
        if self.train_function is not made:
            if self.check_independence:
                self.train_function = self._guard.value.wrap(
                    self.train_function, self.steps_per_execution)
            # Every call opens the ledger segment of its steps.
            self.train_function = self.with_ledger(self.train_function)
        return result

    @property
    def independence_guard(self):
        """The `tf_dpadam.training.independence.Guard` that checks the training
        batches (its `rate`, `checks` and `check(batch)`)."""
        return self._guard.value

    def train_step(self, data) -> dict:
        """One DP step (`tf_dpadam.training.train_step`)."""
        return train_step_lib.train_step(
            self, data, noise_seeds=self._noise_seeds.value,
            hooks=self.step_hooks, ledger=self._model_ledger,
            noise_history=self._noise_history.value,
        )

    def after_symbolic_build(self) -> None:
        """Correlated noise: its history is made as soon as the model is
        built, before the step's first trace, where a replica's step of
        tf.distribute could not make it (`NoiseHistory.draws_for`; `fit`
        aligned its batches with the same count)."""
        optimizer = getattr(self, "optimizer", None)
        if self.built and getattr(optimizer, "noise_bands", 1) > 1:
            self.noise_history.draws_for(
                optimizer.noise_strategy,
                [v.shape for v in self.trainable_variables],
                self.distribute_strategy)

    @property
    def noise_history(self):
        """The model's `noise_history.NoiseHistory`: the secret state of
        correlated noise (an optimizer's `noise_strategy` of b > 1 bands),
        never saved with the model."""
        return self._noise_history.value

    def per_example_norms_step(self, data) -> tuple:
        """`(norms, present)` of one batch, without an update: every
        example's gradient norm before clipping, as the train step computes
        it (see `tf_dpadam.per_example_gradient_norms`; NOT private)."""
        return train_step_lib.per_example_norms(self, data)

    @property
    def step_hooks(self) -> tuple:
        """The registered `tf_dpadam.training.hooks.StepHooks`, in order."""
        return tuple(self._step_hooks.value)

    def add_step_hooks(self, hooks: hooks_lib.StepHooks) -> None:
        """Registers `hooks` with the train step (after the others).

        The step calls it while tracing: the next `fit` traces a new step
        (the traced one is forgotten). Hooks are not saved with the model.

        Raises:
            ValueError: if `hooks` is not a `StepHooks` or is registered.
        """
        if not isinstance(hooks, hooks_lib.StepHooks):
            raise ValueError(
                f"Expected hooks={hooks!r} to be a"
                " tf_dpadam.training.hooks.StepHooks."
            )
        if any(hook is hooks for hook in self._step_hooks.value):
            raise ValueError(f"Expected hooks={hooks!r} not registered yet.")
        self._step_hooks.value.append(hooks)
        self.train_function = None

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

    def get_config(self) -> dict:
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
            # What the model spent: `clone_model` and `from_config` keep it.
            "privacy_ledger": self.privacy_ledger.to_json(),
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


def make_private(model: keras.Model, *, seed: Optional[int] = None,
                 clipping: str = "auto", diagnostics: bool = False,
                 secure_mode: bool = False,
                 augment: Optional[Callable] = None, augmult: int = 1,
                 check_independence: bool = True) -> PrivateModel:
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
            "auto" (default): ghost clipping (`tf_dpadam.privatizer.ghost_clipping`:
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
            `tf_dpadam.tools.diagnostics.MomentDiagnostics` compares Adam's clean
            and private moments (the paper's Table 2 and Figure 2). The
            weights follow the same trajectory (same noise) as without it,
            but the clean gradients and all that is computed from them leak
            private information; a warning says so.
        secure_mode: False (default) or True: each noise value is the sum of
            `step.noise.SECURE_MODE_DRAWS` normals (the same variance),
            against floating-point attacks on the Gaussian sampler (Holohan
            & Braghin 2021; as Opacus' `secure_mode`); needs `seed=None`.
            See docs/guides/threat_model.md for what it does and does not
            protect against.
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
            i's gradient is that of its mean loss over them, clipped ONCE::

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
        check_independence: True (default): check eagerly, on training
            batches, that each example's gradient depends on it alone
            (`tf_dpadam.training.independence`): for two random examples i, the
            predictions, loss and gradient norm the private step computes
            must not change when every other example of the batch is
            replaced by a copy of i (random layers replayed with the same
            seeds), nor the loss's gradient (no in-batch negatives). The
            first call of the train function is checked, every call after
            the loss, the trainable weights or `augment` changed, and each
            later call with probability 1%
            (`model.independence_guard.rate`). Otherwise training would not
            be differentially private (or, with clipping="vectorized", would
            train on batches of one): a `ValueError` names the layer, the
            augmentation or the loss. False turns the check off: only for a
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
