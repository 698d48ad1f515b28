"""A Keras callback that reports, and can cap, the privacy spent in training.

`PrivacyBudget` reads the noise multiplier sigma and the expected batch size B
from the model's DP optimizer and the number of steps taken from the
optimizer's `iterations`, and accounts them as the dp-accounting event
SelfComposedDpEvent(PoissonSampledDpEvent(B / N, GaussianDpEvent(sigma)), T)
with `tf_dpadam.accounting.epsilon_after_steps`.
"""

import math

import keras
from keras import ops

from tf_dpadam import accounting
from tf_dpadam import validation


class PrivacyBudget(keras.callbacks.Callback):
    """Logs epsilon every epoch and optionally stops training at a budget.

    The accounting (see `tf_dpadam.accounting.epsilon_after_steps`) is that of
    T steps of Poisson sampling at rate q = B / N with Gaussian noise of
    multiplier sigma, under add-or-remove-one adjacency, where

    * sigma is `model.optimizer.noise_multiplier`,
    * B is `model.optimizer.batch_size`, or this callback's `batch_size` if
      the optimizer's is None (it divides by the number of examples in each
      step); the accounting needs the expected batch size,
    * T is `int(model.optimizer.iterations)`: the optimizer counts the
      privatized (logical) steps, and its `iterations` is saved and restored
      with the model, so after save / load / resume epsilon continues from
      the steps already taken instead of restarting at zero.

    At the end of every batch and every epoch it sets `logs["epsilon"]`, so
    epsilon shows in the live progress bar (`verbose=1`), the `History`,
    `TensorBoard` (`batch_epsilon` with an integer `update_freq`, and
    `epoch_epsilon`), `CSVLogger` and so on.
    Keras' `CallbackList` passes one logs dict to every callback in list
    order and appends its own `History` and `ProgbarLogger` after the user's
    callbacks, so these two always see epsilon. A callback of yours that reads
    the epoch logs (`TensorBoard`, `CSVLogger`, `EarlyStopping`, ...) sees it
    only if it comes after `PrivacyBudget`: put `PrivacyBudget` first.

    With `target_epsilon`, `on_train_begin` computes once
    `max_steps = tf_dpadam.accounting.calibrate_steps(...)`, the largest T
    with epsilon(T) <= target_epsilon, and `on_train_batch_end` sets
    `model.stop_training = True` as soon as T reaches `max_steps`, so no step
    beyond the budget is taken. If the budget is already spent when training
    begins, `on_train_begin` raises before any step. The stop is exact only
    with `steps_per_execution=1`, which the callback then requires.

    Attributes:
        epsilon: The last epsilon computed (None before training begins).
        max_steps: The step budget for `target_epsilon` (None without one).
    """

    def __init__(
        self,
        num_examples,
        delta,
        target_epsilon=None,
        accountant="rdp",
        batch_size=None,
    ):
        """Creates the callback.

        Args:
            num_examples: N, the number of training examples (> 0).
            delta: The delta of the (epsilon, delta) guarantee, in (0, 1).
            target_epsilon: Optional budget epsilon > 0; training stops before
                the first step that would exceed it.
            accountant: "rdp" or "pld" (see `tf_dpadam.accounting`).
            batch_size: The expected batch size B, used only when the
                optimizer's `batch_size` is None.

        Raises:
            ValueError: if an argument is out of range.
        """
        super().__init__()
        validation.check_positive_int("num_examples", num_examples)
        if batch_size is not None:
            validation.check_sizes("num_examples", num_examples, batch_size)
        validation.check_delta(delta)
        if target_epsilon is not None:
            validation.check_positive_real("target_epsilon", target_epsilon)
        validation.check_accountant(accountant)
        self.num_examples = int(num_examples)
        self.delta = float(delta)
        self.target_epsilon = (
            None if target_epsilon is None else float(target_epsilon)
        )
        self.accountant = accountant
        self.batch_size = None if batch_size is None else int(batch_size)
        self.epsilon = None
        self.max_steps = None
        self._epsilons = {}  # (sigma, B, T) -> epsilon.
        self._max_steps = {}  # (sigma, B) -> max_steps.

    # ----------------------------------------------------------------------
    # Reading the model.

    def _dp_optimizer(self):
        optimizer = getattr(self.model, "optimizer", None)
        # A loss-scale wrapper keeps the DP optimizer as `inner_optimizer`.
        inner = getattr(optimizer, "inner_optimizer", None)
        for candidate in (optimizer, inner):
            if candidate is not None and hasattr(candidate, "noise_multiplier"):
                return candidate
        raise ValueError(
            f"PrivacyBudget needs the model's optimizer to have a"
            f" noise_multiplier, and {type(optimizer).__name__} has none: the"
            " model must be compiled with a tf_dpadam DP optimizer (DPSGD,"
            " DPAdam or DPAdamCorrected)."
        )

    def _hyperparameters(self):
        """Returns (sigma, B) of the model's DP optimizer."""
        optimizer = self._dp_optimizer()
        sigma = float(optimizer.noise_multiplier)
        batch_size = getattr(optimizer, "batch_size", None)
        if batch_size is None:
            if self.batch_size is None:
                raise ValueError(
                    "PrivacyBudget needs the expected batch size B (the"
                    " accounting uses the sampling rate q = B / num_examples):"
                    " the optimizer's batch_size is None, so pass"
                    " PrivacyBudget(..., batch_size=B)."
                )
            batch_size = self.batch_size
        elif self.batch_size is not None and self.batch_size != batch_size:
            raise ValueError(
                f"Expected batch_size={self.batch_size!r} to be None or equal"
                f" to the optimizer's batch_size={batch_size!r}."
            )
        return sigma, int(batch_size)

    def _steps_taken(self):
        return int(ops.convert_to_numpy(self._dp_optimizer().iterations))

    def _epsilon_at(self, steps, sigma, batch_size):
        key = (sigma, batch_size, steps)
        if key not in self._epsilons:
            if steps == 0:
                epsilon = 0.0
            elif sigma == 0:
                epsilon = math.inf
            else:
                epsilon = accounting.epsilon_after_steps(
                    steps=steps,
                    num_examples=self.num_examples,
                    batch_size=batch_size,
                    noise_multiplier=sigma,
                    delta=self.delta,
                    accountant=self.accountant,
                )
            self._epsilons[key] = epsilon
        return self._epsilons[key]

    def _update_epsilon(self):
        sigma, batch_size = self._hyperparameters()
        self.epsilon = self._epsilon_at(self._steps_taken(), sigma, batch_size)
        return self.epsilon

    def _compute_max_steps(self, sigma, batch_size):
        key = (sigma, batch_size)
        if key not in self._max_steps:
            if sigma == 0:
                raise ValueError(
                    "Expected the optimizer's noise_multiplier=0.0 > 0 with"
                    f" target_epsilon={self.target_epsilon!r}: without noise"
                    " a single step has epsilon = inf."
                )
            self._max_steps[key] = accounting.calibrate_steps(
                target_epsilon=self.target_epsilon,
                num_examples=self.num_examples,
                batch_size=batch_size,
                noise_multiplier=sigma,
                delta=self.delta,
                accountant=self.accountant,
            )
        return self._max_steps[key]

    # ----------------------------------------------------------------------
    # Keras hooks.

    def on_train_begin(self, logs=None):
        sigma, batch_size = self._hyperparameters()
        steps = self._steps_taken()
        self.epsilon = self._epsilon_at(steps, sigma, batch_size)
        if self.target_epsilon is None:
            return
        steps_per_execution = getattr(self.model, "steps_per_execution", 1)
        if steps_per_execution != 1:
            raise ValueError(
                f"Expected steps_per_execution={steps_per_execution!r} == 1"
                " with target_epsilon: the callback can only stop training"
                " between executions."
            )
        self.max_steps = self._compute_max_steps(sigma, batch_size)
        if steps >= self.max_steps:
            raise RuntimeError(
                "The privacy budget is already spent: the optimizer has taken"
                f" {steps} steps (epsilon = {self.epsilon:.6g}), and"
                f" target_epsilon={self.target_epsilon!r} allows at most"
                f" {self.max_steps} steps; training would exceed it, so no"
                " step is taken."
            )

    def on_train_batch_end(self, batch, logs=None):
        steps = self._steps_taken()
        if logs is not None:
            sigma, batch_size = self._hyperparameters()
            self.epsilon = self._epsilon_at(steps, sigma, batch_size)
            logs["epsilon"] = self.epsilon
        if self.max_steps is not None and steps >= self.max_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        epsilon = self._update_epsilon()
        if logs is not None:
            logs["epsilon"] = epsilon

    def on_train_end(self, logs=None):
        self._update_epsilon()
