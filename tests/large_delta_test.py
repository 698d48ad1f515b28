"""Issue 34: delta >= 1/N warns wherever epsilon is computed with a known N.

A delta of 1/N or more allows a mechanism that publishes one random example
in the clear, so every entry point that knows N warns (a `UserWarning`
naming delta and N), exactly once per call: a calibration's search probes
epsilon dozens of times and must not warn at each probe.
"""

import math
import warnings

import pytest
from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import tf_dpadam
from tf_dpadam import accounting
from tf_dpadam.accounting import cli as privacy_cli
from tf_dpadam.common import validation
from tf_dpadam.accounting import plans

N = 100
BAD_DELTA = 0.05  # >= 1/N = 0.01.
GOOD_DELTA = 1e-4
MESSAGE = ("delta=0.05 >= 1/N = 0.01: an (epsilon, delta) guarantee with"
           " delta >= 1/N allows releasing an example outright; use delta"
           " well below 1/N (N = 100 examples).")


def _calls(delta):
    """Every public function that computes epsilon with a known N."""
    setting = dict(num_examples=N, batch_size=10)
    return {
        "compute_dp_sgd_privacy": lambda: accounting.compute_dp_sgd_privacy(
            N, 10, 1.0, 3, delta),
        "epsilon_after_steps": lambda: accounting.epsilon_after_steps(
            steps=30, noise_multiplier=1.0, delta=delta, **setting),
        "calibrate_steps": lambda: accounting.calibrate_steps(
            target_epsilon=20.0, noise_multiplier=1.0, delta=delta,
            **setting),
        "calibrate_steps_rdp": lambda: accounting.calibrate_steps(
            target_epsilon=20.0, noise_multiplier=1.0, delta=delta,
            accountant="rdp", **setting),
        "calibrate_noise_multiplier": (
            lambda: accounting.calibrate_noise_multiplier(
                target_epsilon=2.0, steps=30, delta=delta, **setting)),
        "statement": lambda: accounting.compute_dp_sgd_privacy_statement(
            N, 10, 3, 1.0, delta, max_examples_per_user=2),
        "cli_statement": lambda: privacy_cli.report(
            noise_multiplier=1.0, epochs=3, delta=delta, **setting),
        "cli_all_three": lambda: privacy_cli.report(
            noise_multiplier=1.0, epochs=3, target_epsilon=20.0,
            delta=delta, **setting),
        "cli_noise": lambda: privacy_cli.report(
            steps=30, target_epsilon=2.0, delta=delta, **setting),
    }


def _recorded(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [w for w in caught
                    if issubclass(w.category, validation.LargeDeltaWarning)]


class LargeDeltaWarningTest(parameterized.TestCase):

    @parameterized.parameters(*sorted(_calls(BAD_DELTA)))
    @pytest.mark.slow
    def test_warns_exactly_once_per_call(self, name):
        result, caught = _recorded(_calls(BAD_DELTA)[name])
        self.assertLen(caught, 1, msg=name)
        self.assertTrue(issubclass(caught[0].category, UserWarning))
        self.assertEqual(str(caught[0].message), MESSAGE)
        # The warning points at the caller, not into the library.
        self.assertEqual(caught[0].filename, __file__)
        self.assertIsNotNone(result)

    @parameterized.parameters(*sorted(_calls(GOOD_DELTA)))
    def test_silent_below_one_over_n(self, name):
        _, caught = _recorded(_calls(GOOD_DELTA)[name])
        self.assertEmpty(caught, msg=name)

    def test_delta_one_half_is_the_issues_example(self):
        # The issue's example: delta = 0.5 gave epsilon = 0.0 silently.
        (epsilon, _), caught = _recorded(
            lambda: accounting.compute_dp_sgd_privacy(N, 10, 1.0, 3, 0.5))
        self.assertLen(caught, 1)
        self.assertIn("delta=0.5 >= 1/N = 0.01", str(caught[0].message))
        self.assertEqual(epsilon, 0.0)


def _model(noise_multiplier=1.0):
    keras.utils.set_random_seed(0)
    model = tf_dpadam.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=noise_multiplier, batch_size=10,
        learning_rate=0.01), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, 3)).astype("float32"),
            rng.normal(size=(N, 1)).astype("float32"))


class PrivacyBudgetLargeDeltaTest(parameterized.TestCase):

    @parameterized.parameters(("given", N), ("from_the_data", None))
    @pytest.mark.slow
    def test_warns_once_per_fit(self, _, num_examples):
        model = _model()
        x, y = _data()
        budget, caught = _recorded(lambda: tf_dpadam.PrivacyBudget(
            num_examples=num_examples, delta=BAD_DELTA, verbose=0))
        # N given: the constructor warns (and fit does not again).
        self.assertLen(caught, 1 if num_examples else 0)

        def fit():
            model.fit(x, y, batch_size=10, epochs=2, verbose=0,
                      callbacks=[budget])
            return budget.epsilon

        if num_examples is not None:
            self.assertEqual(str(caught[0].message), MESSAGE)
            epsilon, caught = _recorded(fit)
            self.assertEmpty(caught)
        else:
            # N from the data: one warning for the fit's 20 steps.
            epsilon, caught = _recorded(fit)
            self.assertLen(caught, 1)
            self.assertEqual(str(caught[0].message), MESSAGE)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, 10))
        self.assertTrue(math.isfinite(epsilon))

    @pytest.mark.slow
    def test_silent_for_a_small_delta(self):
        model = _model()
        x, y = _data()
        budget = tf_dpadam.PrivacyBudget(delta=GOOD_DELTA, verbose=0)
        _, caught = _recorded(lambda: model.fit(
            x, y, batch_size=10, epochs=1, verbose=0, callbacks=[budget]))
        self.assertEmpty(caught)


class EpochsZeroTest(absltest.TestCase):

    def test_zero_epochs_spend_nothing(self):
        # The docstring allows E >= 0; it raised "`count` must be positive".
        epsilon, order = accounting.compute_dp_sgd_privacy(
            60000, 256, 1.1, 0, 1e-5)
        self.assertEqual(epsilon, 0.0)
        self.assertTrue(math.isnan(order))
        for sampling in ("poisson", "shuffled"):
            self.assertEqual(accounting.compute_dp_sgd_privacy(
                60000, 256, 1.1, 0.0, 1e-5, sampling=sampling)[0], 0.0)
        # The smallest positive length is one step, with epsilon > 0.
        self.assertGreater(accounting.compute_dp_sgd_privacy(
            60000, 256, 1.1, 1e-9, 1e-5)[0], 0.0)


if __name__ == "__main__":
    absltest.main()
