"""Every binary of the harness runs a few DP steps on tiny or mock data (their
command lines: binaries_command_line_test and readme_test)."""

import json
import os
import tempfile
from unittest import mock

import numpy as np
import tensorflow_datasets as tfds
import keras
from absl.testing import absltest
from absl.testing import flagsaver

import tf_dpadam
from research import common
from research import datasets
from research import diagnostics
from research import models
from research import record_sources
from research import train_image
from research import train_text

from research.tests import research_helpers


class TinyImagesForTest(tfds.core.GeneratorBasedBuilder):
    """96 train and 16 test 8x8 grey images, labels 0-9; no download."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples(96, 0),
                "test": self._generate_examples(16, 1)}

    def _generate_examples(self, n, seed):
        rng = np.random.default_rng(seed)
        for i in range(n):
            yield i, {"image": rng.integers(0, 256, (8, 8, 1), np.uint8),
                      "label": i % 10}


class ImageBinaryTest(absltest.TestCase):

    def test_cifar10_through_tfds_mock_data(self):
        model_dir = tempfile.mkdtemp()
        config = research_helpers.train_config(epochs=4 * 16 / 64, model_dir=model_dir)
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
        more = research_helpers.train_config(epochs=6 * 16 / 64, model_dir=model_dir)
        with tfds.testing.mock_data(num_examples=64):
            results = train_image.run("cifar10", None, more)
        self.assertEqual(results["steps"], 6)
        self.assertEqual([r["step"] for r in results["history"]], [2, 4, 6])

    def test_data_source_reads_only_the_sampled_records(self):
        # --data_source: a tfds image dataset prepared as ArrayRecord, read
        # by random access: every read is one step's Poisson(q = 16/96)
        # sample, never the whole set, and the accounting uses N = 96.
        data_dir = tempfile.mkdtemp()
        builder = TinyImagesForTest(data_dir=data_dir, file_format="array_record")
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(
                try_download_gcs=False))
        train, (x_test, y_test), num_classes = (
            record_sources.image_data_source("tiny_images_for_test", data_dir))
        self.assertLen(train, 96)
        by_folder, _, _ = record_sources.image_data_source(
            os.path.join(data_dir, "tiny_images_for_test", "1.0.0"))
        self.assertLen(by_folder, 96)
        self.assertEqual((x_test.shape, num_classes), ((16, 8, 8, 1), 10))
        x, y = train.decode([train.source[0], train.source[1]])
        self.assertEqual((x.shape, x.dtype, y.dtype),
                         ((2, 8, 8, 1), np.float32, np.int32))
        self.assertBetween(float(x.max()), 0.0, 1.0)
        reads = []  # the records of each read: one step's sample
        original = type(train.source).__getitems__

        def counting(source, indices):
            reads.append(list(indices))
            return original(source, indices)

        config = research_helpers.train_config(epochs=4 * 16 / 96)
        with mock.patch.object(type(train.source), "__getitems__", counting):
            results = train_image.run(None, data_dir, config,
                                      data_source="tiny_images_for_test")
        self.assertEqual((results["steps"], results["num_examples"]), (4, 96))
        self.assertEqual(results["epsilon"], common.spent_epsilon(config, 4,
                                                                  96))
        # One read per step (the pipeline may prefetch a few more), each of
        # one Poisson sample: about 16 records, never a pass over all 96.
        self.assertGreaterEqual(len(reads), 4)
        self.assertLess(max(len(r) for r in reads), 48)
        self.assertTrue(all(len(set(r)) == len(r) for r in reads))
        with self.assertRaisesRegex(datasets.DatasetUnavailableError,
                                    "--data_source=nowhere"):
            record_sources.image_data_source("nowhere", data_dir)

    def test_augmult_trains_on_augmented_views(self):
        config = research_helpers.train_config(epochs=2 * 16 / 64, eval_every=2,
                                      augmult=2)
        with tfds.testing.mock_data(num_examples=64), \
                mock.patch.object(tf_dpadam, "make_private",
                                  wraps=tf_dpadam.make_private) as private:
            results = train_image.run("cifar10", None, config)
        self.assertEqual(results["steps"], 2)
        # The record says how the run was trained.
        self.assertEqual(results["config"]["augmult"], 2)
        kwargs = private.call_args.kwargs
        self.assertEqual(kwargs["augmult"], 2)
        self.assertEqual([type(layer).__name__
                          for layer in kwargs["augment"].layers],
                         ["RandomFlip", "RandomTranslation"])

    def test_target_epsilon_stops_at_the_calibrated_step(self):
        config = research_helpers.train_config(
            optimizer="dpsgd", learning_rate=0.5, noise_multiplier=2.0,
            target_epsilon=3.0, eval_every=5,
        )
        with tfds.testing.mock_data(num_examples=64):
            results = train_image.run("cifar10", None, config)
        expected = common.total_steps(config, 64)
        self.assertEqual(results["steps"], expected)
        self.assertLessEqual(results["epsilon"], 3.0)

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                train_image.main(["train_image", "stray"])


class TinyTextForTest(tfds.core.GeneratorBasedBuilder):
    """64 train and 16 validation sentences (or premise/hypothesis pairs,
    config "pairs", with some unlabeled: -1) and binary labels."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="sentences"),
                       tfds.core.BuilderConfig(name="pairs")]

    def _info(self):
        text = {"sentence": tfds.features.Text()}
        if self.builder_config.name == "pairs":
            text = {"premise": tfds.features.Text(),
                    "hypothesis": tfds.features.Text()}
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(dict(
                text, label=tfds.features.ClassLabel(num_classes=2))),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples(64, 0),
                "validation": self._generate_examples(16, 1)}

    def _generate_examples(self, n, seed):
        rng = np.random.default_rng(seed)
        words = ["good", "bad", "movie", "the", "a", "great", "awful"]
        for i in range(n):
            sentence = " ".join(rng.choice(words, size=5))
            label = int("good" in sentence)
            if self.builder_config.name == "pairs":
                yield i, {"premise": sentence, "hypothesis": "the movie",
                          "label": -1 if i % 8 == 7 else label}
            else:
                yield i, {"sentence": sentence, "label": label}


