"""Tests of tf_dpadam.training.callbacks.PrivacyBudget on private models (issue 49).

`PrivacyBudget` reads one thing: the private model's privacy ledger, which
the model's train step writes (one count per logical step, where the noise
is drawn) and every `fit` segments by its sampling. So these tests train
real private models (`tf_dpadam.make_private` of a one-layer model,
compiled with `tf_dpadam.DPSGD`) on in-memory arrays, which `fit` samples
by Poisson at q = B / N unless a test says otherwise; the steps a test
expects are counted here (`_Recorder`: the batches that ended), never taken
from the ledger alone.

Every expected epsilon is computed independently of the ledger:
`tf_dpadam.accounting.epsilon_after_steps` for T Poisson steps at q = B / N
(as before the ledger), and dp-accounting's `PLDAccountant` (value
discretization 1e-3, as tf_dpadam's) on the composed events where the
ledger composes several mechanisms.
"""

import contextlib
import io
import math
import os
import re
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadam
from tf_dpadam import accounting
from tf_dpadam.training import callbacks
from tf_dpadam.common import validation

N = 64  # Examples; with an expected batch of B = 8 an epoch is 8 steps.
B = 8
SIGMA = 1.0
DELTA = 1e-5


# ---------------------------------------------------------------------------
# Independent epsilons.

def _eps(steps, accountant="pld", num_examples=N):
    """T Poisson steps at q = B / N (PrivacyBudget's default accountant)."""
    return accounting.epsilon_after_steps(
        steps=steps,
        num_examples=num_examples,
        batch_size=B,
        noise_multiplier=SIGMA,
        delta=DELTA,
        accountant=accountant,
    )


def _poisson_event(q, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(SIGMA)), steps)


def _pld_epsilon(events):
    """dp-accounting's PLD epsilon at DELTA of the composition of
    `events`, with tf_dpadam's value discretization."""
    pld = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=(
            accounting.PLD_VALUE_DISCRETIZATION_INTERVAL))
    pld.compose(dp_accounting.ComposedDpEvent(list(events)))
    return float(pld.get_epsilon(DELTA))


# ---------------------------------------------------------------------------
# Models, data and the independent step count.

def _optimizer(batch_size=B, learning_rate=0.01):
    return tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=SIGMA,
                           batch_size=batch_size, learning_rate=learning_rate)


def _base_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def _private_model(optimizer=None, **compile_kwargs):
    # Without the first batch's independence check (1 to 2 s a model on
    # 2 cores; tested in independence_rows_test.py): the steps, the ledger and
    # its epsilon are the same.
    model = tf_dpadam.make_private(_base_model(), check_independence=False)
    model.compile(optimizer=optimizer or _optimizer(), loss="mse",
                  **compile_kwargs)
    return model


def _data(n=N):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, 3)).astype("float32"),
        rng.normal(size=(n, 1)).astype("float32"),
    )


def _fit(model, callback_list, epochs, n=N, **kwargs):
    """fit on the first n examples (Poisson batches unless `sampling`)."""
    x, y = _data()
    return model.fit(x[:n], y[:n], epochs=epochs, verbose=0,
                     callbacks=callback_list, **kwargs)


def _printed(function):
    """What `function` prints (the callback's accounting line), and its
    result."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = function()
    return out.getvalue(), result


class _Recorder(keras.callbacks.Callback):
    """Counts the batches that ended (the steps taken, independently of the
    ledger), and records the keys of the epoch logs it sees and the batch
    and epoch logs' epsilon (None where absent)."""

    def __init__(self):
        super().__init__()
        self.batches = 0
        self.keys = []
        self.batch_epsilons = []
        self.epoch_epsilons = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        self.batch_epsilons.append((logs or {}).get("epsilon"))

    def on_epoch_end(self, epoch, logs=None):
        self.keys.append(sorted(logs))
        self.epoch_epsilons.append(logs.get("epsilon"))


