"""Cyclic Poisson segments of the ledger (`Mechanism.poisson(..., bands=b)`).

Choquette-Choo et al. (2023, arXiv 2306.08153): b groups, step t samples
group t mod b at q = min(1, b B / N); with at most b bands, T steps are
DP-SGD with ceil(T / b) steps at q. Every expected epsilon is dp-accounting's
own accountant on an event built here, with the package's PLD
discretization (1e-3) or RDP orders, as in `ledger_test.py`.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting
import pytest

from tf_dpadam import accounting
from tf_dpadam.accounting import ledger as ledger_lib
from tf_dpadam.accounting import plans

import helpers

DELTA = 1e-5
Mechanism = ledger_lib.Mechanism


def _reference(q, sigma, steps, name):
    """dp-accounting's epsilon of `steps` Poisson-sampled Gaussian steps."""
    accountant = helpers.reference_accountant(name)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(DELTA)


def _ledger(*segments):
    return ledger_lib.Ledger(tuple(
        ledger_lib.Segment(mechanism, steps) for mechanism, steps in segments))


class CyclicEpsilonTest(parameterized.TestCase):

    @parameterized.parameters("pld", "rdp")
    def test_one_cyclic_segment_is_ceil_t_over_b_steps_at_b_q(self, name):
        n, batch, sigma, steps, bands = 60000, 256, 1.1, 1001, 4
        mechanism = Mechanism.poisson(sigma, n, batch, bands=bands)
        q = min(1.0, bands * batch / n)
        self.assertEqual(mechanism.sampling_rate, q)
        expected = _reference(q, sigma, math.ceil(steps / bands), name)
        self.assertAlmostEqual(
            _ledger((mechanism, steps)).epsilon(DELTA, name), expected,
            places=9)

    @parameterized.parameters("pld", "rdp")
    def test_segments_each_count_ceil_t_over_b(self, name):
        # 9 + 9 steps over 4 groups: 3 + 3 = 6 Poisson steps (each segment
        # may start at any group), not ceil(18 / 4) = 5.
        mechanism = Mechanism.poisson(1.0, 6000, 100, bands=4)
        q = 400 / 6000
        ledger = _ledger((mechanism, 9), (mechanism, 9))
        self.assertAlmostEqual(ledger.epsilon(DELTA, name),
                               _reference(q, 1.0, 6, name), places=9)
        self.assertGreater(ledger.epsilon(DELTA, name),
                           _reference(q, 1.0, 5, name) + 1e-6)
        self.assertEqual(ledger.dp_event(), dp_accounting.ComposedDpEvent(
            [accounting.dp_sgd_event(q, 1.0, 6)]))

    def test_cyclic_and_plain_segments_of_one_rate_merge(self):
        # B = 100 over 4 groups of N = 6000 and B = 400 over all: both
        # q = 1/15, so their Poisson steps add up (3 + 5).
        cyclic = Mechanism.poisson(1.0, 6000, 100, bands=4)
        plain = Mechanism.poisson(1.0, 6000, 400)
        self.assertEqual(cyclic.sampling_rate, plain.sampling_rate)
        ledger = _ledger((cyclic, 10), (plain, 5))
        self.assertAlmostEqual(ledger.epsilon(DELTA, "rdp"),
                               _reference(400 / 6000, 1.0, 8, "rdp"),
                               places=9)

    @parameterized.parameters("pld", "rdp")
    def test_one_band_is_exactly_todays_epsilon(self, name):
        today = _ledger((Mechanism.poisson(1.1, 60000, 256), 500))
        one_band = _ledger((Mechanism.poisson(1.1, 60000, 256, bands=1), 500))
        self.assertEqual(Mechanism.poisson(1.1, 60000, 256).bands, 1)
        self.assertEqual(one_band.epsilon(DELTA, name),
                         today.epsilon(DELTA, name))
        self.assertAlmostEqual(today.epsilon(DELTA, name),
                               _reference(256 / 60000, 1.1, 500, name),
                               places=9)

    def test_a_group_rate_is_at_most_one(self):
        mechanism = Mechanism.poisson(1.0, 100, 30, bands=4)
        self.assertEqual(mechanism.sampling_rate, 1.0)
        self.assertAlmostEqual(
            _ledger((mechanism, 8)).epsilon(DELTA, "rdp"),
            _reference(1.0, 1.0, 2, "rdp"), places=9)

    def test_max_more_steps_ends_a_cycle(self):
        mechanism = Mechanism.poisson(1.0, 6000, 100, bands=4)
        steps = ledger_lib.Ledger().max_more_steps(mechanism, 2.0, DELTA,
                                                   "rdp")
        self.assertGreater(steps, 0)
        # Steps 4m - 3 .. 4m cost the same: the answer completes a cycle.
        self.assertEqual(steps % 4, 0)
        self.assertLessEqual(_reference(400 / 6000, 1.0, steps // 4, "rdp"),
                             2.0)
        self.assertGreater(
            _reference(400 / 6000, 1.0, steps // 4 + 1, "rdp"), 2.0)


class CyclicMechanismTest(parameterized.TestCase):

    def test_json_round_trip_keeps_the_bands(self):
        ledger = _ledger((Mechanism.poisson(1.0, 6000, 100, 2, bands=4), 9),
                         (Mechanism.poisson(1.0, 6000, 100), 3))
        loaded = ledger_lib.Ledger.loads(ledger.dumps())
        self.assertEqual(loaded, ledger)
        self.assertEqual([s.mechanism.bands for s in loaded.segments], [4, 1])
        self.assertEqual(loaded.epsilon(DELTA, "rdp"),
                         ledger.epsilon(DELTA, "rdp"))

    def test_an_old_ledger_without_bands_loads_with_one_band(self):
        old = {"format": ledger_lib.FORMAT_VERSION, "segments": [{
            "id": "abc", "steps": 500, "sampling": "poisson",
            "noise_multiplier": 1.1, "num_examples": 60000,
            "expected_batch_size": 256, "batches_per_pass": None,
            "accumulation_steps": 1, "source": "Poisson batches"}]}
        loaded = ledger_lib.Ledger.from_json(old)
        (segment,) = loaded.segments
        self.assertEqual(segment.mechanism.bands, 1)
        self.assertEqual(segment.mechanism,
                         Mechanism.poisson(1.1, 60000, 256))
        self.assertEqual(
            loaded.epsilon(DELTA, "rdp"),
            _ledger((Mechanism.poisson(1.1, 60000, 256), 500)).epsilon(
                DELTA, "rdp"))

    @parameterized.named_parameters(
        ("zero", 0), ("negative", -2), ("float", 2.0), ("bool", True),
        ("string", "2"))
    def test_bad_bands(self, bands):
        with self.assertRaisesRegex(ValueError, "bands"):
            Mechanism.poisson(1.0, 6000, 100, bands=bands)
        with self.assertRaisesRegex(ValueError, "bands"):
            Mechanism("poisson", 1.0, 6000, 100, bands=bands)

    def test_bands_only_for_poisson(self):
        with self.assertRaisesRegex(ValueError, "bands=2"):
            Mechanism("passes", 1.0, None, None, 10, bands=2)
        with self.assertRaisesRegex(ValueError, "bands=2"):
            Mechanism("every_step", 1.0, bands=2)
        with self.assertRaisesRegex(ValueError, "bands"):
            ledger_lib.Ledger.from_json({
                "format": ledger_lib.FORMAT_VERSION, "segments": [{
                    "id": "x", "steps": 3, "sampling": "passes",
                    "noise_multiplier": 1.0, "batches_per_pass": 10,
                    "bands": 2}]})
        self.assertEqual(Mechanism.passes(1.0, 10).bands, 1)

    def test_describe_names_the_cyclic_groups(self):
        text = Mechanism.poisson(1.0, 6000, 100, bands=4).describe()
        self.assertIn("cyclic Poisson sampling over 4 groups", text)
        self.assertIn("0.06667", text)
        self.assertNotIn("cyclic",
                         Mechanism.poisson(1.0, 6000, 100).describe())

    def test_poisson_plan_carries_its_groups(self):
        plan = plans.PoissonPlan(6000, 100, 2, groups=4)
        mechanism = plan.mechanism(1.0)
        self.assertEqual(mechanism.bands, 4)
        self.assertEqual(mechanism.accumulation_steps, 2)
        self.assertEqual(plans.PoissonPlan(6000, 100).mechanism(1.0).bands,
                         1)
        with self.assertRaisesRegex(ValueError, "groups"):
            plans.PoissonPlan(6000, 100, groups=0)


    @parameterized.parameters("pld", "rdp")
    def test_epsilon_after_steps_with_bands_is_the_ledgers(self, name):
        n, batch, sigma, steps, bands = 60000, 256, 1.1, 1001, 4
        self.assertEqual(
            accounting.epsilon_after_steps(
                steps=steps, num_examples=n, batch_size=batch,
                noise_multiplier=sigma, delta=DELTA, accountant=name,
                bands=bands),
            _ledger((Mechanism.poisson(sigma, n, batch, bands=bands),
                     steps)).epsilon(DELTA, name))


class CyclicCalibrationTest(parameterized.TestCase):

    @parameterized.parameters(("rdp", 2), ("rdp", 8), ("pld", 4))
    @pytest.mark.slow
    def test_calibrated_sigma_meets_the_ledgers_epsilon(self, name, bands):
        n, batch, epochs, target = 60000, 256, 2, 3.0
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=target, num_examples=n, batch_size=batch,
            epochs=epochs, delta=DELTA, accountant=name, bands=bands)
        steps = math.ceil(epochs * n / batch)

        def epsilon(noise_multiplier):
            return _ledger((Mechanism.poisson(noise_multiplier, n, batch,
                                              bands=bands), steps)).epsilon(
                                                  DELTA, name)

        self.assertLessEqual(epsilon(sigma), target)
        self.assertGreater(epsilon(sigma / 1.01), target)
        # More bands, larger group rate: more noise than DP-SGD's.
        self.assertGreater(sigma, accounting.calibrate_noise_multiplier(
            target_epsilon=target, num_examples=n, batch_size=batch,
            epochs=epochs, delta=DELTA, accountant=name))


    @parameterized.parameters(("rdp", 4), ("pld", 2))
    @pytest.mark.slow
    def test_calibrated_steps_are_the_most_within_the_target(self, name,
                                                              bands):
        n, batch, sigma, target = 60000, 256, 0.8, 2.0
        steps = accounting.calibrate_steps(
            target_epsilon=target, num_examples=n, batch_size=batch,
            noise_multiplier=sigma, delta=DELTA, accountant=name,
            bands=bands)
        self.assertEqual(steps % bands, 0)

        def epsilon(t):
            return _ledger((Mechanism.poisson(sigma, n, batch, bands=bands),
                            t)).epsilon(DELTA, name)

        self.assertLessEqual(epsilon(steps), target)
        self.assertGreater(epsilon(steps + 1), target)


if __name__ == "__main__":
    absltest.main()
