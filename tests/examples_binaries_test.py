"""Every example binary runs a few DP steps on tiny or mock data."""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

import numpy as np
import tensorflow_datasets as tfds
import keras
from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

import tf_dpadam
from examples import common
from examples import datasets
from examples import diagnostics
from examples import models
from examples import reproduce
from examples import train_image
from examples import train_text

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides):
    values = dict(
        optimizer="dpadam_corrected", l2_norm_clip=1.0, noise_multiplier=1.0,
        batch_size=16, physical_batch_size=8, learning_rate=1e-3,
        epsilon=None, phi=None, beta_1=0.9, beta_2=0.999, momentum=0.0,
        target_epsilon=None, delta=1e-5, epochs=None, eval_every=2,
        model_dir=None, seed=0, jit_compile=False,
    )
    values.update(overrides)
    return common.TrainConfig(**values)


class ImageBinaryTest(absltest.TestCase):

    def test_cifar10_through_tfds_mock_data(self):
        model_dir = tempfile.mkdtemp()
        config = _config(epochs=4 * 16 / 64, model_dir=model_dir)
        with tfds.testing.mock_data(num_examples=64):
            results = train_image.run("cifar10", None, config)
        self.assertEqual(results["steps"], 4)
        self.assertGreater(results["epsilon"], 0)
        self.assertBetween(results["test_accuracy"], 0.0, 1.0)
        with open(os.path.join(model_dir, "metrics.json")) as f:
            saved = json.load(f)
        self.assertEqual([r["step"] for r in saved["history"]], [2, 4])
        self.assertIn("epsilon", saved["history"][-1])
        # A rerun with more steps resumes from the checkpoint: the curve
        # keeps the first two evaluations and the step count goes on.
        more = _config(epochs=6 * 16 / 64, model_dir=model_dir)
        with tfds.testing.mock_data(num_examples=64):
            results = train_image.run("cifar10", None, more)
        self.assertEqual(results["steps"], 6)
        self.assertEqual([r["step"] for r in results["history"]], [2, 4, 6])

    def test_training_accuracy_ignores_the_poisson_padding(self):
        # A model that always says class 1, on examples all of class 1: the
        # padding rows (label 0, weight 0) must not count as mistakes.
        import keras

        def model_fn():
            model = keras.Sequential([
                keras.Input((3,)),
                keras.layers.Dense(2, kernel_initializer="zeros",
                                   bias_initializer=keras.initializers
                                   .Constant([0.0, 100.0])),
            ])
            return model

        x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
        y = np.ones(64, "int64")
        config = _config(optimizer="dpsgd", learning_rate=1e-6,
                         physical_batch_size=32, epochs=4 * 16 / 64)
        results = common.fit_private(
            model_fn, (x, y), (x, y), config,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.assertEqual([r["accuracy"] for r in results["history"]],
                         [1.0, 1.0])
        self.assertEqual(results["test_accuracy"], 1.0)

    def test_target_epsilon_stops_at_the_calibrated_step(self):
        config = _config(
            optimizer="dpsgd", learning_rate=0.5, noise_multiplier=2.0,
            target_epsilon=3.0, eval_every=5,
        )
        with tfds.testing.mock_data(num_examples=64):
            results = train_image.run("cifar10", None, config)
        expected = common.total_steps(config, 64)
        self.assertEqual(results["steps"], expected)
        self.assertLessEqual(results["epsilon"], 3.0)

    def test_main_on_fashion_mnist_files(self):
        if datasets.fashion_mnist_files() is None:
            self.skipTest("Debian's dataset-fashion-mnist is not installed.")
        run = subprocess.run(
            [sys.executable, "-m", "examples.train_image",
             "--dataset=fashion_mnist", "--optimizer=dpadam",
             "--max_examples=256", "--batch_size=32", "--target_epsilon=0",
             "--epochs=0.25", "--eval_every=1"],
            cwd=_ROOT, capture_output=True, text=True, timeout=600,
            check=False,
        )
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        self.assertRegex(run.stdout, r"test accuracy 0\.\d+ after 2 steps;"
                                     r" spent epsilon \d+\.\d+")

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                train_image.main(["train_image", "stray"])


class TextBinaryTest(absltest.TestCase):

    def write_sst2(self):
        folder = tempfile.mkdtemp()
        rng = np.random.default_rng(0)
        words = ["good", "bad", "movie", "the", "a", "great", "awful"]
        for name, n in (("train.tsv", 48), ("dev.tsv", 16)):
            with open(os.path.join(folder, name), "w") as f:
                f.write("sentence\tlabel\n")
                for _ in range(n):
                    sentence = " ".join(rng.choice(words, size=5))
                    f.write(f"{sentence}\t{int('good' in sentence)}\n")
        return folder

    def test_sst2_tsv_with_a_tiny_bert(self):
        folder = self.write_sst2()
        backbone = models.make_tiny_bert(sequence_length=16)
        config = _config(optimizer="dpadam", epsilon=1e-8, epochs=4 * 16 / 48)
        results = train_text.run("sst2_tsv", folder, None, 16, config,
                                 backbone=backbone, cache_frozen=False)
        self.assertEqual(results["steps"], 4)
        self.assertBetween(results["test_accuracy"], 0.0, 1.0)

    def test_no_cache_when_the_features_would_not_fit(self):
        folder = self.write_sst2()
        backbone = models.make_tiny_bert(sequence_length=16)
        # 64 examples x 16 x 32 floats x 2 copies = 262 kB > 3 x 80 kB.
        with mock.patch.object(train_text, "memory_bytes",
                               return_value=3 * 80_000), \
                mock.patch.object(models, "frozen_features") as features:
            results = train_text.run(
                "sst2_tsv", folder, None, 16, _config(epochs=2 * 16 / 48),
                backbone=backbone, feature_cache={})
        features.assert_not_called()
        self.assertEqual(results["steps"], 2)

    def test_cached_features_are_computed_once_and_resume(self):
        folder = self.write_sst2()
        backbone = models.make_tiny_bert(sequence_length=16)
        cache = {}
        calls = []
        real = models.frozen_features

        def counting(frozen, x):
            calls.append(len(x["token_ids"]))
            return real(frozen, x)

        model_dir = tempfile.mkdtemp()
        with mock.patch.object(models, "frozen_features", counting):
            first = train_text.run(
                "sst2_tsv", folder, None, 16,
                _config(epochs=2 * 16 / 48, model_dir=model_dir), backbone=backbone,
                feature_cache=cache)
            self.assertEqual(calls, [48, 16])  # Train and dev, once each.
            # A resumed run (more epochs) reloads the checkpoint of the top
            # model and trains on the cached features.
            second = train_text.run(
                "sst2_tsv", folder, None, 16,
                _config(epochs=4 * 16 / 48, model_dir=model_dir),
                backbone=backbone, feature_cache=cache)
        self.assertEqual(calls, [48, 16])
        # The whole classifier, with the trained top (from the resumed
        # checkpoint), is saved for use on tokenized text.
        classifier = keras.models.load_model(
            os.path.join(model_dir, train_text.CLASSIFIER_FILE))
        (_, (x_dev, y_dev)), _ = datasets.load_text_dataset("sst2_tsv",
                                                            folder)
        tokens = datasets.preprocess(backbone[1], x_dev)
        classifier.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
        _, accuracy = classifier.evaluate(tokens, y_dev, verbose=0)
        self.assertAlmostEqual(accuracy, second["test_accuracy"], places=6)
        checkpoint = keras.models.load_model(
            os.path.join(model_dir, "checkpoint.keras"))
        fresh, _ = models.make_text_classifier(backbone, 2,
                                               sequence_length=16, seed=0)
        trained = [l for l in checkpoint.base_model.layers if l.weights]
        self.assertEqual([l.name for l in trained],
                         ["transformer_layer_1", "head"])
        for layer in trained:
            for got, want, init in zip(
                    classifier.get_layer(layer.name).get_weights(),
                    layer.get_weights(),
                    fresh.get_layer(layer.name).get_weights()):
                np.testing.assert_array_equal(got, want)
            self.assertFalse(np.array_equal(got, init))
        self.assertEqual(first["steps"], 2)
        self.assertEqual(second["steps"], 4)
        self.assertEqual([r["step"] for r in second["history"]], [2, 4])

    def test_snli_through_tfds_mock_data(self):
        backbone = models.make_tiny_bert(sequence_length=16)
        config = _config(optimizer="dpsgd", learning_rate=1.0,
                         epochs=2 * 16 / 64)
        with tfds.testing.mock_data(num_examples=64):
            results = train_text.run("snli", None, None, 16, config,
                                     backbone=backbone)
        self.assertEqual(results["steps"], 2)


def _tiny_data(n=64):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.integers(0, 2, size=n))