def _tempdir(test):
    path = tempfile.mkdtemp()
    test.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def _ledger_steps(model):
    return model.privacy_ledger.steps


def _iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class PrivacyBudgetTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_epsilon_in_history_and_later_callbacks(self):
        # Two budgets in one fit, RDP then PLD: the logs dict is shared in
        # list order, so each callback sees the epsilon of the last budget
        # before it, and the History (after every callback) PLD's.
        model = _private_model()
        before = _Recorder()
        after_rdp = _Recorder()
        after = _Recorder()
        folder = _tempdir(self)
        csv_path = os.path.join(folder, "log.csv")
        board = keras.callbacks.TensorBoard(
            os.path.join(folder, "board"), update_freq=1, write_graph=False)
        rdp = callbacks.PrivacyBudget(N, DELTA, accountant="rdp", verbose=0)
        budget = callbacks.PrivacyBudget(N, DELTA, verbose=0)  # PLD.
        history = _fit(model, [before, rdp, after_rdp, budget, after, board,
                               keras.callbacks.CSVLogger(csv_path)],
                       epochs=2)
        steps = 2 * N // B
        self.assertEqual(after.batches, steps)
        self.assertEqual(_ledger_steps(model), steps)
        # Exactly dp-accounting's PLD of SelfComposed(PoissonSampled(q,
        # Gaussian(sigma)), T).
        self.assertEqual(_eps(steps),
                         _pld_epsilon([_poisson_event(B / N, steps)]))
        for accountant, callback, recorder in (("rdp", rdp, after_rdp),
                                               ("pld", budget, after)):
            expected = [_eps(steps // 2, accountant), _eps(steps, accountant)]
            self.assertEqual(recorder.epoch_epsilons, expected)
            self.assertEqual(callback.epsilon, expected[-1])
            self.assertEqual(model.spent_epsilon(DELTA, accountant),
                             expected[-1])
            self.assertIsNone(callback.max_steps)
            # Every batch's logs too (the live progress bar, TensorBoard's
            # batch_epsilon): epsilon after the steps taken so far.
            self.assertEqual(
                recorder.batch_epsilons,
                [_eps(t, accountant) for t in range(1, steps + 1)])
        expected = after.epoch_epsilons
        self.assertEqual(history.history["epsilon"], expected)
        self.assertLess(expected[-1], after_rdp.epoch_epsilons[-1])
        # Callbacks before the budgets do not see epsilon.
        self.assertNotIn("epsilon", before.keys[0])
        self.assertEqual(before.batch_epsilons, [None] * steps)
        # CSVLogger and TensorBoard after the budget write PLD's.
        with open(csv_path) as f:
            header, *rows = [line.strip().split(",") for line in f]
        column = header.index("epsilon")
        self.assertEqual([float(row[column]) for row in rows], expected)
        written = {}
        for path in tf.io.gfile.glob(
                os.path.join(folder, "board", "train", "*")):
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                for value in event.summary.value:
                    written.setdefault(value.tag, []).append(
                        float(tf.make_ndarray(value.tensor)))
        # Summaries are float32.
        self.assertSequenceAlmostEqual(written["epoch_epsilon"], expected,
                                       delta=1e-5)
        self.assertSequenceAlmostEqual(
            written["batch_epsilon"], after.batch_epsilons, delta=1e-5)

    def test_shuffled_fixed_batches_account_passes_without_amplification(self):
        # 8 batches a pass, 2 epochs: 16 steps, 2 passes, each a Gaussian
        # mechanism of multiplier sigma on every example.
        model = _private_model()
        budget = callbacks.PrivacyBudget(N, DELTA)
        printed, history = _printed(lambda: _fit(
            model, [budget], epochs=2, batch_size=B, sampling="shuffled"))
        expected = [
            _pld_epsilon([dp_accounting.GaussianDpEvent(
                SIGMA / math.sqrt(passes))])
            for passes in (1, 2)
        ]
        self.assertEqual(history.history["epsilon"], expected)
        self.assertGreater(expected[1], _eps(16))
        # The accounting line, once when training starts, compares with
        # Poisson sampling of the same N and B.
        self.assertEqual(printed.count("PrivacyBudget:"), 1)
        self.assertIn("shuffled fixed batches, no amplification", printed)
        self.assertIn("(8 batches a pass)", printed)
        self.assertIn(
            f"After 16 more steps: epsilon = {expected[1]:.4g}; Poisson"
            " sampling of the same data (fit's default on in-memory data)"
            f" would give {_eps(16):.4g}.", printed)

    @pytest.mark.slow
    def test_user_pipeline_accounts_every_step_and_uses_batch_size(self):
        # A tf.data pipeline of the user's: nothing says which rows a batch
        # holds, so each of the 8 steps is a Gaussian mechanism on every
        # example (S = 8). The callback's N and B (the optimizer divides by
        # each batch's size) make the comparison with Poisson sampling.
        model = _private_model(_optimizer(batch_size=None))
        x, y = _data()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
        budget = callbacks.PrivacyBudget(N, DELTA, batch_size=B)
        printed, history = _printed(lambda: model.fit(
            dataset, epochs=1, verbose=0, shuffle=False, callbacks=[budget]))
        expected = _pld_epsilon(
            [dp_accounting.GaussianDpEvent(SIGMA / math.sqrt(8))])
        self.assertEqual(history.history["epsilon"], [expected])
        self.assertIn("a tf.data.Dataset, no amplification", printed)
        self.assertIn(f"would give {_eps(8):.4g}.", printed)

    def test_poisson_fit_needs_the_optimizers_batch_size(self):
        # fit's own check now, before the callback and any step.
        model = _private_model(_optimizer(batch_size=None))
        budget = callbacks.PrivacyBudget(N, DELTA, batch_size=B, verbose=0)
        with self.assertRaisesRegex(ValueError, "batch_size=None"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_ledger_steps(model), 0)

    def test_conflicting_batch_size_raises(self):
        model = _private_model()
        budget = callbacks.PrivacyBudget(N, DELTA, batch_size=2 * B)
        with self.assertRaisesRegex(
                ValueError, "batch_size=16 to be None or equal to the"
                " optimizer's batch_size=8"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_ledger_steps(model), 0)

    def test_conflicting_num_examples_raises(self):
        model = _private_model()
        budget = callbacks.PrivacyBudget(2 * N, DELTA)
        with self.assertRaisesRegex(
                ValueError, "num_examples=128 to equal the 64 examples"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_ledger_steps(model), 0)

    def test_target_below_one_step_raises_before_training(self):
        model = _private_model()
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=_eps(1) / 2,
                                         verbose=0)
        # An argument error on a model that spent nothing, naming the
        # epsilon of one step.
        with self.assertRaisesRegex(
                ValueError, re.escape(f">= {_eps(1)!r}, the epsilon of a"
                                      " single step")):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_ledger_steps(model), 0)

    @pytest.mark.slow
    def test_loss_scale_wrapper_is_looked_through(self):
        # Under "mixed_float16" Keras wraps the DP optimizer in a
        # LossScaleOptimizer at compile; the private model applies float32
        # privatized gradients through the DP optimizer itself, and its
        # steps are accounted as any others.
        policy = keras.mixed_precision.global_policy()
        self.addCleanup(keras.mixed_precision.set_global_policy, policy)
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = _private_model()
        self.assertIsInstance(model.optimizer, tf_dpadam.DPSGD)
        history = _fit(model, [callbacks.PrivacyBudget(N, DELTA, verbose=0)],
                       epochs=1)
        self.assertEqual(history.history["epsilon"], [_eps(N // B)])
        # And a wrapper the callback meets around the DP optimizer is
        # looked through, to its noise_multiplier.
        budget = callbacks.PrivacyBudget(N, DELTA)
        budget.set_model(model)
        model.optimizer = keras.optimizers.LossScaleOptimizer(model.optimizer)
        self.assertIs(budget._dp_optimizer(),
                      model.optimizer.inner_optimizer)

    @parameterized.named_parameters(
        ("sgd", lambda: keras.optimizers.SGD()),
        ("dp_optimizer", _optimizer),
    )
    def test_model_without_a_ledger_raises_naming_make_private(
            self, optimizer):
        # A plain Keras model has no privacy ledger, whatever its optimizer
        # (even a DP one): nothing counts its steps where the noise is drawn.
        model = _base_model()
        model.compile(optimizer=optimizer(), loss="mse")
        with self.assertRaisesRegex(ValueError, r"tf_dpadam\.make_private"):
            _fit(model, [callbacks.PrivacyBudget(N, DELTA)], epochs=1,
                 batch_size=B)
        self.assertEqual(_iterations(model), 0)

    def test_steps_per_execution_with_target_raises(self):
        model = _private_model(steps_per_execution=2)
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=5.0,
                                         verbose=0)
        with self.assertRaisesRegex(
                ValueError, "steps_per_execution=2 == 1 with target_epsilon"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_ledger_steps(model), 0)

    def test_large_delta_warns(self):
        # delta >= 1/N: at construction with N given ...
        with self.assertWarns(validation.LargeDeltaWarning):
            callbacks.PrivacyBudget(N, 1 / N)
        # ... and when training begins with N taken from the data (here
        # before a target below one step stops the fit: no step needed).
        model = _private_model()
        budget = callbacks.PrivacyBudget(delta=2 / N, target_epsilon=1e-3,
                                         verbose=0)
        with self.assertWarns(validation.LargeDeltaWarning):
            with self.assertRaisesRegex(ValueError, "target_epsilon"):
                _fit(model, [budget], epochs=1)
        self.assertEqual(_ledger_steps(model), 0)

    @parameterized.named_parameters(
        ("num_examples", dict(num_examples=0, delta=DELTA), "num_examples=0"),
        ("delta", dict(num_examples=N, delta=1.0), "delta=1.0"),
        ("no_delta", dict(num_examples=N), "delta=None"),
        (
            "target_epsilon",
            dict(num_examples=N, delta=DELTA, target_epsilon=-1.0),
            "target_epsilon=-1.0",
        ),
        (
            "accountant",
            dict(num_examples=N, delta=DELTA, accountant="prv"),
            "accountant='prv'",
        ),
        (
            "batch_size",
            dict(num_examples=N, delta=DELTA, batch_size=N + 1),
            "batch_size=65",
        ),
        ("verbose", dict(delta=DELTA, verbose=2), "verbose=2"),
    )
    def test_invalid_arguments(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, message):
            callbacks.PrivacyBudget(**kwargs)


class BudgetOfTheModelTest(absltest.TestCase):
    """Issue 49: the budget is the model's ledger's, not one fit's."""

    @pytest.mark.slow
    def test_target_epsilon_across_a_recompile(self):
        target = _eps(13)
        model = _private_model()
        first = _Recorder()
        _fit(model, [callbacks.PrivacyBudget(N, DELTA, target_epsilon=target,
                                             verbose=0), first], epochs=1)
        self.assertEqual(first.batches, 8)  # Within the budget.
        # A new DP optimizer starts at iteration 0; the ledger keeps the 8
        # steps, and the second fit takes only the 5 the budget has left.
        model.compile(optimizer=_optimizer(learning_rate=0.05), loss="mse")
        self.assertEqual(_iterations(model), 0)
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target,
                                         verbose=0)
        second = _Recorder()
        history = _fit(model, [budget, second], epochs=5)
        self.assertEqual(budget.max_steps, 13)
        self.assertEqual(second.batches, 5)
        self.assertEqual(_iterations(model), 5)
        self.assertEqual(_ledger_steps(model), 13)
        self.assertEqual(second.batch_epsilons,
                         [_eps(t) for t in range(9, 14)])
        self.assertEqual(history.history["epsilon"], [_eps(13)])
        self.assertLessEqual(budget.epsilon, target)

        # Spent: after yet another compile, a fit raises before any step.
        model.compile(optimizer=_optimizer(), loss="mse")
        with self.assertRaisesRegex(RuntimeError, "already spent"):
            _fit(model, [budget, second], epochs=1)
        self.assertEqual(second.batches, 5)
        self.assertEqual(_ledger_steps(model), 13)
        self.assertEqual(budget.epsilon, _eps(13))

    @pytest.mark.slow
    def test_resume_from_saved_model_continues_the_ledger(self):
        model = _private_model()
        target = _eps(30)
        history = _fit(
            model,
            [callbacks.PrivacyBudget(N, DELTA, target_epsilon=target,
                                     verbose=0)],
            epochs=2,
        )
        self.assertEqual(history.history["epsilon"], [_eps(8), _eps(16)])
        path = os.path.join(_tempdir(self), "model.keras")
        model.save(path)
        restored = keras.models.load_model(path)
        self.assertIsInstance(restored.optimizer, tf_dpadam.DPSGD)
        self.assertEqual(restored.optimizer.noise_multiplier, SIGMA)
        self.assertEqual(restored.optimizer.batch_size, B)
        # The ledger of the file (in its config and its weights: one
        # history, counted once).
        self.assertEqual(_ledger_steps(restored), 16)
        self.assertEqual(restored.spent_epsilon(DELTA), _eps(16))

        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target,
                                         verbose=0)
        steps = _Recorder()
        history = _fit(restored, [budget, steps], epochs=4, initial_epoch=2)
        # Steps 17..24 in epoch 3, then the stop at 30 in epoch 4.
        self.assertEqual(history.history["epsilon"], [_eps(24), _eps(30)])
        self.assertEqual(steps.batches, 14)
        self.assertEqual(_ledger_steps(restored), 30)
        self.assertEqual(budget.max_steps, 30)
        self.assertEqual(_ledger_steps(model), 16)  # The original's own.

    @pytest.mark.slow
    def test_epsilon_never_decreases_across_fits(self):
        # Poisson on all 64 examples (q = 1/8), then Poisson on a subset of
        # 32 (q = 1/4), then shuffled fixed batches of all 64: each fit's
        # steps are composed with the earlier ones, never re-accounted at
        # the current N.
        model = _private_model()
        budget = callbacks.PrivacyBudget(delta=DELTA)  # N from the data.
        logs = _Recorder()
        printed, history = _printed(lambda: _fit(model, [budget, logs],
                                                 epochs=1))
        epochs = history.history["epsilon"]
        self.assertEqual(epochs, [_eps(8)])
        self.assertIn("q = B/N = 8/64", printed)

        printed, history = _printed(lambda: _fit(model, [budget, logs],
                                                 epochs=1, n=N // 2))
        epochs += history.history["epsilon"]
        self.assertEqual(logs.batches, 8 + 4)  # ceil(32 / 8) more steps.
        self.assertIn("q = B/N = 8/32", printed)
        self.assertIn(
            f"Composed with the 8 steps this model took before (epsilon ="
            f" {_eps(8):.4g}).", printed)
        composed = _pld_epsilon([_poisson_event(B / N, 8),
                                 _poisson_event(B / (N // 2), 4)])
        self.assertAlmostEqual(epochs[-1], composed, delta=1e-9)
        # Not the 12 steps re-accounted at either rate.
        self.assertLess(epochs[-1], _eps(12, num_examples=N // 2))
        self.assertGreater(epochs[-1], _eps(12))

        _, history = _printed(lambda: _fit(
            model, [budget, logs], epochs=1, batch_size=B,
            sampling="shuffled"))
        epochs += history.history["epsilon"]
        self.assertEqual(logs.batches, 8 + 4 + 8)
        self.assertEqual(_ledger_steps(model), 20)
        composed = _pld_epsilon([_poisson_event(B / N, 8),
                                 _poisson_event(B / (N // 2), 4),
                                 dp_accounting.GaussianDpEvent(SIGMA)])
        self.assertAlmostEqual(epochs[-1], composed, delta=1e-9)
        self.assertEqual(model.spent_epsilon(DELTA), epochs[-1])

        # Every batch and epoch log of the three fits, in order.
        self.assertEqual(logs.batch_epsilons, sorted(logs.batch_epsilons))
        self.assertEqual(epochs, sorted(epochs))
        self.assertLess(epochs[0], epochs[1])
        self.assertLess(epochs[1], epochs[2])


class BudgetAcrossRestartsTest(absltest.TestCase):
    """Issue 34: the budget holds whatever the callback order."""

    @pytest.mark.slow
    def test_stops_exactly_at_max_steps_and_backup_takes_no_step(self):
        # eps(T) is strictly increasing, so the budget eps(13) allows exactly
        # 13 steps: one epoch of 8 and 5 steps of the second. Then the same
        # script again: PrivacyBudget first (the order its docstring
        # recommends), its on_train_begin runs before BackupAndRestore's
        # restores the spent model (and its ledger), so the check must also
        # come before the first batch.
        target = _eps(13)
        backup = _tempdir(self)

        def script():
            """The same training script, run twice."""
            model = _private_model()
            budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target,
                                             verbose=0)
            steps = _Recorder()
            restore = keras.callbacks.BackupAndRestore(
                backup, double_checkpoint=True, delete_checkpoint=False)
            return model, budget, steps, lambda: _fit(
                model, [budget, restore, steps], epochs=5)

        model, budget, steps, fit = script()
        history = fit()
        self.assertEqual(budget.max_steps, 13)
        self.assertEqual(steps.batches, 13)  # Trained to the budget.
        self.assertEqual(_ledger_steps(model), 13)
        self.assertEqual(history.history["epsilon"], [_eps(8), _eps(13)])
        self.assertLessEqual(budget.epsilon, target)
        self.assertGreater(_eps(14), target)
        model, budget, steps, fit = script()
        self.assertEqual(_ledger_steps(model), 0)  # A fresh model ...
        with self.assertRaisesRegex(RuntimeError, "already spent"):
            fit()
        # ... restored to the spent one, and not one step more.
        self.assertEqual(steps.batches, 0)
        self.assertEqual(_ledger_steps(model), 13)
        self.assertEqual(budget.epsilon, _eps(13))
        self.assertLessEqual(budget.epsilon, target)

    @pytest.mark.slow
    def test_budget_counts_a_restored_ledger_of_another_sampling(self):
        # Run 1: one epoch of shuffled fixed batches (8 steps, one Gaussian
        # mechanism of multiplier sigma on every example), backed up. Run 2:
        # Poisson batches, PrivacyBudget first. Its on_train_begin budgets
        # the fresh model's empty ledger; BackupAndRestore then loads the 8
        # steps of run 1, which a count of Poisson steps does not bound: the
        # budget must be taken again before the first batch, leaving 3
        # Poisson steps.
        def composed(poisson_steps):
            return _pld_epsilon([_poisson_event(B / N, poisson_steps),
                                 dp_accounting.GaussianDpEvent(SIGMA)])

        target = (composed(3) + composed(4)) / 2
        backup = _tempdir(self)

        def restore():
            return keras.callbacks.BackupAndRestore(
                backup, delete_checkpoint=False)

        model = _private_model()
        _fit(model, [restore()], epochs=1, batch_size=B, sampling="shuffled")
        self.assertEqual(_ledger_steps(model), 8)

        model = _private_model()
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target,
                                         verbose=0)
        steps = _Recorder()
        _fit(model, [budget, restore(), steps], epochs=5)
        self.assertEqual(steps.batches, 3)
        self.assertEqual(_ledger_steps(model), 11)
        self.assertEqual(budget.max_steps, 11)
        self.assertLessEqual(budget.epsilon, target)
        self.assertAlmostEqual(budget.epsilon, composed(3), delta=1e-9)


if __name__ == "__main__":
    absltest.main()
