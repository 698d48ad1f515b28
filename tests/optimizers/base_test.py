"""The DP part shared by the three optimizers (`tf_dpadam.optimizers.base`)."""

import keras
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.optimizers import base as optimizer_base


class OptimizerBaseTest(absltest.TestCase):

    def test_constructor_arguments_merge_kwargs(self):
        arguments = {"self": object(), "__class__": object, "a": 1,
                     "kwargs": {"b": 2}}
        self.assertEqual(optimizer_base.constructor_arguments(arguments),
                         {"a": 1, "b": 2})

    def test_every_dp_optimizer_shares_the_constructor(self):
        for cls in (tf_dpadam.DPSGD, tf_dpadam.DPAdam,
                    tf_dpadam.DPAdamCorrected):
            optimizer = cls(l2_norm_clip=2.0, noise_multiplier=0.5,
                            batch_size=8, gradient_accumulation_steps=3)
            self.assertTrue(optimizer_base.is_dp_optimizer(optimizer))
            self.assertEqual(optimizer.dp_config.accumulation_steps, 3)
            config = optimizer.get_config()
            self.assertEqual(
                {k: config[k] for k in ("l2_norm_clip", "noise_multiplier",
                                        "batch_size",
                                        "gradient_accumulation_steps")},
                {"l2_norm_clip": 2.0, "noise_multiplier": 0.5,
                 "batch_size": 8, "gradient_accumulation_steps": 3})
            with self.assertRaisesRegex(ValueError, "loss_scale_factor"):
                cls(l2_norm_clip=1.0, noise_multiplier=1.0,
                    loss_scale_factor=2.0)
        self.assertFalse(optimizer_base.is_dp_optimizer(
            keras.optimizers.SGD()))


if __name__ == "__main__":
    absltest.main()
