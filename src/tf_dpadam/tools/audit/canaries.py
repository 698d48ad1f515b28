"""Canaries, their scores and the auditor's guesses.

Two kinds, both with each of the m canaries included in training
independently with probability 1/2 (`included`, drawn from the canaries'
own seed and never shown to the scoring):

* `GradientCanaries` (white-box, the privatizer itself): canary i is a Dirac
  gradient, `norm` times a sign on one coordinate of one trainable variable
  (distinct coordinates, so canaries do not interfere). At every step each
  included canary is sampled with the data's rate q, like an example, and
  the sampled ones are clipped by the privatizer's own clip factor and added
  to the sum of clipped per-example gradients before the noise. Score: how
  far the final weights moved along the canary (against its gradient, as
  descent does) from where they were when training began.
* `InputCanaries` (black-box, the whole pipeline): canary i is a real input
  with a wrong label; the included ones are added to the training data.
  Score: how much the model's loss on the wrong label fell during training.

`guess` then guesses "included" for the highest scores and "excluded" for
the lowest, abstaining on the middle, and `AuditResult` turns the count of
correct guesses into `bound.epsilon_lower_bound`.
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tf_dpadam.privatizer import dp_math
from tf_dpadam.privatizer import replicas
from tf_dpadam.common import validation
from tf_dpadam.tools.audit import bound
from tf_dpadam.tools.audit import hooks as hooks_lib


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of one audit.

    Attributes:
        num_canaries: m.
        num_guesses: r, the canaries guessed (the rest abstained on).
        num_correct: v, the correct guesses.
        delta: the delta of the claim audited.
        confidence: of the bound.
        epsilon_lower_bound: `bound.epsilon_lower_bound(m, r, v, delta,
            confidence)`.
    """

    num_canaries: int
    num_guesses: int
    num_correct: int
    delta: float
    confidence: float
    epsilon_lower_bound: float

    def describe(self, claimed_epsilon=None):
        """One line: the guesses and the bound (and the claim, if given)."""
        line = (
            f"{self.num_correct} of {self.num_guesses} guesses correct on"
            f" {self.num_canaries} canaries: epsilon >="
            f" {self.epsilon_lower_bound:.3f} at delta {self.delta:g}"
            f" ({self.confidence:.0%} confidence)"
        )
        if claimed_epsilon is not None:
            line += f"; claimed epsilon {claimed_epsilon:.3f}"
        return line


def guess(scores, num_guesses):
    """The auditor's guesses from the scores alone.

    "Included" (+1) for the `ceil(r / 2)` highest scores, "excluded" (-1) for
    the `floor(r / 2)` lowest, 0 (abstain) for the rest. Ties are broken by
    position, which carries no information about inclusion.

    Args:
        scores: the m canaries' scores (higher: more likely included).
        num_guesses: r, at most m.

    Returns:
        An int array of m values in {-1, 0, +1}.
    """
    scores = np.asarray(scores, np.float64)
    m = len(scores)
    validation.check(
        validation.is_int(num_guesses) and 0 <= num_guesses <= m,
        "num_guesses", num_guesses, f"to be an int in [0, {m}]",
    )
    if np.any(~np.isfinite(scores)):
        raise ValueError(
            "The canary scores are not all finite (training diverged?); no"
            " audit can be made from them."
        )
    order = np.argsort(scores, kind="stable")
    guesses = np.zeros(m, np.int64)
    num_high = (num_guesses + 1) // 2
    num_low = num_guesses // 2
    if num_high:
        guesses[order[m - num_high:]] = 1
    guesses[order[:num_low]] = -1
    return guesses


def audit_result(scores, included, num_guesses, delta, confidence=0.95):
    """Guesses from `scores`, checked against `included`, as a bound."""
    included = np.asarray(included, bool)
    guesses = guess(scores, num_guesses)
    truth = np.where(included, 1, -1)
    num_correct = int(np.sum(guesses == truth))
    return AuditResult(
        num_canaries=len(included),
        num_guesses=int(np.sum(guesses != 0)),
        num_correct=num_correct,
        delta=float(delta),
        confidence=float(confidence),
        epsilon_lower_bound=bound.epsilon_lower_bound(
            len(included), int(np.sum(guesses != 0)), num_correct, delta,
            confidence,
        ),
    )


def _inclusion_coins(num_canaries, rng):
    return rng.random(num_canaries) < 0.5