def _tiny_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


class NoiseSeedTest(absltest.TestCase):
    """--seed sets the model and data order; --noise_seed the noise and batches."""

    def fit(self, noise_seed):
        """The weights after 2 steps at seed 0, and the seeds the library got."""
        data = _tiny_data()
        trained = []
        with mock.patch.object(
                tf_dpadam.data, "poisson_batches",
                wraps=tf_dpadam.data.poisson_batches) as sampling, \
                mock.patch.object(tf_dpadam, "make_private",
                                  wraps=tf_dpadam.make_private) as private:
            common.fit_private(
                _tiny_model, data, data,
                _config(epochs=2 * 16 / 64, noise_seed=noise_seed),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                on_trained=lambda model: trained.append(model.get_weights()))
        return (trained[0], sampling.call_args.kwargs["seed"],
                private.call_args.kwargs["seed"])

    def test_default_noise_and_sampling_are_secret(self):
        first, sampling_seed, noise_seed = self.fit(None)
        self.assertIsNone(sampling_seed)
        self.assertIsNone(noise_seed)
        # Same --seed (model and data), other noise and batches.
        second = self.fit(None)[0]
        self.assertFalse(all(np.array_equal(a, b)
                             for a, b in zip(first, second)))

    def test_noise_seed_makes_a_run_reproducible(self):
        runs = []
        for _ in range(2):
            with self.assertWarnsRegex(UserWarning, "explicit seed=5"):
                runs.append(self.fit(5))
        self.assertEqual(runs[0][1:], (5, 5))
        for a, b in zip(runs[0][0], runs[1][0]):
            np.testing.assert_array_equal(a, b)

    def test_diagnostics_key_noise_and_sampling_with_noise_seed(self):
        data = _tiny_data()
        config = _config(optimizer="dpadam", epsilon=1e-8,
                         epochs=1 * 16 / 64, seed=0, noise_seed=4)
        with mock.patch.object(
                tf_dpadam.data, "poisson_batches",
                wraps=tf_dpadam.data.poisson_batches) as sampling, \
                mock.patch.object(tf_dpadam, "make_private",
                                  wraps=tf_dpadam.make_private) as private, \
                self.assertWarnsRegex(UserWarning, "explicit seed=4"):
            diagnostics.train_with_diagnostics(_tiny_model, data, data,
                                               config, report_steps=())
        self.assertEqual(sampling.call_args.kwargs["seed"], 4)
        self.assertEqual(private.call_args.kwargs["seed"], 4)

    def test_research_reruns_key_noise_with_their_seed(self):
        base = reproduce.base_config("fashion_mnist")
        setting = reproduce.Setting("dpadam_corrected", 1e-3, None)
        model_dir = tempfile.mkdtemp()
        config = reproduce.run_config(base, setting, 3, model_dir)
        self.assertEqual((config.seed, config.noise_seed), (3, 3))
        # A run dir from before --noise_seed (its config has no noise_seed;
        # its seed keyed the noise) is the same run; another seed is not.
        saved = dataclasses.asdict(config)
        del saved["noise_seed"]
        with open(os.path.join(model_dir, "metrics.json"), "w") as f:
            json.dump({"config": saved}, f)
        reproduce.check_run_dir(model_dir, config, data=None)
        other = dataclasses.replace(config, noise_seed=4)
        with self.assertRaisesRegex(ValueError, "noise_seed"):
            reproduce.check_run_dir(model_dir, other, data=None)


class DefaultsTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        if "optimizer" not in flags.FLAGS:
            common.define_flags()  # The binaries define them in __main__.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()

    def test_paper_defaults_per_optimizer(self):
        with flagsaver.flagsaver(optimizer="dpsgd"):
            config = common.config_from_flags("cifar10")
        self.assertEqual((config.learning_rate, config.batch_size), (4.0, 2048))
        with flagsaver.flagsaver(optimizer="dpadam_corrected"):
            config = common.config_from_flags("snli")
        self.assertEqual(
            (config.l2_norm_clip, config.noise_multiplier, config.epsilon,
             config.learning_rate),
            (0.1, 0.4, 1e-9, 1e-3),
        )
        with flagsaver.flagsaver(optimizer="dpadam_corrected", epsilon="none"):
            config = common.config_from_flags("cifar10")
        self.assertIsNone(config.epsilon)

    def test_noise_seed_is_secret_unless_given(self):
        with flagsaver.flagsaver(seed=3):
            config = common.config_from_flags("cifar10")
        self.assertEqual((config.seed, config.noise_seed), (3, None))
        with flagsaver.flagsaver(seed=3, noise_seed=5):
            config = common.config_from_flags("cifar10")
        self.assertEqual((config.seed, config.noise_seed), (3, 5))
        self.assertIn("not of the DP noise", flags.FLAGS["seed"].help)
        self.assertIn("anyone who knows it can remove the noise",
                      flags.FLAGS["noise_seed"].help)


if __name__ == "__main__":
    absltest.main()
