"""Ghost clipping of ReversibleEmbedding and keras-hub's PositionEmbedding
against explicit clipping; BERT and GPT-2 backbones with every weight
trainable; augmentation multiplicity; what falls back."""

import sys
from unittest import mock

import keras
import keras_hub
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from keras import layers

from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.privatizer.ghost_clipping import keras_hub as keras_hub_rules
from tf_dpadam.privatizer.ghost_clipping import registry

import helpers

_B = helpers.BATCH
_VOCABULARY = 9
_SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _ids(shape, seed=0):
    """Ids in [1, _VOCABULARY), with repeats."""
    return helpers.rng(seed).integers(1, _VOCABULARY, size=shape).astype(
        "int32")


def _positions(length=5, width=4, start_index=0, twice=False, heads=None,
               positions=False):
    """x + PositionEmbedding(x) -> Dense(tanh) -> Dense(3) (regression).

    `heads`: inputs `[B, heads, length, width]` (the rows broadcast over the
    heads too); `positions`: a second input of per-example positions, with
    repeats; `twice`: the layer is called again at another start.
    """
    keras.utils.set_random_seed(0)
    shape = (length, width) if heads is None else (heads, length, width)
    inputs = keras.Input(shape)
    layer = keras_hub.layers.PositionEmbedding(length + 3, name="positions")
    x = [helpers.normal((_B, *shape))]
    if positions:
        ids = keras.Input((length,), dtype="int32")
        h = inputs + layer(inputs, positions=ids)
        inputs = [inputs, ids]
        x.append(helpers.rng(3).integers(
            0, length + 3, size=(_B, length)).astype("int32"))
    else:
        h = inputs + layer(inputs, start_index=start_index)
    if twice:
        h = h * layer(inputs, start_index=start_index + 2)
    h = layers.Dense(4, activation="tanh")(h)
    model = keras.Model(inputs, layers.Dense(3)(layers.Flatten()(h)))
    return model, x if len(x) > 1 else x[0]


def _reversible(tie_weights=True, reverse=True, hub=True, **kwargs):
    """ids -> ReversibleEmbedding -> Dense(tanh) -> (reverse: per-position
    logits over the vocabulary, else pooled Dense(3))."""
    keras.utils.set_random_seed(0)
    cls = (keras_hub.layers.ReversibleEmbedding if hub
           else layers.ReversibleEmbedding)
    embedding = cls(_VOCABULARY, 4, tie_weights=tie_weights,
                    name="reversible", **kwargs)
    inputs = keras.Input((6,), dtype="int32")
    h = layers.Dense(4, activation="tanh")(embedding(inputs))
    if reverse:
        outputs = embedding(h, reverse=True)
    else:
        outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs), _ids((_B, 6))


def _bert_inputs(length=6, seed=0):
    lengths = helpers.rng(seed).integers(2, length + 1, size=_B)
    padding = (np.arange(length) < lengths[:, None]).astype("int32")
    return {"token_ids": _ids((_B, length), seed) * padding,
            "segment_ids": (np.arange(length) >= 3).astype("int32")
            * np.ones((_B, 1), "int32"),
            "padding_mask": padding}


def _bert():
    """A tiny keras-hub BERT, every weight trainable, Dense(3) on pooled."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=10, dropout=0.0,
    )
    outputs = layers.Dense(3)(backbone.output["pooled_output"])
    return keras.Model(backbone.input, outputs), _bert_inputs()


def _gpt2():
    """A tiny keras-hub GPT-2 with its tied token embedding as the output
    layer (as GPT2CausalLM): logits over the vocabulary at every position."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=10, dropout=0.0,
    )
    logits = backbone.token_embedding(backbone.output, reverse=True)
    x = _bert_inputs()
    del x["segment_ids"]
    return keras.Model(backbone.input, logits), x


def _next_ids(x):
    """Per-position targets for a model of `_ids` (or dict) inputs."""
    ids = x["token_ids"] if isinstance(x, dict) else x
    return np.roll(ids, -1, axis=1)


class _OverridingPositionEmbedding(keras_hub.layers.PositionEmbedding):

    def call(self, inputs, start_index=0, positions=None):
        return 2.0 * super().call(inputs, start_index, positions)


