"""DPAdamScaleThenPrivatize against a NumPy reference, step by step."""

import os
import tempfile
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.optimizers import scale_then_privatize as stp
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import standardized

_BETA_1, _BETA_2, _EPS, _EPS_S = 0.9, 0.999, 1e-7, 1e-3


def _dense_model(seed=0, features=8, outputs=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((features,)),
                             keras.layers.Dense(outputs)])


def _batch(n=6, features=8, outputs=3, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.normal(size=(n, outputs)).astype("float32"))


def numpy_per_example_grads(w, b, x, y):
    """Per-example gradients of the mean squared error of x @ w + b."""
    residual = 2.0 * (x @ w + b - y) / y.shape[1]  # dL_i/dy_pred
    return [np.einsum("ni,nk->nik", x, residual), residual]


def numpy_preconditioner(velocities, done, eps_s=_EPS_S, normalize=True):
    """r / (sqrt(v_hat) + eps_s), r the RMS of the denominators over all
    (1 without `normalize`)."""
    denominators = [
        np.sqrt(v / (1 - _BETA_2**done) if done > 0 else np.zeros_like(v))
        + eps_s for v in velocities]
    flat = np.concatenate([d.ravel() for d in denominators])
    rms = np.sqrt(np.mean(flat**2)) if normalize else 1.0
    return [rms / d for d in denominators]


class NumpySTP:
    """The update rule, in float64: scale, clip, sum, /B, unscale, Adam."""

    def __init__(self, weights, normalize=True):
        self.normalize = normalize
        self.weights = [np.array(w, "float64") for w in weights]
        self.m = [np.zeros_like(w) for w in self.weights]
        self.v = [np.zeros_like(w) for w in self.weights]
        self.t = 0

    def scales(self):
        return numpy_preconditioner(self.v, self.t,
                                    normalize=self.normalize)

    def private_gradient(self, x, y, clip, batch_size):
        """The noise-free scaled private gradient sum_i clip(s g_i) / B."""
        grads = numpy_per_example_grads(*self.weights, x, y)
        scaled = [g * s[None] for g, s in zip(grads, self.scales())]
        norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1)**2, axis=1)
                            for g in scaled))
        factors = np.minimum(1.0, clip / norms)
        return [np.tensordot(factors, g, axes=1) / batch_size
                for g in scaled]

    def apply(self, scaled_gradient, lr):
        unscaled = [g / s for g, s in zip(scaled_gradient, self.scales())]
        self.t += 1
        alpha = lr * np.sqrt(1 - _BETA_2**self.t) / (1 - _BETA_1**self.t)
        for i, g in enumerate(unscaled):
            self.m[i] += (g - self.m[i]) * (1 - _BETA_1)
            self.v[i] += (g**2 - self.v[i]) * (1 - _BETA_2)
            self.weights[i] -= alpha * self.m[i] / (np.sqrt(self.v[i]) + _EPS)


class Capture(tf_dpadam.StepHooks):
    """Keeps each step's private gradient (scaled space, noised, / B)."""

    values = None

    def build(self, variables):  # Called on every trace.
        if self.values is None:
            self.values = [tf.Variable(tf.zeros(v.shape)) for v in variables]

    def after_noise(self, private_grads, variables):
        for value, g in zip(self.values, private_grads):
            value.assign(g)


def _private(model, noise_multiplier, clip, batch_size, lr, normalize=True,
             **kwargs):
    private = tf_dpadam.make_private(model, seed=3, **kwargs)
    private.compile(
        optimizer=stp.DPAdamScaleThenPrivatize(
            l2_norm_clip=clip, noise_multiplier=noise_multiplier,
            batch_size=batch_size, learning_rate=lr, beta_1=_BETA_1,
            beta_2=_BETA_2, epsilon=_EPS, scale_epsilon=_EPS_S,
            normalize_scale=normalize),
        loss="mse")
    return private