class GradientCanaries:
    """White-box Dirac gradient canaries inside a private model's DP step.

    Usage:

        canaries = GradientCanaries(num_canaries=1000, sampling_probability=q)
        canaries.attach(private_model)  # built and compiled
        private_model.fit(...)
        result = canaries.result(private_model, num_guesses=200, delta=1e-5)
    """

    def __init__(self, *, num_canaries, sampling_probability, norm_multiple=1.0,
                 seed=None):
        """Draws which canaries are included.

        Args:
            num_canaries: m >= 1.
            sampling_probability: q, the rate at which an included canary is
                sampled into each step: the data's Poisson rate, so that a
                canary is treated exactly as an example.
            norm_multiple: a canary's L2 norm in units of the clip norm C,
                >= 1: a correct privatizer clips it to exactly C; above 1 a
                privatizer that does not clip lets it through larger.
            seed: of the inclusion coins, the coordinates and the per-step
                sampling (None: fresh from the OS). Keep it from whoever
                scores the canaries.
        """
        validation.check(validation.is_int(num_canaries) and num_canaries >= 1,
                         "num_canaries", num_canaries, "to be an int >= 1")
        validation.check(
            validation.is_real(sampling_probability)
            and 0 < sampling_probability <= 1,
            "sampling_probability", sampling_probability, "in (0, 1]",
        )
        validation.check(validation.is_real(norm_multiple)
                         and norm_multiple >= 1, "norm_multiple",
                         norm_multiple, ">= 1")
        self.num_canaries = int(num_canaries)
        self.sampling_probability = float(sampling_probability)
        self.norm_multiple = float(norm_multiple)
        self._rng = np.random.default_rng(seed)
        self.included = _inclusion_coins(self.num_canaries, self._rng)
        self._step_key = int(self._rng.integers(0, 2**62))
        self._variables = None  # per canary: index into trainable_variables
        self._coordinates = None  # per canary: flat index in that variable
        self._signs = None
        self._start = None  # per canary: the coordinate's value at attach

    def attach(self, model):
        """Places the canaries on `model`'s weights and starts the scores.

        Call it after `compile` (the clip norm comes from the optimizer) and
        before `fit`. Coordinates are drawn uniformly without replacement
        over all trainable scalars.

        Raises:
            ValueError: if the model is not private or not built, or has
                fewer trainable scalars than canaries.
        """
        hooks = hooks_lib.hooks_of(model)
        if not model.built or not model.trainable_variables:
            raise ValueError("Expected a built model with trainable weights.")
        if getattr(model, "optimizer", None) is None:
            raise ValueError("Expected a compiled model (call compile first).")
        sizes = np.array([int(np.prod(v.shape))
                          for v in model.trainable_variables])
        if sizes.sum() < self.num_canaries:
            raise ValueError(
                f"Expected num_canaries={self.num_canaries} <= the model's"
                f" {sizes.sum()} trainable scalars."
            )
        flat = self._rng.choice(sizes.sum(), self.num_canaries, replace=False)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        self._variables = np.searchsorted(offsets, flat, side="right") - 1
        self._coordinates = flat - offsets[self._variables]
        # (variable index, the canaries on it), for the variables with any.
        self._groups = [(index, np.flatnonzero(self._variables == index))
                        for index in np.unique(self._variables)]
        self._signs = self._rng.choice([-1.0, 1.0], self.num_canaries)
        bands = getattr(model.optimizer, "noise_bands", 1)
        if bands > 1:
            raise ValueError(
                f"Expected noise_strategy with 1 band for the audit, got"
                f" {bands} bands: its canaries take part in every step, an"
                " example of cyclic Poisson batches in one step of every"
                f" {bands}, so their scores would not measure the"
                " guarantee that the ledger states.")
        if model.optimizer.variable_groups() is not None:
            raise ValueError(
                "The audit's canaries are clipped to one global norm; an"
                " optimizer with per-layer clipping (per_layer_clipping or a"
                " mapping l2_norm_clip) is not supported by the audit.")
        self._num_variables = len(sizes)
        self._start = self._values(model)
        # Out of the model's sight (the hooks are untracked): not saved.
        self._gradient_sums = tf.Variable(
            tf.zeros([self.num_canaries], tf.float64), trainable=False,
            name="canary_gradient_sums",
        )
        hooks.canaries = self

    def _gather(self, tensors):
        """Each canary's coordinate of `tensors` (one per trainable
        variable, in order): a float64 vector of m values."""
        along = tf.zeros([self.num_canaries], tf.float64)
        for index, canary_ids in self._groups:
            values = tf.gather(tf.reshape(tensors[index], [-1]),
                               self._coordinates[canary_ids])
            along = along + tf.scatter_nd(
                tf.constant(canary_ids[:, None], tf.int64),
                tf.cast(values, tf.float64), [self.num_canaries],
            )
        return along

    def _values(self, model):
        return self._gather(model.trainable_variables).numpy()

    def add_to_step(self, summed, count, variables, l2_norm_clip, step):
        """The clipped sum plus this step's sampled canaries (graph code).

        Each included canary is in the step with probability q, from a
        stateless draw keyed by the canaries' seed and the step; each
        sampled one adds norm * factor * sign at its coordinate, factor being
        the privatizer's clip factor min(1, C / norm).
        """
        if len(variables) != self._num_variables:
            raise ValueError(
                "The model's trainable variables changed since the canaries"
                " were attached."
            )
        seed = tf.stack([tf.constant(self._step_key, tf.int64),
                         tf.cast(step, tf.int64)])
        drawn = tf.random.stateless_uniform([self.num_canaries], seed=seed)
        sampled = tf.logical_and(tf.constant(self.included),
                                 drawn < self.sampling_probability)
        # norm_multiple times the step's C (which moves under adaptive
        # clipping), clipped as an example to C.
        clip = tf.cast(l2_norm_clip, tf.float32)
        norm = self.norm_multiple * clip
        factor = dp_math.clip_factors(norm, clip)
        values = (tf.cast(sampled, tf.float32) * norm * factor
                  * tf.constant(self._signs, tf.float32))
        result = list(summed)
        for index, canary_ids in self._groups:
            variable = variables[index]
            delta = tf.scatter_nd(
                tf.constant(self._coordinates[canary_ids][:, None], tf.int64),
                tf.gather(values, canary_ids),
                [int(np.prod(variable.shape))],
            )
            result[index] = result[index] + tf.cast(
                tf.reshape(delta, variable.shape), result[index].dtype
            )
        count = count + tf.cast(tf.reduce_sum(tf.cast(sampled, tf.int32)),
                                count.dtype)
        return result, count

    def observe(self, private_grads, variables):
        """Adds this step's privatized gradient along each canary (graph code).

        The privatized gradients are what DP releases at every step (the
        accounting's epsilon covers all of them), so their sum along a
        canary is a fair white-box score whatever the optimizer does next.
        """
        if replicas.num_replicas() > 1:
            raise ValueError(
                "GradientCanaries support one replica only (the privatized"
                " gradient is split between replicas)."
            )
        self._gradient_sums.assign_add(self._gather(private_grads))

    def scores(self, model, kind="movement"):
        """Each canary's score; higher means more likely included.

        Args:
            model: the model the canaries were attached to, after training.
            kind: "movement": how far the weight moved against the canary's
                gradient since `attach` (the final model only). "gradients":
                the sum over steps of the privatized gradient along the
                canary (the transcript of the training; independent of the
                optimizer's update rule, so Adam's per-coordinate scaling
                cannot hide a canary).
        """
        if self._start is None:
            raise ValueError("Call attach(model) before scoring.")
        if kind == "movement":
            return self._signs * (self._start - self._values(model))
        if kind == "gradients":
            return self._signs * self._gradient_sums.numpy()
        raise ValueError(
            f"Expected kind={kind!r} to be 'movement' or 'gradients'."
        )

    def result(self, model, *, num_guesses, delta, confidence=0.95,
               kind="movement"):
        """The audit of the model as trained: an `AuditResult`."""
        return audit_result(self.scores(model, kind), self.included,
                            num_guesses, delta, confidence)