class _OverridingReversibleEmbedding(keras_hub.layers.ReversibleEmbedding):

    def call(self, inputs, reverse=False):
        return super().call(inputs, reverse=reverse)


class PositionEmbeddingTest(helpers.GhostLockstepMixin,
                            parameterized.TestCase):

    @parameterized.named_parameters(
        ("graph", {}, False),
        ("jit", {}, True),
        ("start_index", {"start_index": 2}, False),
        ("called_twice", {"twice": True}, False),
        ("heads", {"heads": 2}, False),
        ("positions", {"positions": True}, False),
        ("positions_jit", {"positions": True}, True),
    )
    @pytest.mark.slow
    def test_lockstep(self, kwargs, jit):
        model, x = _positions(**kwargs)
        self.assert_kinds(model, positions="ghost (PositionEmbedding)")
        self.assert_lockstep(model, x, helpers.normal((_B, 3), seed=1),
                             jit=jit)

    def test_dynamic_batch_and_regularizer(self):
        model, x = _positions()
        model.get_layer("positions").position_embeddings.regularizer = (
            keras.regularizers.L2(0.1))
        self.assert_lockstep(model, x, helpers.normal((_B, 3), seed=1),
                             dynamic_batch=True)


class ReversibleEmbeddingTest(helpers.GhostLockstepMixin,
                              parameterized.TestCase):

    @parameterized.named_parameters(
        ("tied", {}, False),
        ("tied_jit", {}, True),
        ("untied", {"tie_weights": False}, False),
        ("soft_cap_keras", {"logit_soft_cap": 2.0, "hub": False}, False),
        ("reverse_dtype", {"reverse_dtype": "float32"}, False),
    )
    @pytest.mark.slow
    def test_reverse(self, kwargs, jit):
        model, x = _reversible(**kwargs)
        self.assert_kinds(model, reversible="ghost (ReversibleEmbedding)")
        self.assert_lockstep(model, x, _next_ids(x), loss=_SCCE, jit=jit)

    @parameterized.named_parameters(("tied", True), ("untied", False))
    def test_forward_only(self, tie_weights):
        # Untied, the reverse embeddings are unused: no block, update 0.
        model, x = _reversible(tie_weights=tie_weights, reverse=False,
                               mask_zero=True)
        x[:, 4:] = 0  # padding, masked in the pooling
        self.assert_lockstep(model, x, helpers.normal((_B, 3), seed=1))

    @pytest.mark.slow
    def test_tied_regularizer(self):
        model, x = _reversible(embeddings_regularizer="l2")
        self.assert_lockstep(model, x, _next_ids(x), loss=_SCCE)

    def test_the_tied_block_has_the_cross_term(self):
        model, x = _reversible()
        modes = ghost_clipping.block_modes(
            model, ghost_clipping.compiled_loss_fn(_compiled(model)), x,
            _next_ids(x))
        self.assertEqual(modes["reversible/embeddings"],
                         ["TiedEmbeddingBlock"])


def _compiled(model):
    model.compile(loss=_SCCE)
    return model


class BackboneTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(("graph", False), ("jit", True))
    @pytest.mark.slow
    def test_bert_every_weight_trainable(self, jit):
        model, x = _bert()
        self.assert_kinds(
            model, token_embedding="ghost (ReversibleEmbedding)",
            position_embedding="ghost (PositionEmbedding)",
            segment_embedding="ghost (Embedding)",
        )
        self.assertNotIn("fallback", " ".join(
            ghost_clipping.describe(model).values()))
        self.assert_lockstep(model, x, helpers.rng(1).integers(0, 3, _B),
                             loss=_SCCE, jit=jit)

    @pytest.mark.slow
    def test_gpt2_tied_output(self):
        model, x = _gpt2()
        self.assert_kinds(model, token_embedding="ghost (ReversibleEmbedding)",
                          position_embedding="ghost (PositionEmbedding)")
        self.assert_lockstep(model, x, _next_ids(x), loss=_SCCE)

    @pytest.mark.slow
    def test_mixed_precision_forward_is_the_layers(self):
        # The recorded forward computes what the layers compute (dtypes
        # and values), under a float16 policy.
        keras.mixed_precision.set_global_policy("mixed_float16")
        self.addCleanup(keras.mixed_precision.set_global_policy, "float32")
        model, x = _gpt2()
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        y = _next_ids(x)
        _compiled(model)
        *_, y_pred = helpers.ghost_clipped_sum(
            model, x, tf.convert_to_tensor(y), None, 1.0, None, False)
        want = model(x, training=True)
        self.assertEqual(y_pred.dtype, want.dtype)
        np.testing.assert_array_equal(y_pred, want)


