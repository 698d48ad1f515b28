"""Correlated noise (an optimizer's `noise_strategy`) through `fit`.

What issue 53 asks of the step, end to end on a private model: one band is
DP-SGD's step bit for bit; the noise of T steps has covariance
(sigma C / B)^2 M^-1 M^-T (measured on 100k coordinates, also across a
kill and resume from a run folder, and NOT so when the saved state is
lost: the test can fail); DP-AdamBC gets the exact Phi_t and averages it
as v_hat does; the epsilon is an independent dp_accounting computation of
ceil(T / b) Poisson rounds at q = b B / N; and what cannot be private is
refused. Scale-then-privatize composes with it: its noise, in the scaled
space, has the strategy's covariance.
"""

import math
import os
import tempfile

import dp_accounting
import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest
import pytest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.optimizers import paper
from tf_dpadam.optimizers import scale_then_privatize
from tf_dpadam.privatizer import correlated_noise
from tf_dpadam.tools import run_dir

import helpers

SIGMA, CLIP, B, N = 1.0, 1.0, 8, 128
IN, OUT = 1000, 100  # 100k weights: each step's noise has 100k coordinates.


def _zero_gradient_model(seed=0):
    """A linear model without bias on all-zero inputs: every example's
    gradient is 0, so each step's private gradient is its noise / B."""
    base = keras.Sequential([keras.Input((IN,)),
                             keras.layers.Dense(OUT, use_bias=False)])
    base.set_weights([np.zeros((IN, OUT), "float32")])
    return tf_dpadam.make_private(base, seed=seed, check_independence=False)


def _compile(model, strategy, optimizer=paper.DPSGD, **kwargs):
    kwargs.setdefault("learning_rate", 1.0)
    model.compile(
        optimizer=optimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA,
                            batch_size=B, noise_strategy=strategy, **kwargs),
        loss="mse")


class _Record(keras.callbacks.Callback):
    """Each step's weights (after it) and the optimizer's Phi."""

    def __init__(self):
        super().__init__()
        self.weights, self.phis, self.averages = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.model.trainable_variables[0].numpy().copy())
        optimizer = self.model.optimizer
        self.phis.append(float(optimizer.noise_phi()))
        average = getattr(optimizer, "_phi_average", None)
        if average is not None:
            self.averages.append(float(average.numpy()))


class _SeenScaleThenPrivatize(
        scale_then_privatize.DPAdamScaleThenPrivatize):
    """Scale-then-privatize that keeps the private gradient it gets (in
    the scaled space, before it undoes the scaling) and its scales."""

    def build(self, variables):
        super().build(variables)
        self.seen = tf.Variable(tf.zeros(variables[0].shape),
                                trainable=False)
        self.seen_scale = tf.Variable(tf.zeros(variables[0].shape),
                                      trainable=False)

    def apply(self, grads, trainable_variables=None):
        if self._private_apply_depth:
            self.seen.assign(tf.cast(grads[0], tf.float32))
            self.seen_scale.assign(self.scales(self._trainable_variables)[0])
        return super().apply(grads, trainable_variables)


class _RecordSeen(keras.callbacks.Callback):
    """Each step's private gradient and scale (`_SeenScaleThenPrivatize`)
    and the weights after it."""

    def __init__(self):
        super().__init__()
        self.seen, self.scales, self.weights = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.seen.append(optimizer.seen.numpy().copy())
        self.scales.append(optimizer.seen_scale.numpy().copy())
        self.weights.append(self.model.trainable_variables[0].numpy().copy())


def _data():
    return (np.zeros((N, IN), "float32"), np.zeros((N, OUT), "float32"))


def _fit(model, epochs, record):
    x, y = _data()
    model.fit(x, y, epochs=epochs, verbose=0, callbacks=[record])


def _noise(weights):
    """Each step's noise w_t (T x d) from DP-SGD's weights at lr = 1:
    theta_t - theta_{t+1} = w_t / B."""
    steps = np.stack([np.zeros((IN, OUT))] + weights).reshape(
        len(weights) + 1, -1)
    return -(np.diff(steps, axis=0)) * B / (SIGMA * CLIP)


