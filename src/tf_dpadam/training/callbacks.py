"""A Keras callback that reports, and can cap, the privacy spent in training.

`PrivacyBudget` reads one thing: the private model's privacy ledger
(`model.privacy_ledger`, `tf_dpadam.accounting.ledger`), which the model's
train step writes and every save and checkpoint carries. Every epsilon it
logs is the composition of that ledger, so it never decreases on one model,
whatever was recompiled, refit, saved, loaded or restored in between.
"""

import dataclasses
import math

import keras

from tf_dpadam.accounting import accountants
from tf_dpadam.accounting import plans
from tf_dpadam.common import validation


class PrivacyBudget(keras.callbacks.Callback):
    """Logs epsilon every epoch and optionally stops training at a budget.

    The epsilon is that of the private model's privacy ledger
    (`model.privacy_ledger`): every logical DP step the model ever took,
    counted by its train step, each with the mechanism it ran under, composed
    by dp-accounting (`tf_dpadam.accounting.ledger`). A mechanism is:

    * tf_dpadam's Poisson batches (the default of `fit` on in-memory data,
      `tf_dpadam.data.poisson_batches`, `poisson_batches_from_source`,
      `sharding.sharded_poisson_batches`): Poisson sampling at q = B / N with
      Gaussian noise of multiplier sigma (amplification by subsampling);
    * `fit(..., sampling="shuffled")` on in-memory data: fixed batches, each
      pass over the data one Gaussian mechanism per example, passes counted
      from the start of each `fit`;
    * anything else (a `tf.data.Dataset` of your own, a `PyDataset`, a
      generator, `train_on_batch`): no amplification, and every step a
      Gaussian mechanism on every example (nothing says which rows a batch
      of such data holds).

    Steps taken under earlier `compile`s, `fit`s, optimizers, datasets or
    processes (a loaded model, a resumed checkpoint) are composed with the
    current ones, never re-accounted at the current rate. At the start of
    training one line (with `verbose=1`) says which accounting applies and,
    for data that could have been Poisson-sampled, the epsilon Poisson
    sampling would have given.

    At the end of every batch and every epoch it sets `logs["epsilon"]`, so
    epsilon shows in the live progress bar (`verbose=1`), the `History`,
    `TensorBoard` (`batch_epsilon` with an integer `update_freq`, and
    `epoch_epsilon`), `CSVLogger` and so on. The epsilon of an epoch end
    and of the end of training is exact. With the PLD accountant (the
    default), an exact epsilon costs about 10 to 100 ms (Poisson sampling,
    sigma = 1 down to 0.3; more for a ledger of several mechanisms), so in
    a fit of more than `pld_log_every` (100)
    batches it is computed at a batch end only at multiples of
    `pld_log_every` steps (past 2,000 steps, of the largest multiple of it
    within 5% of the steps); between them the batch logs show the epsilon
    of the next multiple (or of `max_steps`), an upper bound, since epsilon
    grows with T. The stop at `target_epsilon` does not depend on it (see
    below). If delta >= 1/N for a known N it warns once
    (`tf_dpadam.common.validation.LargeDeltaWarning`, a `UserWarning`).
    Keras' `CallbackList` passes one logs dict to every callback in list
    order and appends its own `History` and `ProgbarLogger` after the user's
    callbacks, so these two always see epsilon. A callback of yours that reads
    the epoch logs (`TensorBoard`, `CSVLogger`, `EarlyStopping`, ...) sees it
    only if it comes after `PrivacyBudget`: put `PrivacyBudget` first.

    With `target_epsilon`, `on_train_begin` computes once the largest total
    T of the ledger's steps such that the ledger plus the steps of this
    `fit` stays within target_epsilon (`Ledger.max_more_steps`), and
    `on_train_batch_end` sets `model.stop_training = True` as soon as the
    ledger reaches it, so no step beyond the budget is taken. The budget is
    the model's, not the `fit`'s: a second `fit`, a new `compile` or a
    loaded model continue from what was spent. If the budget is already
    spent when training begins, `on_train_begin` raises before any step,
    and so does `on_train_batch_begin`. The stop is exact only with
    `steps_per_execution=1`, which the callback then requires.

    Attributes:
        epsilon: The last epsilon computed (None before training begins).
        max_steps: The ledger's step budget for `target_epsilon` (None
            without one).
        plan: The sampling plan of the running `fit` (None before training
            begins).
    """

    # With PLD and Poisson sampling, the batch logs' epsilon is exact every
    # this many steps (see the class docstring).
    pld_log_every = 100

    def __init__(
        self,
        num_examples: int | None = None,
        delta: float | None = None,
        target_epsilon: float | None = None,
        accountant: str = "pld",
        batch_size: int | None = None,
        verbose: int = 1,
    ) -> None:
        """Creates the callback.

        Args:
            num_examples: N, the number of training examples (> 0), or None
                to take it from the data (`fit` knows it for in-memory data
                and tf_dpadam's Poisson pipelines). A value that disagrees
                with the data `fit` knows is an error.
            delta: The delta of the (epsilon, delta) guarantee, in (0, 1).
            target_epsilon: Optional budget epsilon > 0; training stops before
                the first step that would exceed it.
            accountant: "pld" (default, the tighter) or "rdp" (see
                `tf_dpadam.accounting`).
            batch_size: The logical batch size, used only when the
                optimizer's `batch_size` is None, to compare with Poisson
                sampling.
            verbose: 1 (default) prints the accounting line when training
                starts (once per plan, not at every `fit` call); 0 does
                not.

        Raises:
            ValueError: if an argument is out of range.
        """
        super().__init__()
        if num_examples is not None:
            validation.check_positive_int("num_examples", num_examples)
            if batch_size is not None:
                validation.check_sizes("num_examples", num_examples,
                                       batch_size)
        elif batch_size is not None:
            validation.check_positive_int("batch_size", batch_size)
        if delta is None:
            raise ValueError("Expected delta=None to be a number in (0, 1).")
        validation.check_delta(delta)
        if target_epsilon is not None:
            validation.check_positive_real("target_epsilon", target_epsilon)
        accountants.get_accountant(accountant)
        validation.check(verbose in (0, 1), "verbose", verbose, "0 or 1")
        self.num_examples = None if num_examples is None else int(num_examples)
        self.delta = float(delta)
        self.target_epsilon = (
            None if target_epsilon is None else float(target_epsilon)
        )
        self.accountant = accountant
        self.batch_size = None if batch_size is None else int(batch_size)
        self.verbose = verbose
        self.epsilon = None
        self.max_steps = None
        self.plan = None
        self._announced = None
        # The ledger's steps when `max_steps` was last checked against it.
        self._budgeted_steps = None
        self._max_steps = {}  # (ledger, mechanism) -> max_steps.
        if self.num_examples is not None:
            validation.warn_large_delta(self.delta, self.num_examples)

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

    def _ledger_model(self):
        """The private model, which owns the ledger."""
        if not hasattr(self.model, "privacy_ledger"):
            raise ValueError(
                f"PrivacyBudget accounts the privacy ledger of a private"
                f" model, and {type(self.model).__name__} has none: wrap the"
                " model with tf_dpadam.make_private(model) and compile it"
                " with a tf_dpadam DP optimizer."
            )
        return self.model

    def _read_plan(self):
        """The running fit's sampling plan, checked against
        `num_examples`."""
        optimizer = self._dp_optimizer()
        k = getattr(optimizer, "dp_accumulation_steps", 1)
        plan = getattr(self.model, "_fit_plan", None) or getattr(
            self.model, "sampling_plan", None)
        if plan is None:
            plan = plans.FixedBatchesPlan("data of unknown sampling", None, k)
        denominator = getattr(optimizer, "batch_size", None)
        if (self.batch_size is not None and denominator is not None
                and self.batch_size != denominator):
            raise ValueError(
                f"Expected batch_size={self.batch_size!r} to be None or equal"
                f" to the optimizer's batch_size={denominator!r}."
            )
        n = self.num_examples
        if plan.num_examples is not None:
            if n is not None and n != plan.num_examples:
                raise ValueError(
                    f"Expected num_examples={n!r} to equal the"
                    f" {plan.num_examples} examples that fit trains on (after"
                    " validation_split, if any): the accounting needs the N"
                    " the batches are sampled from. Leave num_examples=None"
                    " to take it from the data."
                )
        elif n is not None:
            logical = getattr(optimizer, "batch_size", None) or self.batch_size
            plan = dataclasses.replace(plan, num_examples=n,
                                       logical_batch_size=logical)
        if self.num_examples is None and plan.num_examples is not None:
            validation.warn_large_delta(self.delta, plan.num_examples)
        return plan

    def _ledger(self):
        return self._ledger_model().privacy_ledger

    def _steps_taken(self):
        """The steps in the model's ledger (all its DP steps, ever)."""
        return self._ledger().steps

    def _mechanism(self):
        return self._ledger_model().ledger_mechanism()

    def _batch_epsilon(self, ledger):
        """The epsilon logged at a batch end: exact, except with PLD in a
        fit of more than `pld_log_every` batches, where it is exact at
        multiples of `every` steps of the ledger and between them the
        epsilon of the ledger with the running mechanism's steps up to the
        next multiple (or to `max_steps`), an upper bound. `every` is
        `pld_log_every`, or the largest multiple of it within 5% of the
        steps taken (500 at 10,000 steps), so that the exact epsilons,
        whose cost grows with the steps, stay a small share of a step."""
        every = self.pld_log_every
        params = self.params or {}
        batches = (params.get("steps") or math.inf) * (params.get("epochs")
                                                       or 1)
        if (not accountants.get_accountant(self.accountant).costly
                or batches <= every):
            return ledger.epsilon(self.delta, self.accountant)
        steps = ledger.steps
        every *= max(1, steps // (20 * every))
        ahead = -(-steps // every) * every
        if self.max_steps is not None and steps <= self.max_steps:
            ahead = min(ahead, self.max_steps)
        return ledger.with_steps(self._mechanism(), ahead - steps).epsilon(
            self.delta, self.accountant)

    def _update_epsilon(self):
        self.epsilon = self._ledger().epsilon(self.delta, self.accountant)
        return self.epsilon

    def _compute_max_steps(self):
        """The ledger's total steps within `target_epsilon`, the rest of
        them taken with the running fit's mechanism."""
        mechanism = self._mechanism()
        if mechanism.noise_multiplier == 0:
            raise ValueError(
                "Expected the optimizer's noise_multiplier=0.0 > 0 with"
                f" target_epsilon={self.target_epsilon!r}: without noise"
                " a single step has epsilon = inf."
            )
        ledger = self._ledger()
        key = (ledger, mechanism)
        if key not in self._max_steps:
            more = ledger.max_more_steps(
                mechanism, self.target_epsilon, self.delta, self.accountant)
            if more == 0 and ledger.steps == 0:
                # Nothing is spent: the target is below a single step's
                # epsilon, an argument error (not "already spent").
                one = ledger.with_steps(mechanism, 1).epsilon(
                    self.delta, self.accountant)
                raise ValueError(
                    f"Expected target_epsilon={self.target_epsilon!r} >="
                    f" {one!r}, the epsilon of a single step (the smallest"
                    f" epsilon reachable with {mechanism.describe()} and"
                    f" delta={self.delta!r})."
                )
            self._max_steps[key] = ledger.steps + more
        return self._max_steps[key]

    def accounting_line(self, planned_steps=None):
        """The line printed at the start of training; `planned_steps` is
        the number of steps of this fit, if known."""
        mechanism = self._mechanism()
        ledger = self._ledger()
        line = f"PrivacyBudget: epsilon accounts {mechanism.describe()}."
        if ledger.steps:
            line += (f" Composed with the {ledger.steps} steps this model took"
                     " before (epsilon ="
                     f" {ledger.epsilon(self.delta, self.accountant):.4g}).")
        alternative = getattr(self.plan, "poisson_alternative", None)
        alternative = alternative() if alternative else None
        sigma = mechanism.noise_multiplier
        if alternative is not None and planned_steps and sigma > 0:
            fixed = ledger.with_steps(mechanism, planned_steps).epsilon(
                self.delta, self.accountant)
            poisson = ledger.with_steps(
                alternative.mechanism(sigma), planned_steps).epsilon(
                    self.delta, self.accountant)
            line += (
                f" After {planned_steps} more steps: epsilon = {fixed:.4g};"
                f" Poisson sampling of the same data (fit's default on"
                f" in-memory data) would give {poisson:.4g}."
            )
        return line

    # ----------------------------------------------------------------------
    # Keras hooks.

    def on_train_begin(self, logs=None):
        self._ledger_model()
        self._dp_optimizer()
        self.plan = self._read_plan()
        self._update_epsilon()
        mechanism = self._mechanism()
        if self.verbose and mechanism != self._announced:
            self._announced = mechanism  # Once, not at every fit call.
            params = self.params or {}
            per_epoch, epochs = params.get("steps"), params.get("epochs")
            planned = None
            if per_epoch and epochs:
                k = getattr(self._dp_optimizer(), "dp_accumulation_steps", 1)
                planned = math.ceil(per_epoch * epochs / k)
            print(self.accounting_line(planned), flush=True)
        if self.target_epsilon is None:
            return
        steps_per_execution = getattr(self.model, "steps_per_execution", 1)
        if steps_per_execution != 1:
            raise ValueError(
                f"Expected steps_per_execution={steps_per_execution!r} == 1"
                " with target_epsilon: the callback can only stop training"
                " between executions."
            )
        self.max_steps = self._compute_max_steps()
        self._budgeted_steps = self._steps_taken()
        self._refuse_if_spent(self._budgeted_steps)

    def _refuse_if_spent(self, steps):
        """Raises before a step if the budget's `max_steps` are taken."""
        if steps >= self.max_steps:
            self._update_epsilon()
            raise RuntimeError(
                "The privacy budget is already spent: the model has taken"
                f" {steps} DP steps (epsilon = {self.epsilon:.6g}, its"
                f" privacy ledger), and target_epsilon={self.target_epsilon!r}"
                f" allows at most {self.max_steps} with this fit's sampling;"
                " training would exceed it, so no step is taken."
            )

    def on_train_batch_begin(self, batch, logs=None):
        # Again before every batch: a callback after this one may change
        # the model, and Keras checks `stop_training` only after a batch.
        if self.max_steps is not None:
            steps = self._steps_taken()
            if steps != self._budgeted_steps:
                # Not this fit's steps: a callback after this one loaded a
                # ledger (BackupAndRestore), maybe of other mechanisms,
                # which a count of steps does not bound. Budget it again.
                self.max_steps = self._compute_max_steps()
                self._budgeted_steps = steps
            self._refuse_if_spent(steps)

    def on_train_batch_end(self, batch, logs=None):
        ledger = self._ledger()
        steps = ledger.steps
        self._budgeted_steps = steps
        if logs is not None:
            self.epsilon = self._batch_epsilon(ledger)
            logs["epsilon"] = self.epsilon
        if self.max_steps is not None and steps >= self.max_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        epsilon = self._update_epsilon()
        if logs is not None:
            logs["epsilon"] = epsilon

    def on_train_end(self, logs=None):
        self._update_epsilon()
