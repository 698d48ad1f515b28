"""LoRA training survives saving and resuming a private model.

Keras saves a LoRA layer with its update merged into the kernel and loads it
with both factors zero, after which LoRA cannot train (both factors'
gradients are zero). A private model saves the factors unmerged and restores
them, LoRA itself and the frozen flags: a resumed run equals an
uninterrupted one.
"""

import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import absltest

import tf_dpadam

import helpers

# Saves and reloads LoRA models (12-22 s each on 2 busy cores); LoRA's
# fast tests are in tests/privatizer/ghost_clipping_lora_test.py.
pytestmark = pytest.mark.slow

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_LENGTH = 6
_BATCH = 8


def _lora_bert(seed=0):
    return helpers.tiny_lora_bert(_LENGTH, output="cls", seed=seed)


def _lora_mlp(seed=0):
    model = helpers.mlp(seed=seed)
    model.layers[0].enable_lora(2)
    return model


def _data(seed=0):
    rng = helpers.rng(seed)
    x = {"token_ids": rng.integers(1, 30, size=(_BATCH, _LENGTH)),
         "segment_ids": np.zeros((_BATCH, _LENGTH), "int32"),
         "padding_mask": np.ones((_BATCH, _LENGTH), "int32")}
    return x, rng.integers(0, 2, size=_BATCH)


def _compiled(model):
    private = tf_dpadam.make_private(model)
    private.compile(optimizer=tf_dpadam.DPAdamCorrected(
        l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.05,
        batch_size=_BATCH), loss=_LOSS)
    return private


def _trainable(private):
    """The indices of the trainable weights among all weights."""
    return [i for i, v in enumerate(private.base_model.weights)
            if v.trainable]


def _values(model):
    return [v.numpy() for v in model.weights]


class LoraStateTest(absltest.TestCase):

    def _assert_same(self, got, want):
        self.assertEqual(len(got), len(want))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)

    def test_resume_from_saved_model_equals_uninterrupted(self):
        for build, data in ((_lora_bert, _data()),
                            (_lora_mlp, helpers.classification_data(
                                _BATCH, classes=2))):
            with self.subTest(build.__name__):
                x, y = data
                private = _compiled(build())
                trainable = _trainable(private)
                self.assertTrue(any("lora_kernel_a" in v.path
                                    for v in private.trainable_variables))
                private.train_on_batch(x, y)
                path = os.path.join(tempfile.mkdtemp(), "lora.keras")
                private.save(path)

                loaded = keras.saving.load_model(path)
                # The raw kernels and both factors, not the merged kernel.
                self._assert_same(_values(loaded.base_model),
                                  _values(private.base_model))
                self.assertEqual(_trainable(loaded), trainable)
                # One more step from each: the same weights.
                private.train_on_batch(x, y)
                loaded.train_on_batch(x, y)
                for a, b in zip(_values(loaded.base_model),
                                _values(private.base_model)):
                    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    def test_weights_file_restores_factors(self):
        x, y = _data()
        private = _compiled(_lora_bert())
        private.train_on_batch(x, y)
        path = os.path.join(tempfile.mkdtemp(), "lora.weights.h5")
        private.save_weights(path)
        other = _compiled(_lora_bert(seed=1))
        other.train_on_batch(x, y)  # Builds the optimizer's variables.
        other.load_weights(path)
        self._assert_same(_values(other.base_model),
                          _values(private.base_model))


if __name__ == "__main__":
    absltest.main()