class PreconditionerTest(absltest.TestCase):

    def test_matches_numpy(self):
        rng = np.random.default_rng(0)
        v = [rng.uniform(0, 2, size=(4, 3)), rng.uniform(0, 1e-4, size=5)]
        for done, normalize in ((0, True), (1, True), (7, True), (1, False),
                                (7, False)):
            got = stp.preconditioner(v, done, _BETA_2, _EPS_S, normalize)
            for a, b in zip(got, numpy_preconditioner(v, done,
                                                      normalize=normalize)):
                # float32's 1 - beta_2^t: 2^-24 / 0.001 at t = 1.
                np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4)

    def test_shape_of_adams_scale_with_an_rms_of_one(self):
        rng = np.random.default_rng(1)
        v = [rng.uniform(0, 2, size=(4, 3)), rng.uniform(0, 1e-4, size=5)]
        s = [np.asarray(x, "float64")
             for x in stp.preconditioner(v, 7, _BETA_2, _EPS_S)]
        inverse = np.concatenate([1 / x.ravel() for x in s])
        self.assertAlmostEqual(np.sqrt(np.mean(inverse**2)), 1.0, delta=1e-5)
        # Proportional to Adam's 1 / (sqrt(v_hat) + eps_s), across variables.
        adam = np.concatenate([
            1 / (np.sqrt(x.ravel() / (1 - _BETA_2**7)) + _EPS_S) for x in v])
        ratio = np.concatenate([x.ravel() for x in s]) / adam
        np.testing.assert_allclose(ratio, ratio[0], rtol=1e-4)

    def test_one_before_the_first_step(self):
        for scale in stp.preconditioner([np.ones(3), np.ones((2, 2))], 0,
                                        _BETA_2, 0.5):
            np.testing.assert_allclose(np.asarray(scale), 1.0)


class LockstepTest(parameterized.TestCase):

    # Most clipped; none clipped; ghost clipping's scaled norms or the
    # vectorized map; the paper's unnormalized scale too.
    @parameterized.product(clip=(0.05, 100.0),
                           clipping=("ghost", "vectorized"),
                           normalize=(True, False))
    @pytest.mark.slow
    def test_noise_free_steps(self, clip, clipping, normalize):
        x, y = _batch()
        model = _dense_model()
        reference = NumpySTP(model.get_weights(), normalize)
        private = _private(model, 0.0, clip, batch_size=6, lr=0.05,
                           normalize=normalize, clipping=clipping)
        for _ in range(4):
            reference.apply(reference.private_gradient(x, y, clip, 6), 0.05)
            private.train_on_batch(x, y)
            for got, want in zip(model.get_weights(), reference.weights):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        self.assertEqual(private.clipping_used, clipping)

    @pytest.mark.slow
    def test_noisy_steps_unscale_the_private_gradient(self):
        # The noise is drawn in the scaled space (std sigma C / B per
        # coordinate) and divided by s before Adam: NumPy follows the
        # captured private gradients.
        features, outputs, n, clip, sigma = 64, 32, 16, 0.5, 2.0
        x, y = _batch(n, features, outputs)
        model = _dense_model(features=features, outputs=outputs)
        reference = NumpySTP(model.get_weights())
        private = _private(model, sigma, clip, batch_size=n, lr=0.01)
        capture = Capture()
        private.add_step_hooks(capture)
        for _ in range(3):
            clean = reference.private_gradient(x, y, clip, n)
            private.train_on_batch(x, y)
            noisy = [np.asarray(v, "float64") for v in capture.values]
            noise = np.concatenate([(a - b).ravel()
                                    for a, b in zip(noisy, clean)])
            # 2,080 coordinates: the std is within 10% (about 6 sigmas).
            self.assertAlmostEqual(np.std(noise) / (sigma * clip / n), 1.0,
                                   delta=0.1)
            self.assertLess(abs(np.mean(noise)), 0.1 * sigma * clip / n)
            reference.apply(noisy, 0.01)
            for got, want in zip(model.get_weights(), reference.weights):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


    @parameterized.parameters(True, False)
    @pytest.mark.slow
    def test_second_moment_keeps_the_noise_scale(self, normalize):
        # Noise-dominated steps (sigma C / B per coordinate in the scaled
        # space; the clipped signal adds at most C^2 / d = 1e-6 Phi to the
        # mean): g_tilde_j = noise_j / s_j with RMS(1 / s) = 1, so the mean
        # of v_hat over the coordinates is Phi = (sigma C / B)^2 in
        # expectation, whatever s. The paper's unnormalized s = 1 /
        # (sqrt(v_hat) + eps_s) gives 1 / eps_s^2 = 1e6 times less here
        # (s stays near 1 / eps_s: the noise it lets through is too small
        # to move v_hat), the collapse that stalled training.
        features, outputs, n, clip, sigma = 64, 32, 16, 0.05, 5.0
        x, y = _batch(n, features, outputs)
        model = _dense_model(features=features, outputs=outputs)
        private = _private(model, sigma, clip, batch_size=n, lr=1e-4,
                           normalize=normalize)
        for _ in range(20):
            private.train_on_batch(x, y)
        optimizer = private.optimizer
        correction = 1 - _BETA_2**int(optimizer.iterations)
        v_hat = np.concatenate([
            np.asarray(optimizer.moments(v)[1]).ravel() / correction
            for v in model.trainable_variables])
        phi = (sigma * clip / n) ** 2
        if normalize:
            # 2,080 coordinates x 20 steps: within a few percent.
            self.assertBetween(np.mean(v_hat) / phi, 0.8, 1.25)
        else:  # The collapse (about eps_s^2 = 1e-6 times Phi).
            self.assertLess(np.mean(v_hat) / phi, 1e-4)


