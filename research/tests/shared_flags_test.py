"""research/shared_flags.py: the flags' defaults and parsing."""

import os
import subprocess
import sys

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from research import common
from research import shared_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


class DefaultsTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        if "optimizer" not in flags.FLAGS:
            shared_flags.define_training_flags()  # Binaries: in __main__.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()

    def test_paper_defaults_per_optimizer(self):
        with flagsaver.flagsaver(optimizer="dpsgd"):
            config = shared_flags.config_from_flags("cifar10")
        self.assertEqual((config.learning_rate, config.batch_size), (4.0, 2048))
        with flagsaver.flagsaver(optimizer="dpadam_corrected"):
            config = shared_flags.config_from_flags("snli")
        self.assertEqual(
            (config.l2_norm_clip, config.noise_multiplier, config.epsilon,
             config.learning_rate),
            (0.1, 0.4, 1e-9, 1e-3),
        )
        with flagsaver.flagsaver(optimizer="dpadam_corrected", epsilon="none"):
            config = shared_flags.config_from_flags("cifar10")
        self.assertIsNone(config.epsilon)

    def test_noise_seed_is_secret_unless_given(self):
        with flagsaver.flagsaver(seed=3):
            config = shared_flags.config_from_flags("cifar10")
        self.assertEqual((config.seed, config.noise_seed), (3, None))
        with flagsaver.flagsaver(seed=3, noise_seed=5):
            config = shared_flags.config_from_flags("cifar10")
        self.assertEqual((config.seed, config.noise_seed), (3, 5))
        self.assertIn("not of the DP noise", flags.FLAGS["seed"].help)
        self.assertIn("anyone who knows it can remove the noise",
                      flags.FLAGS["noise_seed"].help)

    def test_weight_decay_and_averaging_reach_the_optimizer(self):
        config = shared_flags.config_from_flags("cifar10")
        self.assertEqual((config.weight_decay, config.ema,
                          config.ema_momentum), (0.0, False, 0.999))
        optimizer = common.make_optimizer(config)
        self.assertEqual((optimizer.weight_decay, optimizer.use_ema),
                         (None, False))
        for name in common.OPTIMIZERS:
            with flagsaver.flagsaver(optimizer=name, weight_decay=0.01,
                                     ema=True, ema_momentum=0.99):
                config = shared_flags.config_from_flags("cifar10")
            optimizer = common.make_optimizer(config)
            self.assertEqual((optimizer.weight_decay, optimizer.use_ema,
                              optimizer.ema_momentum), (0.01, True, 0.99))
        # DP-SGD's learning rate 4 with a decay of 0.25 would zero the
        # weights at every step.
        with flagsaver.flagsaver(optimizer="dpsgd", weight_decay=0.25):
            with self.assertRaisesRegex(ValueError, "--weight_decay=0.25"):
                shared_flags.config_from_flags("cifar10")
        self.assertIn("multiplies every trainable weight by 1 - "
                      "learning_rate * weight_decay",
                      flags.FLAGS["weight_decay"].help)
        self.assertIn("free in privacy", flags.FLAGS["ema"].help)

    def test_epsilon_target_or_epochs(self):
        with flagsaver.flagsaver(target_epsilon=0.0):
            with self.assertRaisesRegex(ValueError, "--epochs"):
                shared_flags.config_from_flags("cifar10")
            with flagsaver.flagsaver(epochs=2.0):
                config = shared_flags.config_from_flags("fashion_mnist")
        self.assertEqual((config.target_epsilon, config.epochs,
                          config.noise_multiplier, config.eval_every),
                         (None, 2.0, 0.52, 100))


class ParseTest(absltest.TestCase):

    def test_list_flags(self):
        self.assertEqual(shared_flags.parse_floats(["0.1", "1e-3"]),
                         (0.1, 1e-3))
        self.assertEqual(shared_flags.parse_gammas(["None", "1e-9"]),
                         (None, 1e-9))
        with self.assertRaisesRegex(ValueError, "Expected a number, got "
                                                "'fast'"):
            shared_flags.parse_floats(["fast"])


class HelpTest(absltest.TestCase):

    def test_help_lists_the_shared_flags(self):
        run = subprocess.run(
            [sys.executable, "-m", "research.train_image", "--help"],
            cwd=_ROOT, capture_output=True, text=True, timeout=300,
            check=False)
        for flag in ("--dataset", "--optimizer", "--noise_multiplier",
                     "--target_epsilon", "--eval_every", "--noise_seed",
                     "--weight_decay", "--[no]ema", "--ema_momentum",
                     "--normalization"):
            self.assertIn(flag, run.stdout)


if __name__ == "__main__":
    absltest.main()