def _grouped_brute_force(model, x, y, size, clip):
    """The sum over examples (groups of `size` rows) of their clipped mean
    loss gradients, one example at a time; and the norms."""
    grads = []
    for i in range(0, _B, size):
        rows = tf.nest.map_structure(lambda t, i=i: t[i:i + size], x)
        with tf.GradientTape() as tape:
            loss = _SCCE(y[i:i + size], model(rows, training=True))
        grads.append([
            np.array(tf.convert_to_tensor(g), "float64")
            for g in tape.gradient(loss, model.trainable_variables)
        ])
    norms = np.sqrt([sum(np.sum(g ** 2) for g in e) for e in grads])
    if clip is None:
        clip = float(np.median(norms)) * 1.0001
    factors = np.minimum(1.0, clip / norms)
    return [sum(f * e[j] for f, e in zip(factors, grads))
            for j in range(len(grads[0]))], norms, clip


class AugmentationMultiplicityTest(parameterized.TestCase):

    @parameterized.named_parameters(("bert", _bert), ("gpt2", _gpt2))
    @pytest.mark.slow
    def test_views_of_an_example_are_one_group(self, build):
        # Rows 2i and 2i + 1 are two views of example i (different tokens,
        # the same positions).
        model, x = build()
        y = (_next_ids(x) if "segment_ids" not in x
             else helpers.rng(1).integers(0, 3, _B))
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        want, norms, clip = _grouped_brute_force(model, x, y, 2, None)
        loss_fn = ghost_clipping.compiled_loss_fn(_compiled(model))

        @tf.function
        def run(x, y):
            return ghost_clipping.clipped_gradient_sum(
                model, loss_fn, x, y, None, clip, group_size=2)

        summed, ghost_norms, _, _ = run(x, tf.convert_to_tensor(y))
        np.testing.assert_allclose(ghost_norms, norms, rtol=2e-5)
        scale = max(np.max(np.abs(w)) for w in want)
        for v, got, w in zip(model.trainable_variables, summed, want):
            np.testing.assert_allclose(got, w, rtol=5e-5, atol=5e-6 * scale,
                                       err_msg=v.path)


class FallbackTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_lora_quantized_and_overridden_fall_back(self):
        lora = keras_hub.layers.ReversibleEmbedding(_VOCABULARY, 4)
        lora.build()
        lora.enable_lora(2)
        self.assertEqual(
            registry.ghost_rule(lora),
            (None, "no ghost rule for ReversibleEmbedding with LoRA"))
        quantized = layers.ReversibleEmbedding(_VOCABULARY, 4,
                                               tie_weights=False)
        quantized.build()
        quantized.quantize("int8")
        self.assertEqual(registry.ghost_rule(quantized),
                         (None, "the layer is quantized"))
        for layer in (_OverridingPositionEmbedding(5),
                      _OverridingReversibleEmbedding(_VOCABULARY, 4)):
            self.assertEqual(registry.ghost_rule(layer),
                             (None, "call is overridden"))

    def test_no_keras_hub_rules_before_keras_hub_is_imported(self):
        with mock.patch.dict(sys.modules, {"keras_hub": None}):
            self.assertEqual(keras_hub_rules.ghost_rules(), {})
            layer = keras_hub.layers.PositionEmbedding(5)
            self.assertEqual(registry.ghost_rule(layer),
                             (None, "no ghost rule for PositionEmbedding"))
        self.assertEqual(
            keras_hub_rules.ghost_rules(),
            {keras_hub.layers.PositionEmbedding:
             keras_hub_rules.PositionEmbeddingRule})


if __name__ == "__main__":
    absltest.main()
