"""The registry: which layers are ghost, fallback or refused, and the docs' table."""

import os

import keras

import tf_dpadam
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.privatizer.ghost_clipping import dense
from tf_dpadam.privatizer.ghost_clipping import registry

import helpers

_GUIDE = os.path.join(helpers.REPO_ROOT, "docs", "guides",
                      "layers_and_clipping.md")


class _SubclassedDense(keras.layers.Dense):
    """A subclass that only adds a constructor argument."""

    def __init__(self, units, note="", **kwargs):
        super().__init__(units, **kwargs)
        self.note = note


class _OverridingDense(keras.layers.Dense):

    def call(self, inputs):
        return super().call(inputs) * 2.0


class RuleLookupTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("dense", keras.layers.Dense(3), "Dense"),
        ("einsum", keras.layers.EinsumDense("ab,bc->ac", 3), "EinsumDense"),
        ("embedding", keras.layers.Embedding(5, 3), "Embedding"),
        ("layer_norm", keras.layers.LayerNormalization(),
         "LayerNormalization"),
        ("conv1d", keras.layers.Conv1D(2, 3), "Conv"),
        ("conv2d", keras.layers.Conv2D(2, 3), "Conv"),
        ("grouped_conv", keras.layers.Conv2D(4, 3, groups=2), "Conv"),
        ("subclass", _SubclassedDense(3), "Dense"),
    )
    def test_ghost(self, layer, name):
        rule, reason = registry.ghost_rule(layer)
        self.assertIsNone(reason)
        self.assertEqual(rule.name, name)
        self.assertIs(rule, registry.GHOST_RULES[registry.registered_class(
            layer)])

    @parameterized.named_parameters(
        ("overridden_call", _OverridingDense(3), "call is overridden"),
        ("grouped_ws_conv", tf_dpadam.layers.WSConv2D(4, 3, groups=2),
         "groups > 1"),
        ("einsum_equation", keras.layers.EinsumDense("ab,bc->abc", (2, 3)),
         "equation 'ab,bc->abc'"),
        ("unknown", keras.layers.Conv3D(2, 3), "no ghost rule for Conv3D"),
        ("depthwise", keras.layers.DepthwiseConv2D(3),
         "no ghost rule for DepthwiseConv2D"),
    )
    def test_no_ghost_rule(self, layer, reason):
        rule, got = registry.ghost_rule(layer)
        self.assertIsNone(rule)
        self.assertIn(reason, got)

    def test_lora_and_replaced_call(self):
        # LoRA layers take their table's rule (tests/privatizer/ghost_clipping_lora_test.py).
        layer = keras.layers.Dense(3)
        layer.build((None, 4))
        layer.enable_lora(2)
        self.assertIs(registry.ghost_rule(layer)[0],
                      registry.LORA_RULES[keras.layers.Dense])
        embedding = keras.layers.Embedding(5, 3)
        embedding.build((None, 4))
        embedding.enable_lora(2)
        self.assertEqual(registry.ghost_rule(embedding),
                         (None, "no ghost rule for Embedding with LoRA"))
        plain = keras.layers.Dense(3)
        object.__setattr__(plain, "call", lambda inputs: inputs)
        self.assertEqual(registry.ghost_rule(plain),
                         (None, "call is replaced on the instance"))

    def test_a_registered_rule_is_looked_up_not_tabled(self):
        # A user's rule (tests/privatizer/ghost_clipping_user_rule_test.py):
        # nearest registered class first, not in GHOST_RULES nor the docs.

        class _Rule(dense.DenseRule):
            name = "Registered"

        table = registry.markdown_table()
        tf_dpadam.register_ghost_rule(_SubclassedDense, _Rule)
        self.addCleanup(registry.unregister_ghost_rule, _SubclassedDense)
        self.assertEqual(registry.ghost_rule(_SubclassedDense(3)),
                         (_Rule, None))
        self.assertIs(registry.ghost_rule(keras.layers.Dense(3))[0],
                      dense.DenseRule)
        self.assertNotIn(_SubclassedDense, registry.GHOST_RULES)
        self.assertEqual(registry.markdown_table(), table)

    def test_refusals(self):
        batch_norm = keras.layers.BatchNormalization()
        self.assertTrue(registry.mixes_examples(batch_norm))
        self.assertEqual(registry.refusals(batch_norm),
                         ["mixes examples in training"])
        batch_norm.trainable = False
        self.assertFalse(registry.mixes_examples(batch_norm))
        self.assertEqual(registry.refusals(batch_norm), [])
        regularized = keras.layers.Dense(3, activity_regularizer="l2")
        self.assertEqual(registry.refusals(regularized),
                         ["activity regularizer"])

    def test_describe_names_the_rule_of_every_registered_layer(self):
        model = helpers.sequential(
            (6, 4),
            keras.layers.Conv1D(4, 3, name="conv1d"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.EinsumDense("abc,cd->abd", (4, 5), name="einsum"),
            keras.layers.GRU(3, name="gru"),
            keras.layers.Dense(2, name="dense"),
        )
        self.assertEqual(ghost_clipping.describe(model), {
            "conv1d": "ghost (Conv)",
            "norm": "ghost (LayerNormalization)",
            "einsum": "ghost (EinsumDense)",
            "gru": "fallback: no ghost rule for GRU",
            "dense": "ghost (Dense)",
        })


class DocsTableTest(absltest.TestCase):

    def test_the_guide_table_is_the_registry(self):
        with open(_GUIDE, encoding="utf-8") as f:
            guide = f.read()
        self.assertIn(
            registry.markdown_table(), guide,
            "docs/guides/layers_and_clipping.md's table of ghost rules is out"
            " of date: paste"
            " tf_dpadam.privatizer.ghost_clipping.registry.markdown_table() into it.",
        )


if __name__ == "__main__":
    absltest.main()
