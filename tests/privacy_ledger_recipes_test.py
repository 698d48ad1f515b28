"""The recipes of issue 49: the epsilon printed is never below the honest one.

Each test runs one training recipe of the issue's table on a tiny private
model and checks that every epsilon the package prints (the `epsilon` that
`tf_dpadam.PrivacyBudget` logs in `History`, and `model.spent_epsilon`) is
at least the honest epsilon of what really ran, and that no epsilon printed
after a phase of the recipe is below one printed after an earlier phase.

The honest epsilon is computed here, independently of the package: the
steps are counted by a callback of this file (`_Steps`: the batches that
ended), never read from the model's ledger, and the events are built with
dp-accounting directly: `SelfComposedDpEvent(PoissonSampledDpEvent(q,
GaussianDpEvent(sigma)), T)` for T Poisson-sampled steps, and for fixed
batches the Gaussian mechanism of the example that took part the most,
`GaussianDpEvent(sigma / sqrt(S))` with S its participations (the steps
holding its batch), all composed by `ComposedDpEvent` and accounted by
dp-accounting's `PLDAccountant` (add-or-remove-one, value discretization
1e-3, delta = 1e-5), as the package's PLD accountant does: the two agree
to about 1e-12, and only a relative 1e-9 of rounding is tolerated.

Each row's check is a method `check_row_N` that raises `AssertionError`
when a printed epsilon is below the honest one. The last test drops the
ledger segment of one `fit` (`ModelLedger._close` patched to forget it)
and shows that the checks then fail: a hook that lowers epsilon cannot
pass this file."""

import math
import os
import tempfile
import typing
from unittest import mock

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadam
from tf_dpadam.training import model_ledger

# Each row trains and refits real models (3-20 s a row on 2 busy cores);
# the ledger's fast tests are tests/accounting/ledger_test.py and
# tests/training/model_ledger_test.py.
pytestmark = pytest.mark.slow

DELTA = 1e-5
SIGMA = 1.0
# Printed and honest epsilons are both PLD epsilons of the same kind of
# events (pessimistic, interval 1e-3), composed in different orders (the
# ledger merges equal segments first); only that rounding is tolerated.
_ROUNDING = 1e-9
_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


# ---------------------------------------------------------------------------
# The honest epsilon, from dp-accounting alone.

def poisson_event(q, steps, sigma=SIGMA):
    """T Poisson-subsampled Gaussian steps at rate q."""
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(sigma)), steps)


def fixed_batches_event(participations, sigma=SIGMA):
    """S participations of an example in fixed batches, no amplification:
    one Gaussian mechanism of multiplier sigma / sqrt(S)."""
    return dp_accounting.GaussianDpEvent(sigma / math.sqrt(participations))


def honest_epsilon(events):
    """PLD epsilon at `DELTA` of the composition of `events`."""
    accountant = dp_accounting.pld.PLDAccountant(
        _RELATION, value_discretization_interval=1e-3)
    accountant.compose(dp_accounting.ComposedDpEvent(list(events)))
    return float(accountant.get_epsilon(DELTA))


# ---------------------------------------------------------------------------
# Models, data and the independent step count.

def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 4)).astype("float32"),
            rng.integers(0, 2, size=n))


def _optimizer(kind, batch_size, learning_rate=0.05):
    cls = {"dpsgd": tf_dpadam.DPSGD, "dpadam": tf_dpadam.DPAdam,
           "corrected": tf_dpadam.DPAdamCorrected}[kind]
    return cls(l2_norm_clip=1.0, noise_multiplier=SIGMA,
               batch_size=batch_size, learning_rate=learning_rate)


