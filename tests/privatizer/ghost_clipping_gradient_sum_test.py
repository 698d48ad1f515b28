"""The ghost clipping step on whole models, and what it refuses."""

from unittest import mock

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam import layers as tf_layers

import helpers

_SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class ModelTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(("graph", False, 32), ("jit", True, 16))
    @pytest.mark.slow
    def test_paper_cnn(self, jit, size):
        keras.utils.set_random_seed(0)
        layers = keras.layers
        model = keras.Sequential([
            keras.Input((size, size, 3)),
            layers.Conv2D(32, 3, padding="same", activation="tanh"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="tanh"),
            layers.MaxPooling2D(),
            layers.Conv2D(128, 3, padding="same", activation="tanh"),
            layers.MaxPooling2D(),
            layers.Conv2D(256, 3, padding="same", activation="tanh"),
            layers.Conv2D(10, 3, padding="same"),
            layers.GlobalAveragePooling2D(),
        ])
        x = helpers.normal((helpers.BATCH, size, size, 3))
        y = helpers.rng().integers(0, 10, size=helpers.BATCH)
        self.assertTrue(ghost_clipping.supports(model))
        self.assert_lockstep(model, x, y, loss=_SCCE, jit=jit)

    @pytest.mark.slow
    def test_transformer_block(self):
        keras.utils.set_random_seed(0)
        layers = keras.layers
        ids = keras.Input((6,), dtype="int32")
        h = layers.Embedding(11, 8)(ids)
        attention = layers.MultiHeadAttention(2, 4, name="attention")(h, h)
        h = layers.LayerNormalization(name="norm1")(h + attention)
        h = layers.LayerNormalization(name="norm2")(
            h + layers.Dense(8, activation="relu")(h)
        )
        logits = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
        model = keras.Model(ids, logits)
        x = helpers.rng().integers(0, 11, size=(helpers.BATCH, 6)).astype("int32")
        y = helpers.rng(1).integers(0, 3, size=helpers.BATCH)
        self.assertTrue(ghost_clipping.supports(model))
        described = ghost_clipping.describe(model)
        self.assertEqual(
            sorted(v for k, v in described.items() if k.startswith("query")
                   or k.startswith("key") or k.startswith("value")
                   or k.startswith("attention_output")),
            ["ghost (EinsumDense)"] * 4,
        )
        self.assert_lockstep(model, x, y, loss=_SCCE)
        self.assert_lockstep(model, x, y, loss=_SCCE, jit=True)

    def test_shared_layer_called_twice(self):
        keras.utils.set_random_seed(0)
        shared = keras.layers.Dense(4, activation="tanh")
        a, b = keras.Input((5,)), keras.Input((5,))
        model = keras.Model(
            [a, b], keras.layers.Dense(2)(shared(a) * shared(b))
        )
        x = [helpers.normal((helpers.BATCH, 5)), helpers.normal((helpers.BATCH, 5), seed=2)]
        self.assert_lockstep(model, x, helpers.normal((helpers.BATCH, 2), seed=1))

    def test_subclassed_model(self):

        class Net(keras.Model):

            def __init__(self):
                super().__init__()
                self.embed = keras.layers.Embedding(7, 4)
                self.hidden = keras.layers.Dense(5, activation="tanh")
                self.out = keras.layers.Dense(2)

            def call(self, ids):
                h = self.hidden(self.embed(ids))
                return self.out(ops.mean(h, axis=1))

        keras.utils.set_random_seed(0)
        model = Net()
        x = helpers.rng().integers(0, 7, size=(helpers.BATCH, 5)).astype("int32")
        model(x)
        self.assert_lockstep(model, x, helpers.normal((helpers.BATCH, 2), seed=1))

    def test_mask_and_sample_weights(self):
        model = helpers.sequential((5,), keras.layers.Dense(6, activation="tanh"),
                            keras.layers.Dense(3))
        x, y = helpers.normal((helpers.BATCH, 5)), helpers.normal((helpers.BATCH, 3), seed=1)
        weights = np.linspace(0.5, 2.0, helpers.BATCH).astype("float32")
        weights[[1, 5]] = 0.0
        mask = (weights != 0).astype("float32")
        self.assert_lockstep(model, x, y, sample_weight=weights, mask=mask)

    def test_masked_examples_contribute_nothing(self):
        model = helpers.sequential((5,), keras.layers.Dense(3))
        model.compile(loss=helpers.MSE)
        x, y = helpers.normal((helpers.BATCH, 5)), helpers.normal((helpers.BATCH, 3), seed=1)
        loss_fn = ghost_clipping.compiled_loss_fn(model)
        mask = np.zeros(helpers.BATCH, "float32")
        mask[:3] = 1.0
        clip = 1e-3
        full, _, _, _ = ghost_clipping.clipped_gradient_sum(
            model, loss_fn, x, y, None, clip, mask=mask
        )
        # Replacing the masked examples by garbage changes nothing.
        x2 = x.copy()
        x2[3:] = 1e3
        other, _, _, _ = ghost_clipping.clipped_gradient_sum(
            model, loss_fn, x2, y, None, clip, mask=mask
        )
        for a, b in zip(full, other):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        # Every present example is clipped to C, so the sum has norm <= 3 C.
        total = float(np.sqrt(sum(np.sum(np.square(g)) for g in full)))
        self.assertLessEqual(total, 3 * clip * (1 + 1e-5))

    def test_frozen_layers_are_excluded(self):
        keras.utils.set_random_seed(0)
        frozen = keras.layers.Dense(6, activation="tanh", name="frozen")
        frozen_embedding = keras.layers.Embedding(9, 5, name="frozen_emb")
        frozen.trainable = False
        frozen_embedding.trainable = False
        ids = keras.Input((4,), dtype="int32")
        h = keras.layers.Flatten()(frozen_embedding(ids))
        h = keras.layers.Dense(6, activation="tanh", name="hidden")(h)
        model = keras.Model(ids, keras.layers.Dense(3, name="out")(frozen(h)))
        described = ghost_clipping.describe(model)
        self.assertEqual(sorted(described), ["hidden", "out"])
        x = helpers.rng().integers(0, 9, size=(helpers.BATCH, 4)).astype("int32")
        self.assert_lockstep(model, x, helpers.normal((helpers.BATCH, 3), seed=1))

    @pytest.mark.slow
    def test_weight_regularizers(self):
        keras.utils.set_random_seed(0)
        model = helpers.sequential(
            (4, 5),
            keras.layers.Embedding(9, 5, embeddings_regularizer="l2"),
            keras.layers.Reshape((4, 25)),
            keras.layers.Dense(6, activation="tanh",
                               kernel_regularizer=keras.regularizers.L2(0.1),
                               bias_regularizer=keras.regularizers.L1(0.05)),
            keras.layers.LayerNormalization(
                gamma_regularizer=keras.regularizers.L2(0.2)
            ),
            keras.layers.Conv1D(3, 2, kernel_regularizer="l1l2"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
            dtype="int32",
        )
        x = helpers.rng().integers(0, 9, size=(helpers.BATCH, 4, 5)).astype("int32")
        self.assert_lockstep(model, x, helpers.normal((helpers.BATCH, 2), seed=1))


class RefusalTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    def test_activity_regularizer_is_refused(self):
        model = helpers.sequential(
            (5,), keras.layers.Dense(3, activity_regularizer="l2"),
        )
        model.compile(loss=helpers.MSE)
        self.assertFalse(ghost_clipping.supports(model))
        self.assertIn(
            "activity regularizer",
            str(ghost_clipping.unsupported_layers(model)),
        )
        with self.assertRaises(ghost_clipping.GhostClippingUnsupportedError):
            ghost_clipping.clipped_gradient_sum(
                model, ghost_clipping.compiled_loss_fn(model),
                helpers.normal((helpers.BATCH, 5)), helpers.normal((helpers.BATCH, 3)), None, 1.0,
            )

    def test_add_loss_in_call_is_refused(self):

        class Penalty(keras.layers.Layer):

            def call(self, x):
                self.add_loss(ops.sum(ops.square(x)))
                return x

        model = helpers.sequential((5,), keras.layers.Dense(3), Penalty())
        model.compile(loss=helpers.MSE)
        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "add_loss"
        ):
            ghost_clipping.clipped_gradient_sum(
                model, ghost_clipping.compiled_loss_fn(model),
                helpers.normal((helpers.BATCH, 5)), helpers.normal((helpers.BATCH, 3)), None, 1.0,
            )

    def test_tied_weights_are_detected(self):

        class TiedOutput(keras.layers.Layer):
            """Reads the embedding matrix outside the Embedding's call."""

            def __init__(self, embedding, **kwargs):
                super().__init__(**kwargs)
                self.embedding = embedding

            def call(self, h):
                return ops.matmul(h, ops.transpose(self.embedding.embeddings))

        keras.utils.set_random_seed(0)
        embedding = keras.layers.Embedding(7, 4)
        ids = keras.Input((3,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(embedding(ids))
        model = keras.Model(ids, TiedOutput(embedding)(h))
        model.compile(loss=helpers.MSE)
        x = helpers.rng().integers(0, 7, size=(helpers.BATCH, 3)).astype("int32")
        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "outside"
        ):
            ghost_clipping.clipped_gradient_sum(
                model, ghost_clipping.compiled_loss_fn(model), x,
                helpers.normal((helpers.BATCH, 7)), None, 1.0,
            )

    def test_time_major_dense_is_refused(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4, 5))
        h = keras.layers.Lambda(lambda t: ops.transpose(t, (1, 0, 2)))(inputs)
        h = keras.layers.Dense(3)(h)
        outputs = keras.layers.Lambda(lambda t: ops.transpose(t, (1, 0, 2)))(h)
        model = keras.Model(inputs, outputs)
        model.compile(loss=helpers.MSE)

        @tf.function(input_signature=[tf.TensorSpec([None, 4, 5])] * 1)
        def run(x):
            return ghost_clipping.clipped_gradient_sum(
                model, ghost_clipping.compiled_loss_fn(model), x,
                tf.zeros_like(x[..., :3]), None, 1.0,
            )[1]

        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "batch axis"
        ):
            run(helpers.normal((helpers.BATCH, 4, 5)))