class InputCanaries:
    """Black-box canaries: real inputs with wrong labels.

    Usage:

        canaries = InputCanaries(x_held_out, y_held_out, num_classes=10)
        x_train, y_train = canaries.training_data(x_train, y_train)
        canaries.start(model)  # before training
        ...train on (x_train, y_train) with the user's own pipeline...
        result = canaries.result(model, num_guesses=200, delta=1e-5)
    """

    def __init__(self, x, y, *, num_classes, seed=None, loss=None):
        """Draws the wrong labels and which canaries are included.

        Args:
            x: the m canary inputs (not otherwise in the training data).
            y: their true integer labels.
            num_classes: >= 2; each canary gets a uniformly random wrong one.
            seed: of the labels and inclusion coins (None: fresh).
            loss: per-example loss `loss(y_true, y_pred)` with no reduction;
                default sparse categorical cross-entropy on logits.
        """
        x, y = np.asarray(x), np.asarray(y)
        validation.check(len(x) >= 1 and len(x) == len(y), "x", x.shape,
                         f"to be non-empty and as long as y ({len(y)})")
        validation.check(validation.is_int(num_classes) and num_classes >= 2,
                         "num_classes", num_classes, "to be an int >= 2")
        rng = np.random.default_rng(seed)
        self.num_canaries = len(x)
        self.x = x
        self.labels = (
            (y.astype(np.int64) + rng.integers(1, num_classes, len(y)))
            % num_classes
        ).astype(y.dtype)
        self.included = _inclusion_coins(self.num_canaries, rng)
        self._loss = loss or keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)
        self._start = None

    def training_data(self, x, y):
        """`(x, y)` with the included canaries (wrong labels) appended."""
        return (np.concatenate([x, self.x[self.included]]),
                np.concatenate([y, self.labels[self.included]]))

    def losses(self, model, batch_size=512):
        """The model's loss on each canary's wrong label."""
        logits = model.predict(self.x, batch_size=batch_size, verbose=0)
        return keras.ops.convert_to_numpy(self._loss(self.labels, logits))

    def start(self, model):
        """Records the losses before training."""
        self._start = self.losses(model)

    def scores(self, model):
        """How much each canary's loss fell since `start`."""
        if self._start is None:
            raise ValueError("Call start(model) before training.")
        return self._start - self.losses(model)

    def result(self, model, *, num_guesses, delta, confidence=0.95):
        """The audit of the model as trained: an `AuditResult`."""
        return audit_result(self.scores(model), self.included, num_guesses,
                            delta, confidence)
