"""Secret seeds (`tf_dpadam.common.seeds`)."""

import warnings

import numpy as np
from absl.testing import absltest

from tf_dpadam.common import seeds


def _resolve(seed):
    return seeds.resolve_seed(seed, what="w", drawn="d", effect="e")


class SeedsTest(absltest.TestCase):

    def test_none_draws_a_63_bit_secret(self):
        drawn = {_resolve(None) for _ in range(20)}
        self.assertLen(drawn, 20)
        self.assertTrue(all(0 <= s < 2**63 for s in drawn))

    def test_an_explicit_seed_warns_at_the_callers_line(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(_resolve(np.int64(5)), 5)
        self.assertLen(caught, 1)
        self.assertIn("seed=5", str(caught[0].message))
        # The first frame outside tf_dpadam: this test file.
        self.assertEqual(caught[0].filename, __file__)

    def test_bad_seeds_are_refused(self):
        for bad in (-1, 2**63, True, 1.5, "3"):
            with self.assertRaisesRegex(ValueError, "seed="):
                _resolve(bad)

    def test_noise_seeds_never_repeat(self):
        noise_seeds = seeds.NoiseSeeds(0)
        drawn = {tuple(noise_seeds.next(0).numpy()) for _ in range(50)}
        self.assertLen(drawn, 50)


if __name__ == "__main__":
    absltest.main()
