"""Ghost clipping in lockstep with explicit per-example clipping."""

import math
import re
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized
from keras import ops

import tf_dpadam
from tf_dpadam import dp_math
from tf_dpadam import ghost_clipping
from tf_dpadam import privatizer

_B = 8
_MSE = keras.losses.MeanSquaredError()
_SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _reference(model, loss, x, y, sample_weight=None):
    """Explicit per-example gradients (vectorized map over one example)."""
    variables = model.trainable_variables

    def example_loss(x1, y1, w1):
        pred = model(x1, training=True)
        value = loss(y1, pred, sample_weight=w1)
        for extra in model.losses:
            value = value + ops.sum(extra)
        return value, pred

    @tf.function
    def run(x, y, w):
        grads, losses, _ = privatizer.per_example_gradients(
            example_loss, variables, (x, y, w)
        )
        return grads, losses

    return run(x, y, sample_weight)


def _ghost(model, x, y, sample_weight, clip, mask, jit,
           dynamic_batch=False):
    loss_fn = ghost_clipping.compiled_loss_fn(model)

    @tf.function(jit_compile=jit)
    def run(x, y, w, mask):
        return ghost_clipping.clipped_sum(
            model, loss_fn, x, y, w, clip, mask=mask
        )

    args = (x, y, sample_weight, mask)
    if dynamic_batch:
        # Traced with an unknown batch size, as Keras does after a batch of
        # another size.
        run = run.get_concrete_function(*tf.nest.map_structure(
            lambda t: t if t is None
            else tf.TensorSpec([None, *t.shape[1:]], t.dtype), args
        ))
    return run(*args)


class _LockstepMixin:

    def assert_lockstep(self, model, x, y, loss=_MSE, sample_weight=None,
                        mask=None, jit=False, clip=None, dynamic_batch=False):
        """Ghost == explicit clipping, with about half the examples clipped.

        Returns the ghost norms.
        """
        if getattr(model, "_compile_loss", None) is None:
            model.compile(loss=loss)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        y = tf.convert_to_tensor(y)
        if sample_weight is not None:
            sample_weight = tf.convert_to_tensor(sample_weight)
        grads, losses = _reference(model, loss, x, y, sample_weight)
        norms = dp_math.per_example_global_norms(grads).numpy()
        if clip is None:
            # Clip roughly half of the examples and leave the others alone.
            clip = float(np.median(norms)) * 1.0001
        self.assertGreater(np.sum(norms > clip), 0)
        self.assertGreater(np.sum(norms < clip), 0)
        expected, _ = privatizer.clip_and_sum(grads, clip, mask=mask)
        if mask is not None:
            mask = tf.convert_to_tensor(mask, "float32")
        summed, ghost_norms, ghost_losses, y_pred = _ghost(
            model, x, y, sample_weight, clip, mask, jit, dynamic_batch
        )
        np.testing.assert_allclose(ghost_norms, norms, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ghost_losses, losses, rtol=2e-5, atol=1e-6)
        self.assertEqual(len(summed), len(model.trainable_variables))
        scale = max(float(np.max(np.abs(e))) for e in expected)
        for variable, got, want in zip(
            model.trainable_variables, summed, expected
        ):
            self.assertEqual(tuple(got.shape), tuple(variable.shape))
            np.testing.assert_allclose(
                got, want, rtol=5e-5, atol=5e-6 * scale, err_msg=variable.path
            )
        self.assertEqual(
            tuple(y_pred.shape), tuple(model(x, training=False).shape)
        )
        return ghost_norms

    def assert_kinds(self, model, **expected):
        described = ghost_clipping.describe(model)
        for name, kind in expected.items():
            self.assertTrue(
                described[name].startswith(kind), (name, described[name])
            )


def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(shape, seed=0):
    return _rng(seed).normal(size=shape).astype("float32")


def _sequential(input_shape, *layers, seed=0, dtype="float32"):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input(input_shape, dtype=dtype), *layers]
    )


def _two_conv_model():
    """Two small convolutions (9 x 8 positions, 27 patch floats) + head."""
    return _sequential(
        (9, 8, 3),
        keras.layers.Conv2D(4, 3, padding="same", activation="tanh",
                            name="conv2d"),
        keras.layers.Conv2D(2, 3, padding="valid", dilation_rate=2,
                            name="dilated"),
        keras.layers.Flatten(), keras.layers.Dense(3),
    )


