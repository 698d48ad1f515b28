"""research/common.py: the binaries account with PLD (issue 34); each
--optimizer makes its class.

Moved from tests/privacy_budget_pld_test.py, which tests the library's
PrivacyBudget and no longer imports the harness.
"""

import dataclasses
import math

from absl.testing import absltest

import tf_dpadam
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



class MakeOptimizerTest(absltest.TestCase):

    def test_each_optimizer_name(self):
        classes = {"dpsgd": tf_dpadam.DPSGD, "dpadam": tf_dpadam.DPAdam,
                   "dpadam_corrected": tf_dpadam.DPAdamCorrected,
                   "dpadam_stp": tf_dpadam.DPAdamScaleThenPrivatize,
                   "dpadam_disk": tf_dpadam.DPAdamDiSK}
        self.assertEqual(set(classes), set(common.OPTIMIZERS))
        self.assertEqual(set(common.OPTIMIZER_LABELS), set(common.OPTIMIZERS))
        base = common.base_config("fashion_mnist", target_epsilon=7.0)
        for name, cls in classes.items():
            defaults = common.PAPER_DEFAULTS["fashion_mnist"]
            config = dataclasses.replace(
                base, optimizer=name,
                learning_rate=defaults["learning_rate"][name],
                epsilon=defaults["epsilon"].get(name))
            optimizer = common.make_optimizer(config)
            self.assertIs(type(optimizer), cls)
            self.assertEqual(optimizer.l2_norm_clip, 1.0)
            if name in common.KERAS_ADAM_EPSILON:
                self.assertEqual(optimizer.epsilon, 1e-8)

    def test_the_update_rule_fields_reach_the_optimizer(self):
        base = common.base_config("fashion_mnist", target_epsilon=7.0)
        sgd = common.make_optimizer(dataclasses.replace(
            base, optimizer="dpsgd", momentum=0.5))
        self.assertEqual(sgd.get_config()["momentum"], 0.5)
        adam = common.make_optimizer(dataclasses.replace(
            base, optimizer="dpadam_corrected", beta_1=0.8, beta_2=0.99,
            epsilon=1e-9, phi=0.25))
        config = adam.get_config()
        self.assertEqual((config["beta_1"], config["beta_2"],
                          config["epsilon"], config["phi"]),
                         (0.8, 0.99, 1e-9, 0.25))
        # DP-Adam takes no phi: the field is not passed (no TypeError).
        plain = common.make_optimizer(dataclasses.replace(
            base, optimizer="dpadam", beta_2=0.99, epsilon=1e-8, phi=0.25))
        self.assertEqual(plain.get_config()["beta_2"], 0.99)


if __name__ == "__main__":
    absltest.main()
