"""Ghost clipping of the weight-standardized convolution (WSConv2D) against
explicit clipping, and its Jacobian identity against NumPy."""

import os
import tempfile
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam import layers
from tf_dpadam.privatizer.ghost_clipping import convolution
from tf_dpadam.privatizer.ghost_clipping import standardized

import helpers


def _ws_model(name="ws_conv", regularizer=None, **kwargs):
    kwargs = {"filters": 4, "kernel_size": 3, **kwargs}
    return helpers.sequential(
        (9, 8, 3),
        layers.WSConv2D(activation="tanh", name=name,
                        kernel_regularizer=regularizer, **kwargs),
        keras.layers.GroupNormalization(2, name="group_norm"),
        keras.layers.Flatten(), keras.layers.Dense(3),
    )


def _numpy_standardized_gradient(w, u, eps):
    """d/dW of sum(standardize(W) * u) by central differences (float64):
    the gradient of W given the gradient u of the standardized kernel."""
    def f(w):
        flat = w.reshape(-1, w.shape[-1])
        k = (flat - flat.mean(0)) / np.sqrt(flat.var(0) + eps)
        return float(np.sum(k * u.reshape(flat.shape)))
    grad = np.zeros_like(w)
    h = 1e-6
    for index in np.ndindex(w.shape):
        step = np.zeros_like(w)
        step[index] = h
        grad[index] = (f(w + step) - f(w - step)) / (2 * h)
    return grad