class LayerTest(_LockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(
        ("2d", (5,), True, "tanh", False),
        ("2d_no_bias", (5,), False, None, False),
        ("3d", (4, 5), True, "relu", False),
        ("3d_no_bias_jit", (4, 5), False, "tanh", True),
        ("4d", (2, 3, 5), True, None, False),
    )
    def test_dense(self, input_shape, use_bias, activation, jit):
        model = _sequential(
            input_shape,
            keras.layers.Dense(6, use_bias=use_bias, activation=activation,
                               name="dense"),
            keras.layers.Dense(3),
        )
        x = _normal((_B, *input_shape))
        y = _normal((_B, *input_shape[:-1], 3), seed=1)
        self.assert_kinds(model, dense="ghost")
        self.assert_lockstep(model, x, y, jit=jit)

    def test_dense_long_sequence_uses_ghost_norm(self):
        # T^2 = 400 < d p = 32 * 24: the ghost norm, not materialized.
        model = _sequential(
            (20, 32), keras.layers.Dense(24, activation="tanh"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
        )
        x, y = _normal((_B, 20, 32)), _normal((_B, 2), seed=1)
        self.assert_lockstep(model, x, y)
        self.assert_lockstep(model, x, y, jit=True)

    @parameterized.named_parameters(
        ("matrix", "ab,bc->ac", (5,), 4, "c"),
        ("sequence", "abc,cd->abd", (3, 5), (3, 4), "d"),
        ("heads", "abc,cde->abde", (3, 5), (3, 2, 4), "de"),
        ("merge_heads", "abcd,cde->abe", (3, 2, 4), (3, 5), "e"),
        ("position_bias", "abc,cd->abd", (3, 5), (3, 4), "bd"),
        ("ellipsis", "...b,bc->...c", (3, 5), 4, "c"),
        ("no_bias", "abc,dc->abd", (3, 5), (3, 4), None),
    )
    def test_einsum_dense(self, equation, input_shape, output_shape, bias):
        layer = keras.layers.EinsumDense(
            equation, output_shape, bias_axes=bias, activation="tanh",
            name="einsum_dense",
        )
        model = _sequential(input_shape, layer, keras.layers.Flatten(),
                            keras.layers.Dense(3))
        x, y = _normal((_B, *input_shape)), _normal((_B, 3), seed=1)
        self.assert_kinds(model, einsum_dense="ghost")
        self.assert_lockstep(model, x, y)

    @parameterized.named_parameters(("graph", False), ("jit", True))
    def test_embedding_with_repeated_ids(self, jit):
        model = _sequential(
            (12,), keras.layers.Embedding(5, 4, name="embedding"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3),
            dtype="int32",
        )
        ids = _rng().integers(0, 5, size=(_B, 12)).astype("int32")
        ids[0] = 2  # one example with a single id
        self.assert_kinds(model, embedding="ghost")
        self.assert_lockstep(model, ids, _normal((_B, 3)), jit=jit)

    @parameterized.named_parameters(
        ("last_axis", {}, (4, 6)),
        ("two_axes", {"axis": [-2, -1]}, (4, 6)),
        ("middle_axis", {"axis": 1}, (4, 6)),
        ("scale_only", {"center": False}, (4, 6)),
        ("center_only", {"scale": False}, (4, 6)),
        ("2d", {}, (6,)),
    )
    def test_layer_normalization(self, kwargs, input_shape):
        keras.utils.set_random_seed(0)
        norm = keras.layers.LayerNormalization(
            gamma_initializer="random_normal", beta_initializer="random_normal",
            name="layer_normalization", **kwargs,
        )
        model = _sequential(input_shape, keras.layers.Dense(6), norm,
                            keras.layers.Flatten(), keras.layers.Dense(3))
        x, y = _normal((_B, *input_shape)), _normal((_B, 3), seed=1)
        self.assert_kinds(model, layer_normalization="ghost")
        self.assert_lockstep(model, x, y)

    @parameterized.named_parameters(
        ("same", {"padding": "same"}, False),
        ("valid", {"padding": "valid"}, False),
        ("strided_same", {"padding": "same", "strides": 2}, False),
        ("strided_valid", {"padding": "valid", "strides": (2, 3)}, False),
        ("dilated", {"padding": "same", "dilation_rate": 2}, False),
        ("rectangular_no_bias", {"kernel_size": (1, 3), "use_bias": False},
         False),
        ("same_jit", {"padding": "same", "strides": 2}, True),
    )
    def test_conv2d(self, kwargs, jit):
        kwargs = {"filters": 4, "kernel_size": 3, **kwargs}
        model = _sequential(
            (9, 8, 3),
            keras.layers.Conv2D(activation="tanh", name="conv2d", **kwargs),
            keras.layers.Flatten(), keras.layers.Dense(3),
        )
        x, y = _normal((_B, 9, 8, 3)), _normal((_B, 3), seed=1)
        self.assert_kinds(model, conv2d="ghost")
        self.assert_lockstep(model, x, y, jit=jit)

    @parameterized.named_parameters(
        ("graph", False, False), ("jit", True, False),
        ("graph_dynamic_batch", False, True),
    )
    def test_conv_norms_in_chunks(self, jit, dynamic_batch):
        # 9 x 8 positions x 27 patch floats = 1944 per example: chunks of 3
        # examples. With a static batch of 8 the last chunk is examples 5-7
        # (overlapping the second); with an unknown batch size the last
        # chunk is padded with zero examples.
        model = _two_conv_model()
        x, y = _normal((_B, 9, 8, 3)), _normal((_B, 3), seed=1)
        with mock.patch.object(
            ghost_clipping, "CONV_PATCH_FLOATS_PER_CHUNK", 3 * 9 * 8 * 27
        ):
            self.assert_lockstep(model, x, y, jit=jit,
                                 dynamic_batch=dynamic_batch)

    def test_conv_chunks_under_xla_hold_no_padded_copies(self):
        # A slice with a dynamic start and size -1 made XLA pad the sliced
        # tensor to twice its size in every dimension (16x an output
        # gradient; 512 MiB for the paper's CNN at B = 256). The largest
        # legitimate buffer here is one chunk of patches: 3 examples x 72
        # positions x 27 floats; allow 1.5x that for XLA's choices.
        model = _two_conv_model()
        model.compile(loss=_MSE)
        x, y = _normal((_B, 9, 8, 3)), _normal((_B, 3), seed=1)
        loss_fn = ghost_clipping.compiled_loss_fn(model)

        @tf.function(jit_compile=True)
        def run(x, y):
            return ghost_clipping.clipped_sum(model, loss_fn, x, y, None, 1.0)

        chunk_floats = 3 * 9 * 8 * 27
        with mock.patch.object(
            ghost_clipping, "CONV_PATCH_FLOATS_PER_CHUNK", chunk_floats
        ):
            hlo = run.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")
        sizes = [math.prod(int(d) for d in dims.split(","))
                 for dims in re.findall(r"f32\[([\d,]+)\]", hlo)]
        self.assertNotEmpty(sizes)
        self.assertLessEqual(max(sizes), 1.5 * chunk_floats)

    @parameterized.named_parameters(
        ("same", {"padding": "same"}),
        ("causal_dilated", {"padding": "causal", "dilation_rate": 2}),
        ("strided", {"padding": "valid", "strides": 2}),
    )
    def test_conv1d(self, kwargs):
        model = _sequential(
            (10, 3),
            keras.layers.Conv1D(4, 3, activation="tanh", name="conv1d",
                                **kwargs),
            keras.layers.Flatten(), keras.layers.Dense(3),
        )
        x, y = _normal((_B, 10, 3)), _normal((_B, 3), seed=1)
        self.assert_kinds(model, conv1d="ghost")
        self.assert_lockstep(model, x, y)

    def test_image_patches_match_tensorflow(self):
        rng = _rng()
        for shape, sizes, strides, rates, padding in [
            ((7, 9), (3, 3), (1, 1), (1, 1), "SAME"),
            ((7, 9), (3, 2), (2, 3), (1, 1), "SAME"),
            ((8, 9), (3, 3), (2, 2), (1, 1), "VALID"),
            ((9, 9), (2, 3), (1, 1), (2, 3), "SAME"),
            ((9, 9), (3, 3), (1, 1), (2, 2), "VALID"),
        ]:
            x = tf.constant(rng.normal(size=(2, *shape, 3)), "float32")
            want = tf.image.extract_patches(
                x, [1, *sizes, 1], [1, *strides, 1], [1, *rates, 1], padding
            )
            got = ghost_clipping._image_patches(
                x, sizes, strides, rates, padding
            )
            np.testing.assert_array_equal(got, want)


class ModelTest(_LockstepMixin, parameterized.TestCase):

    # (Under XLA on 16x16 images: compiling for 32x32 takes ~10 s.)
    @parameterized.named_parameters(("graph", False, 32), ("jit", True, 16))
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
        x = _normal((_B, size, size, 3))
        y = _rng().integers(0, 10, size=_B)
        self.assertTrue(ghost_clipping.supports(model))
        self.assert_lockstep(model, x, y, loss=_SCCE, jit=jit)

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
        x = _rng().integers(0, 11, size=(_B, 6)).astype("int32")
        y = _rng(1).integers(0, 3, size=_B)
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
        x = [_normal((_B, 5)), _normal((_B, 5), seed=2)]
        self.assert_lockstep(model, x, _normal((_B, 2), seed=1))

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
        x = _rng().integers(0, 7, size=(_B, 5)).astype("int32")
        model(x)
        self.assert_lockstep(model, x, _normal((_B, 2), seed=1))

    def test_mask_and_sample_weights(self):
        model = _sequential((5,), keras.layers.Dense(6, activation="tanh"),
                            keras.layers.Dense(3))
        x, y = _normal((_B, 5)), _normal((_B, 3), seed=1)
        weights = np.linspace(0.5, 2.0, _B).astype("float32")
        weights[[1, 5]] = 0.0
        mask = (weights != 0).astype("float32")
        self.assert_lockstep(model, x, y, sample_weight=weights, mask=mask)

    def test_masked_examples_contribute_nothing(self):
        model = _sequential((5,), keras.layers.Dense(3))
        model.compile(loss=_MSE)
        x, y = _normal((_B, 5)), _normal((_B, 3), seed=1)
        loss_fn = ghost_clipping.compiled_loss_fn(model)
        mask = np.zeros(_B, "float32")
        mask[:3] = 1.0
        clip = 1e-3
        full, _, _, _ = ghost_clipping.clipped_sum(
            model, loss_fn, x, y, None, clip, mask=mask
        )
        # Replacing the masked examples by garbage changes nothing.
        x2 = x.copy()
        x2[3:] = 1e3
        other, _, _, _ = ghost_clipping.clipped_sum(
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
        x = _rng().integers(0, 9, size=(_B, 4)).astype("int32")
        self.assert_lockstep(model, x, _normal((_B, 3), seed=1))

    def test_weight_regularizers(self):
        keras.utils.set_random_seed(0)
        model = _sequential(
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
        x = _rng().integers(0, 9, size=(_B, 4, 5)).astype("int32")
        self.assert_lockstep(model, x, _normal((_B, 2), seed=1))


class FallbackTest(_LockstepMixin, parameterized.TestCase):

    def test_unsupported_layers_are_fallback_units(self):

        class Scale(keras.layers.Layer):
            """A layer with its own weights and no ghost rule."""

            def build(self, input_shape):
                self.scale = self.add_weight(
                    shape=input_shape[-1:], initializer="random_normal"
                )

            def call(self, x):
                return x * self.scale + ops.sin(x)

        keras.utils.set_random_seed(0)
        inputs = keras.Input((5, 3))
        h = keras.layers.LSTM(4, return_sequences=True, unroll=True,
                              name="lstm")(inputs)
        h = Scale(name="scale")(h)
        h = keras.layers.EinsumDense("abc,bc->ab", 5, name="odd_einsum")(h)
        model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
        self.assertTrue(ghost_clipping.supports(model))
        self.assert_kinds(model, lstm="fallback", scale="fallback",
                          odd_einsum="fallback", out="ghost")
        x, y = _normal((_B, 5, 3)), _normal((_B, 2), seed=1)
        self.assert_lockstep(model, x, y)

    def test_subclass_with_weights_the_rule_does_not_know(self):

        class WeightNormDense(keras.layers.Dense):
            """Dense whose kernel is g * v / ||v||: `call` is Dense's own."""

            def build(self, input_shape):
                super().build(input_shape)
                self._kernel.trainable = False
                self.v = self.add_weight(shape=self._kernel.shape,
                                         initializer="random_normal")
                self.g = self.add_weight(shape=(self.units,),
                                         initializer="ones")

            @property
            def kernel(self):
                return self.g * self.v / ops.norm(self.v, axis=0)

        keras.utils.set_random_seed(0)
        model = _sequential(
            (4,), WeightNormDense(3, activation="tanh", name="normed"),
            keras.layers.Dense(2, name="out"),
        )
        # The Dense rule would take the kernel for a variable and drop the
        # gradients of v and g.
        self.assert_kinds(model, normed="fallback", out="ghost")
        x, y = _normal((_B, 4)), _normal((_B, 2), seed=1)
        self.assert_lockstep(model, x, y)

    def test_fallback_units_under_xla(self):
        # (Keras' LSTM loop does not compile with XLA inside a vectorized map,
        # in the vectorized path either.)
        keras.utils.set_random_seed(0)
        model = _sequential(
            (5, 3), keras.layers.Dense(4, name="in"),
            keras.layers.EinsumDense("abc,bc->ab", 5, name="odd_einsum"),
            keras.layers.Dense(2, name="out"),
        )
        self.assert_kinds(model, odd_einsum="fallback", out="ghost")
        x, y = _normal((_B, 5, 3)), _normal((_B, 2), seed=1)
        self.assert_lockstep(model, x, y, jit=True)

    def test_activity_regularizer_is_refused(self):
        model = _sequential(
            (5,), keras.layers.Dense(3, activity_regularizer="l2"),
        )
        model.compile(loss=_MSE)
        self.assertFalse(ghost_clipping.supports(model))
        self.assertIn(
            "activity regularizer",
            str(ghost_clipping.unsupported_layers(model)),
        )
        with self.assertRaises(ghost_clipping.GhostClippingUnsupportedError):
            ghost_clipping.clipped_sum(
                model, ghost_clipping.compiled_loss_fn(model),
                _normal((_B, 5)), _normal((_B, 3)), None, 1.0,
            )

    def test_add_loss_in_call_is_refused(self):

        class Penalty(keras.layers.Layer):

            def call(self, x):
                self.add_loss(ops.sum(ops.square(x)))
                return x

        model = _sequential((5,), keras.layers.Dense(3), Penalty())
        model.compile(loss=_MSE)
        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "add_loss"
        ):
            ghost_clipping.clipped_sum(
                model, ghost_clipping.compiled_loss_fn(model),
                _normal((_B, 5)), _normal((_B, 3)), None, 1.0,
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
        model.compile(loss=_MSE)
        x = _rng().integers(0, 7, size=(_B, 3)).astype("int32")
        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "outside"
        ):
            ghost_clipping.clipped_sum(
                model, ghost_clipping.compiled_loss_fn(model), x,
                _normal((_B, 7)), None, 1.0,
            )

    def test_random_fallback_unit_is_refused(self):
        model = _sequential(
            (5, 3), keras.layers.LSTM(4, dropout=0.5), keras.layers.Dense(2)
        )
        model.compile(loss=_MSE)
        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "random"
        ):
            ghost_clipping.clipped_sum(
                model, ghost_clipping.compiled_loss_fn(model),
                _normal((_B, 5, 3)), _normal((_B, 2)), None, 1.0,
            )

    def test_time_major_dense_is_refused(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4, 5))
        h = keras.layers.Lambda(lambda t: ops.transpose(t, (1, 0, 2)))(inputs)
        h = keras.layers.Dense(3)(h)
        outputs = keras.layers.Lambda(lambda t: ops.transpose(t, (1, 0, 2)))(h)
        model = keras.Model(inputs, outputs)
        model.compile(loss=_MSE)

        @tf.function(input_signature=[tf.TensorSpec([None, 4, 5])] * 1)
        def run(x):
            return ghost_clipping.clipped_sum(
                model, ghost_clipping.compiled_loss_fn(model), x,
                tf.zeros_like(x[..., :3]), None, 1.0,
            )[1]

        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "batch axis"
        ):
            run(_normal((_B, 4, 5)))

    def test_dropout_between_ghost_layers_is_allowed(self):
        model = _sequential(
            (16,), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dropout(0.5), keras.layers.Dense(2),
        )
        model.compile(loss=_MSE)
        loss_fn = ghost_clipping.compiled_loss_fn(model)
        run = tf.function(
            lambda x, y: ghost_clipping.clipped_sum(model, loss_fn, x, y,
                                                    None, 0.1)
        )
        x, y = _normal((_B, 16)), _normal((_B, 2), seed=1)
        first = run(x, y)
        second = run(x, y)
        self.assertFalse(np.allclose(first[1], second[1]))  # new masks
        total = np.sqrt(sum(np.sum(np.square(g)) for g in first[0]))
        self.assertLessEqual(total, _B * 0.1 * (1 + 1e-5))


