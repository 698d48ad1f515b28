"""examples/shared_flags.py: the flags' defaults and parsing."""

import os
import subprocess
import sys

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from examples import shared_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
            [sys.executable, "-m", "examples.train_image", "--help"],
            cwd=_ROOT, capture_output=True, text=True, timeout=300,
            check=False)
        for flag in ("--dataset", "--optimizer", "--noise_multiplier",
                     "--target_epsilon", "--eval_every", "--noise_seed"):
            self.assertIn(flag, run.stdout)


if __name__ == "__main__":
    absltest.main()