def _both(**kwargs):
    """One of each optimizer that transforms the per-example gradient."""
    return [stp.DPAdamScaleThenPrivatize(scale_epsilon=_EPS_S, **kwargs),
            tf_dpadam.DPAdamDiSK(**kwargs)]


class ComposesTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_accumulation_is_one_step_on_the_union(self):
        x, y = _batch(n=12)
        settings = dict(l2_norm_clip=0.3, noise_multiplier=0.0,
                        batch_size=12, learning_rate=0.05)
        for whole, split in zip(
                _both(**settings),
                _both(gradient_accumulation_steps=2, **settings)):
            weights = []
            for optimizer, batches in ((whole, [slice(0, 12)]),
                                       (split, [slice(0, 6), slice(6, 12)])):
                model = _dense_model()
                private = tf_dpadam.make_private(model, seed=0)
                private.compile(optimizer=optimizer, loss="mse")
                for _ in range(3):
                    for rows in batches:
                        private.train_on_batch(x[rows], y[rows])
                self.assertEqual(int(optimizer.iterations), 3)
                weights.append(model.get_weights())
            for a, b in zip(*weights):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    @pytest.mark.slow
    def test_adaptive_per_layer_clipping(self):
        x, y = _batch(n=12)
        for optimizer in _both(l2_norm_clip=10.0, noise_multiplier=1.0,
                               batch_size=12, per_layer_clipping=True,
                               target_unclipped_quantile=0.5,
                               clipped_count_stddev=5.0):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((8,)), keras.layers.Dense(4, activation="tanh"),
                keras.layers.Dense(3)])
            private = tf_dpadam.make_private(model, seed=0)
            private.compile(optimizer=optimizer, loss="mse")
            for _ in range(3):
                private.train_on_batch(x, y)
            clips = np.asarray(optimizer.clip_norms())
            self.assertLen(clips, 2)
            self.assertTrue(np.all(np.isfinite(clips)), clips)
            self.assertTrue(np.all(clips != np.float32(10.0 / np.sqrt(2))),
                            clips)  # Each group's C moved.
            for w in model.get_weights():
                self.assertTrue(np.all(np.isfinite(w)))


class ApiTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_auto_takes_ghost_clipping_where_it_has_scaled_norms(self):
        x, y = _batch()
        private = _private(_dense_model(), 1.0, 1.0, 6, 0.01)
        private.train_on_batch(x, y)
        self.assertEqual(private.clipping_used, "ghost")

        def ws_conv_model():
            keras.utils.set_random_seed(0)
            return keras.Sequential([
                keras.Input((6, 6, 2)), tf_dpadam.layers.WSConv2D(3, 3),
                keras.layers.Flatten(), keras.layers.Dense(2)])

        images = np.ones((4, 6, 6, 2), "float32")
        labels = np.ones((4, 2), "float32")
        private = _private(ws_conv_model(), 1.0, 1.0, 4, 0.01)
        private.train_on_batch(images, labels)
        self.assertEqual(private.clipping_used, "ghost")
        # A block without a scaled norm (a user's rule may have none): the
        # vectorized map, with the reason.
        with mock.patch.object(
                standardized.StandardizedKernelBlock, "_scaled_norms",
                side_effect=blocks.ScaledNormUnsupportedError(
                    "this block has no scaled norm")):
            private = _private(ws_conv_model(), 1.0, 1.0, 4, 0.01)
            private.train_on_batch(images, labels)
        self.assertEqual(private.clipping_used, "vectorized")
        self.assertIn("this block has no scaled norm",
                      private.ghost_unsupported_reason)

    def test_moment_diagnostics_refuse_transformed_gradients(self):
        x, y = _batch()
        for optimizer in (
                stp.DPAdamScaleThenPrivatize(l2_norm_clip=1.0,
                                             noise_multiplier=1.0,
                                             batch_size=6),
                tf_dpadam.DPAdamDiSK(l2_norm_clip=1.0, noise_multiplier=1.0,
                                     batch_size=6)):
            private = tf_dpadam.make_private(_dense_model(), seed=0,
                                             diagnostics=True)
            private.compile(optimizer=optimizer, loss="mse")
            with self.assertRaisesRegex(ValueError, "MomentDiagnostics.*"
                                        + type(optimizer).__name__):
                private.fit(x, y, verbose=0,
                            callbacks=[tf_dpadam.MomentDiagnostics()])

    @parameterized.parameters(0.0, -1.0, float("nan"))
    def test_bad_scale_epsilon(self, value):
        with self.assertRaisesRegex(ValueError, "scale_epsilon"):
            stp.DPAdamScaleThenPrivatize(
                l2_norm_clip=1.0, noise_multiplier=1.0, scale_epsilon=value)

    def test_bad_normalize_scale(self):
        with self.assertRaisesRegex(ValueError, "normalize_scale"):
            stp.DPAdamScaleThenPrivatize(
                l2_norm_clip=1.0, noise_multiplier=1.0, normalize_scale=1)

    def test_amsgrad_refused(self):
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            stp.DPAdamScaleThenPrivatize(
                l2_norm_clip=1.0, noise_multiplier=1.0, amsgrad=True)

    def test_config_round_trip(self):
        optimizer = stp.DPAdamScaleThenPrivatize(
            l2_norm_clip=2.0, noise_multiplier=0.7, batch_size=32,
            scale_epsilon=1e-4, learning_rate=0.003, normalize_scale=False)
        config = optimizer.get_config()
        again = stp.DPAdamScaleThenPrivatize.from_config(config)
        self.assertEqual(again.scale_epsilon, 1e-4)
        self.assertFalse(again.normalize_scale)
        self.assertEqual(again.get_config(), config)
        revived = keras.optimizers.deserialize(
            keras.optimizers.serialize(optimizer))
        self.assertIsInstance(revived, stp.DPAdamScaleThenPrivatize)

    @pytest.mark.slow
    def test_save_and_load_keeps_the_preconditioner(self):
        x, y = _batch()
        model = _dense_model()
        private = _private(model, 1.0, 1.0, 6, 0.01)
        private.train_on_batch(x, y)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        private.save(path)
        loaded = keras.models.load_model(path)
        for a, b in zip(private.optimizer.scales(model.trainable_variables),
                        loaded.optimizer.scales(
                            loaded.trainable_variables)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b))
        self.assertEqual(loaded.optimizer.scale_epsilon, _EPS_S)


if __name__ == "__main__":
    absltest.main()
