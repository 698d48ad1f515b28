"""research/common.py: the binaries account with PLD (issue 34).

Moved from tests/privacy_budget_pld_test.py, which tests the library's
PrivacyBudget and no longer imports the harness.
"""

import math

from absl.testing import absltest

from research import common
from tf_dpadam import accounting

N, B, DELTA = 60000, 256, 1e-5


class BinariesAccountingTest(absltest.TestCase):

    def test_the_binaries_account_with_pld(self):
        config = common.base_config("fashion_mnist", target_epsilon=7.0,
                                    delta=DELTA)
        steps = common.total_steps(config, N)
        self.assertEqual(steps, accounting.calibrate_steps(
            target_epsilon=7.0, num_examples=N, batch_size=B,
            noise_multiplier=0.52, delta=DELTA, accountant="pld"))
        self.assertLessEqual(common.spent_epsilon(config, steps, N), 7.0)
        self.assertGreater(common.spent_epsilon(config, steps + 1, N), 7.0)
        self.assertTrue(math.isfinite(common.spent_epsilon(config, 1, N)))


if __name__ == "__main__":
    absltest.main()
