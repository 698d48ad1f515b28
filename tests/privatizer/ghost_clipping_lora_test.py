"""Ghost clipping of Dense and EinsumDense with LoRA against explicit clipping.

The rules (`src/tf_dpadam/privatizer/ghost_clipping/lora.py`) get the per-example gradients
of the factors A and B from the layer's input, its low-rank activation and
the output gradient; these tests run them in lockstep with per-example
gradients of the whole model (`helpers.reference_per_example_gradients`).
"""

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.privatizer.ghost_clipping import lora
from tf_dpadam.privatizer.ghost_clipping import registry

import helpers


def _randomize_factors(model, seed=3):
    """Random LoRA factors: B starts at zero, which zeroes A's gradients."""
    rng = helpers.rng(seed)
    for v in model.trainable_variables:
        if "lora_kernel" in v.path:
            v.assign(0.5 * rng.normal(size=v.shape).astype("float32"))


def _lora_model(input_shape, layer, rank, alpha, after_build):
    """`layer` (with LoRA of `rank`), flattened, then a Dense(3) head."""
    model = helpers.sequential(input_shape, layer, keras.layers.Flatten(),
                               keras.layers.Dense(3, name="head"))
    if after_build:
        layer.enable_lora(rank, lora_alpha=alpha)
    _randomize_factors(model)
    return model


class LoraDenseTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(
        ("flat_constructor", (5,), "tanh", False),
        ("flat_after_build", (5,), None, True),
        ("sequence_constructor", (4, 5), None, False),
        ("sequence_after_build", (4, 5), "relu", True),
    )
    @pytest.mark.slow
    def test_dense(self, input_shape, activation, after_build):
        kwargs = {} if after_build else {"lora_rank": 2, "lora_alpha": 3}
        layer = keras.layers.Dense(6, activation=activation, name="lora",
                                   **kwargs)
        model = _lora_model(input_shape, layer, rank=2, alpha=3,
                            after_build=after_build)
        # (Dense's constructor enables LoRA with lora_alpha = lora_rank.)
        self.assertEqual(layer.lora_alpha / layer.lora_rank,
                         1.5 if after_build else 1.0)
        self.assertEqual(
            [v.path.rsplit("/", 1)[-1] for v in model.trainable_variables],
            ["bias", "lora_kernel_a", "lora_kernel_b", "kernel", "bias"],
        )
        x = helpers.normal((helpers.BATCH, *input_shape))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, lora="ghost (Dense with LoRA)")
        self.assert_lockstep(model, x, y)

    def test_masked_examples_and_unfrozen_kernel(self):
        # W made trainable again gets the plain kernel block besides A and B;
        # masked examples contribute nothing.
        layer = keras.layers.Dense(6, activation="tanh", name="lora")
        model = _lora_model((4, 5), layer, rank=3, alpha=None,
                            after_build=True)
        layer._kernel.trainable = True
        x = helpers.normal((helpers.BATCH, 4, 5))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        mask = np.array([1, 0, 1, 1, 0, 1, 1, 1], "float32")
        self.assert_kinds(model, lora="ghost (Dense with LoRA)")
        self.assert_lockstep(model, x, y, mask=mask)

    @pytest.mark.slow
    def test_regularized_factors_under_xla(self):
        # Keras gives the factors the kernel's regularizer.
        layer = keras.layers.Dense(6, activation="tanh", name="lora",
                                   kernel_regularizer="l2")
        model = _lora_model((4, 5), layer, rank=2, alpha=None,
                            after_build=True)
        x = helpers.normal((helpers.BATCH, 4, 5))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_lockstep(model, x, y, jit=True)


class LoraEinsumDenseTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(
        # B's axis an output axis.
        ("matrix_tanh", "ab,bc->ac", (5,), 4, "c", "tanh", True),
        ("sequence", "abc,cd->abd", (3, 5), (3, 4), "d", None, True),
        ("sequence_tanh_constructor", "abc,cd->abd", (3, 5), (3, 4), "d",
         "tanh", False),
        # Attention-style projections: to heads, and back from them.
        ("heads_tanh", "abc,cde->abde", (3, 5), (3, 2, 4), "de", "tanh",
         True),
        ("heads_constructor", "abc,cde->abde", (3, 5), (3, 2, 4), "de", None,
         False),
        ("merge_heads_tanh", "abcd,cde->abe", (3, 2, 4), (3, 5), "e", "tanh",
         True),
        ("position_bias_tanh", "abc,cd->abd", (3, 5), (3, 4), "bd", "tanh",
         True),
        ("ellipsis", "...b,bc->...c", (3, 5), 4, "c", None, True),
        # B's axis contracted: the kernel is "dc", B is [r, c].
        ("contracted_last_tanh", "abc,dc->abd", (3, 5), (3, 4), None, "tanh",
         True),
        ("contracted_last_heads", "abcd,ecd->abe", (3, 2, 4), (3, 5), "e",
         None, True),
    )
    @pytest.mark.slow
    def test_einsum_dense(self, equation, input_shape, output_shape, bias,
                          activation, after_build):
        kwargs = {} if after_build else {"lora_rank": 2, "lora_alpha": 4}
        layer = keras.layers.EinsumDense(
            equation, output_shape, bias_axes=bias, activation=activation,
            name="lora", **kwargs)
        model = _lora_model(input_shape, layer, rank=2, alpha=4,
                            after_build=after_build)
        self.assertEqual(layer.lora_alpha / layer.lora_rank, 2.0)
        x = helpers.normal((helpers.BATCH, *input_shape))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, lora="ghost (EinsumDense with LoRA)")
        self.assert_lockstep(model, x, y)

    @pytest.mark.slow
    def test_masked_examples_regularized(self):
        layer = keras.layers.EinsumDense(
            "abc,dc->abd", (3, 4), activation="tanh", name="lora",
            kernel_regularizer="l2")
        model = _lora_model((3, 5), layer, rank=2, alpha=None,
                            after_build=True)
        x = helpers.normal((helpers.BATCH, 3, 5))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        mask = np.array([0, 1, 1, 0, 1, 1, 1, 1], "float32")
        self.assert_lockstep(model, x, y, mask=mask)

    @pytest.mark.slow
    def test_long_sequence_uses_ghost_norms(self):
        # T = 12: the A block of "abc,cde->abde" is [16, 3 heads * rank 4]
        # (d p = 192 > T^2) and takes the ghost norm; B's ([4, 5] at T * 3
        # positions) is formed.
        layer = keras.layers.EinsumDense(
            "abc,cde->abde", (12, 3, 5), bias_axes="de", name="lora")
        model = _lora_model((12, 16), layer, rank=4, alpha=None,
                            after_build=True)
        x = helpers.normal((helpers.BATCH, 12, 16))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_lockstep(model, x, y)
        modes = ghost_clipping.block_modes(
            model, ghost_clipping.compiled_loss_fn(model), x, y)
        # (Paths start with the Sequential's automatic name.)
        modes = {path.split("/", 1)[1]: m for path, m in modes.items()}
        self.assertEqual(modes, {
            "lora/bias": ["MaterializedBlock"],
            "lora/lora_kernel_a": ["ghost"],
            "lora/lora_kernel_b": ["materialize"],
            "head/kernel": ["outer"],
            "head/bias": ["MaterializedBlock"],
        })


class LoraBlocksTest(parameterized.TestCase):
    """`lora_blocks` against per-example gradients formed by hand (NumPy)."""

    @parameterized.parameters(True, False)
    def test_against_numpy(self, output_side):
        rng = helpers.rng(7)
        batch, t, r, k, other = 3, 4, 2, 5, 3
        d, p = (6, other * k) if output_side else (other * k, 6)
        a = rng.normal(size=(batch, t, d)).astype("float32")
        g = rng.normal(size=(batch, t, p)).astype("float32")
        b = rng.normal(size=(r, k)).astype("float32")
        scale = 1.5
        shape = (d, other * r) if output_side else (other * r, p)
        a_matrix = rng.normal(size=shape).astype("float32")
        # Example i's loss is sum(z_i * g_i) with z_i = s a_i W, W built
        # from the factors: W = A (I ⊗ B) (column block j is A_j B) or
        # (I ⊗ B^T) A (row block j is B^T A_j). One tape per example.
        a_var, b_var = tf.Variable(a_matrix), tf.Variable(b)
        want_a, want_b = [], []
        for i in range(batch):
            with tf.GradientTape() as tape:
                if output_side:
                    w = tf.concat([a_var[:, j * r:(j + 1) * r] @ b_var
                                   for j in range(other)], axis=1)
                else:
                    w = tf.concat([tf.transpose(b_var)
                                   @ a_var[j * r:(j + 1) * r]
                                   for j in range(other)], axis=0)
                z = scale * (a[i] @ w)
                loss = tf.reduce_sum(z * g[i])
            ga, gb = tape.gradient(loss, [a_var, b_var])
            want_a.append(ga.numpy())
            want_b.append(gb.numpy())
        a_block, b_block = lora.lora_blocks(
            tf.constant(a), tf.constant(g), tf.constant(a_matrix),
            tf.constant(b), scale, output_side, lambda w: w, lambda m: m)
        factors = tf.constant([0.5, 0.0, 2.0])
        for block, want in ((a_block, want_a), (b_block, want_b)):
            want = np.stack(want)
            np.testing.assert_allclose(
                block.squared_norms(), np.sum(np.square(want), axis=(1, 2)),
                rtol=1e-5)
            np.testing.assert_allclose(
                block.weighted_sum(factors),
                np.tensordot(factors.numpy(), want, axes=1),
                rtol=1e-5, atol=1e-5)


