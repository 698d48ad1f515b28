"""A keras-hub task model with its preprocessor, through make_private.

`keras_hub.models.BertTextClassifier(backbone, num_classes,
preprocessor=...)`, every weight trainable (full fine-tuning), fits on raw
strings: one noise-free DP-SGD step on strings equals brute-force
per-example clipping (a one-example tape per example) of the preprocessed
batch; padding rows of weight 0 change nothing; evaluate, predict and a
saved model take strings too.
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.data import pipeline

import helpers

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_SENTENCES = np.array([
    "the movie was good", "bad film", "a great story", "terrible acting",
    "good acting and a great story", "the film was bad", "story", "great",
])
_LABELS = np.array([1, 0, 1, 0, 1, 0, 1, 1])


def _task_model(seed=0):
    return helpers.tiny_bert_classifier(seed)


def _private(model, clip, clipping="auto"):
    private = tf_dpadam.make_private(model, clipping=clipping)
    private.compile(
        optimizer=tf_dpadam.DPSGD(l2_norm_clip=clip, noise_multiplier=0.0,
                                  learning_rate=1.0,
                                  batch_size=len(_SENTENCES)),
        loss=_LOSS, metrics=["accuracy"])
    return private


def _token_ids(model, sentences):
    x, _, _ = keras.utils.unpack_x_y_sample_weight(
        model.preprocessor(tf.constant(sentences)))
    return x


class TaskModelTest(absltest.TestCase):

    @pytest.mark.slow
    def test_fit_on_strings_equals_brute_force(self):
        model = _task_model()
        variables = model.trainable_variables
        # Full fine-tuning: the embeddings, the block and the head.
        self.assertEqual(len(variables), len(model.weights))
        x = _token_ids(model, _SENTENCES)
        y = tf.constant(_LABELS)
        clip, want = helpers.reference_dpsgd_step(self, model, _LOSS, x, y)
        before = helpers.numpy_values(variables)

        private = _private(model, clip)
        private.fit(_SENTENCES, _LABELS, batch_size=len(_SENTENCES),
                    shuffle=False, verbose=0)
        self.assertEqual(private.clipping_used, "ghost")
        helpers.assert_update(variables, before, want)
        after = helpers.numpy_values(variables)

        # Rows of weight 0 (Poisson padding: empty strings) change nothing.
        for v, b in zip(variables, before):
            v.assign(b)
        padded = tf.data.Dataset.from_tensor_slices((
            np.concatenate([_SENTENCES, ["", ""]]),
            np.concatenate([_LABELS, [0, 0]]),
            np.array([1.0] * len(_SENTENCES) + [0.0, 0.0], "float32"),
        )).batch(len(_SENTENCES) + 2)
        private.fit(padded, verbose=0)
        for v, a, p in zip(variables, after,
                           helpers.numpy_values(variables)):
            np.testing.assert_allclose(p, a, rtol=1e-5, atol=1e-6,
                                       err_msg=v.path)

        # Evaluation and prediction take strings as the task model does.
        logits = model(x, training=False).numpy()
        np.testing.assert_allclose(
            private.predict(_SENTENCES, batch_size=3, verbose=0), logits,
            rtol=1e-5, atol=1e-6)
        loss, accuracy = private.evaluate(_SENTENCES, _LABELS, verbose=0)
        self.assertAlmostEqual(
            loss, float(_LOSS(_LABELS, logits)), places=5)
        self.assertAlmostEqual(
            accuracy, float(np.mean(logits.argmax(1) == _LABELS)), places=6)

        # A saved private model keeps its preprocessor.
        path = os.path.join(tempfile.mkdtemp(), "private.keras")
        private.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(
            loaded.predict(_SENTENCES, verbose=0), logits, rtol=1e-5,
            atol=1e-6)

    @pytest.mark.slow
    def test_validation_data_of_strings(self):
        private = _private(_task_model(), clip=1.0)
        history = private.fit(
            _SENTENCES, _LABELS, batch_size=4, verbose=0,
            validation_data=(_SENTENCES[:3], _LABELS[:3]),
            sampling="shuffled")
        self.assertIn("val_loss", history.history)
        history = private.fit(_SENTENCES, _LABELS, batch_size=4, verbose=0,
                              validation_split=0.25, sampling="shuffled")
        self.assertIn("val_accuracy", history.history)

    def test_unsupported_inputs_raise(self):
        private = _private(_task_model(), clip=1.0)
        generator = ((s, 1) for s in _SENTENCES)
        with self.assertRaisesRegex(ValueError,
                                    "Expected x to be.*preprocess it yourself"):
            private.fit(generator, verbose=0)
        dataset = tf.data.Dataset.from_tensor_slices(
            (_SENTENCES, _LABELS)).batch(4)
        with self.assertRaisesRegex(ValueError, "batch_size=None"):
            private.fit(dataset, batch_size=4, verbose=0)
        with self.assertRaisesRegex(ValueError, "validation_split"):
            private.fit(dataset, validation_split=0.5, verbose=0)


class RowsTest(absltest.TestCase):
    """`as_rows`, `num_rows` and `split_rows`, shared by `fit`'s sampling
    and the keras-hub preprocessing."""

    def test_a_list_of_rows_becomes_one_array(self):
        for numpy_leaves in (False, True):
            rows = pipeline.as_rows(["a", "bc", "d"],
                                    numpy_leaves=numpy_leaves)
            self.assertIsInstance(rows, np.ndarray)
            self.assertEqual(rows.tolist(), ["a", "bc", "d"])
            self.assertIsNone(pipeline.as_rows(None,
                                               numpy_leaves=numpy_leaves))

    def test_structures_and_tensors(self):
        tensor = tf.constant([[1.0], [2.0]])
        data = {"ids": [[1, 2], [3, 4]], "x": tensor}
        kept = pipeline.as_rows(data)
        self.assertIs(kept["x"], tensor)  # Tensors stay tensors.
        self.assertEqual(kept["ids"].shape, (2, 2))
        as_numpy = pipeline.as_rows((tensor, [1, 2]), numpy_leaves=True)
        self.assertIsInstance(as_numpy, tuple)
        self.assertIsInstance(as_numpy[0], np.ndarray)
        np.testing.assert_array_equal(as_numpy[1], [1, 2])

    def test_a_list_of_arrays(self):
        a, b = np.zeros((3, 2)), np.ones((3, 1))
        # For fit: the inputs of a multi-input model stay a list.
        inputs = pipeline.as_rows([a, b], numpy_leaves=True)
        self.assertIsInstance(inputs, list)
        self.assertLen(inputs, 2)
        # For tf.data slicing: one array (as tf.data reads a list).
        stacked = pipeline.as_rows([a, a])
        self.assertEqual(stacked.shape, (2, 3, 2))

    def test_num_rows_and_split_rows(self):
        data = ({"x": np.arange(10).reshape(5, 2)}, np.arange(5), None)
        self.assertEqual(pipeline.num_rows(data), 5)
        head, tail = (pipeline.split_rows(data, 0, 3),
                      pipeline.split_rows(data, 3, 5))
        np.testing.assert_array_equal(head[1], [0, 1, 2])
        np.testing.assert_array_equal(tail[0]["x"], [[6, 7], [8, 9]])
        self.assertIsNone(tail[2])
        self.assertIsNone(pipeline.split_rows(None, 0, 1))


if __name__ == "__main__":
    absltest.main()