def _tape_gradients(model, x, y, group_size=1):
    """Each example's gradient (float64), from one-example tapes: the mean
    of its `group_size` rows' loss gradients plus the regularizer's."""
    grads = []
    for i in range(len(x) // group_size):
        rows = slice(i * group_size, (i + 1) * group_size)
        with tf.GradientTape() as tape:
            pred = model(x[rows], training=True)
            loss = keras.ops.mean(keras.ops.mean(
                keras.ops.square(pred - y[rows]), axis=-1))
            for extra in model.losses:
                loss = loss + keras.ops.sum(extra)
        grads.append([np.asarray(g, "float64") for g in
                      tape.gradient(loss, model.trainable_variables)])
    return grads


class StandardizedConvolutionTest(helpers.GhostLockstepMixin,
                                  parameterized.TestCase):

    @parameterized.named_parameters(
        ("same", {"padding": "same"}, False),
        ("valid_bias", {"padding": "valid", "use_bias": True}, False),
        ("strided", {"padding": "same", "strides": 2}, False),
        ("dilated_valid", {"padding": "valid", "dilation_rate": 2}, False),
        ("rectangular", {"kernel_size": (1, 3)}, False),
        ("large_epsilon", {"standardization_epsilon": 0.5}, False),
        ("regularized", {"regularizer": keras.regularizers.L2(0.1)}, False),
        ("same_jit", {"padding": "same", "strides": 2}, True),
    )
    @pytest.mark.slow
    def test_ws_conv2d(self, kwargs, jit):
        kwargs = {"use_bias": False, **kwargs}
        keras.utils.set_random_seed(0)
        model = _ws_model(**kwargs)
        x = helpers.normal((helpers.BATCH, 9, 8, 3))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, ws_conv="ghost (WSConv)",
                          group_norm="ghost (GroupNormalization)")
        self.assert_lockstep(model, x, y, jit=jit)

    @pytest.mark.slow
    def test_chunked_norms(self):
        # A batch larger than one chunk of patches: the norms come from
        # several chunks (tf.map_fn) of the scaled output gradients.
        keras.utils.set_random_seed(1)
        model = _ws_model(padding="same")
        x = helpers.normal((helpers.BATCH, 9, 8, 3))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        with mock.patch.object(convolution, "PATCH_FLOATS_PER_CHUNK",
                                        9 * 8 * 27 * 3):
            self.assert_lockstep(model, x, y)

    @parameterized.named_parameters(
        ("same", {"padding": "same"}, {}),
        ("regularized_strided", {"padding": "same", "strides": 2,
                                 "regularizer": keras.regularizers.L2(0.1)},
         {}),
        ("chunked", {"padding": "valid", "use_bias": True},
         {"chunk_floats": 9 * 8 * 27 * 3}),
        ("chunked_dynamic_batch", {"padding": "same"},
         {"chunk_floats": 9 * 8 * 27 * 3, "dynamic": True}),
        ("augmult", {"padding": "same",
                     "regularizer": keras.regularizers.L2(0.1)},
         {"group_size": 3}),
        ("jit", {"padding": "same", "dilation_rate": 2}, {"jit": True}),
    )
    @pytest.mark.slow
    def test_scaled_norms_against_tapes(self, kwargs, options):
        # Scale-then-privatize: the norms of S * grad_i and the clipped sum
        # of the scaled gradients, against one-example tapes.
        kwargs = {"use_bias": False, **kwargs}
        group_size = options.get("group_size", 1)
        keras.utils.set_random_seed(3)
        model = _ws_model(**kwargs)
        model.compile(loss="mse")
        rows = helpers.BATCH * group_size
        x = helpers.normal((rows, 9, 8, 3))
        y = helpers.normal((rows, 3), seed=1)
        rng = np.random.default_rng(4)
        scales = [rng.uniform(0.2, 2.0, v.shape).astype("float32")
                  for v in model.trainable_variables]
        grads = _tape_gradients(model, x, y, group_size)
        scaled = [[s * g for s, g in zip(scales, example)]
                  for example in grads]
        norms = np.array([np.sqrt(sum(np.sum(g ** 2) for g in example))
                          for example in scaled])
        clip = float(np.median(norms)) * 1.0001
        want = [sum(min(1.0, clip / n) * example[j]
                    for n, example in zip(norms, scaled))
                for j in range(len(scales))]
        loss_fn = ghost_clipping.compiled_loss_fn(model)

        @tf.function(jit_compile=options.get("jit", False))
        def run(x, y):
            return ghost_clipping.clipped_gradient_sum(
                model, loss_fn, x, y, None, clip, group_size=group_size,
                scales=[tf.constant(s) for s in scales])

        if options.get("dynamic"):
            run = run.get_concrete_function(
                tf.TensorSpec([None, 9, 8, 3]), tf.TensorSpec([None, 3]))
        with mock.patch.object(convolution, "PATCH_FLOATS_PER_CHUNK",
                               options.get("chunk_floats",
                                           convolution.PATCH_FLOATS_PER_CHUNK)):
            summed, got_norms, _, _ = run(tf.constant(x), tf.constant(y))
        np.testing.assert_allclose(got_norms, norms, rtol=2e-5)
        for got, w in zip(summed, want):
            np.testing.assert_allclose(got, w, rtol=5e-5,
                                       atol=5e-6 * np.max(np.abs(w)))

    def test_jacobian_identity_against_numpy(self):
        # The block's claim: grad W = J u, |J u_o|^2 = |u~|^2 - (1.u~)^2/n -
        # (2 - r)(k.u~)^2/n, checked on one kernel against finite
        # differences of NumPy's standardization.
        rng = np.random.default_rng(0)
        eps = 0.3
        w = rng.normal(size=(2, 2, 3, 4))
        u = rng.normal(size=w.shape)
        want = _numpy_standardized_gradient(w, u, eps)
        flat = w.reshape(-1, 4)
        n = flat.shape[0]
        var = flat.var(0)
        s = np.sqrt(var + eps)
        k = (flat - flat.mean(0)) / s
        ut = u.reshape(-1, 4) / s
        sq = (np.sum(ut ** 2, 0) - np.sum(ut, 0) ** 2 / n
              - (2 - var / (var + eps)) * np.sum(k * ut, 0) ** 2 / n)
        np.testing.assert_allclose(sq, np.sum(want.reshape(-1, 4) ** 2, 0),
                                   rtol=1e-6)
        # And the block's projection, on the same numbers.
        point = standardized.KernelPoint(
            inner=None, kernel=keras.ops.convert_to_tensor(k, "float32"),
            ratio=None)
        block = standardized.StandardizedKernelBlock(
            inner=type("Inner", (), {"shape": w.shape})(), points=[point],
            ones_dot=None, dots=None)
        got = block._jacobian_times(point, u.reshape(w.shape) / s)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    def test_two_point_identity_against_numpy(self):
        # DiSK's two passes read the kernel at W_1 and W_2: |J_1 u_1 +
        # J_2 u_2|^2 = |v|^2 - (1.v)^2/n - 2 sum_P alpha_P (k_P.v)/n
        # + sum_PQ alpha_P alpha_Q (k_P.k_Q)/n^2, v = u~_1 + u~_2.
        rng = np.random.default_rng(1)
        eps = 0.3
        ws = [rng.normal(size=(2, 2, 3, 4)) for _ in range(2)]
        us = [rng.normal(size=(2, 2, 3, 4)) for _ in range(2)]
        want = sum(_numpy_standardized_gradient(w, u, eps)
                   for w, u in zip(ws, us)).reshape(-1, 4)
        ks, uts = [], []
        for w, u in zip(ws, us):
            flat = w.reshape(-1, 4)
            s = np.sqrt(flat.var(0) + eps)
            ks.append((flat - flat.mean(0)) / s)
            uts.append(u.reshape(-1, 4) / s)
        n = ks[0].shape[0]
        v = uts[0] + uts[1]
        alphas = [np.sum(k * ut, 0) for k, ut in zip(ks, uts)]
        sq = (np.sum(v ** 2, 0) - np.sum(v, 0) ** 2 / n
              - 2 * sum(a * np.sum(k * v, 0) for a, k in zip(alphas, ks)) / n
              + sum(alphas[i] * alphas[j] * np.sum(ks[i] * ks[j], 0)
                    for i in range(2) for j in range(2)) / n ** 2)
        np.testing.assert_allclose(sq, np.sum(want ** 2, 0), rtol=1e-6)

    def test_layer_standardizes_and_saves(self):
        keras.utils.set_random_seed(2)
        model = _ws_model(padding="same")
        x = helpers.normal((2, 9, 8, 3))
        conv = model.get_layer("ws_conv")
        kernel = keras.ops.convert_to_numpy(conv.kernel).astype("float64")
        flat = kernel.reshape(-1, 4)
        k = ((flat - flat.mean(0)) / np.sqrt(flat.var(0) + 1e-5)).reshape(
            kernel.shape)
        plain = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)
        plain.build((None, 9, 8, 3))
        plain.kernel.assign(k.astype("float32"))
        np.testing.assert_allclose(conv(x), keras.activations.tanh(plain(x)),
                                   rtol=1e-5, atol=1e-5)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "ws.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
        self.assertIsInstance(loaded.get_layer("ws_conv"), layers.WSConv2D)
        np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)

    def test_epsilon_must_be_positive(self):
        with self.assertRaisesRegex(ValueError, "standardization_epsilon"):
            layers.WSConv2D(2, 3, standardization_epsilon=0.0)


if __name__ == "__main__":
    absltest.main()