class PerExampleLossTest(parameterized.TestCase):
    """compiled_loss_fn's direct path (no vectorized map) against the
    compiled loss applied to one example at a time."""

    def one_at_a_time(self, model, y, y_pred, sample_weight):
        losses = []
        for i in range(y.shape[0]):
            w = None if sample_weight is None else sample_weight[i:i + 1]
            losses.append(float(model._compile_loss(
                y[i:i + 1], y_pred[i:i + 1], w)))
        return np.array(losses)

    @parameterized.named_parameters(
        ("mse_3d", keras.losses.MeanSquaredError(), (3, 2), False, None),
        ("mse_weighted", keras.losses.MeanSquaredError(), (3,), True, 0.5),
        ("sparse_ce", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), (4,), False, None),
        ("sparse_ce_weighted", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), (4,), True, 2.0),
        ("binary_ce", keras.losses.BinaryCrossentropy(from_logits=True),
         (1,), True, None),
    )
    def test_direct_path_matches_the_compiled_loss(self, loss, shape, weighted,
                                                   loss_weight):
        model = _sequential((5,), keras.layers.Dense(int(np.prod(shape))),
                            keras.layers.Reshape(shape))
        model.compile(loss=loss, loss_weights=loss_weight)
        rng = _rng(3)
        y_pred = tf.constant(rng.normal(size=(6, *shape)), "float32")
        if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
            y = tf.constant(rng.integers(0, shape[-1], size=6))
        elif isinstance(loss, keras.losses.BinaryCrossentropy):
            y = tf.constant(rng.integers(0, 2, size=(6, 1)), "float32")
        else:
            y = tf.constant(rng.normal(size=(6, *shape)), "float32")
        w = tf.constant(rng.uniform(0.1, 2.0, size=6), "float32") \
            if weighted else None
        direct = ghost_clipping._direct_per_example_loss(
            model._compile_loss, y, y_pred, w)
        self.assertIsNotNone(direct)
        np.testing.assert_allclose(
            direct, self.one_at_a_time(model, y, y_pred, w), rtol=1e-5,
            atol=1e-6)

    def test_other_cases_take_the_mapped_path(self):
        model = _sequential((5,), keras.layers.Dense(3))
        y = tf.zeros((4, 3))
        y_pred = tf.ones((4, 3))
        model.compile(loss=keras.losses.MeanSquaredError(reduction="sum"))
        self.assertIsNone(ghost_clipping._direct_per_example_loss(
            model._compile_loss, y, y_pred, None))
        model.compile(loss="mse")  # Per-element sample weights next.
        model._compile_loss.build(y, y_pred)
        per_element = tf.ones((4, 3))
        self.assertIsNone(ghost_clipping._direct_per_example_loss(
            model._compile_loss, y, y_pred, per_element))