def _compile(model, kind, batch_size, learning_rate=0.05):
    model.compile(
        optimizer=_optimizer(kind, batch_size, learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _private(kind, batch_size, layers=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = tf_dpadam.make_private(keras.Sequential(
        [keras.Input((4,))] + (layers or [keras.layers.Dense(2)])))
    return _compile(model, kind, batch_size)


class _Steps(keras.callbacks.Callback):
    """Counts the train batches that ended (here one batch = one logical
    step: no accumulation), over every `fit` it is passed to."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


class _Interrupt(keras.callbacks.Callback):
    """Raises at the end of one batch of one epoch, as a crash would."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self._epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self.at:
            raise KeyboardInterrupt("interrupted")


class Phase(typing.NamedTuple):
    """The epsilons printed after one phase of a recipe, and the honest."""

    what: str
    printed: tuple
    honest: float


def _budget(pld_log_every=None, **kwargs):
    """A `PrivacyBudget` at `DELTA`; `pld_log_every` (default: the
    class') spaces its exact epsilons at batch ends, not at epoch ends,
    where the `History` reads it: those are always exact."""
    budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0, **kwargs)
    if pld_log_every is not None:
        budget.pld_log_every = pld_log_every
    return budget


class PrivacyLedgerRecipesTest(parameterized.TestCase):
    """One test per row of the issue's table (see the module)."""

    def _covers(self, what, printed, honest):
        """Raises AssertionError if `printed` < `honest` (rounding aside)."""
        logging.info("%s: printed %.4f, honest %.4f", what, printed, honest)
        if not printed >= honest - _ROUNDING * max(1.0, honest):
            raise AssertionError(
                f"{what}: the package printed epsilon = {printed:.6g}, below"
                f" the honest epsilon {honest:.6g} of what ran")

    def _phase(self, model, history, events, what):
        """Checks the epsilons printed after one phase (`spent_epsilon`,
        and `PrivacyBudget`'s last logged one if `history` is given)
        against the honest epsilon of `events`, all that ran so far."""
        honest = honest_epsilon(events)
        printed = [model.spent_epsilon(DELTA)]
        self._covers(f"{what}: spent_epsilon", printed[0], honest)
        if history is not None:
            printed.append(history.history["epsilon"][-1])
            self._covers(f"{what}: PrivacyBudget's epsilon", printed[1],
                         honest)
        return Phase(what, tuple(printed), honest)

    def _never_decreases(self, phases):
        """Raises AssertionError if an epsilon printed after a phase is
        below one printed after an earlier phase."""
        for before, after in zip(phases, phases[1:]):
            if min(after.printed) < max(before.printed):
                raise AssertionError(
                    f"epsilon went down from {before.what} {before.printed}"
                    f" to {after.what} {after.printed}")

    # -- Row 1 and 2: Keras' transfer-learning recipe. ---------------------

    def _transfer_model(self):
        base = keras.layers.Dense(4, activation="tanh", name="base")
        base.trainable = False
        model = _private("dpadam", 32, [base, keras.layers.Dense(2)])
        return model, base

    def check_row_1(self):
        # N = 512, B = 32: fit 80 steps, unfreeze, compile a new DP
        # optimizer, fit 80 more.
        n, b = 512, 32
        x, y = _data(n)
        model, base = self._transfer_model()
        steps = _Steps()
        # Exact epsilons every 16 batches only (at every epoch end), not at
        # all 160: about 30 ms (and more) each.
        history = model.fit(x, y, epochs=5, verbose=0,
                            callbacks=[_budget(pld_log_every=16), steps])
        first = steps.count
        phases = [self._phase(model, history,
                              [poisson_event(b / n, first)], "row 1, fit")]
        base.trainable = True
        _compile(model, "corrected", b, learning_rate=1e-3)
        history = model.fit(x, y, epochs=5, verbose=0,
                            callbacks=[_budget(pld_log_every=16), steps])
        self.assertEqual((first, steps.count), (80, 160))
        phases.append(self._phase(
            model, history, [poisson_event(b / n, steps.count)],
            "row 1, unfrozen and recompiled"))
        self._never_decreases(phases)
        return phases

    def test_row_1_transfer_learning_recompiled(self):
        self.check_row_1()

    def check_row_2(self):
        # The same recipe with target_epsilon=3 in both phases: the total
        # stays within 3; the second phase refuses or stops at once.
        n, b, target = 512, 32, 3.0
        x, y = _data(n)
        model, base = self._transfer_model()
        steps = _Steps()
        history = model.fit(x, y, epochs=5, verbose=0, callbacks=[
            _budget(target_epsilon=target), steps])
        first = steps.count
        self.assertBetween(first, 1, 79)  # The budget stopped it.
        phases = [self._phase(model, history,
                              [poisson_event(b / n, first)], "row 2, fit")]
        base.trainable = True
        _compile(model, "corrected", b, learning_rate=1e-3)
        history = None
        try:
            history = model.fit(x, y, epochs=5, verbose=0, callbacks=[
                _budget(target_epsilon=target), steps])
        except RuntimeError as error:
            self.assertIn("privacy budget is already spent", str(error))
        total = steps.count
        phases.append(self._phase(
            model, history, [poisson_event(b / n, total)],
            "row 2, unfrozen and recompiled"))
        for phase in phases:
            self.assertLessEqual(max(phase.printed), target)
            self.assertLessEqual(phase.honest, target)
        # No step of the second phase beyond the budget: one more step of
        # the recipe's sampling would exceed it.
        self.assertGreater(
            honest_epsilon([poisson_event(b / n, total + 1)]), target)
        self._never_decreases(phases)
        return phases

    def test_row_2_target_epsilon_in_both_phases(self):
        self.check_row_2()

    # -- Row 3: shuffled epochs, then a Poisson epoch. ----------------------

    def check_row_3(self):
        n, b = 64, 8
        x, y = _data(n)
        model = _private("dpsgd", b)
        steps = _Steps()
        history = model.fit(x, y, batch_size=b, epochs=3, sampling="shuffled",
                            verbose=0, callbacks=[_budget(), steps])
        shuffled = steps.count
        # Every epoch is a pass: an example is in one batch per epoch.
        passes = math.ceil(shuffled / math.ceil(n / b))
        events = [fixed_batches_event(passes)]
        phases = [self._phase(model, history, events, "row 3, shuffled")]
        history = model.fit(x, y, epochs=1, verbose=0,
                            callbacks=[_budget(), steps])
        poisson = steps.count - shuffled
        self.assertEqual((shuffled, poisson, passes), (24, 8, 3))
        events.append(poisson_event(b / n, poisson))
        phases.append(self._phase(model, history, events,
                                  "row 3, then Poisson"))
        self._never_decreases(phases)
        return phases

    def test_row_3_shuffled_epochs_then_poisson(self):
        self.check_row_3()

    # -- Row 4: a user's tf.data pipeline of several passes. ---------------

    def check_row_4(self):
        n, b = 32, 8
        x, y = _data(n)
        model = _private("dpadam", b)
        dataset = (tf.data.Dataset.from_tensor_slices((x, y))
                   .shuffle(n, seed=0).batch(b).repeat(3))
        steps = _Steps()
        history = model.fit(dataset, epochs=1, verbose=0,
                            callbacks=[_budget(), steps])
        # Each pass of the shuffled dataset holds every example once.
        passes = math.ceil(steps.count * b / n)
        self.assertEqual((steps.count, passes), (12, 3))
        phase = self._phase(model, history, [fixed_batches_event(passes)],
                            "row 4, shuffle().batch().repeat(3)")
        return [phase]

    def test_row_4_user_dataset_repeated(self):
        self.check_row_4()

    # -- Row 5: Poisson batches through repeat().take(). -------------------

    def check_row_5(self, steps=300, budget=False):
        # `take` is not row-preserving for the plan detector
        # (`sampling._ROW_PRESERVING`): the model accounts every step as a
        # participation, which is above the honest Poisson epsilon.
        n, b = 64, 8
        x, y = _data(n)
        model = _private("corrected", b)
        batches = tf_dpadam.data.poisson_batches((x, y), expected_batch_size=b)
        counted = _Steps()
        history = model.fit(
            batches.dataset.repeat().take(steps), epochs=1, verbose=0,
            callbacks=[counted] + ([_budget()] if budget else []))
        self.assertEqual(counted.count, steps)
        phase = self._phase(model, history if budget else None,
                            [poisson_event(b / n, counted.count)],
                            f"row 5, poisson_batches.repeat().take({steps})")
        return [phase]

    def test_row_5_poisson_batches_repeat_take(self):
        self.check_row_5()

    def test_row_5_poisson_batches_repeat_take_with_privacy_budget(self):
        # The same with PrivacyBudget logging. In a fit of at most
        # `pld_log_every` batches it computes the exact epsilon at every
        # batch end, and with every step a participation that is the PLD of
        # a Gaussian of multiplier sigma / sqrt(T): about 0.1 s (T = 10) to
        # 1.8 s (T = 300) a batch on 2 cores, so 100 steps here, not 300.
        self.check_row_5(steps=100, budget=True)

    # -- Row 6: one fixed batch, fit again and again. ----------------------

    def check_row_6(self):
        n, b = 64, 8
        x, y = _data(n)
        model = _private("dpsgd", b)
        steps = _Steps()
        phases = []
        for fit in range(10):
            history = model.fit(x, y, batch_size=b, steps_per_epoch=1,
                                shuffle=False, sampling="shuffled",
                                verbose=0, callbacks=[_budget(), steps])
            # Rows 0 to 7 are in every step: S = the steps so far.
            self.assertEqual(steps.count, fit + 1)
            phases.append(self._phase(
                model, history, [fixed_batches_event(steps.count)],
                f"row 6, fit {fit + 1} of one unshuffled batch"))
        self._never_decreases(phases)
        return phases[-1:]

    def test_row_6_one_batch_ten_fits(self):
        self.check_row_6()

    # -- Row 7: save, load, recompile, train on. ---------------------------

    def check_row_7(self):
        n, b = 256, 16
        x, y = _data(n)
        model = _private("dpadam", b)
        steps = _Steps()
        history = model.fit(x, y, epochs=1, verbose=0,
                            callbacks=[_budget(), steps])
        first = steps.count
        phases = [self._phase(model, history, [poisson_event(b / n, first)],
                              "row 7, fit")]
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
        phases.append(self._phase(loaded, None, [poisson_event(b / n, first)],
                                  "row 7, loaded"))
        _compile(loaded, "dpadam", b, learning_rate=0.01)
        history = loaded.fit(x, y, epochs=1, verbose=0,
                             callbacks=[_budget(), steps])
        self.assertEqual((first, steps.count), (16, 32))
        phases.append(self._phase(
            loaded, history, [poisson_event(b / n, steps.count)],
            "row 7, loaded, recompiled, fit"))
        self._never_decreases(phases)
        return phases

    def test_row_7_save_load_recompile(self):
        self.check_row_7()

    # -- Row 8: a small data set, then a large one that contains it. -------

    def check_row_8(self):
        b = 32
        small, large = 256, 4096
        x, y = _data(large)
        model = _private("dpsgd", b)
        steps = _Steps()
        history = model.fit(x[:small], y[:small], epochs=4, verbose=0,
                            callbacks=[_budget(), steps])
        first = steps.count
        events = [poisson_event(b / small, first)]
        phases = [self._phase(model, history, events, "row 8, 256 rows")]
        history = model.fit(x, y, epochs=1, verbose=0,
                            callbacks=[_budget(), steps])
        second = steps.count - first
        self.assertEqual((first, second), (32, 128))
        # The first 256 rows took part in both phases.
        events.append(poisson_event(b / large, second))
        phases.append(self._phase(model, history, events,
                                  "row 8, 4096 rows holding them"))
        self._never_decreases(phases)
        return phases

    def test_row_8_small_then_large_data(self):
        self.check_row_8()

    # -- Row 9: BackupAndRestore rolls the weights back, not the privacy. --

    def check_row_9(self):
        n, b = 64, 8
        x, y = _data(n)
        model = _private("dpsgd", b)
        steps = _Steps()
        with tempfile.TemporaryDirectory() as folder:
            backup = keras.callbacks.BackupAndRestore(folder)
            with self.assertRaises(KeyboardInterrupt):
                model.fit(x, y, epochs=4, verbose=0, callbacks=[
                    _budget(), steps, backup, _Interrupt(epoch=2, batch=3)])
            interrupted = steps.count
            # Two epochs backed up, four steps of the third taken after.
            self.assertEqual(interrupted, 2 * 8 + 4)
            phases = [self._phase(model, None,
                                  [poisson_event(b / n, interrupted)],
                                  "row 9, interrupted")]
            history = model.fit(x, y, epochs=4, verbose=0, callbacks=[
                _budget(), steps, keras.callbacks.BackupAndRestore(folder)])
        resumed = steps.count - interrupted
        self.assertEqual(resumed, 2 * 8)  # Epochs 3 and 4 again.
        phases.append(self._phase(
            model, history, [poisson_event(b / n, steps.count)],
            "row 9, restored and finished"))
        self._never_decreases(phases)
        return phases

    def test_row_9_backup_and_restore(self):
        self.check_row_9()

    # -- Row 10: clone_model carries the ledger. ---------------------------

    def check_row_10(self):
        n, b = 64, 8
        x, y = _data(n)
        model = _private("dpsgd", b)
        steps = _Steps()
        model.fit(x, y, epochs=2, verbose=0, callbacks=[steps])
        clone = keras.models.clone_model(model)
        phase = self._phase(clone, None,
                            [poisson_event(b / n, steps.count)],
                            "row 10, clone_model")
        self.assertEqual(clone.spent_epsilon(DELTA),
                         model.spent_epsilon(DELTA))
        return [phase]

    def test_row_10_clone_model_carries_the_ledger(self):
        self.check_row_10()

    # -- Row 11: the suite catches a dropped segment. ----------------------

    @parameterized.named_parameters(
        ("row_3", "check_row_3"), ("row_9", "check_row_9"))
    def test_row_11_dropping_one_fits_segment_fails_the_check(self, check):
        closing = model_ledger.ModelLedger._close
        dropped = []

        def drop_first_segment(ledger):
            # The first segment with steps is forgotten instead of closed.
            opened = ledger._open
            if (not dropped and opened is not None
                    and ledger._count() > opened[2]):
                dropped.append(opened)
                ledger._open = None
                return
            closing(ledger)

        with mock.patch.object(model_ledger.ModelLedger, "_close",
                               drop_first_segment):
            with self.assertRaisesRegex(AssertionError, "below the honest"):
                getattr(self, check)()
        self.assertLen(dropped, 1)


if __name__ == "__main__":
    absltest.main()
