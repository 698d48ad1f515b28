"""Tests of tf_dpadam.accounting.search: the calibrations' search."""

import math

from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.accounting import pld
from tf_dpadam.accounting import search


class LargestWithinTest(parameterized.TestCase):
    """The shared search, against brute force on curves with plateaus."""

    @parameterized.product(start=[1, 37, 5000, 10**6], cap=[1, 9, 10**6])
    def test_equals_brute_force(self, start, cap):
        def curve(t):  # Non-decreasing, with steps: floor(sqrt(t)) / 10.
            return math.isqrt(t) / 10

        for target in (0.05, 0.1, 0.35, 2.0, 99.95, 1e6):
            expected = min(cap, (math.floor(target * 10 + 1e-9) + 1)**2 - 1)
            got = search.largest_within(curve, target, cap=cap, start=start)
            self.assertEqual(got, expected, (target, start, cap))

    def test_few_probes_near_a_good_guess(self):
        probes = []

        def curve(t):
            probes.append(t)
            return 0.1 * math.sqrt(t) + 1e-6 * t

        answer = search.largest_within(curve, 50.0, cap=10**9,
                                       start=200_000)
        self.assertLessEqual(curve(answer), 50.0)
        self.assertGreater(curve(answer + 1), 50.0)
        self.assertLessEqual(len(probes), 12)

    def test_never_many_more_probes_than_bisection(self):
        # A curve that defeats interpolation (flat, then a cliff).
        probes = []

        def curve(t):
            probes.append(t)
            return 0.0 if t <= 777_777 else 1e9

        self.assertEqual(search.largest_within(curve, 1.0, cap=10**7), 777_777)
        self.assertLessEqual(len(probes), 3 * 24)

    def test_log_ratio(self):
        self.assertAlmostEqual(search.log_ratio(math.e, 1.0), 1.0)
        self.assertIsNone(search.log_ratio(0.0, 1.0))
        self.assertIsNone(search.log_ratio(math.inf, 1.0))

    def test_infinite_past_a_limit_narrows_to_it(self):
        failures = {}

        def curve(t):
            if t > 1234:
                raise pld.PLDTooLargeError("too large")
            return t / 1e6

        bounded = search.inf_beyond_pld_limit(curve, failures)
        self.assertEqual(
            search.largest_within(bounded, 1.0, cap=10**7, start=10**6), 1234)
        self.assertIn(1235, failures)


if __name__ == "__main__":
    absltest.main()
