"""Banded Toeplitz correlated noise against dense NumPy linear algebra.

The reference builds M as a dense matrix and solves M w = z with
`np.linalg.solve`; the covariance of the noise across steps is measured on
200,000 coordinates against (sigma C)^2 M^-1 M^-T.
"""

import math

import dp_accounting
import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.privatizer import correlated_noise
from tf_dpadam.privatizer import noise as noise_lib

_BandedToeplitz = correlated_noise.BandedToeplitz


def _run(strategy, draws, shapes=None):
    """`correlate` over the rows of each of `draws` (a list of [T, ...]
    arrays): the stacked noise per tensor and the variances."""
    shapes = shapes or [d.shape[1:] for d in draws]
    state = correlated_noise.initial_state(strategy, shapes)
    outputs = [[] for _ in draws]
    variances = []
    for t in range(draws[0].shape[0]):
        noise, variance, state = correlated_noise.correlate(
            strategy, [tf.constant(d[t]) for d in draws], state)
        for out, w in zip(outputs, noise):
            out.append(w.numpy())
        variances.append(float(variance))
    return [np.stack(out) for out in outputs], np.array(variances), state


def _dense_inverse(strategy, steps):
    return np.linalg.inv(strategy.matrix(steps))


class StrategyTest(parameterized.TestCase):

    def test_bisr_is_the_inverse_square_root_series(self):
        m = np.array(_BandedToeplitz.bisr(4).coefficients)
        want = np.array([1.0, 1 / 2, 3 / 8, 5 / 16])
        np.testing.assert_allclose(m, want / np.linalg.norm(want), rtol=1e-12)

    @parameterized.parameters(1, 2, 5)
    def test_every_full_column_has_norm_one(self, bands):
        for strategy in (_BandedToeplitz.bisr(bands),
                         _BandedToeplitz.optimized(bands, 40),
                         _BandedToeplitz(tuple(range(1, bands + 1)))):
            norms = np.linalg.norm(strategy.matrix(12), axis=0)
            np.testing.assert_allclose(norms[:12 - bands + 1], 1.0,
                                       rtol=1e-12)
            self.assertLessEqual(norms.max(), 1.0 + 1e-12)

    def test_prefix_error_is_that_of_the_dense_factorization(self):
        steps = 30
        prefix = np.tril(np.ones((steps, steps)))
        for strategy in (_BandedToeplitz.bisr(4),
                         _BandedToeplitz((1.0, -0.3, 0.2))):
            dense = np.sum((prefix @ _dense_inverse(strategy, steps))**2)
            self.assertAlmostEqual(
                correlated_noise.prefix_error(strategy.coefficients, steps),
                dense / steps, places=9)
        self.assertAlmostEqual(correlated_noise.prefix_error((1.0,), steps),
                               (steps + 1) / 2, places=12)

    @parameterized.parameters(2, 4, 8)
    def test_optimized_bands_beat_dp_sgd_and_bisr(self, bands):
        steps = 200
        dp_sgd = correlated_noise.prefix_error((1.0,), steps)
        bisr = correlated_noise.prefix_error(
            _BandedToeplitz.bisr(bands).coefficients, steps)
        optimized = correlated_noise.prefix_error(
            _BandedToeplitz.optimized(bands, steps).coefficients, steps)
        self.assertLess(bisr, dp_sgd)
        self.assertLessEqual(optimized, bisr * (1 + 1e-9))
        # More bands, no worse (each optimum is feasible for more bands).
        if bands > 2:
            fewer = correlated_noise.prefix_error(
                _BandedToeplitz.optimized(bands // 2, steps).coefficients,
                steps)
            self.assertLessEqual(optimized, fewer * (1 + 1e-6))

    def test_one_band_is_the_identity(self):
        for strategy in (_BandedToeplitz.bisr(1),
                         _BandedToeplitz.optimized(1, 10),
                         _BandedToeplitz((3.0,))):
            self.assertEqual(strategy.coefficients, (1.0,))

    @parameterized.named_parameters(
        ("zero_bands", dict(bands=0)), ("bool", dict(bands=True)),
        ("float", dict(bands=2.0)), ("too_many", dict(bands=65)))
    def test_bad_bands_name_the_argument(self, kwargs):
        with self.assertRaisesRegex(ValueError, "bands="):
            _BandedToeplitz.bisr(**kwargs)
        with self.assertRaisesRegex(ValueError, "bands="):
            _BandedToeplitz.optimized(steps=100, **kwargs)

    def test_bad_steps_and_coefficients_name_the_argument(self):
        with self.assertRaisesRegex(ValueError, "steps=3"):
            _BandedToeplitz.optimized(4, 3)
        for coefficients in ((), (0.0, 1.0), (-1.0,), (1.0, float("nan"))):
            with self.assertRaisesRegex(ValueError, "coefficients="):
                _BandedToeplitz(coefficients)


class CorrelateTest(parameterized.TestCase):

    def test_one_band_returns_the_draws_themselves(self):
        # Bit-equal: DP-SGD's step, with Phi's multiplier exactly 1.
        rng = np.random.default_rng(0)
        draws = [rng.normal(size=(5, 3, 2)).astype("float32"),
                 rng.normal(size=(5, 7)).astype("float32")]
        got, variances, _ = _run(_BandedToeplitz.bisr(1), draws)
        for g, d in zip(got, draws):
            np.testing.assert_array_equal(g, d)
        np.testing.assert_array_equal(variances, np.ones(5))

    @parameterized.parameters(2, 3, 6)
    def test_the_noise_solves_the_banded_system(self, bands):
        steps = 9
        strategy = _BandedToeplitz.optimized(bands, 50)
        rng = np.random.default_rng(bands)
        z = rng.normal(size=(steps, 4, 3)).astype("float32")
        (got,), variances, state = _run(strategy, [z])
        want = np.linalg.solve(strategy.matrix(steps),
                               z.reshape(steps, -1).astype(np.float64))
        np.testing.assert_allclose(got.reshape(steps, -1), want, rtol=1e-4,
                                   atol=1e-5)
        # Phi's multiplier: the squared norm of row t of M^-1.
        rows = np.sum(_dense_inverse(strategy, steps)**2, axis=1)
        np.testing.assert_allclose(variances, rows, rtol=1e-6)
        np.testing.assert_allclose(strategy.noise_variances(steps), rows,
                                   rtol=1e-12)
        self.assertEqual(int(state.draws), steps)
        self.assertEqual(tuple(state.history[0].shape), (bands - 1, 4, 3))

    def test_graph_and_xla_equal_eager(self):
        strategy = _BandedToeplitz.bisr(4)
        z = np.random.default_rng(1).normal(size=(6, 5)).astype("float32")
        (eager,), eager_variances, _ = _run(strategy, [z])

        for jit in (False, True):
            @tf.function(jit_compile=jit)
            def step(z_t, state):
                return correlated_noise.correlate(strategy, [z_t], state)

            state = correlated_noise.initial_state(strategy, [(5,)])
            for t in range(6):
                (w,), variance, state = step(tf.constant(z[t]), state)
                np.testing.assert_allclose(w.numpy(), eager[t], rtol=1e-6,
                                           atol=1e-7)
                self.assertAlmostEqual(float(variance), eager_variances[t],
                                       places=6)

    def test_noise_covariance_across_steps(self):
        # n = 200,000 coordinates of z ~ N(0, (sigma C)^2): the sample
        # covariance of (w_s, w_t) has standard error
        # sqrt((S_ss S_tt + S_st^2) / n) around S = (sigma C)^2 M^-1 M^-T;
        # every entry must be within 5 of them (about 0.5% of S_tt here).
        steps, n, stddev = 6, 200_000, 1.3 * 0.5
        strategy = _BandedToeplitz.optimized(3, steps)
        draws = np.stack([
            noise_lib.gaussian([n], stddev, tf.float32,
                               tf.constant([7, t], tf.int64)).numpy()
            for t in range(steps)])
        (w,), _, _ = _run(strategy, [draws])
        sample = (w.astype(np.float64) @ w.T.astype(np.float64)) / n
        inverse = _dense_inverse(strategy, steps)
        want = stddev**2 * inverse @ inverse.T
        diagonal = np.diag(want)
        error = np.sqrt((np.outer(diagonal, diagonal) + want**2) / n)
        np.testing.assert_array_less(np.abs(sample - want), 5 * error)
        # The test can fail: independent noise of the same variances would
        # miss the correlations by far more than 5 standard errors.
        off = want - np.diag(diagonal)
        self.assertGreater(np.max(np.abs(off) / error), 20)


class AccountingTest(absltest.TestCase):

    def _rdp_epsilon(self, event, delta):
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(event)
        return accountant.get_epsilon(delta)

    def test_one_band_is_dp_sgd(self):
        q, sigma, steps = 0.01, 1.1, 1000
        self.assertEqual(
            accounting_epsilon.banded_dp_sgd_event(q, sigma, steps, 1),
            accounting_epsilon.dp_sgd_event(q, sigma, steps))

    def test_bands_compose_ceil_t_over_b_group_steps(self):
        # Independently: N = 60,000, B = 250, b = 4 groups of 15,000, each
        # sampled at 4 B / N on every 4th step, 1,001 steps: an example's
        # group is drawn at most 251 times.
        q_group, sigma, delta = 4 * 250 / 60_000, 1.0, 1e-5
        event = accounting_epsilon.banded_dp_sgd_event(q_group, sigma, 1001,
                                                       4)
        independent = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q_group, dp_accounting.GaussianDpEvent(sigma)), 251)
        got = self._rdp_epsilon(event, delta)
        self.assertAlmostEqual(got, self._rdp_epsilon(independent, delta),
                               places=12)
        # Fewer group steps than DP-SGD's T at a b-fold rate: neither is
        # the other (the test would see a swapped count).
        dp_sgd = self._rdp_epsilon(
            accounting_epsilon.dp_sgd_event(q_group / 4, sigma, 1001), delta)
        self.assertTrue(math.isfinite(got) and math.isfinite(dp_sgd))
        self.assertNotAlmostEqual(got, dp_sgd, places=3)

    def test_bad_bands_name_the_argument(self):
        with self.assertRaisesRegex(ValueError, "bands"):
            accounting_epsilon.banded_dp_sgd_event(0.1, 1.0, 10, 0)


if __name__ == "__main__":
    absltest.main()
