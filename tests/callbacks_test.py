"""Tests of tf_dpadam.callbacks.PrivacyBudget.

The model is compiled with `FakeDPOptimizer`, a plain SGD that carries the two
attributes the callback reads (`noise_multiplier`, `batch_size`), so that
these tests do not depend on the DP optimizers of the package. The model
carries the `sampling_plan` that a private model's `fit` records: Poisson
(the plan the accounting tables of these tests use) unless a test says
otherwise; what `fit` records for each data path is tested in
private_fit_test.py.
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

from tf_dpadam import accounting
from tf_dpadam import callbacks
from tf_dpadam.accounting import plans

N = 64  # Examples; with batches of B = 8 an epoch is 8 steps.
B = 8
SIGMA = 1.0
DELTA = 1e-5


@keras.saving.register_keras_serializable(package="tf_dpadam_tests")
class FakeDPOptimizer(keras.optimizers.SGD):
    """SGD with the DP attributes of a tf_dpadam optimizer."""

    def __init__(self, noise_multiplier=SIGMA, batch_size=B, **kwargs):
        super().__init__(**kwargs)
        self.noise_multiplier = noise_multiplier
        self.batch_size = batch_size

    def get_config(self):
        config = super().get_config()
        config.update(
            noise_multiplier=self.noise_multiplier, batch_size=self.batch_size
        )
        return config


class _LogsRecorder(keras.callbacks.Callback):
    """Records the keys of the epoch logs it sees, and the batch logs'
    epsilon (None where absent)."""

    def __init__(self):
        super().__init__()
        self.keys = []
        self.batch_epsilons = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_epsilons.append((logs or {}).get("epsilon"))

    def on_epoch_end(self, epoch, logs=None):
        self.keys.append(sorted(logs))


POISSON = plans.PoissonPlan(N, B)


def _model(optimizer, plan=POISSON):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    model.sampling_plan = plan
    return model


def _data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(N, 3)).astype("float32"),
        rng.normal(size=(N, 1)).astype("float32"),
    )


def _fit(model, callback_list, epochs, **kwargs):
    x, y = _data()
    return model.fit(
        x,
        y,
        batch_size=B,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callback_list,
        **kwargs,
    )


def _iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def _eps(steps, accountant="pld"):  # PrivacyBudget's default.
    return accounting.epsilon_after_steps(
        steps=steps,
        num_examples=N,
        batch_size=B,
        noise_multiplier=SIGMA,
        delta=DELTA,
        accountant=accountant,
    )


class PrivacyBudgetTest(parameterized.TestCase):

    @parameterized.parameters("rdp", "pld")
    def test_epsilon_in_history_and_later_callbacks(self, accountant):
        model = _model(FakeDPOptimizer(learning_rate=0.01))
        before = _LogsRecorder()
        after = _LogsRecorder()
        budget = callbacks.PrivacyBudget(N, DELTA, accountant=accountant)
        history = _fit(model, [before, budget, after], epochs=2)
        self.assertEqual(_iterations(model), 2 * N // B)
        expected = [_eps(N // B, accountant), _eps(2 * N // B, accountant)]
        self.assertEqual(history.history["epsilon"], expected)
        self.assertEqual(budget.epsilon, expected[-1])
        self.assertIsNone(budget.max_steps)
        # The logs dict is shared in list order: callbacks after the budget
        # see epsilon, callbacks before it do not.
        self.assertIn("epsilon", after.keys[0])
        self.assertNotIn("epsilon", before.keys[0])
        # Every batch's logs too (the live progress bar, TensorBoard's
        # batch_epsilon): epsilon after the steps taken so far.
        self.assertEqual(after.batch_epsilons,
                         [_eps(t, accountant) for t in range(1, 2 * N // B + 1)])
        self.assertEqual(before.batch_epsilons, [None] * (2 * N // B))

    def test_fixed_batches_account_passes_without_amplification(self):
        # 8 batches a pass, 2 epochs: 16 steps, 2 passes, each a Gaussian
        # mechanism of multiplier sigma on every example.
        fixed = plans.FixedBatchesPlan("fixed batches", N // B)
        model = _model(FakeDPOptimizer(batch_size=None, learning_rate=0.01),
                       plan=fixed)
        budget = callbacks.PrivacyBudget(N, DELTA, batch_size=B)
        history = _fit(model, [budget], epochs=2)
        expected = [
            accounting.passes.gaussian_epsilon(SIGMA / np.sqrt(passes),
                                               DELTA, "pld")
            for passes in (1, 2)
        ]
        self.assertEqual(history.history["epsilon"], expected)
        self.assertGreater(expected[1], _eps(16))
        # The callback's N and B make the comparison with Poisson sampling.
        self.assertIn(f"would give {_eps(16):.4g}",
                      budget.accounting_line(16))

    def test_poisson_plan_needs_the_optimizers_batch_size(self):
        model = _model(FakeDPOptimizer(batch_size=None, learning_rate=0.01))
        budget = callbacks.PrivacyBudget(N, DELTA, batch_size=B)
        with self.assertRaisesRegex(ValueError, "batch_size=None: set it to 8"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_iterations(model), 0)

    def test_stops_exactly_at_max_steps_and_refuses_to_resume(self):
        # eps(T) is strictly increasing, so the budget eps(13) allows exactly
        # 13 steps: one epoch of 8 and 5 steps of the second.
        target = _eps(13)
        model = _model(FakeDPOptimizer(learning_rate=0.01))
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target)
        history = _fit(model, [budget], epochs=5)
        self.assertEqual(budget.max_steps, 13)
        self.assertEqual(_iterations(model), 13)
        self.assertEqual(history.history["epsilon"], [_eps(8), _eps(13)])
        self.assertLessEqual(budget.epsilon, target)
        self.assertGreater(_eps(14), target)

        # The budget is spent: a new fit raises before taking any step.
        again = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target)
        with self.assertRaisesRegex(RuntimeError, "already spent"):
            _fit(model, [again], epochs=1)
        self.assertEqual(_iterations(model), 13)

    def test_target_below_one_step_raises_before_training(self):
        model = _model(FakeDPOptimizer(learning_rate=0.01))
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=_eps(1) / 2)
        with self.assertRaisesRegex(ValueError, "target_epsilon"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_iterations(model), 0)

    def test_resume_from_saved_model_continues_the_count(self):
        model = _model(FakeDPOptimizer(learning_rate=0.01))
        target = _eps(30)
        history = _fit(
            model,
            [callbacks.PrivacyBudget(N, DELTA, target_epsilon=target)],
            epochs=2,
        )
        self.assertEqual(history.history["epsilon"], [_eps(8), _eps(16)])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            restored = keras.models.load_model(path)
        self.assertIsInstance(restored.optimizer, FakeDPOptimizer)
        self.assertEqual(restored.optimizer.noise_multiplier, SIGMA)
        self.assertEqual(restored.optimizer.batch_size, B)
        self.assertEqual(_iterations(restored), 16)

        restored.sampling_plan = POISSON  # What a private model's fit sets.
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target)
        history = _fit(restored, [budget], epochs=4, initial_epoch=2)
        # Steps 17..24 in epoch 3, then the stop at 30 in epoch 4.
        self.assertEqual(history.history["epsilon"], [_eps(24), _eps(30)])
        self.assertEqual(_iterations(restored), 30)
        self.assertEqual(budget.max_steps, 30)

    def test_loss_scale_wrapper_is_looked_through(self):
        model = _model(
            keras.optimizers.LossScaleOptimizer(
                FakeDPOptimizer(learning_rate=0.01)
            )
        )
        history = _fit(model, [callbacks.PrivacyBudget(N, DELTA)], epochs=1)
        self.assertEqual(history.history["epsilon"], [_eps(N // B)])

    def test_optimizer_without_noise_multiplier_raises(self):
        model = _model(keras.optimizers.SGD())
        with self.assertRaisesRegex(ValueError, "tf_dpadam DP optimizer"):
            _fit(model, [callbacks.PrivacyBudget(N, DELTA)], epochs=1)

    def test_missing_batch_size_raises(self):
        model = _model(FakeDPOptimizer(batch_size=None))
        with self.assertRaisesRegex(ValueError, "batch_size=None"):
            _fit(model, [callbacks.PrivacyBudget(N, DELTA)], epochs=1)

    def test_conflicting_batch_size_raises(self):
        model = _model(FakeDPOptimizer(batch_size=B))
        budget = callbacks.PrivacyBudget(N, DELTA, batch_size=2 * B)
        with self.assertRaisesRegex(ValueError, "batch_size=16"):
            _fit(model, [budget], epochs=1)

    def test_steps_per_execution_with_target_raises(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(
            optimizer=FakeDPOptimizer(), loss="mse", steps_per_execution=2
        )
        budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=5.0)
        with self.assertRaisesRegex(ValueError, "steps_per_execution=2"):
            _fit(model, [budget], epochs=1)
        self.assertEqual(_iterations(model), 0)

    @parameterized.named_parameters(
        ("num_examples", dict(num_examples=0, delta=DELTA), "num_examples=0"),
        ("delta", dict(num_examples=N, delta=1.0), "delta=1.0"),
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
    )
    def test_invalid_arguments(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, message):
            callbacks.PrivacyBudget(**kwargs)


class BudgetAcrossRestartsTest(absltest.TestCase):
    """Issue 34: the budget holds whatever the callback order."""

    def test_backup_and_restore_after_the_budget_takes_no_step(self):
        # PrivacyBudget first (the order its docstring recommends): its
        # on_train_begin runs before BackupAndRestore's restores the
        # spent model, so the check must also come before the first batch.
        target = _eps(13)
        backup = tempfile.mkdtemp()

        def script():
            """The same training script, run twice."""
            model = _model(FakeDPOptimizer(learning_rate=0.01))
            budget = callbacks.PrivacyBudget(N, DELTA, target_epsilon=target)
            restore = keras.callbacks.BackupAndRestore(
                backup, double_checkpoint=True, delete_checkpoint=False)
            return model, budget, lambda: _fit(model, [budget, restore],
                                               epochs=5)

        model, budget, fit = script()
        fit()
        self.assertEqual(_iterations(model), 13)  # Trained to the budget.
        model, budget, fit = script()
        self.assertEqual(_iterations(model), 0)  # A fresh model ...
        with self.assertRaisesRegex(RuntimeError, "already spent"):
            fit()
        # ... restored to the spent one, and not one step more.
        self.assertEqual(_iterations(model), 13)
        self.assertEqual(budget.epsilon, _eps(13))
        self.assertLessEqual(budget.epsilon, target)


if __name__ == "__main__":
    absltest.main()