class PrivateModelTest(parameterized.TestCase):
    """Ghost clipping of a `make_private` model = its vectorized path."""

    def test_matches_private_model_per_example_path(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(
            8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)
        )(inputs)
        outputs = {
            "a": keras.layers.Dense(3, name="a")(h),
            "b": keras.layers.Dense(1, name="b")(h),
        }
        model = tf_dpadam.make_private(keras.Model(inputs, outputs), seed=0)
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0),
            loss={"a": _SCCE, "b": "mse"}, loss_weights={"a": 1.0, "b": 0.5},
        )
        x = _normal((_B, 6))
        y = {"a": _rng().integers(0, 3, size=_B),
             "b": _normal((_B, 1), seed=1)}
        weights = np.linspace(0.5, 2.0, _B).astype("float32")
        weights[2] = 0.0
        mask = (weights != 0).astype("float32")
        variables = model.trainable_variables

        @tf.function
        def vectorized(x, y, w):
            grads, losses, _ = model._per_example_gradients(x, y, w, variables)
            norms = dp_math.per_example_global_norms(grads)
            clip = tf.sort(norms)[_B // 2]
            summed, _ = privatizer.clip_and_sum(grads, clip, mask=mask)
            return summed, norms, losses, clip

        summed, norms, losses, clip = vectorized(x, y, weights)
        loss_fn = ghost_clipping.compiled_loss_fn(model)

        @tf.function
        def ghost(x, y, w):
            return ghost_clipping.clipped_sum(
                model, loss_fn, x, y, w, clip, mask=mask
            )

        ghost_summed, ghost_norms, ghost_losses, _ = ghost(x, y, weights)
        np.testing.assert_allclose(ghost_norms, norms, rtol=2e-5)
        np.testing.assert_allclose(ghost_losses, losses, rtol=2e-5)
        for a, b in zip(ghost_summed, summed):
            np.testing.assert_allclose(a, b, rtol=5e-5, atol=1e-6)


if __name__ == "__main__":
    absltest.main()
