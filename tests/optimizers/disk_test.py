"""DPAdamDiSK against a NumPy reference, step by step."""

import functools
import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.optimizers import disk

from training import augmentation_test
import scale_then_privatize_test as stp_test

_BETA_1, _BETA_2, _EPS = 0.9, 0.999, 1e-7
_KAPPA, _GAMMA = 0.7, 0.5


class NumpyDiSK:
    """The update rule in float64: combine, clip, sum, /B, filter, Adam."""

    def __init__(self, weights):
        self.weights = [np.array(w, "float64") for w in weights]
        self.previous = [w.copy() for w in self.weights]
        self.filtered = [np.zeros_like(w) for w in self.weights]
        self.m = [np.zeros_like(w) for w in self.weights]
        self.v = [np.zeros_like(w) for w in self.weights]
        self.t = 0

    def private_gradient(self, x, y, clip, batch_size):
        """The noise-free private gradient sum_i clip(d_i) / B."""
        w = (1 - _KAPPA) / (_KAPPA * _GAMMA)
        shifted = [p + _GAMMA * (p - q)
                   for p, q in zip(self.weights, self.previous)]
        here = stp_test.numpy_per_example_grads(*self.weights, x, y)
        there = stp_test.numpy_per_example_grads(*shifted, x, y)
        combined = [(1 - w) * a + w * b for a, b in zip(here, there)]
        norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1)**2, axis=1)
                            for g in combined))
        factors = np.minimum(1.0, clip / norms)
        return [np.tensordot(factors, g, axes=1) / batch_size
                for g in combined]

    def apply(self, private_gradient, lr):
        if self.t == 0:
            estimate = [g.copy() for g in private_gradient]
        else:
            estimate = [(1 - _KAPPA) * f + _KAPPA * g
                        for f, g in zip(self.filtered, private_gradient)]
        self.filtered = estimate
        self.previous = [w.copy() for w in self.weights]
        self.t += 1
        alpha = lr * np.sqrt(1 - _BETA_2**self.t) / (1 - _BETA_1**self.t)
        for i, g in enumerate(estimate):
            self.m[i] += (g - self.m[i]) * (1 - _BETA_1)
            self.v[i] += (g**2 - self.v[i]) * (1 - _BETA_2)
            self.weights[i] -= alpha * self.m[i] / (np.sqrt(self.v[i]) + _EPS)


def _optimizer(noise_multiplier, clip, batch_size, lr):
    return disk.DPAdamDiSK(
        l2_norm_clip=clip, noise_multiplier=noise_multiplier,
        batch_size=batch_size, learning_rate=lr, beta_1=_BETA_1,
        beta_2=_BETA_2, epsilon=_EPS, kappa=_KAPPA, gamma=_GAMMA)


def _private(model, noise_multiplier, clip, batch_size, lr, **kwargs):
    private = tf_dpadam.make_private(model, seed=3, **kwargs)
    private.compile(optimizer=_optimizer(noise_multiplier, clip, batch_size,
                                         lr), loss="mse")
    return private


class ShiftWeightTest(absltest.TestCase):

    def test_formula(self):
        self.assertAlmostEqual(disk.shift_weight(0.7, 0.5), 0.3 / 0.35)
        self.assertEqual(disk.shift_weight(1.0, 0.5), 0.0)