def _check_covariance(test, noise, strategy, block_at=None):
    """The empirical T x T covariance of the noise over its d coordinates
    equals M^-1 M^-T (unit variance per z), within 6 standard errors of
    each entry's estimate."""
    steps, d = noise.shape
    inverse = np.linalg.inv(strategy.matrix(steps))
    if block_at is not None:  # A history that restarted at zero.
        inverse[block_at:, :block_at] = 0
        inverse[block_at:, block_at:] = np.linalg.inv(
            strategy.matrix(steps - block_at))
    worst = helpers.covariance_standard_errors(
        noise @ noise.T / d, inverse @ inverse.T, d)
    test.assertLess(worst, 6.0, f"covariance off by {worst:.1f} std errors")


class CorrelatedNoiseFitTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_one_band_is_dp_sgds_step_bit_for_bit(self):
        results = []
        for strategy in (None, 1, correlated_noise.BandedToeplitz((2.0,))):
            keras.utils.set_random_seed(3)
            model = _zero_gradient_model(seed=7)
            _compile(model, strategy, paper.DPAdamCorrected,
                     learning_rate=0.01)
            record = _Record()
            x, y = _data()
            # Examples with gradients, so that the steps are not all noise.
            x = np.random.default_rng(0).normal(size=x.shape).astype(
                "float32")
            model.fit(x, y, epochs=1, verbose=0, callbacks=[record],
                      sampling="poisson")
            results.append((record.weights, record.phis))
        for weights, phis in results[1:]:
            self.assertEqual(phis, results[0][1])
            for mine, theirs in zip(weights, results[0][0]):
                np.testing.assert_array_equal(mine, theirs)

    @parameterized.named_parameters(
        ("two_bands", 2, 1, False),
        ("four_bands", 4, 1, False),
        ("accumulation", 4, 2, False),
        ("xla", 2, 1, True),
    )
    @pytest.mark.slow
    def test_noise_covariance_is_the_strategys(self, bands, accumulation,
                                               jit_compile):
        strategy = correlated_noise.BandedToeplitz.bisr(bands)
        model = _zero_gradient_model()
        _compile(model, bands,
                 gradient_accumulation_steps=accumulation)
        model.jit_compile = jit_compile
        record = _Record()
        _fit(model, 1, record)  # N / B = 16 steps
        # One record per physical batch: a step's weights after its last.
        noise = _noise(record.weights[accumulation - 1::accumulation])
        self.assertEqual(noise.shape, (N // B, IN * OUT))
        _check_covariance(self, noise, strategy)
        # Independent noise would not pass (the test can fail).
        with self.assertRaises(AssertionError):
            _check_covariance(self, noise,
                              correlated_noise.BandedToeplitz((1.0,)))

    @pytest.mark.slow
    def test_kill_and_resume_continues_the_noise_stream(self):
        strategy = correlated_noise.BandedToeplitz.optimized(4, 16)
        for keep_state in (True, False):
            with tempfile.TemporaryDirectory() as folder:
                model = _zero_gradient_model()
                _compile(model, strategy)
                first = _Record()
                _fit(model, 1, first)
                run_dir.save_checkpoint(model, folder)
                self.assertEqual(
                    os.stat(os.path.join(folder, run_dir.NOISE_STATE)).st_mode
                    & 0o777, 0o600)
                if not keep_state:
                    os.remove(os.path.join(folder, run_dir.NOISE_STATE))
                del model  # The process dies; a new one loads the folder.
                resumed = run_dir.load_checkpoint(folder)
                second = _Record()
                _fit(resumed, 1, second)
                noise = _noise(first.weights + second.weights)
                if keep_state:
                    _check_covariance(self, noise, strategy)
                else:  # A new history: block diagonal, and detected.
                    _check_covariance(self, noise, strategy, block_at=16)
                    with self.assertRaises(AssertionError):
                        _check_covariance(self, noise, strategy)

    @pytest.mark.slow
    def test_resume_with_another_strategy_is_refused(self):
        with tempfile.TemporaryDirectory() as folder:
            model = _zero_gradient_model()
            _compile(model, 4)
            _fit(model, 1, _Record())
            run_dir.save_checkpoint(model, folder)
            resumed = run_dir.load_checkpoint(folder)
            _compile(resumed, 2)
            with self.assertRaisesRegex(ValueError, "noise_strategy"):
                _fit(resumed, 1, _Record())

    @pytest.mark.slow
    def test_corrected_adam_gets_the_exact_phi_t(self):
        bands = 4
        model = _zero_gradient_model()
        _compile(model, bands, paper.DPAdamCorrected, learning_rate=1e-3)
        record = _Record()
        _fit(model, 1, record)
        strategy = correlated_noise.BandedToeplitz.bisr(bands)
        steps = N // B
        phi = (SIGMA * CLIP / B) ** 2
        expected = phi * strategy.noise_variances(steps)
        np.testing.assert_allclose(record.phis, expected, rtol=1e-6)
        # v_hat's bias is the average of the Phi_tau with v's weights.
        beta_2 = model.optimizer.beta_2
        average = 0.0
        for t in range(steps):
            average = beta_2 * average + (1 - beta_2) * expected[t]
            np.testing.assert_allclose(record.averages[t], average,
                                       rtol=1e-5)
        self.assertGreater(expected[-1] / expected[0], 1.3)

    @pytest.mark.slow
    def test_scale_then_privatize_composes(self):
        # The noise is added in the scaled space, where each step is the
        # Gaussian mechanism of sensitivity C: there it has the strategy's
        # covariance, and the update divides it by the step's scales
        # (which change from step to step, as Adam's v does).
        bands = 4
        model = _zero_gradient_model()
        _compile(model, bands, _SeenScaleThenPrivatize, learning_rate=1e-3)
        record = _RecordSeen()
        _fit(model, 1, record)
        noise = (np.stack(record.seen).reshape(len(record.seen), -1)
                 * B / (SIGMA * CLIP))
        self.assertEqual(noise.shape, (N // B, IN * OUT))
        strategy = correlated_noise.BandedToeplitz.bisr(bands)
        _check_covariance(self, noise, strategy)
        with self.assertRaises(AssertionError):
            _check_covariance(self, noise,
                              correlated_noise.BandedToeplitz((1.0,)))
        # The scales move from step to step (as Adam's v does), and every
        # update is Keras Adam's on the unscaled private gradient
        # g_t = w_t / (B s_t): a NumPy Adam in lockstep.
        self.assertGreater(np.max(np.abs(record.scales[-1]
                                         - record.scales[1])), 0.0)
        optimizer = model.optimizer
        beta_1, beta_2 = optimizer.beta_1, optimizer.beta_2
        theta = np.zeros(IN * OUT)
        m, v = np.zeros_like(theta), np.zeros_like(theta)
        for t, (seen, scale, weights) in enumerate(
                zip(record.seen, record.scales, record.weights), start=1):
            g = (seen / scale).reshape(-1).astype("float64")
            m = beta_1 * m + (1 - beta_1) * g
            v = beta_2 * v + (1 - beta_2) * g * g
            alpha = 1e-3 * math.sqrt(1 - beta_2**t) / (1 - beta_1**t)
            theta = theta - alpha * m / (np.sqrt(v) + optimizer.epsilon)
            np.testing.assert_allclose(weights.reshape(-1), theta,
                                       rtol=1e-3, atol=1e-7,
                                       err_msg=f"step {t}")

    @pytest.mark.slow
    def test_epsilon_is_dp_accountings_of_the_amplified_mechanism(self):
        bands, delta = 4, 1e-5
        model = _zero_gradient_model()
        _compile(model, bands)
        _fit(model, 2, _Record())
        _fit(model, 1, _Record())  # A second fit: its own segment.
        steps = N // B
        self.assertEqual(model.privacy_ledger.steps, 3 * steps)
        q = bands * B / N
        rounds = 2 * math.ceil(steps / bands) + math.ceil(steps / bands)
        accountant = dp_accounting.rdp.RdpAccountant(
            list(accounting_epsilon.RDP_ORDERS))
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(SIGMA)), rounds))
        self.assertAlmostEqual(model.spent_epsilon(delta, "rdp"),
                               accountant.get_epsilon(delta), places=9)
        pld = dp_accounting.pld.PLDAccountant(
            value_discretization_interval=1e-3)
        pld.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(SIGMA)), rounds))
        self.assertAlmostEqual(model.spent_epsilon(delta),
                               pld.get_epsilon(delta), delta=1e-6)
        # Fewer rounds than DP-SGD's steps at the same q would be.
        self.assertLess(rounds, 3 * steps)

    @parameterized.named_parameters(
        ("train_on_batch", "train_on_batch"),
        ("shuffled", "shuffled"),
        ("user_dataset", "dataset"),
        ("own_cyclic_batches", "cyclic"),
    )
    def test_without_cyclic_batches_refused(self, how):
        model = _zero_gradient_model()
        _compile(model, 4)
        x, y = _data()
        with self.assertRaisesRegex(ValueError, "noise_strategy"):
            if how == "train_on_batch":
                model.train_on_batch(x[:B], y[:B])
            elif how == "shuffled":
                model.fit(x, y, batch_size=B, sampling="shuffled", verbose=0)
            elif how == "dataset":
                model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B),
                          verbose=0)
            else:  # Groups that do not continue the noise's cycle.
                model.fit(tf_dpadam.data.poisson_batches(
                    (x, y), expected_batch_size=B, groups=4,
                    group_offset=1).dataset, verbose=0)
        self.assertEqual(model.privacy_ledger.steps, 0)

    @pytest.mark.slow
    def test_own_cyclic_batches_continuing_the_cycle_train(self):
        model = _zero_gradient_model()
        _compile(model, 4)
        x, y = _data()
        model.fit(x[:40], y[:40], epochs=1, verbose=0)  # 5 -> 8 steps
        draws = model.noise_history.draws
        self.assertEqual(draws, 8)
        batches = tf_dpadam.data.poisson_batches(
            (x, y), expected_batch_size=B, groups=4, group_offset=draws)
        model.fit(batches.dataset, verbose=0)
        self.assertEqual(model.noise_history.draws, 8 + N // B)
        self.assertEqual(
            [s.mechanism.bands for s in model.privacy_ledger.segments],
            [4, 4])
        with self.assertRaisesRegex(ValueError, "group_offset"):
            model.fit(tf_dpadam.data.poisson_batches(
                (x, y), expected_batch_size=B, groups=4,
                group_offset=draws + 1).dataset, verbose=0)

    @pytest.mark.slow
    def test_cyclic_batches_read_from_a_source_train(self):
        # Data larger than memory: random-access reads of cyclic Poisson
        # batches (`poisson_batches_from_source(..., groups=b)`).
        model = _zero_gradient_model()
        _compile(model, 4)
        x, y = _data()
        source = [(x[i], y[i]) for i in range(N)]
        draws = model.noise_history.draws_for(
            model.optimizer.noise_strategy, [(IN, OUT)])
        batches = tf_dpadam.data.poisson_batches_from_source(
            source, expected_batch_size=B, groups=4, group_offset=draws)
        model.fit(batches.dataset, verbose=0)
        self.assertEqual(model.noise_history.draws, N // B)
        segment, = model.privacy_ledger.segments
        self.assertEqual((segment.mechanism.bands,
                          segment.mechanism.sampling_rate), (4, 4 * B / N))
        with self.assertRaisesRegex(ValueError, "group_offset"):
            model.fit(tf_dpadam.data.poisson_batches_from_source(
                source, expected_batch_size=B, groups=4,
                group_offset=1).dataset, verbose=0)

    @pytest.mark.slow
    def test_history_is_never_saved_with_the_model(self):
        model = _zero_gradient_model()
        _compile(model, 4)
        _fit(model, 1, _Record())
        self.assertEqual(model.noise_history.draws, N // B)
        names = [w.path for w in model.weights + model.optimizer.variables]
        self.assertEqual(len(model.weights), 1)
        self.assertFalse(any("history" in name for name in names))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "m.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
            self.assertEqual(loaded.noise_history.draws, 0)
            self.assertEqual(
                loaded.optimizer.noise_strategy, model.optimizer.noise_strategy)

    def test_adaptive_clipping_refused(self):
        with self.assertRaisesRegex(ValueError, "noise_strategy"):
            paper.DPAdamCorrected(l2_norm_clip=1.0, noise_multiplier=1.0,
                                  batch_size=64, noise_strategy=2,
                                  target_unclipped_quantile=0.5)
        paper.DPAdamCorrected(l2_norm_clip=1.0, noise_multiplier=1.0,
                              batch_size=64, noise_strategy=1,
                              target_unclipped_quantile=0.5)

    def test_config_round_trip(self):
        strategy = correlated_noise.BandedToeplitz.optimized(4, 32)
        optimizer = paper.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0, noise_strategy=strategy)
        config = optimizer.get_config()
        again = paper.DPAdamCorrected.from_config(config)
        self.assertEqual(again.noise_strategy, strategy)
        self.assertIsNone(paper.DPSGD(
            l2_norm_clip=1.0, noise_multiplier=1.0).get_config()[
                "noise_strategy"])

    @parameterized.parameters((0,), (65,), ("4",), (2.5,), ({"bands": 2},))
    def test_bad_strategy_refused_naming_it(self, value):
        with self.assertRaisesRegex(ValueError, "noise_strategy"):
            paper.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                        noise_strategy=value)


if __name__ == "__main__":
    absltest.main()
