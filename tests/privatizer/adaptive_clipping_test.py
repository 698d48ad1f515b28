"""Adaptive clipping (Andrew et al. 2021): the moving C, the count's noise,
the composed guarantee and Phi under a moving C, against NumPy.

Fixture: a linear "loss" sum(x_i . w) whose per-example gradient is x_i
whatever w, so every example's gradient norm is known (||x_i||) and the
clip norm's path can be replayed in NumPy.
"""

import math
import os
import tempfile
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.privatizer import adaptive_clipping
from tf_dpadam.privatizer import noise


def linear_loss(y_true, y_pred):
    """sum_j y_pred_j per example: the gradient of w is x_i itself."""
    del y_true
    return keras.ops.sum(y_pred, axis=-1)


def examples_with_norms(norms, d=5, seed=0):
    """Rows of width `d` in random directions with the given L2 norms."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(len(norms), d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return (directions * np.asarray(norms)[:, None]).astype("float32")


def log_uniform_norms(n, low, high, seed=0):
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(low), np.log(high), size=n))


def linear_model(d=5, units=1, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)),
                             keras.layers.Dense(units, use_bias=False)])


def two_branch_model(seed=0):
    """out = a . w_a + b . w_b: group norms ||a_i|| and ||b_i||."""
    keras.utils.set_random_seed(seed)
    a, b = keras.Input((3,), name="a"), keras.Input((4,), name="b")
    out = keras.layers.Add()([
        keras.layers.Dense(1, use_bias=False, name="branch_a")(a),
        keras.layers.Dense(1, use_bias=False, name="branch_b")(b),
    ])
    return keras.Model([a, b], out)


class ClipTrace(keras.callbacks.Callback):
    """The optimizer's clip norm(s) after every batch."""

    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        clip = self.model.optimizer.l2_norm_clip
        self.values.append(list(clip.values()) if isinstance(clip, dict)
                           else [clip])