class LockstepTest(parameterized.TestCase):

    # Most clipped, none clipped; ghost clipping's second pass ("auto" on a
    # Dense model) and the vectorized map.
    @parameterized.product(clip=(0.05, 100.0),
                           clipping=("auto", "vectorized"))
    @pytest.mark.slow
    def test_noise_free_steps(self, clip, clipping):
        x, y = stp_test._batch()
        model = stp_test._dense_model()
        reference = NumpyDiSK(model.get_weights())
        private = _private(model, 0.0, clip, batch_size=6, lr=0.05,
                           clipping=clipping)
        for _ in range(5):
            reference.apply(reference.private_gradient(x, y, clip, 6), 0.05)
            private.train_on_batch(x, y)
            for got, want in zip(model.get_weights(), reference.weights):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        self.assertEqual(private.clipping_used,
                         "ghost" if clipping == "auto" else "vectorized")

    @pytest.mark.slow
    def test_noisy_steps_filter_the_private_gradient(self):
        features, outputs, n, clip, sigma = 64, 32, 16, 0.5, 2.0
        x, y = stp_test._batch(n, features, outputs)
        model = stp_test._dense_model(features=features, outputs=outputs)
        reference = NumpyDiSK(model.get_weights())
        private = _private(model, sigma, clip, batch_size=n, lr=0.01)
        capture = stp_test.Capture()
        private.add_step_hooks(capture)
        for _ in range(4):
            clean = reference.private_gradient(x, y, clip, n)
            private.train_on_batch(x, y)
            noisy = [np.asarray(v, "float64") for v in capture.values]
            noise = np.concatenate([(a - b).ravel()
                                    for a, b in zip(noisy, clean)])
            # Noise once on the combined clipped sum, std sigma C / B
            # (2,080 coordinates: within 10%, about 6 sigmas).
            self.assertAlmostEqual(np.std(noise) / (sigma * clip / n), 1.0,
                                   delta=0.1)
            reference.apply(noisy, 0.01)
            for got, want in zip(model.get_weights(), reference.weights):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


class DropoutTest(parameterized.TestCase):

    @parameterized.parameters("ghost", "vectorized")
    @pytest.mark.slow
    def test_both_passes_draw_the_same_masks(self, clipping):
        # At the first step the shift is 0, so the combined gradient is the
        # gradient itself only if both passes use the same dropout masks:
        # the clean sum equals DPAdam's on an identical model.
        x, y = stp_test._batch(n=8)
        sums = []
        for optimizer, rate in (
                (_optimizer(0.0, 1e3, 1, 0.0), 0.5),
                (tf_dpadam.DPAdam(l2_norm_clip=1e3, noise_multiplier=0.0,
                                  batch_size=1, learning_rate=0.0), 0.5),
                (tf_dpadam.DPAdam(l2_norm_clip=1e3, noise_multiplier=0.0,
                                  batch_size=1, learning_rate=0.0), 0.0)):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dropout(rate), keras.layers.Dense(3)])
            private = tf_dpadam.make_private(model, seed=0, diagnostics=True,
                                             clipping=clipping)
            private.compile(optimizer=optimizer, loss="mse")
            private.train_on_batch(x, y)
            self.assertEqual(private.clipping_used, clipping)
            sums.append(np.concatenate(
                [np.ravel(v) for v in private.clean_gradients]))
        np.testing.assert_allclose(sums[0], sums[1], rtol=1e-5, atol=1e-7)
        # Dropout did act: without it the sum differs.
        self.assertGreater(np.linalg.norm(sums[1] - sums[2]),
                           0.1 * np.linalg.norm(sums[2]))


class AugmultTest(parameterized.TestCase):

    # group_normalized_cnn: WSConv2D's blocks read the kernel at each pass.
    @parameterized.parameters("cnn", "sequence", "group_normalized_cnn")
    @pytest.mark.slow
    def test_ghost_and_vectorized_agree_with_augmult(self, name):
        # K = 3 views per example and a non-zero shift: ghost clipping's
        # two passes (their records grouped by example) give the
        # vectorized map's clipped sum (exact against one-example tapes in
        # tests/preclip_zoo_test.py without views).
        sums = []
        for clipping in ("ghost", "vectorized"):
            base, x, y = augmentation_test._build(name)
            weights = [np.array(v) for v in base.trainable_variables]
            rng = np.random.default_rng(5)
            private = tf_dpadam.make_private(
                base, clipping=clipping, augmult=3, diagnostics=True, seed=0,
                augment=functools.partial(augmentation_test._augment,
                                          augmult=3))
            optimizer = _optimizer(0.0, 0.05, 8, 0.0)
            private.compile(optimizer=optimizer,
                            loss=augmentation_test._LOSS)
            self.assertTrue(optimizer.built)
            optimizer.iterations.assign(3)
            for v, w in zip(base.trainable_variables, weights):
                move = 0.1 * rng.normal(size=w.shape)
                optimizer.state(v)[0].assign((w - move).astype(w.dtype))
            private.train_on_batch(x, y,
                                   sample_weight=augmentation_test._WEIGHTS)
            self.assertEqual(private.clipping_used, clipping)
            sums.append(np.concatenate(
                [np.ravel(c) for c in private.clean_gradients]))
        self.assertGreater(np.linalg.norm(sums[1]), 0.0)
        np.testing.assert_allclose(sums[0], sums[1], rtol=1e-4,
                                   atol=1e-4 * np.max(np.abs(sums[1])))


class ApiTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_disk_on_ghost_clipping(self):
        # A second pass at the shifted weights: ghost clipping where every
        # rule's blocks come from its records (a Dense model) ...
        x, y = stp_test._batch()
        private = tf_dpadam.make_private(stp_test._dense_model(), seed=0,
                                         clipping="ghost")
        private.compile(optimizer=tf_dpadam.DPAdamDiSK(
            l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=6),
            loss="mse")
        for _ in range(2):  # the second step has a non-zero shift
            private.train_on_batch(x, y)
        self.assertEqual(private.clipping_used, "ghost")
        self.assertEqual(int(private.optimizer.iterations), 2)
        # ... and where a rule reads its weights after the forward pass
        # (WSConv2D's standardization), at each pass's weights.
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6, 6, 2)), tf_dpadam.layers.WSConv2D(3, 3),
            keras.layers.Flatten(), keras.layers.Dense(2)])
        private = tf_dpadam.make_private(model, seed=0, clipping="ghost")
        private.compile(optimizer=tf_dpadam.DPAdamDiSK(
            l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=4),
            loss="mse")
        for _ in range(2):
            private.train_on_batch(np.ones((4, 6, 6, 2), "float32"),
                                   np.ones((4, 2), "float32"))
        self.assertEqual(private.clipping_used, "ghost")
        self.assertEqual(int(private.optimizer.iterations), 2)

    @parameterized.parameters(
        dict(kappa=0.0), dict(kappa=1.5), dict(gamma=0.0),
        dict(gamma=-1.0),
        # A string was a TypeError from the comparison, naming nothing.
        dict(kappa="0.5"), dict(gamma="0.5"))
    def test_bad_arguments(self, **kwargs):
        with self.assertRaisesRegex(ValueError, next(iter(kwargs))):
            disk.DPAdamDiSK(l2_norm_clip=1.0, noise_multiplier=1.0, **kwargs)

    def test_config_round_trip(self):
        optimizer = disk.DPAdamDiSK(l2_norm_clip=2.0, noise_multiplier=0.7,
                                    batch_size=32, kappa=0.5, gamma=0.25)
        config = optimizer.get_config()
        again = disk.DPAdamDiSK.from_config(config)
        self.assertEqual((again.kappa, again.gamma), (0.5, 0.25))
        self.assertEqual(again.get_config(), config)

    @pytest.mark.slow
    def test_save_and_load_keeps_the_filter(self):
        x, y = stp_test._batch()
        model = stp_test._dense_model()
        private = _private(model, 1.0, 1.0, 6, 0.01)
        private.train_on_batch(x, y)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        private.save(path)
        loaded = keras.models.load_model(path)
        for v, w in zip(model.trainable_variables,
                        loaded.trainable_variables):
            for a, b in zip(private.optimizer.state(v),
                            loaded.optimizer.state(w)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b))
        self.assertEqual(loaded.optimizer.kappa, _KAPPA)
        self.assertEqual(int(loaded.optimizer.iterations), 1)


if __name__ == "__main__":
    absltest.main()
