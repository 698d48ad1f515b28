"""Ghost clipping of Conv1D and Conv2D against explicit clipping."""

import math
import re
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.privatizer.ghost_clipping import convolution

import helpers


def _two_conv_model():
    """Two small convolutions (9 x 8 positions, 27 patch floats) + head."""
    return helpers.sequential(
        (9, 8, 3),
        keras.layers.Conv2D(4, 3, padding="same", activation="tanh",
                            name="conv2d"),
        keras.layers.Conv2D(2, 3, padding="valid", dilation_rate=2,
                            name="dilated"),
        keras.layers.Flatten(), keras.layers.Dense(3),
    )


class ConvolutionTest(helpers.GhostLockstepMixin, parameterized.TestCase):

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
    @pytest.mark.slow
    def test_conv2d(self, kwargs, jit):
        kwargs = {"filters": 4, "kernel_size": 3, **kwargs}
        model = helpers.sequential(
            (9, 8, 3),
            keras.layers.Conv2D(activation="tanh", name="conv2d", **kwargs),
            keras.layers.Flatten(), keras.layers.Dense(3),
        )
        x, y = helpers.normal((helpers.BATCH, 9, 8, 3)), helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, conv2d="ghost")
        self.assert_lockstep(model, x, y, jit=jit)

    @parameterized.named_parameters(
        ("graph", False, False), ("jit", True, False),
        ("graph_dynamic_batch", False, True),
    )
    @pytest.mark.slow
    def test_conv_norms_in_chunks(self, jit, dynamic_batch):
        # 9 x 8 positions x 27 patch floats = 1944 per example: chunks of 3
        # examples. With a static batch of 8 the last chunk is examples 5-7
        # (overlapping the second); with an unknown batch size the last
        # chunk is padded with zero examples.
        model = _two_conv_model()
        x, y = helpers.normal((helpers.BATCH, 9, 8, 3)), helpers.normal((helpers.BATCH, 3), seed=1)
        with mock.patch.object(
            convolution, "PATCH_FLOATS_PER_CHUNK", 3 * 9 * 8 * 27
        ):
            self.assert_lockstep(model, x, y, jit=jit,
                                 dynamic_batch=dynamic_batch)

    @pytest.mark.slow
    def test_conv_chunks_under_xla_hold_no_padded_copies(self):
        # A slice with a dynamic start and size -1 made XLA pad the sliced
        # tensor to twice its size in every dimension (16x an output
        # gradient; 512 MiB for the paper's CNN at B = 256). The largest
        # legitimate buffer here is one chunk of patches: 3 examples x 72
        # positions x 27 floats; allow 1.5x that for XLA's choices.
        model = _two_conv_model()
        model.compile(loss=helpers.MSE)
        x, y = helpers.normal((helpers.BATCH, 9, 8, 3)), helpers.normal((helpers.BATCH, 3), seed=1)
        loss_fn = ghost_clipping.compiled_loss_fn(model)

        @tf.function(jit_compile=True)
        def run(x, y):
            return ghost_clipping.clipped_gradient_sum(model, loss_fn, x, y, None, 1.0)

        chunk_floats = 3 * 9 * 8 * 27
        with mock.patch.object(
            convolution, "PATCH_FLOATS_PER_CHUNK", chunk_floats
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
        model = helpers.sequential(
            (10, 3),
            keras.layers.Conv1D(4, 3, activation="tanh", name="conv1d",
                                **kwargs),
            keras.layers.Flatten(), keras.layers.Dense(3),
        )
        x, y = helpers.normal((helpers.BATCH, 10, 3)), helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, conv1d="ghost")
        self.assert_lockstep(model, x, y)

    @parameterized.parameters(
        # The identity convolution (C <= 4 without dilation), the slices
        # (stride 1) and ExtractImagePatches (strided, C > 4).
        1, convolution.IDENTITY_CONV_MAX_CHANNELS,
        convolution.IDENTITY_CONV_MAX_CHANNELS + 1)
    def test_image_patches_match_tensorflow(self, channels):
        rng = helpers.rng()
        for shape, sizes, strides, rates, padding in [
            ((7, 9), (3, 3), (1, 1), (1, 1), "SAME"),
            ((7, 9), (3, 2), (2, 3), (1, 1), "SAME"),
            ((8, 9), (3, 3), (2, 2), (1, 1), "VALID"),
            ((9, 9), (2, 3), (1, 1), (2, 3), "SAME"),
            ((9, 9), (3, 3), (1, 1), (2, 2), "VALID"),
            ((28, 28), (8, 8), (2, 2), (1, 1), "SAME"),
        ]:
            x = tf.constant(rng.normal(size=(2, *shape, channels)), "float32")
            want = tf.image.extract_patches(
                x, [1, *sizes, 1], [1, *strides, 1], [1, *rates, 1], padding
            )
            got = convolution.image_patches(
                x, sizes, strides, rates, padding
            )
            np.testing.assert_array_equal(got, want)


if __name__ == "__main__":
    absltest.main()
