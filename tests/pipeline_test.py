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
from absl.testing import absltest

import tf_dpadam
from research import models

import helpers

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_SENTENCES = np.array([
    "the movie was good", "bad film", "a great story", "terrible acting",
    "good acting and a great story", "the film was bad", "story", "great",
])
_LABELS = np.array([1, 0, 1, 0, 1, 0, 1, 1])


def _task_model(seed=0):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone, preprocessor = models.make_tiny_bert(
        num_layers=1, hidden_dim=16, intermediate_dim=32, sequence_length=8,
        dropout=0.0)
    return keras_hub.models.BertTextClassifier(
        backbone, 2, preprocessor=preprocessor, dropout=0.0)


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


if __name__ == "__main__":
    absltest.main()
