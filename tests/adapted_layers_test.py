"""make_private warns once about layers whose state comes from `adapt`.

A Normalization, Discretization, StringLookup, IntegerLookup or
TextVectorization adapted on the training data carries statistics of that
data that no noise protects. `make_private` (and loading a saved private
model) warns once, naming every such layer; a layer given its state in the
constructor, and a model without such layers, get no warning.
"""

import os
import tempfile
import warnings

import keras
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.privatizer.ghost_clipping import registry


def _adapt_warnings(make):
    """(result of make(), the adapted-layer warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = make()
    return result, [str(w.message) for w in caught
                    if "adapt(data)" in str(w.message)]


_FLOATS = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
_WORDS = np.array(["a b", "c d e", "a c", "f"])


def _layer_model(kind, adapted):
    """A small model with one preprocessing layer named `kind`, either
    adapted on data or given its state explicitly."""
    if kind == "normalization":
        layer = (keras.layers.Normalization(name=kind) if adapted else
                 keras.layers.Normalization(mean=[0.0] * 3,
                                            variance=[1.0] * 3, name=kind))
        if adapted:
            layer.adapt(_FLOATS)
        return keras.Sequential([keras.Input((3,)), layer,
                                 keras.layers.Dense(2)])
    if kind == "discretization":
        layer = (keras.layers.Discretization(num_bins=4, name=kind)
                 if adapted else keras.layers.Discretization(
                     bin_boundaries=[-1.0, 0.0, 1.0], name=kind))
        if adapted:
            layer.adapt(_FLOATS)
        inputs = keras.Input((3,))
        return keras.Sequential([inputs, layer, keras.layers.Embedding(5, 2),
                                 keras.layers.Flatten(),
                                 keras.layers.Dense(2)])
    if kind == "string_lookup":
        vocabulary = None if adapted else ["a", "b", "c"]
        layer = keras.layers.StringLookup(vocabulary=vocabulary, name=kind)
        if adapted:
            layer.adapt(np.array(["a", "b", "c", "a"]))
        inputs = keras.Input((1,), dtype="string")
    elif kind == "integer_lookup":
        vocabulary = None if adapted else [3, 5, 7]
        layer = keras.layers.IntegerLookup(vocabulary=vocabulary, name=kind)
        if adapted:
            layer.adapt(np.array([3, 5, 7, 3]))
        inputs = keras.Input((1,), dtype="int64")
    else:
        assert kind == "text_vectorization", kind
        vocabulary = None if adapted else ["a", "b", "c"]
        layer = keras.layers.TextVectorization(
            vocabulary=vocabulary, output_sequence_length=3, name=kind)
        if adapted:
            layer.adapt(_WORDS)
        inputs = keras.Input((1,), dtype="string")
    return keras.Sequential([inputs, layer, keras.layers.Embedding(10, 2),
                             keras.layers.Flatten(), keras.layers.Dense(2)])


_KINDS = ("normalization", "discretization", "string_lookup",
          "integer_lookup", "text_vectorization")


class _CustomAdapted(keras.layers.Layer):
    """A layer of no listed class with an `adapt` method: warned about."""

    def adapt(self, data):
        self.offset = float(np.mean(data))

    def call(self, inputs):
        return inputs


class AdaptedLayersWarningTest(parameterized.TestCase):

    @parameterized.parameters(*_KINDS)
    def test_adapted_layer_warns_once_naming_it(self, kind):
        model = _layer_model(kind, adapted=True)
        _, messages = _adapt_warnings(lambda: tf_dpadam.make_private(model))
        self.assertLen(messages, 1)
        self.assertIn(f"'{kind}'", messages[0])
        self.assertIn("public data", messages[0])

    @parameterized.parameters(*_KINDS)
    def test_explicit_state_does_not_warn(self, kind):
        model = _layer_model(kind, adapted=False)
        _, messages = _adapt_warnings(lambda: tf_dpadam.make_private(model))
        self.assertEmpty(messages)

    def test_plain_model_does_not_warn(self):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.LayerNormalization(),
                                  keras.layers.Dense(2)])
        _, messages = _adapt_warnings(lambda: tf_dpadam.make_private(model))
        self.assertEmpty(messages)

    def test_one_warning_names_every_adapted_layer(self):
        norm = keras.layers.Normalization(name="norm_a")
        norm.adapt(_FLOATS)
        custom = _CustomAdapted(name="custom_b")
        inner = keras.Sequential([keras.Input((3,)), custom,
                                  keras.layers.Dense(3)], name="inner")
        model = keras.Sequential([keras.Input((3,)), norm, inner,
                                  keras.layers.Dense(2)])
        _, messages = _adapt_warnings(lambda: tf_dpadam.make_private(model))
        self.assertLen(messages, 1)
        self.assertIn("'norm_a'", messages[0])
        self.assertIn("'custom_b'", messages[0])

    def test_text_vectorization_inner_lookup_not_named_again(self):
        model = _layer_model("text_vectorization", adapted=True)
        found = registry.data_adapted_layers(model)
        self.assertEqual([type(layer).__name__ for layer in found],
                         ["TextVectorization"])

    def test_warning_points_at_the_caller(self):
        model = _layer_model("normalization", adapted=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tf_dpadam.make_private(model)
        files = [w.filename for w in caught if "adapt(data)" in str(w.message)]
        self.assertEqual(files, [__file__])

    @parameterized.parameters(True, False)
    def test_loading_warns_once_exactly_when_making_did(self, adapted):
        model = _layer_model("normalization", adapted=adapted)
        private = tf_dpadam.make_private(model)
        private.compile(optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.keras")
            private.save(path)
            loaded, messages = _adapt_warnings(
                lambda: keras.saving.load_model(path))
        self.assertLen(messages, 1 if adapted else 0)
        # The adapted state travelled with the model.
        np.testing.assert_allclose(loaded.predict(_FLOATS, verbose=0),
                                   private.predict(_FLOATS, verbose=0),
                                   rtol=1e-6)


if __name__ == "__main__":
    absltest.main()