class LoraRegistryTest(parameterized.TestCase):

    def test_rules(self):
        dense = keras.layers.Dense(3, lora_rank=2)
        dense.build((None, 4))
        self.assertEqual(registry.ghost_rule(dense),
                         (lora.LoraDenseRule, None))
        einsum = keras.layers.EinsumDense("abc,cde->abde", (3, 2, 4))
        einsum.build((None, 3, 5))
        einsum.enable_lora(2)
        self.assertEqual(registry.ghost_rule(einsum),
                         (lora.LoraEinsumDenseRule, None))

    @pytest.mark.slow
    def test_refused(self):
        embedding = keras.layers.Embedding(7, 4, lora_rank=2)
        embedding.build((None, 3))
        self.assertEqual(registry.ghost_rule(embedding),
                         (None, "no ghost rule for Embedding with LoRA"))
        quantized = keras.layers.Dense(3)
        quantized.build((None, 4))
        quantized.quantize("int8")
        quantized.enable_lora(2)
        self.assertEqual(registry.ghost_rule(quantized),
                         (None, "the layer is quantized"))
        replaced = keras.layers.Dense(3, lora_rank=2)
        replaced.build((None, 4))
        object.__setattr__(replaced, "call", lambda inputs: inputs)
        self.assertEqual(registry.ghost_rule(replaced),
                         (None, "call is replaced on the instance"))

        class Kernel(keras.layers.Dense):
            @property
            def kernel(self):
                return super().kernel * 2.0

        overridden = Kernel(3, lora_rank=2)
        overridden.build((None, 4))
        self.assertEqual(registry.ghost_rule(overridden),
                         (None, "kernel is overridden"))
        # Without LoRA the rule uses the property as the call does.
        self.assertIsNotNone(registry.ghost_rule(Kernel(3))[0])


class LoraBertTest(parameterized.TestCase):
    """A tiny keras-hub BERT with `backbone.enable_lora` under make_private."""

    @pytest.mark.slow
    def test_ghost_equals_vectorized_and_explicit(self):
        length = 6
        model = helpers.tiny_lora_bert(length)
        _randomize_factors(model)
        described = ghost_clipping.describe(model)
        self.assertEqual(
            sorted(k for k, v in described.items() if "LoRA" in v),
            ["query", "value"])
        self.assertTrue(all(v.startswith("ghost") for v in described.values()),
                        described)

        batch = helpers.BATCH
        x, y = helpers.random_bert_batch(helpers.rng(5), length, batch)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        variables = model.trainable_variables
        # One DPSGD step, lr 1.
        clip, want = helpers.reference_dpsgd_step(self, model, loss, x, y)

        before = helpers.numpy_values(variables)
        # The steps alone: the guard's probes would trace each path once
        # more. The guard is run on this LoRA BERT under clipping="auto"
        # (ghost) by tests/training/lora_state_test.py, and on a keras-hub
        # BERT under clipping="vectorized" by tests/guard_corpus_test.py.
        for clipping in ("ghost", "vectorized"):
            private = helpers.noise_free_dpsgd_step(
                model, loss, clip, x, y, clipping=clipping,
                check_independence=False)
            self.assertEqual(private.clipping_used, clipping)
            helpers.assert_update(variables, before, want)
            for v, b in zip(variables, before):
                v.assign(b)


if __name__ == "__main__":
    absltest.main()