def fit_and_trace(model, x, batch_size, epochs, clipping="auto",
                  check_independence=True, **kwargs):
    """Trains `model` made private with DPSGD(lr=0); the C after each step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private = tf_dpadam.make_private(
            model, clipping=clipping, seed=0,
            check_independence=check_independence)
    args = dict(l2_norm_clip=1.0, noise_multiplier=0.0,
                batch_size=batch_size * kwargs.get(
                    "gradient_accumulation_steps", 1), learning_rate=0.0,
                target_unclipped_quantile=0.5)
    args.update(kwargs)
    private.compile(optimizer=tf_dpadam.DPSGD(**args), loss=linear_loss)
    n = len(keras.tree.flatten(x)[0])
    trace = ClipTrace()
    # Fixed consecutive batches, so that NumPy can replay them.
    private.fit(x, np.zeros((n, 1), "float32"), batch_size=batch_size,
                epochs=epochs, shuffle=False, sampling="shuffled", verbose=0,
                callbacks=[trace])
    return np.array(trace.values), private


def reference_clips(group_norms, clips, batch_size, steps, target, eta):
    """NumPy: C_l <- C_l exp(-eta (b_l - gamma)) on consecutive batches
    (no count noise); `group_norms` is `[G, N]`, the result `[steps, G]`."""
    clips = np.array(clips, "float64")
    n = group_norms.shape[1]
    out = []
    for t in range(steps):
        rows = np.arange(t * batch_size, (t + 1) * batch_size) % n
        fraction = np.mean(group_norms[:, rows] <= clips[:, None], axis=1)
        clips = clips * np.exp(-eta * (fraction - target))
        out.append(clips.copy())
    return np.array(out)


class MathTest(parameterized.TestCase):

    @parameterized.parameters((1.0, 12.8, 1), (0.7, 3.0, 4), (2.0, 51.2, 2))
    def test_noise_multipliers_compose_to_the_configured_one(self, z, sb, g):
        z_grad = adaptive_clipping.gradient_noise_multiplier(z, sb, g)
        self.assertGreater(z_grad, z)
        # Each query's RDP is alpha / (2 z^2), so z^-2 adds up exactly.
        self.assertAlmostEqual(z_grad ** -2 + g * (2 * sb) ** -2, z ** -2,
                               places=12)
        self.assertAlmostEqual(
            adaptive_clipping.composed_noise_multiplier(z_grad, sb, g), z,
            places=10)

    def test_too_little_count_noise_is_refused(self):
        with self.assertRaisesRegex(ValueError, "clipped_count_stddev"):
            adaptive_clipping.gradient_noise_multiplier(1.0, 0.5, 1)
        with self.assertRaisesRegex(ValueError, "clipped_count_stddev"):
            adaptive_clipping.gradient_noise_multiplier(1.0, 0.9, 4)
        self.assertEqual(adaptive_clipping.gradient_noise_multiplier(
            0.0, 0.0, 1), 0.0)

    @parameterized.parameters(1, 3)
    def test_the_accountant_sees_one_gaussian_of_multiplier_z(self, groups):
        # The gradient query and the G count queries, composed by
        # dp-accounting's RDP accountant, give the epsilon of one Gaussian
        # query with the configured multiplier (what tf_dpadam accounts).
        z, sb = 1.1, 6.4
        z_grad = adaptive_clipping.gradient_noise_multiplier(z, sb, groups)
        composed = dp_accounting.rdp.RdpAccountant()
        composed.compose(dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(z_grad)]
            + [dp_accounting.GaussianDpEvent(2 * sb)] * groups))
        stated = dp_accounting.rdp.RdpAccountant()
        stated.compose(dp_accounting.GaussianDpEvent(z))
        self.assertAlmostEqual(composed.get_epsilon(1e-5),
                               stated.get_epsilon(1e-5), places=9)

    def test_constructor_checks(self):
        for bad in (0.0, 1.0, -0.1, float("nan")):
            with self.assertRaisesRegex(ValueError,
                                        "target_unclipped_quantile"):
                tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                batch_size=8, target_unclipped_quantile=bad)
        with self.assertRaisesRegex(ValueError, "clip_learning_rate"):
            tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            batch_size=8, target_unclipped_quantile=0.5,
                            clip_learning_rate=0.0)
        with self.assertRaisesRegex(ValueError, "batch_size"):
            tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            target_unclipped_quantile=0.5)
        with self.assertRaisesRegex(ValueError, "clipped_count_stddev"):
            tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            batch_size=10, target_unclipped_quantile=0.5)
        with self.assertRaisesRegex(ValueError, "clipped_count_stddev"):
            tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            batch_size=100, clipped_count_stddev=5.0)
        with self.assertRaisesRegex(ValueError, "clip_learning_rate"):
            tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            batch_size=100, clip_learning_rate=0.5)
        # The paper's default sigma_b = B / 20.
        opt = tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=256,
            target_unclipped_quantile=0.5)
        self.assertEqual(opt.clipped_count_stddev(), 12.8)


class LockstepTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_clip_norm_follows_numpy_ghost(self):
        self.check_clip_norm_follows_numpy("ghost")

    @pytest.mark.slow
    def test_clip_norm_follows_numpy_vectorized(self):
        self.check_clip_norm_follows_numpy("vectorized")

    def check_clip_norm_follows_numpy(self, clipping):
        norms = log_uniform_norms(96, 0.1, 10.0, seed=1)
        x = examples_with_norms(norms)
        got, _ = fit_and_trace(linear_model(), x, 16, 2, clipping=clipping,
                               l2_norm_clip=0.05, clipped_count_stddev=0.0,
                               target_unclipped_quantile=0.3,
                               clip_learning_rate=0.4)
        want = reference_clips(norms[None], [0.05], 16, 12, 0.3, 0.4)
        np.testing.assert_allclose(got, want, rtol=2e-5)

    @pytest.mark.slow
    def test_per_group_clip_norms_follow_numpy(self):
        norms_a = log_uniform_norms(64, 0.01, 1.0, seed=2)
        norms_b = log_uniform_norms(64, 1.0, 100.0, seed=3)
        x = [examples_with_norms(norms_a, 3, seed=4),
             examples_with_norms(norms_b, 4, seed=5)]
        got, private = fit_and_trace(
            two_branch_model(), x, 8, 2, l2_norm_clip={"branch_a": 1.0,
                                                       "branch_b": 2.0},
            clipped_count_stddev=0.0, target_unclipped_quantile=0.6)
        self.assertEqual(private.optimizer.clip_group_names,
                         ["branch_a", "branch_b"])
        want = reference_clips(np.stack([norms_a, norms_b]), [1.0, 2.0], 8,
                               16, 0.6, 0.2)
        np.testing.assert_allclose(got, want, rtol=2e-5)

    @pytest.mark.slow
    def test_accumulation_moves_c_once_per_logical_step(self):
        norms = log_uniform_norms(64, 0.1, 10.0, seed=6)
        x = examples_with_norms(norms)
        got, _ = fit_and_trace(linear_model(), x, 8, 1, l2_norm_clip=5.0,
                               clipped_count_stddev=0.0,
                               gradient_accumulation_steps=2)
        want = reference_clips(norms[None], [5.0], 16, 4, 0.5, 0.2)
        # Traced after every physical batch: C moves on every second one.
        np.testing.assert_allclose(got[1::2], want, rtol=2e-5)
        np.testing.assert_allclose(got[0::2][1:], want[:-1], rtol=2e-5)


@pytest.mark.slow
class ConvergenceTest(parameterized.TestCase):

    @parameterized.parameters((0.01, "ghost"), (100.0, "ghost"),
                              (0.01, "vectorized"), (100.0, "vectorized"))
    def test_c_reaches_the_target_quantile_from_100x_off(self, factor,
                                                         clipping):
        # Norms log-uniform on [0.1, 10]: the 0.5-quantile is 1. The count
        # is noised (sigma_b = B / 20) and so is the gradient (z = 1).
        norms = log_uniform_norms(64 * 100, 0.1, 10.0, seed=7)
        target = float(np.quantile(norms, 0.5))
        got, private = fit_and_trace(
            linear_model(), examples_with_norms(norms), 64, 3,
            clipping=clipping, l2_norm_clip=factor * target,
            noise_multiplier=1.0)
        self.assertLen(got, 300)
        last = got[-50:, 0]
        self.assertLess(np.max(np.abs(np.log(last / target))), math.log(1.5),
                        f"C went from {factor * target} to {last}")
        # And it was not there at the start.
        self.assertGreater(abs(math.log(got[0, 0] / target)), math.log(50))


@pytest.mark.slow
class CountNoiseTest(absltest.TestCase):

    def test_the_count_noise_has_std_sigma_b_over_b(self):
        # All gradients are 0 (x = 0), so every example is unclipped and the
        # true fraction is 1; b_tilde is read back from C's steps:
        # b_tilde = gamma - log(C_t+1 / C_t) / eta.
        # The independence guard is off: with every row equal it cannot
        # check a batch (it warns so), and a guard that has not passed a
        # check checks every call again, about 0.1 s a step here (90% of
        # the test). The guard runs on this model and adaptive optimizer in
        # LockstepTest (fit_and_trace's default), on rows that differ.
        b, sb, eta, steps = 32, 4.0, 0.01, 600
        x = np.zeros((b * steps, 5), "float32")
        got, _ = fit_and_trace(linear_model(), x, b, 1, noise_multiplier=1.0,
                               clipped_count_stddev=sb, clip_learning_rate=eta,
                               check_independence=False)
        clips = np.concatenate([[1.0], got[:, 0]])
        fractions = 0.5 - np.diff(np.log(clips)) / eta
        # 600 draws: the mean is within 4 standard errors of 1 and the
        # std within 15% of sigma_b / B (its standard error is ~3%).
        self.assertLess(abs(fractions.mean() - 1.0), 4 * sb / b / steps ** 0.5)
        self.assertAlmostEqual(fractions.std() / (sb / b), 1.0, delta=0.15)


@pytest.mark.slow
class SensitivityTest(parameterized.TestCase):
    """The step's two releases together move by at most 1 / z (one
    Gaussian query of multiplier z), exactly 1 / z for an example clipped
    in every group: measured on the real step, removing one example."""

    @parameterized.parameters((None, 1), ({"branch_a": 0.5, "branch_b": 1.5},
                                          2))
    def test_remove_one_moves_the_normalized_release_by_1_over_z(
            self, spec, groups):
        z, sb, b = 1.3, 3.0, 4
        norms_a = np.array([5.0, 0.2, 3.0, 0.1])
        norms_b = np.array([7.0, 0.3, 0.1, 9.0])
        x = [examples_with_norms(norms_a, 3, seed=8),
             examples_with_norms(norms_b, 4, seed=9)]

        def release(rows):
            """The clipped sum over z_grad C and the shifted counts over
            sigma_b. Every run has the same noise key (seed=0), so the
            count's noise cancels between two runs; with B = 1 and
            eta = 1, log(C_t / C_t+1) = b_tilde - gamma."""
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                private = tf_dpadam.make_private(two_branch_model(), seed=0,
                                                 diagnostics=True)
            opt = tf_dpadam.DPSGD(
                l2_norm_clip=spec or 1.0, noise_multiplier=z, batch_size=1,
                learning_rate=0.0, target_unclipped_quantile=0.5,
                clipped_count_stddev=sb, clip_learning_rate=1.0)
            private.compile(optimizer=opt, loss=linear_loss)
            opt.build(private.trainable_variables)
            before = np.array(opt.clip_norms(), "float64")
            private.train_on_batch([v[rows] for v in x],
                                   np.zeros((len(rows), 1), "float32"))
            after = np.array(opt.clip_norms(), "float64")
            clean = np.concatenate([np.ravel(g) for g in
                                    private.clean_gradients])
            total = np.sqrt(np.sum(before ** 2))
            return (clean / (opt.gradient_noise_multiplier * total),
                    np.log(before / after) / sb, before)

        full_sum, full_count, clips = release(np.arange(b))
        self.assertLen(clips, groups)
        group_norms = (np.stack([norms_a, norms_b]) if groups == 2
                       else np.hypot(norms_a, norms_b)[None])
        for j in range(b):
            sum_j, count_j, _ = release(
                np.array([i for i in range(b) if i != j]))
            # Each group's shifted count moves by exactly 1/2.
            np.testing.assert_allclose(np.abs(full_count - count_j),
                                       0.5 / sb, rtol=1e-4)
            distance = np.sqrt(np.sum((full_sum - sum_j) ** 2)
                               + np.sum((full_count - count_j) ** 2))
            self.assertLessEqual(distance * z, 1 + 1e-4)
            if np.all(group_norms[:, j] > clips):
                self.assertAlmostEqual(distance * z, 1.0, places=4)


class MovingPhiTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.z, self.sb, self.b = 1.0, 5.0, 10

    def optimizer(self, **kwargs):
        opt = tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=self.z, batch_size=self.b,
            target_unclipped_quantile=0.5, clipped_count_stddev=self.sb,
            learning_rate=0.01, **kwargs)
        return opt

    def test_lockstep_with_numpy(self):
        rng = np.random.default_rng(0)
        opt = self.optimizer()
        var = keras.Variable(np.zeros(6, "float32"))
        opt.build([var])
        z_grad = (self.z ** -2 - (2 * self.sb) ** -2) ** -0.5
        self.assertAlmostEqual(opt.gradient_noise_multiplier, z_grad)
        b1, b2, lr, eta, gamma = 0.9, 0.999, 0.01, 0.2, 0.5
        theta, m, v, phi_sum, clip = (np.zeros(6), np.zeros(6), np.zeros(6),
                                      0.0, 1.0)
        for t in range(1, 31):
            g = rng.normal(size=6) * 0.1
            fraction = rng.uniform(0, 1)
            # Phi as the step's privatizer returns it: from this step's C.
            _, phi = noise.divide([], opt.gradient_noise_stddev(), self.b)
            opt.apply_private([tf.constant(g, tf.float32)], [var], phi,
                              tf.constant([fraction]))
            phi_t = (z_grad * clip / self.b) ** 2
            phi_sum = b2 * phi_sum + (1 - b2) * phi_t
            phi_hat = phi_sum / (1 - b2 ** t)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            theta -= lr * m_hat / np.sqrt(
                np.maximum(v_hat - phi_hat, max(0.04 * phi_hat, 1e-14)))
            clip *= math.exp(-eta * (fraction - gamma))
            np.testing.assert_allclose(var.numpy(), theta, rtol=1e-4,
                                       atol=1e-7)
            self.assertAlmostEqual(opt.l2_norm_clip, clip, places=5)

    def test_todays_phi_would_be_measurably_wrong_after_c_moves(self):
        # Pure noise (the true gradient is 0): E[v_hat] is the average of the
        # past Phi_tau. C shrinks by exp(-0.1) a step (every example
        # unclipped), so today's Phi_t is far below E[v_hat].
        rng = np.random.default_rng(1)
        opt = self.optimizer()
        var = keras.Variable(np.zeros(20000, "float32"))
        opt.build([var])
        z_grad = opt.gradient_noise_multiplier
        for t in range(1, 41):
            clip = opt.l2_norm_clip
            g = rng.normal(size=20000) * z_grad * clip / self.b
            _, phi = noise.divide([], opt.gradient_noise_stddev(), self.b)
            opt.apply_private([tf.constant(g, tf.float32)], [var], phi,
                              tf.constant([1.0]))
        _, v = opt.moments(var)
        v_hat = np.mean(v.numpy()) / (1 - opt.beta_2 ** 40)
        # The Phi that step 40 subtracted (`step_phi` reads t = 41 now).
        averaged = float(opt.step_phi()) * (1 - opt.beta_2 ** 41) / (
            1 - opt.beta_2 ** 40)
        todays = (z_grad * clip / self.b) ** 2
        self.assertAlmostEqual(v_hat / averaged, 1.0, delta=0.03)
        self.assertGreater(v_hat / todays, 10.0)


@pytest.mark.slow
class ResumeTest(absltest.TestCase):

    def test_c_is_saved_and_restored(self):
        norms = log_uniform_norms(64, 0.1, 10.0, seed=10)
        x = examples_with_norms(norms)
        args = dict(l2_norm_clip=0.2, clipped_count_stddev=0.0)
        straight, _ = fit_and_trace(linear_model(), x, 16, 2, **args)
        first, private = fit_and_trace(linear_model(), x, 16, 1, **args)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        private.save(path)
        loaded = keras.models.load_model(
            path, custom_objects={"linear_loss": linear_loss})
        self.assertAlmostEqual(loaded.optimizer.l2_norm_clip, first[-1, 0],
                               places=6)
        self.assertEqual(loaded.optimizer.get_config()["l2_norm_clip"], 0.2)
        trace = ClipTrace()
        loaded.fit(x, np.zeros((64, 1), "float32"), batch_size=16, epochs=1,
                   shuffle=False, sampling="shuffled", verbose=0,
                   callbacks=[trace])
        np.testing.assert_allclose(np.concatenate([first, trace.values]),
                                   straight, rtol=1e-6)


if __name__ == "__main__":
    absltest.main()