def _shifted_sum(model, x, y, clip, shifts, weight, jit=False):
    """`clipped_gradient_sum` with shifts (DiSK's two points), in a graph
    (compiled by XLA with `jit`)."""
    loss_fn = ghost_clipping.compiled_loss_fn(model)

    @tf.function(jit_compile=jit)
    def run(x, y):
        return ghost_clipping.clipped_gradient_sum(
            model, loss_fn, x, y, None, clip, shifts=shifts,
            shift_weight=weight)

    return run(x, y)


class ShiftedPassTest(parameterized.TestCase):
    """Ghost clipping of (1 - w) g_i(theta) + w g_i(theta + d) (DiSK)."""

    def _model(self, kind):
        keras.utils.set_random_seed(0)
        if kind == "fallback":  # SimpleRNN: replayed at the shifted weights
            # (unrolled: a while loop under the vectorized map costs 15 s)
            hidden = [keras.layers.SimpleRNN(4, return_sequences=True,
                                             unroll=True)]
        elif kind == "standardized":
            # WSConv2D's blocks read the kernel where each pass read it.
            hidden = [keras.layers.Reshape((6, 3, 1)),
                      tf_layers.WSConv2D(
                          3, 2, activation="tanh",
                          kernel_regularizer=keras.regularizers.L2(0.1))]
        elif kind == "lora":
            # Each factor's block reads the other factor where its pass
            # read it; B's last axis produced (Dense), then contracted.
            hidden = [keras.layers.Dense(4, activation="tanh"),
                      keras.layers.EinsumDense("abc,dc->abd",
                                               output_shape=(6, 5))]
        else:
            hidden = [keras.layers.Conv1D(
                4, 2, activation="tanh",
                kernel_regularizer=keras.regularizers.L2(0.1)),
                keras.layers.LayerNormalization()]
        model = helpers.sequential(
            (6, 3), *hidden, keras.layers.Flatten(), keras.layers.Dense(2))
        if kind == "lora":
            for layer in hidden:
                layer.enable_lora(2)
        model.compile(loss=helpers.MSE)
        return model

    # w = 0.857 is the defaults' (kappa 0.7, gamma 0.5); 1.5 makes 1 - w < 0.
    # XLA on the rules that read weights at each pass's point.
    @parameterized.parameters(
        *[dict(weight=w, kind=k, jit=False) for w in (0.857, 1.5)
          for k in ("ghost", "fallback", "lora", "standardized")],
        *[dict(weight=0.857, kind=k, jit=True)
          for k in ("lora", "standardized")])
    @pytest.mark.slow
    def test_matches_per_example_gradients_at_both_points(self, weight, kind,
                                                          jit):
        model = self._model(kind)
        x = helpers.normal((helpers.BATCH, 6, 3))
        y = helpers.normal((helpers.BATCH, 2), seed=1)
        variables = model.trainable_variables
        before = helpers.numpy_values(variables)
        rng = helpers.rng(3)
        shifts = [0.3 * rng.normal(size=v.shape).astype("float32")
                  for v in variables]
        here, _ = helpers.reference_per_example_gradients(
            model, helpers.MSE, x, y)
        for v, b, d in zip(variables, before, shifts):
            v.assign(b + d)
        there, _ = helpers.reference_per_example_gradients(
            model, helpers.MSE, x, y)
        for v, b in zip(variables, before):
            v.assign(b)
        combined = [(1.0 - weight) * np.asarray(a, "float64")
                    + weight * np.asarray(b, "float64")
                    for a, b in zip(here, there)]
        norms = np.sqrt(sum(np.sum(np.square(g.reshape(len(g), -1)), axis=1)
                            for g in combined))
        clip = float(np.median(norms)) * 1.0001
        factors = np.minimum(1.0, clip / norms)
        want = [np.tensordot(factors, g, axes=1) for g in combined]
        summed, got_norms, _, _ = _shifted_sum(
            model, x, y, clip, [tf.constant(d) for d in shifts], weight, jit)
        np.testing.assert_allclose(got_norms, norms, rtol=2e-5)
        for got, expected, v in zip(summed, want, variables):
            np.testing.assert_allclose(got, expected, rtol=5e-5, atol=1e-6,
                                       err_msg=v.path)
        # The weights are where they were.
        for v, b in zip(variables, before):
            np.testing.assert_array_equal(v.numpy(), b)

    def test_both_points_draw_the_same_dropout_masks(self):
        # With zero shifts, (1 - w) g_i + w g_i = g_i only if the second
        # pass draws the first pass's masks; the generators advance once.
        keras.utils.set_random_seed(0)
        model = helpers.sequential(
            (5,), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dropout(0.5), keras.layers.Dense(2))
        model.compile(loss=helpers.MSE)
        x = helpers.normal((helpers.BATCH, 5))
        y = helpers.normal((helpers.BATCH, 2), seed=1)
        generators = compat.seed_generators(model)
        self.assertNotEmpty(generators)
        start = [g.state.numpy() for g in generators]
        zeros = [tf.zeros(v.shape) for v in model.trainable_variables]
        shifted = _shifted_sum(model, x, y, 1e3, zeros, 0.857)[0]
        advanced = [g.state.numpy() for g in generators]
        for g, s in zip(generators, start):
            g.state.assign(s)
        plain = _shifted_sum(model, x, y, 1e3, None, 0.0)[0]
        for g, a in zip(generators, advanced):
            np.testing.assert_array_equal(g.state.numpy(), a)
        for a, b in zip(shifted, plain):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        # A different draw gives a different sum (the test can fail).
        other = _shifted_sum(model, x, y, 1e3, None, 0.0)[0]
        self.assertGreater(
            max(float(np.max(np.abs(a - b))) for a, b in zip(other, plain)),
            1e-3)

    def test_rules_that_do_not_opt_in_are_refused(self):
        # A rule whose blocks would read a weight after the forward pass at
        # the wrong point does not set `shifted_pass`.
        class NotShifted(ghost_clipping.dense.DenseRule):
            shifted_pass = False

        keras.utils.set_random_seed(0)
        model = helpers.sequential((5,), keras.layers.Dense(3),
                                   keras.layers.Dense(2))
        model.compile(loss=helpers.MSE)
        zeros = [tf.zeros(v.shape) for v in model.trainable_variables]
        with mock.patch.dict(ghost_clipping.registry.GHOST_RULES,
                             {keras.layers.Dense: NotShifted}):
            with self.assertRaisesRegex(
                    ghost_clipping.GhostClippingUnsupportedError,
                    "shifted weights"):
                _shifted_sum(model, helpers.normal((helpers.BATCH, 5)),
                             helpers.normal((helpers.BATCH, 2), seed=1), 1.0,
                             zeros, 0.5)


if __name__ == "__main__":
    absltest.main()