class TextBinaryTest(absltest.TestCase):

    def test_data_source_tokenizes_each_sampled_batch(self):
        data_dir = tempfile.mkdtemp()
        backbone = models.make_tiny_bert(sequence_length=16)
        for config_name in ("sentences", "pairs"):
            builder = TinyTextForTest(config=config_name, data_dir=data_dir,
                                      file_format="array_record")
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(
                    try_download_gcs=False))
            name = f"tiny_text_for_test/{config_name}"
            train, (x_test, y_test), classes = record_sources.text_data_source(
                name, backbone[1], data_dir)
            self.assertEqual((len(train), classes), (64, 2))
            # Unlabeled pairs are left out of the evaluation and weigh 0
            # in training (sampled at the same rate, so q = B / N holds).
            self.assertLen(y_test, 14 if config_name == "pairs" else 16)
            self.assertEqual(x_test["token_ids"].shape[1], 16)
            records = [train.source[i] for i in range(len(train))]
            _, y, weight = train.decode(records)
            labels = np.array([r["label"] for r in records])
            np.testing.assert_array_equal(weight, labels >= 0)
            np.testing.assert_array_equal(y, np.maximum(labels, 0))
            self.assertEqual(int((weight == 0).sum()),
                             8 if config_name == "pairs" else 0)
        # Training on the pairs (the harder input) covers the sentences'
        # path too: the same RecordSource, decode and transform.
        config = research_helpers.train_config(optimizer="dpadam", epsilon=1e-8,
                                      epochs=4 * 16 / 64)
        results = train_text.run(None, data_dir, None, 16, config,
                                 backbone=backbone, data_source=name)
        self.assertEqual((results["steps"], results["num_examples"]), (4, 64))
        self.assertBetween(results["test_accuracy"], 0.0, 1.0)

    def test_sst2_tsv_with_a_tiny_bert(self):
        folder = research_helpers.write_sst2_tsv()
        backbone = models.make_tiny_bert(sequence_length=16)
        config = research_helpers.train_config(optimizer="dpadam", epsilon=1e-8,
                              epochs=4 * 16 / 48)
        results = train_text.run("sst2_tsv", folder, None, 16, config,
                                 backbone=backbone, cache_frozen=False)
        self.assertEqual(results["steps"], 4)
        self.assertBetween(results["test_accuracy"], 0.0, 1.0)

    def test_no_cache_when_the_features_would_not_fit(self):
        folder = research_helpers.write_sst2_tsv()
        backbone = models.make_tiny_bert(sequence_length=16)
        # 64 examples x 16 x 32 floats x 2 copies = 262 kB > 3 x 80 kB.
        with mock.patch.object(train_text, "memory_bytes",
                               return_value=3 * 80_000), \
                mock.patch.object(models, "frozen_features") as features:
            results = train_text.run(
                "sst2_tsv", folder, None, 16, research_helpers.train_config(epochs=2 * 16 / 48),
                backbone=backbone, feature_cache={})
        features.assert_not_called()
        self.assertEqual(results["steps"], 2)

    def test_cached_features_are_computed_once_and_resume(self):
        folder = research_helpers.write_sst2_tsv()
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
                research_helpers.train_config(epochs=2 * 16 / 48, model_dir=model_dir),
                backbone=backbone,
                feature_cache=cache)
            self.assertEqual(calls, [48, 16])  # Train and dev, once each.
            # A resumed run (more epochs) reloads the checkpoint of the top
            # model and trains on the cached features.
            second = train_text.run(
                "sst2_tsv", folder, None, 16,
                research_helpers.train_config(epochs=4 * 16 / 48, model_dir=model_dir),
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
        config = research_helpers.train_config(optimizer="dpsgd", learning_rate=1.0,
                         epochs=2 * 16 / 64)
        with tfds.testing.mock_data(num_examples=64):
            results = train_text.run("snli", None, None, 16, config,
                                     backbone=backbone)
        self.assertEqual(results["steps"], 2)


class DiagnosticsBinaryTest(absltest.TestCase):

    def test_train_with_diagnostics_snapshots_and_keys_the_noise(self):
        rng = np.random.default_rng(0)
        data = (rng.normal(size=(64, 3)).astype("float32"),
                rng.integers(0, 2, size=64))
        config = research_helpers.train_config(optimizer="dpadam", epsilon=1e-8,
                         epochs=3 * 16 / 64, eval_every=1, noise_seed=4)
        with mock.patch.object(
                tf_dpadam.data, "poisson_batches",
                wraps=tf_dpadam.data.poisson_batches) as sampling, \
                mock.patch.object(tf_dpadam, "make_private",
                                  wraps=tf_dpadam.make_private) as private, \
                self.assertWarnsRegex(UserWarning, "explicit seed=4"):
            moments, results = diagnostics.train_with_diagnostics(
                lambda: keras.Sequential([keras.Input((3,)),
                                          keras.layers.Dense(2)]),
                data, data, config, report_steps=(1, 10))
        self.assertEqual(sampling.call_args.kwargs["seed"], 4)
        self.assertEqual(private.call_args.kwargs["seed"], 4)
        self.assertTrue(private.call_args.kwargs["diagnostics"])
        # Step 1 and the last step (10 is past it); it stops at step 3.
        self.assertEqual(sorted(moments.snapshots), [1, 3])
        self.assertEqual(results["steps"], 3)
        self.assertEqual(results["num_parameters"], 3 * 2 + 2)
        # Physical batches of 8 for an expected batch of 16 (and its
        # Poisson headroom): several per step.
        self.assertGreaterEqual(results["accumulation_steps"], 2)
        for key in ("capacity", "epsilon", "test_accuracy", "wall_seconds"):
            self.assertIn(key, results)


if __name__ == "__main__":
    absltest.main()
