"""Tests of tf_dpadam.accounting.ledger against dp-accounting directly.

Every expected epsilon is dp-accounting's own accountant on an event built
here from the segments' description (not `Ledger.dp_event`), with the
package's PLD discretization (1e-3) or RDP orders.
"""

import pytest
import math

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting

from tf_dpadam import accounting
from tf_dpadam.accounting import ledger as ledger_lib
from tf_dpadam.accounting import passes

import helpers

DELTA = 1e-5
Mechanism = ledger_lib.Mechanism


# Fixed-batch segments are one Gaussian mechanism of multiplier
# (sum_i S_i / sigma_i^2)^(-1/2), exactly their composition; dp-accounting's
# PLD composes the discretized Gaussians one by one, each rounded up by
# pessimistic discretization, so it lies a little above (relative 1e-7 here).
_COMPOSED_GAUSSIANS_RTOL = 1e-6


def _reference(events, name="pld"):
    accountant = helpers.reference_accountant(name)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def _poisson(q, sigma, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _ledger(*segments):
    return ledger_lib.Ledger(tuple(
        ledger_lib.Segment(mechanism, steps) for mechanism, steps in segments))


class EpsilonTest(parameterized.TestCase):

    @parameterized.parameters("pld", "rdp")
    def test_one_poisson_segment(self, name):
        ledger = _ledger((Mechanism.poisson(1.1, 60000, 256), 500))
        self.assertAlmostEqual(ledger.epsilon(DELTA, name),
                               _reference([_poisson(256 / 60000, 1.1, 500)],
                                          name), places=9)

    @parameterized.parameters("pld", "rdp")
    @pytest.mark.slow
    def test_poisson_segments_at_two_rates_compose(self, name):
        # 32 steps on 256 rows, then 128 steps on 4,096 rows (issue 49).
        ledger = _ledger((Mechanism.poisson(1.0, 256, 16), 32),
                         (Mechanism.poisson(1.0, 4096, 16), 128))
        expected = _reference([_poisson(16 / 256, 1.0, 32),
                               _poisson(16 / 4096, 1.0, 128)], name)
        self.assertAlmostEqual(ledger.epsilon(DELTA, name), expected,
                               places=6)
        first_alone = _ledger((Mechanism.poisson(1.0, 256, 16), 32))
        self.assertGreater(ledger.epsilon(DELTA, name),
                           first_alone.epsilon(DELTA, name))

    @parameterized.parameters("pld", "rdp")
    def test_passes_then_poisson(self, name):
        # 3 shuffled passes of 10 batches, then 10 Poisson steps: the three
        # passes are one Gaussian of multiplier sigma / sqrt(3).
        ledger = _ledger((Mechanism.passes(1.0, 10), 30),
                         (Mechanism.poisson(1.0, 80, 8), 10))
        expected = _reference([dp_accounting.GaussianDpEvent(1 / math.sqrt(3)),
                               _poisson(0.1, 1.0, 10)], name)
        self.assertAlmostEqual(ledger.epsilon(DELTA, name), expected,
                               places=6)

    @pytest.mark.slow
    def test_every_step_segments_each_a_participation(self):
        # 10 fits of 1 step on the same rows: 10 Gaussian mechanisms.
        ledger = _ledger(*[(Mechanism.passes(1.0, 32), 1)] * 10)
        self._assert_composed_gaussians(
            ledger, [dp_accounting.GaussianDpEvent(1.0)] * 10)
        unknown = _ledger((Mechanism.every_step(1.0, accumulation_steps=2), 5))
        # k = 2 physical batches may both hold the example: sensitivity 2C.
        self._assert_composed_gaussians(
            unknown, [dp_accounting.GaussianDpEvent(0.5)] * 5)

    def _assert_composed_gaussians(self, ledger, events):
        expected = _reference(events)
        self.assertLessEqual(ledger.epsilon(DELTA), expected)
        self.assertAlmostEqual(ledger.epsilon(DELTA) / expected, 1.0,
                               delta=_COMPOSED_GAUSSIANS_RTOL)
        single = _reference([dp_accounting.GaussianDpEvent(
            1 / math.sqrt(sum(1 / e.noise_multiplier**2 for e in events)))])
        self.assertAlmostEqual(ledger.epsilon(DELTA), single, places=9)

    def test_fixed_sigma_differs_between_segments(self):
        ledger = _ledger((Mechanism.every_step(1.5), 4),
                         (Mechanism.every_step(6.0), 4))
        self._assert_composed_gaussians(
            ledger, [dp_accounting.GaussianDpEvent(1.5)] * 4
            + [dp_accounting.GaussianDpEvent(6.0)] * 4)

    def test_one_mechanism_alone_gives_the_existing_numbers(self):
        poisson = _ledger((Mechanism.poisson(0.52, 60000, 256), 1468))
        self.assertEqual(poisson.epsilon(DELTA), accounting.epsilon_after_steps(
            steps=1468, num_examples=60000, batch_size=256,
            noise_multiplier=0.52, delta=DELTA, accountant="pld"))
        fixed = _ledger((Mechanism.passes(1.0, 10), 30))
        self.assertEqual(fixed.epsilon(DELTA),
                         passes.epsilon_without_amplification(
                             steps=30, noise_multiplier=1.0, delta=DELTA,
                             batches_per_pass=10, accountant="pld"))

    def test_dp_event_is_the_composition(self):
        ledger = _ledger((Mechanism.poisson(1.0, 256, 16), 32),
                         (Mechanism.passes(2.0, 8), 16))
        accountant = helpers.reference_accountant("pld")
        accountant.compose(ledger.dp_event())
        self.assertAlmostEqual(accountant.get_epsilon(DELTA),
                               ledger.epsilon(DELTA), places=6)

    def test_no_noise_is_infinite_and_empty_is_zero(self):
        self.assertEqual(ledger_lib.Ledger().epsilon(DELTA), 0.0)
        ledger = _ledger((Mechanism.poisson(1.0, 256, 16), 3),
                         (Mechanism.poisson(0.0, 256, 16), 1))
        self.assertEqual(ledger.epsilon(DELTA), math.inf)

    @pytest.mark.slow
    def test_epsilon_grows_with_every_segment_and_step(self):
        mechanisms = [Mechanism.poisson(1.0, 512, 32),
                      Mechanism.passes(1.0, 16), Mechanism.every_step(3.0),
                      Mechanism.poisson(2.0, 4096, 32)]
        ledger, last = ledger_lib.Ledger(), 0.0
        for steps in (1, 5, 20):
            for mechanism in mechanisms:
                ledger = ledger.with_steps(mechanism, steps)
                epsilon = ledger.epsilon(DELTA)
                self.assertGreater(epsilon, last)
                last = epsilon


class MaxMoreStepsTest(parameterized.TestCase):

    @parameterized.parameters("pld", "rdp")
    def test_the_largest_within_target(self, name):
        spent = _ledger((Mechanism.passes(2.0, 8), 8))
        mechanism = Mechanism.poisson(1.0, 512, 32)
        more = spent.max_more_steps(mechanism, 3.0, DELTA, name)
        self.assertGreater(more, 0)
        self.assertLessEqual(
            spent.with_steps(mechanism, more).epsilon(DELTA, name), 3.0)
        self.assertGreater(
            spent.with_steps(mechanism, more + 1).epsilon(DELTA, name), 3.0)

    def test_a_spent_ledger_allows_none(self):
        mechanism = Mechanism.poisson(1.0, 512, 32)
        spent = _ledger((mechanism, 10_000))
        self.assertEqual(spent.max_more_steps(mechanism, 1.0, DELTA), 0)


class SizeLimitTest(absltest.TestCase):

    @pytest.mark.slow
    def test_past_the_pld_limit_rdp_and_still_growing(self):
        # 1 / sqrt(T) falls below the PLD's smallest multiplier (0.0667)
        # between T = 224 and 225: the RDP's epsilon, larger, takes over.
        mechanism = Mechanism.every_step(1.0)
        below = _ledger((mechanism, 224)).epsilon(DELTA)
        above = _ledger((mechanism, 225))
        self.assertEqual(above.epsilon(DELTA), above.epsilon(DELTA, "rdp"))
        self.assertGreater(above.epsilon(DELTA), below)
        self.assertLess(above.epsilon(DELTA), math.inf)

    def test_a_huge_budget_stops_at_the_cap(self):
        mechanism = Mechanism.poisson(6.0, 60000, 256)
        more = ledger_lib.Ledger().max_more_steps(mechanism, 50.0, DELTA,
                                                  cap=10**6)
        self.assertEqual(more, 10**6)


class SerializationTest(absltest.TestCase):

    def test_round_trip_keeps_ids_and_epsilon(self):
        ledger = _ledger((Mechanism.poisson(1.0, 256, 16, 2), 7),
                         (Mechanism.every_step(1.5, source="a generator"), 3))
        again = ledger_lib.Ledger.loads(ledger.dumps())
        self.assertEqual(again, ledger)
        self.assertEqual(again.epsilon(DELTA), ledger.epsilon(DELTA))

    def test_damaged_text_is_a_value_error(self):
        for text in ("{", '{"format": 99, "segments": []}',
                     '{"format": 1, "segments": [{"steps": 3}]}',
                     '{"format": 1, "segments": [{"id": "a", "steps": -1,'
                     ' "sampling": "poisson", "noise_multiplier": 1.0}]}'):
            with self.assertRaises(ValueError, msg=text):
                ledger_lib.Ledger.loads(text)

    def test_bad_mechanisms_name_the_argument(self):
        with self.assertRaisesRegex(ValueError, "sampling='bernoulli'"):
            Mechanism("bernoulli", 1.0)
        with self.assertRaisesRegex(ValueError, "noise_multiplier=-1"):
            Mechanism.every_step(-1.0)
        with self.assertRaisesRegex(ValueError, "batches_per_pass"):
            Mechanism("passes", 1.0)
        with self.assertRaisesRegex(ValueError, "num_examples"):
            Mechanism("poisson", 1.0)


class MergeTest(absltest.TestCase):

    def test_same_segment_keeps_the_larger_count(self):
        mechanism = Mechanism.poisson(1.0, 256, 16)
        earlier = ledger_lib.Ledger((ledger_lib.Segment(mechanism, 5, "a"),))
        later = ledger_lib.Ledger((ledger_lib.Segment(mechanism, 9, "a"),))
        self.assertEqual(earlier.merged(later), later)
        self.assertEqual(later.merged(earlier), later)  # Never lowered.

    def test_unknown_segments_are_composed(self):
        mine = _ledger((Mechanism.poisson(1.0, 256, 16), 5))
        theirs = _ledger((Mechanism.every_step(1.5), 4))
        merged = mine.merged(theirs)
        self.assertEqual(merged.steps, 9)
        self.assertGreater(merged.epsilon(DELTA), mine.epsilon(DELTA))
        self.assertGreater(merged.epsilon(DELTA), theirs.epsilon(DELTA))


if __name__ == "__main__":
    absltest.main()
