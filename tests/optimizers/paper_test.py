"""The DP step and the three update rules against an independent NumPy reference.

The reference below is written from the equations, not from tf_dpadam:

    g_tilde = (sum_i g_i * min(1, C / ||g_i||) + z) / B,  z ~ N(0, sigma^2 C^2 I)

    DPSGD            v <- mu v - lr g_tilde;  theta <- theta + v        (Keras SGD)
    DPAdam           Keras Adam on g_tilde
    DPAdamCorrected  m <- b1 m + (1 - b1) g_tilde, v <- b2 v + (1 - b2) g_tilde^2,
                     theta <- theta - lr m_hat / sqrt(max(v_hat - Phi, gamma'))

Per-example gradients come from a one-hidden-layer tanh MLP with softmax
cross-entropy, differentiated by hand.
"""

import inspect
import math

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from scipy import stats

import tf_dpadam
from tf_dpadam.common import seeds
from tf_dpadam.privatizer import noise

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_D, _HIDDEN, _CLASSES = 4, 5, 3
# 44 examples in physical batches of 8: five full steps and one of 4, so that
# `batch_size=None` (B = examples in the step) sees two different B.
_N, _PHYSICAL = 44, 8
_FIXED_B = 10  # A public B that differs from every physical batch.


# --------------------------------------------------------------------------
# NumPy reference (float64).
# --------------------------------------------------------------------------


def _softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def mlp_per_example_grads(params, x, y):
    """Per-example gradients of CE(softmax(tanh(x W1 + b1) W2 + b2), y).

    Args:
        params: [W1 (d, h), b1 (h,), W2 (h, k), b2 (k,)].
        x: (n, d) inputs; y: (n,) integer labels.

    Returns:
        [gW1 (n, d, h), gb1 (n, h), gW2 (n, h, k), gb2 (n, k)], one gradient
        of each example's own loss per row.
    """
    w1, b1, w2, b2 = params
    a = np.tanh(x @ w1 + b1)                       # (n, h)
    p = _softmax(a @ w2 + b2)                      # (n, k)
    d_logits = p - np.eye(w2.shape[1])[y]          # dCE/dlogits = p - onehot
    d_pre = (d_logits @ w2.T) * (1.0 - a**2)       # back through tanh
    return [
        x[:, :, None] * d_pre[:, None, :],
        d_pre,
        a[:, :, None] * d_logits[:, None, :],
        d_logits,
    ]


def reference_private_gradient(per_example, clip, denominator):
    """Clip each example to global norm C, sum, divide by B (no noise).

    Returns:
        (g_tilde, norms): the list of averaged clipped gradients and the
        per-example global norms before clipping.
    """
    n = per_example[0].shape[0]
    norms = np.sqrt(sum((g.reshape(n, -1) ** 2).sum(axis=1) for g in per_example))
    factors = np.minimum(1.0, clip / norms)
    g_tilde = [
        np.tensordot(factors, g, axes=1) / denominator for g in per_example
    ]
    return g_tilde, norms


def sgd_momentum_update(theta, g, velocity, *, lr, momentum):
    """Keras SGD: v <- mu v - lr g; theta <- theta + v."""
    velocity = momentum * velocity - lr * g
    return theta + velocity, velocity


def adam_moments(g, m, v, t, beta_1, beta_2):
    """Adam's moments and their bias-corrected versions at step t (1-based)."""
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g**2
    return m, v, m / (1 - beta_1**t), v / (1 - beta_2**t)


def keras_adam_update(theta, g, m, v, t, *, lr, beta_1, beta_2, epsilon):
    """Keras Adam (Kingma & Ba, end of section 2, the "epsilon hat" form).

    Keras computes lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), that
    is lr m_hat / (sqrt(v_hat) + eps / sqrt(1 - b2^t)): the epsilon is outside
    the root and is added before the bias correction of v.
    """
    m, v, m_hat, v_hat = adam_moments(g, m, v, t, beta_1, beta_2)
    eps_hat = epsilon / math.sqrt(1 - beta_2**t)
    return theta - lr * m_hat / (np.sqrt(v_hat) + eps_hat), m, v


def corrected_adam_update(theta, g, m, v, t, *, lr, beta_1, beta_2, phi,
                          gamma):
    """Tang & Lecuyer's Algorithm 1; also returns where gamma' is the floor."""
    m, v, m_hat, v_hat = adam_moments(g, m, v, t, beta_1, beta_2)
    floored = v_hat - phi < gamma
    theta = theta - lr * m_hat / np.sqrt(np.maximum(v_hat - phi, gamma))
    return theta, m, v, floored


class ReferenceOptimizer:
    """Holds the NumPy state of one of the three rules over a parameter list.

    `rule` is "sgd" (lr, momentum), "adam" (lr, beta_1, beta_2, epsilon) or
    "corrected" (lr, beta_1, beta_2, phi, gamma).
    """

    def __init__(self, rule, params, **hyper):
        self.rule = rule
        self.hyper = hyper
        self.t = 0
        self.slots = [
            [np.zeros_like(p), np.zeros_like(p)] for p in params
        ]
        self.floored = []  # One boolean array per variable and step.

    def step(self, params, grads):
        self.t += 1
        new_params = []
        for i, (theta, g) in enumerate(zip(params, grads)):
            a, b = self.slots[i]
            if self.rule == "sgd":
                theta, a = sgd_momentum_update(theta, g, a, **self.hyper)
            elif self.rule == "adam":
                theta, a, b = keras_adam_update(
                    theta, g, a, b, self.t, **self.hyper
                )
            else:
                theta, a, b, floored = corrected_adam_update(
                    theta, g, a, b, self.t, **self.hyper
                )
                self.floored.append(floored)
            self.slots[i] = [a, b]
            new_params.append(theta)
        return new_params


def reference_training(params, x, y, *, clip, batch_size, physical, make_rule):
    """Runs the noiseless DP step over consecutive batches, like `fit`.

    Returns:
        (trajectory, norms, first_g, optimizer): the parameters after every
        step, every example's gradient norm, g_tilde of the first step and
        the `ReferenceOptimizer`.
    """
    params = [np.asarray(p, np.float64) for p in params]
    optimizer = make_rule(params)
    trajectory, all_norms, first_g = [], [], None
    for start in range(0, len(x), physical):
        xb, yb = x[start:start + physical], y[start:start + physical]
        denominator = len(xb) if batch_size is None else batch_size
        g_tilde, norms = reference_private_gradient(
            mlp_per_example_grads(params, xb, yb), clip, denominator
        )
        if first_g is None:
            first_g = g_tilde
        params = optimizer.step(params, g_tilde)
        trajectory.append(params)
        all_norms.append(norms)
    return trajectory, np.concatenate(all_norms), first_g, optimizer


# --------------------------------------------------------------------------
# Keras side.
# --------------------------------------------------------------------------


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(_N, _D)).astype("float32")
    y = rng.integers(0, _CLASSES, size=_N)
    return x, y


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((_D,)),
        keras.layers.Dense(_HIDDEN, activation="tanh",
                           bias_initializer="random_normal"),
        keras.layers.Dense(_CLASSES, bias_initializer="random_normal"),
    ])


def _arrays(variables):
    return [np.array(v) for v in variables]


class _RecordWeights(keras.callbacks.Callback):
    """The trainable weights after every step of `fit`."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(_arrays(self.model.trainable_variables))


def _median_clip(params, x, y):
    """C at the median initial per-example norm: about half are clipped."""
    norms = np.sqrt(sum(
        (g.reshape(len(x), -1) ** 2).sum(axis=1)
        for g in mlp_per_example_grads(
            [np.asarray(p, np.float64) for p in params], x, y)
    ))
    return float(np.median(norms))


_BETA_1, _BETA_2 = 0.9, 0.999
# Five update rules: DPSGD with momentum, DPAdam, and DPAdamCorrected without
# Phi (noise_multiplier=0 gives Phi = 0 and gamma' = 1e-14) and with a Phi
# override comparable to g^2, with the default gamma' = 0.04 Phi and with an
# explicit epsilon = 0.25 Phi.
_RULES = ["dpsgd", "dpadam", "corrected", "corrected_phi",
          "corrected_phi_epsilon"]
# Weights are compared with atol = 1e-6 (for those near 0) and rtol 1e-5:
# float32 per-example gradients that nearly cancel in the clipped sum carry
# relative errors up to ~2e-5 in a few coordinates of g_tilde (measured
# against this float64 reference). Where v_hat - Phi is just above gamma' the
# corrected step amplifies the relative error of v_hat by
# v_hat / (2 (v_hat - Phi)), up to (1 + c) / (2 c) = 13 for gamma' = c Phi
# with c = 0.04, so the Phi rules get rtol 1e-4 (they use under half of it;
# the others use about a fifth of theirs).
_ATOL = 1e-6
_RTOL = {"dpsgd": 1e-5, "dpadam": 1e-5, "corrected": 1e-5,
         "corrected_phi": 1e-4, "corrected_phi_epsilon": 1e-4}


def _median_phi(initial, x, y, clip, batch_size, physical):
    """Phi at the median of g_tilde^2 of the first step (= v_hat at t = 1),
    so that v_hat - Phi falls below gamma' on about half of the
    coordinates."""
    *_, first_g, _ = reference_training(
        initial, x, y, clip=clip, batch_size=batch_size, physical=physical,
        make_rule=lambda p: ReferenceOptimizer("sgd", p, lr=0.0, momentum=0.0),
    )
    return float(np.median(np.concatenate([g.ravel() ** 2 for g in first_g])))


def _rule_setup(name, phi=None):
    """Returns (optimizer class, its kwargs, reference rule, its hyper)."""
    if name == "dpsgd":
        return (tf_dpadam.DPSGD, {"learning_rate": 0.1, "momentum": 0.9},
                "sgd", {"lr": 0.1, "momentum": 0.9})
    adam = {"learning_rate": 0.01, "beta_1": _BETA_1, "beta_2": _BETA_2}
    moments = {"lr": 0.01, "beta_1": _BETA_1, "beta_2": _BETA_2}
    if name == "dpadam":
        return (tf_dpadam.DPAdam, dict(adam, epsilon=1e-7),
                "adam", dict(moments, epsilon=1e-7))
    if name == "corrected":
        return (tf_dpadam.DPAdamCorrected, adam,
                "corrected", dict(moments, phi=0.0, gamma=1e-14))
    if name == "corrected_phi":
        return (tf_dpadam.DPAdamCorrected, dict(adam, phi=phi),
                "corrected", dict(moments, phi=phi, gamma=0.04 * phi))
    return (tf_dpadam.DPAdamCorrected, dict(adam, phi=phi, epsilon=0.25 * phi),
            "corrected", dict(moments, phi=phi, gamma=0.25 * phi))


class ReferenceTest(parameterized.TestCase):

    def test_hand_gradients_match_autodiff(self):
        # The reference's own check: its per-example gradients are Keras'
        # gradient of each example's loss (plain GradientTape, no tf_dpadam).
        model = _mlp(seed=1)
        x, y = _data(seed=1)
        x, y = x[:6], y[:6]
        expected = mlp_per_example_grads(_arrays(model.trainable_variables),
                                         x.astype(np.float64), y)
        for i in range(len(x)):
            with tf.GradientTape() as tape:
                loss = _LOSS(y[i:i + 1], model(x[i:i + 1]))
            grads = tape.gradient(loss, model.trainable_variables)
            for g, e in zip(grads, expected):
                np.testing.assert_allclose(g.numpy(), e[i], rtol=1e-5,
                                           atol=1e-7)

    def test_corrected_rule_hand_computed(self):
        # One coordinate at t = 1 (m_hat = g, v_hat = g^2), lr = 0.1:
        # g = 0.3, Phi = 0.05: max(0.09 - 0.05, 0.01) = 0.04 -> 0.1*0.3/0.2.
        # g = 0.2, Phi = 0.05: max(0.04 - 0.05, 0.01) = 0.01 -> 0.1*0.2/0.1.
        theta, _, _, floored = corrected_adam_update(
            np.zeros(2), np.array([0.3, 0.2]), np.zeros(2), np.zeros(2), 1,
            lr=0.1, beta_1=0.9, beta_2=0.999, phi=0.05, gamma=0.01,
        )
        np.testing.assert_allclose(theta, [-0.15, -0.2])
        np.testing.assert_array_equal(floored, [False, True])


# Every rule with both B in graph mode. XLA costs about 5 s of compilation
# per run, so it gets four: each optimizer class, each B, and the corrected
# rule with Phi and with both kinds of gamma'. (The corrected rule without
# Phi runs the same update_step and differs only in the value of Phi.)
_LOCKSTEP_CASES = [
    (rule, False, b) for rule in _RULES for b in (None, _FIXED_B)
] + [
    ("dpsgd", True, None),
    ("dpadam", True, _FIXED_B),
    ("corrected_phi", True, None),
    ("corrected_phi_epsilon", True, _FIXED_B),
]


class LockstepTest(parameterized.TestCase):

    def _train_both(self, rule, jit_compile, batch_size):
        """Trains the private model and the reference; checks the setup.

        Returns:
            (actual, expected): the weights after every step, from `fit` and
            from the NumPy reference.
        """
        x, y = _data()
        x64 = x.astype(np.float64)
        base = _mlp()
        initial = _arrays(base.trainable_variables)
        clip = _median_clip(initial, x, y)

        phi = None
        if rule.startswith("corrected_phi"):
            phi = _median_phi(initial, x64, y, clip, batch_size, _PHYSICAL)
        cls, kwargs, ref_rule, hyper = _rule_setup(rule, phi)

        trajectory, norms, _, reference = reference_training(
            initial, x64, y, clip=clip, batch_size=batch_size,
            physical=_PHYSICAL,
            make_rule=lambda p: ReferenceOptimizer(ref_rule, p, **hyper),
        )
        self.assertLen(trajectory, 6)
        # Clipping is active on some examples and not on others.
        self.assertGreater(int((norms > clip).sum()), 0)
        self.assertGreater(int((norms < clip).sum()), 0)
        if phi is not None:
            floored = np.concatenate([f.ravel() for f in reference.floored])
            # gamma' is the floor on some coordinates, v_hat - Phi on others.
            self.assertGreater(int(floored.sum()), 0)
            self.assertGreater(int((~floored).sum()), 0)

        model = tf_dpadam.make_private(base, seed=0)
        model.compile(
            optimizer=cls(l2_norm_clip=clip, noise_multiplier=0.0,
                          batch_size=batch_size, **kwargs),
            loss=_LOSS,
            jit_compile=jit_compile,
        )
        recorder = _RecordWeights()
        model.fit(x, y, batch_size=_PHYSICAL, epochs=1, shuffle=False,
                  verbose=0, callbacks=[recorder], sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 6)
        self.assertLen(recorder.steps, 6)
        return recorder.steps, trajectory

    @parameterized.named_parameters(
        (f"{rule}_{'xla' if jit else 'graph'}_b_{b or 'counted'}", rule, jit, b)
        for rule, jit, b in _LOCKSTEP_CASES
    )
    @pytest.mark.slow
    def test_weights_follow_numpy_reference_every_step(
        self, rule, jit_compile, batch_size
    ):
        actual, expected = self._train_both(rule, jit_compile, batch_size)
        for step, (got, want) in enumerate(zip(actual, expected)):
            for a, e in zip(got, want):
                np.testing.assert_allclose(
                    a, e, rtol=_RTOL[rule], atol=_ATOL,
                    err_msg=f"step {step + 1}",
                )

    @parameterized.named_parameters(
        ("counted_b", None, [12, 8]),
        ("fixed_b", 16, [16, 16]),
    )
    @pytest.mark.slow
    def test_step_phi_uses_the_step_denominator(self, batch_size, expected_b):
        sigma, clip = 1.3, 0.7
        x, y = _data()
        model = tf_dpadam.make_private(_mlp(), seed=0)
        optimizer = tf_dpadam.DPAdamCorrected(
            l2_norm_clip=clip, noise_multiplier=sigma, batch_size=batch_size
        )
        model.compile(optimizer=optimizer, loss=_LOSS, jit_compile=False)
        phis, gammas = [], []

        class Record(keras.callbacks.Callback):

            def on_train_batch_end(self, batch, logs=None):
                phi = optimizer.step_phi()
                phis.append(float(phi))
                gammas.append(float(optimizer.step_gamma(phi)))

        # 20 examples in batches of 12: steps of 12 and 8 examples.
        model.fit(x[:20], y[:20], batch_size=12, shuffle=False, verbose=0,
                  callbacks=[Record()], sampling="shuffled")
        expected = [(sigma * clip / b) ** 2 for b in expected_b]
        np.testing.assert_allclose(phis, expected, rtol=1e-6)
        np.testing.assert_allclose(gammas, [0.04 * p for p in expected],
                                   rtol=1e-6)

        # An override replaces Phi whatever B is; epsilon replaces gamma'.
        override = tf_dpadam.DPAdamCorrected(
            l2_norm_clip=clip, noise_multiplier=sigma, batch_size=batch_size,
            phi=3e-5, epsilon=2e-6,
        )
        model.compile(optimizer=override, loss=_LOSS, jit_compile=False)
        model.fit(x[:12], y[:12], batch_size=12, verbose=0,
                  sampling="shuffled")
        np.testing.assert_allclose(float(override.step_phi()), 3e-5,
                                   rtol=1e-6)
        np.testing.assert_allclose(
            float(override.step_gamma(override.step_phi())), 2e-6, rtol=1e-6
        )


# --------------------------------------------------------------------------
# Statistics of the noise (one step on a model whose gradients are all 0).
# --------------------------------------------------------------------------

_UNITS_IN, _UNITS_OUT = 400, 256  # 102,400 kernel coordinates.
_EXAMPLES = 8
_SIGMA, _CLIP = 1.1, 0.9


def _pure_noise_update(optimizer, seed, jit=False):
    """The update of one step whose clipped gradient sum is exactly 0.

    Zero inputs, zero targets, a zero bias-free kernel and MSE: every
    example's gradient is 0, so g_tilde = z / B.
    """
    keras.utils.set_random_seed(seed)
    base = keras.Sequential([
        keras.Input((_UNITS_IN,)),
        keras.layers.Dense(_UNITS_OUT, use_bias=False,
                           kernel_initializer="zeros"),
    ])
    model = tf_dpadam.make_private(base, seed=seed)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
    model.train_on_batch(np.zeros((_EXAMPLES, _UNITS_IN), "float32"),
                         np.zeros((_EXAMPLES, _UNITS_OUT), "float32"))
    return np.array(base.weights[0], np.float64).ravel()


def _assert_share(test, values, threshold, predicted, name):
    """Empirical share of `values > threshold` vs a predicted probability.

    The count is Binomial(n, p): its share has standard error
    sqrt(p (1 - p) / n) (<= 0.16% at n = 102,400); 5 standard errors,
    plus 1e-4 for float32 rounding of values that sit on the threshold.
    """
    n = values.size
    share = float(np.mean(values > threshold))
    tolerance = 5 * math.sqrt(predicted * (1 - predicted) / n) + 1e-4
    test.assertAlmostEqual(
        share, predicted, delta=tolerance,
        msg=f"{name}: share of > {threshold}",
    )


def _corrected_ratio_tail(threshold, c):
    """P(|u| / sqrt(max(u^2 - 1, c)) > T) for u ~ N(0, 1).

    At t = 1, m_hat = g and v_hat = g^2, so with g = u sqrt(Phi) and
    gamma' = c Phi the corrected |update| / lr is r(u) = |u| /
    sqrt(max(u^2 - 1, c)). For u^2 <= 1 + c, r = |u| / sqrt(c) rises to
    sqrt((1 + c) / c); beyond, r = |u| / sqrt(u^2 - 1) falls towards 1. So
    r > T exactly on T sqrt(c) < |u| < T / sqrt(T^2 - 1) (no upper bound for
    T <= 1, an empty set for T >= sqrt((1 + c) / c)).
    """
    lower = threshold * math.sqrt(c)
    upper = (math.inf if threshold <= 1
             else threshold / math.sqrt(threshold**2 - 1))
    return 2 * max(0.0, stats.norm.cdf(upper) - stats.norm.cdf(lower))


class NoiseStatisticsTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("counted_b", None, False), ("fixed_b", 20, False),
        ("fixed_b_xla", 20, True),
    )
    @pytest.mark.slow
    def test_dpsgd_update_is_gaussian_with_std_sigma_c_over_b(
        self, batch_size, jit
    ):
        update = _pure_noise_update(
            tf_dpadam.DPSGD(l2_norm_clip=_CLIP, noise_multiplier=_SIGMA,
                            batch_size=batch_size, learning_rate=1.0),
            seed=11, jit=jit,
        )
        b = _EXAMPLES if batch_size is None else batch_size
        expected = _SIGMA * _CLIP / b
        n = update.size
        self.assertGreaterEqual(n, 100_000)
        # The sample std of n Gaussians has relative standard error
        # 1/sqrt(2n) = 0.22% at n = 102,400; we allow 5 of them (1.1%). A
        # wrong B (8 vs 20) or noise std sigma (not sigma C) is far outside.
        self.assertAlmostEqual(np.std(update) / expected, 1.0,
                               delta=5 / math.sqrt(2 * n))
        # The sample mean has standard error expected / sqrt(n); 5 of them.
        self.assertLess(abs(np.mean(update)), 5 * expected / math.sqrt(n))
        # Gaussian tails: P(|z| > 2 s) = 2 (1 - Phi(2)) = 4.55%.
        _assert_share(self, np.abs(update), 2 * expected,
                      2 * stats.norm.sf(2.0), "|update| / s")

    @parameterized.named_parameters(
        # The seeds make_private draws (one per step).
        ("noise_seeds_graph", "noise_seeds", False),
        ("noise_seeds_xla", "noise_seeds", True),
        ("seed_pair_graph", "pair", False),
        ("seed_pair_xla", "pair", True),
    )
    @pytest.mark.slow
    def test_equal_shaped_tensors_get_independent_noise(self, seed, jit):
        # Two tensors of one shape (as a model's twin layers have), two
        # steps: four draws that must be independent N(0, stddev^2).
        stddev, shape = 2.0, (320, 320)
        n = shape[0] * shape[1]
        zeros = [tf.zeros(shape), tf.zeros(shape)]
        if seed == "noise_seeds":
            noise_seeds = seeds.NoiseSeeds(5)
            step = tf.function(
                lambda t: noise.add_noise(zeros, stddev, noise_seeds.next(t)),
                jit_compile=jit,
            )
            draws = step(tf.constant(0)) + step(tf.constant(1))
        else:
            step = tf.function(
                lambda s: noise.add_noise(zeros, stddev, s),
                jit_compile=jit,
            )
            draws = step(tf.constant([5, 6])) + step(tf.constant([5, 7]))
        draws = [np.asarray(d, np.float64).ravel() for d in draws]
        for draw in draws:
            # Relative standard error of the sample std: 1/sqrt(2n) = 0.22%.
            self.assertAlmostEqual(np.std(draw) / stddev, 1.0,
                                   delta=5 / math.sqrt(2 * n))
        # Sample correlations of independent draws: standard error
        # 1/sqrt(n) = 0.31%; equal noise would give 1.
        correlations = np.corrcoef(np.stack(draws))
        off_diagonal = correlations[~np.eye(len(draws), dtype=bool)]
        self.assertLess(np.max(np.abs(off_diagonal)), 5 / math.sqrt(n))

    @parameterized.named_parameters(
        # gamma' = 0.04 Phi (epsilon=None), B counted: r(u) peaks at
        # sqrt(26) = 5.1, so every threshold below has mass.
        ("default_gamma_counted_b", None, None, (0.5, 1.0, 2.0, 4.0)),
        # gamma' = 0.25 Phi, B = 32: r(u) <= sqrt(5) = 2.24, so no
        # coordinate may exceed 3.
        ("explicit_gamma_fixed_b", 32, 0.25, (0.5, 1.0, 1.5, 2.0, 3.0)),
    )
    def test_corrected_first_step_ratio_distribution(
        self, batch_size, gamma_over_phi, thresholds
    ):
        b = _EXAMPLES if batch_size is None else batch_size
        phi = (_SIGMA * _CLIP / b) ** 2
        epsilon = None if gamma_over_phi is None else gamma_over_phi * phi
        lr = 0.01
        update = _pure_noise_update(
            tf_dpadam.DPAdamCorrected(
                l2_norm_clip=_CLIP, noise_multiplier=_SIGMA,
                batch_size=batch_size, learning_rate=lr, epsilon=epsilon,
            ),
            seed=12,
        )
        c = 0.04 if gamma_over_phi is None else gamma_over_phi
        ratio = np.abs(update) / lr
        for threshold in thresholds:
            _assert_share(self, ratio, threshold,
                          _corrected_ratio_tail(threshold, c), "corrected r")
        # The sign is the noise's: symmetric (Binomial(n, 1/2), 5 SE).
        _assert_share(self, update, 0.0, 0.5, "positive updates")

    @parameterized.named_parameters(
        # Keras' default epsilon: |update| / lr = |g| / (|g| + e) with a tiny
        # e, i.e. lr * sign(g) up to the smallest |g|. (Thresholds much
        # closer to 1 would see Keras' float32 bias correction:
        # 1 - float32(0.999) is 1e-3 (1 - 1.3e-5), which scales every update
        # by 1 - 6.4e-6.)
        ("default_epsilon", None, (0.99, 0.999)),
        # epsilon = s sqrt(1 - beta_2), i.e. e = s: r > T iff |g| > s T /
        # (1 - T). This pins Keras' placement of epsilon; with
        # m_hat / (sqrt(v_hat) + epsilon), e would be 0.03 s and the share
        # of r > 0.5 would be 97.5% instead of 31.7%.
        ("epsilon_at_noise_scale", 1.0, (0.25, 0.5, 0.75)),
    )
    def test_biased_adam_first_step_ratio_distribution(self, scale,
                                                       thresholds):
        s = _SIGMA * _CLIP / _EXAMPLES  # std of g_tilde = z / B
        epsilon = 1e-7 if scale is None else scale * s * math.sqrt(1 - _BETA_2)
        lr = 0.01
        update = _pure_noise_update(
            tf_dpadam.DPAdam(l2_norm_clip=_CLIP, noise_multiplier=_SIGMA,
                             learning_rate=lr, beta_2=_BETA_2,
                             epsilon=epsilon),
            seed=13,
        )
        # At t = 1 Keras Adam gives lr g / (|g| + e), e = eps / sqrt(1 - b2).
        e = epsilon / math.sqrt(1 - _BETA_2)
        ratio = np.abs(update) / lr
        self.assertLessEqual(float(ratio.max()), 1.0 + 1e-6)
        for threshold in thresholds:
            # |g| / (|g| + e) > T  <=>  |g| > e T / (1 - T).
            predicted = 2 * stats.norm.sf(e * threshold / (1 - threshold) / s)
            _assert_share(self, ratio, threshold, predicted, "adam r")
        _assert_share(self, update, 0.0, 0.5, "positive updates")


class NumericArgumentTypeTest(parameterized.TestCase):
    """Issue 52: a number given as a string (e.g. from a config file) is a
    ValueError naming the argument, not a TypeError from a comparison."""

    @parameterized.product(
        cls=[tf_dpadam.DPSGD, tf_dpadam.DPAdam, tf_dpadam.DPAdamCorrected,
             tf_dpadam.DPAdamDiSK, tf_dpadam.DPAdamScaleThenPrivatize],
        name=["l2_norm_clip", "noise_multiplier", "batch_size",
              "learning_rate", "beta_1", "beta_2", "epsilon", "momentum",
              "kappa", "gamma", "scale_epsilon"])
    def test_string_refused_naming_the_argument(self, cls, name):
        arguments = dict(l2_norm_clip=1.0, noise_multiplier=1.0,
                         batch_size=8)
        if name not in arguments and name not in inspect.signature(
                cls.__init__).parameters:
            self.skipTest(f"{cls.__name__} has no {name}")
        arguments[name] = "0.5"
        # learning_rate: Keras' own ValueError, which names it too.
        with self.assertRaisesRegex(ValueError, f"{name}=.?0.5"):
            cls(**arguments)


class LearningRateValidationTest(parameterized.TestCase):
    """Issue 34: a NaN, infinite or negative learning rate is refused (it
    trained to NaN weights); 0, schedules and callables are accepted."""

    _OPTIMIZERS = (tf_dpadam.DPSGD, tf_dpadam.DPAdam,
                   tf_dpadam.DPAdamCorrected)

    def _make(self, cls, learning_rate):
        return cls(l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=8,
                   learning_rate=learning_rate)

    @parameterized.product(index=[0, 1, 2],
                           value=[float("nan"), float("inf"), -0.01])
    def test_refused(self, index, value):
        with self.assertRaisesRegex(
                ValueError, f"Expected learning_rate={value!r} to be a"
                " finite number >= 0"):
            self._make(self._OPTIMIZERS[index], value)

    @parameterized.parameters(0, 1, 2)
    def test_accepted_as_keras_accepts_them(self, index):
        cls = self._OPTIMIZERS[index]
        self.assertEqual(float(self._make(cls, 0.0).learning_rate), 0.0)
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
        optimizer = self._make(cls, schedule)
        restored = cls.from_config(optimizer.get_config())
        self.assertIsInstance(restored._learning_rate,
                              keras.optimizers.schedules.ExponentialDecay)
        self._make(cls, lambda: 0.01)


if __name__ == "__main__":
    absltest.main()


# --------------------------------------------------------------------------
# Keras' decoupled weight decay and parameter averaging (EMA) on the DP rules.
# --------------------------------------------------------------------------


class _DecayedReference(ReferenceOptimizer):
    """A rule with decoupled weight decay (Loshchilov & Hutter; Keras'
    `weight_decay`): theta <- theta - lr * wd * theta, then the rule's own
    update on the private gradient. It also keeps the exponential moving
    average of the weights that Keras' `use_ema` keeps: the weights after
    the first step, then avg <- mu avg + (1 - mu) theta."""

    def __init__(self, rule, params, *, weight_decay, ema_momentum, **hyper):
        super().__init__(rule, params, **hyper)
        self.weight_decay = weight_decay
        self.ema_momentum = ema_momentum
        self.average = None

    def step(self, params, grads):
        lr = self.hyper["lr"]
        decayed = [p - lr * self.weight_decay * p for p in params]
        params = super().step(decayed, grads)
        mu = 0.0 if self.average is None else self.ema_momentum
        self.average = [p if a is None else mu * a + (1 - mu) * p
                        for p, a in zip(params, self.average or [None] * len(params))]
        return params


class WeightDecayAndEmaTest(parameterized.TestCase):
    """DP-SGD, DP-AdamW and DP-AdamBC with decoupled weight decay (the
    corrected form of DP-AdamW), and parameter averaging, in lockstep with
    the NumPy reference: every step, and the averaged weights that `fit`
    leaves in the model at its end (Keras' `finalize_variable_values`).
    Accumulated: two physical batches of 8 per logical step of B = 16, so
    decay and average advance once per logical step."""

    @parameterized.named_parameters(
        ("dpsgd", "dpsgd", 1), ("dpadamw", "dpadam", 1),
        ("corrected", "corrected", 1), ("corrected_phi", "corrected_phi", 1),
        ("corrected_phi_accumulated", "corrected_phi", 2),
    )
    @pytest.mark.slow
    def test_weights_and_average_follow_reference(self, rule, accumulation):
        weight_decay, ema_momentum = 0.05, 0.8
        x, y = _data()
        x64 = x.astype(np.float64)
        base = _mlp()
        initial = _arrays(base.trainable_variables)
        clip = _median_clip(initial, x, y)
        logical = _PHYSICAL * accumulation
        batch_size = _FIXED_B if accumulation == 1 else logical
        phi = None
        if rule == "corrected_phi":
            phi = _median_phi(initial, x64, y, clip, batch_size, logical)
        cls, kwargs, ref_rule, hyper = _rule_setup(rule, phi)
        trajectory, _, _, reference = reference_training(
            initial, x64, y, clip=clip, batch_size=batch_size,
            physical=logical,
            make_rule=lambda p: _DecayedReference(
                ref_rule, p, weight_decay=weight_decay,
                ema_momentum=ema_momentum, **hyper),
        )
        # The decay matters: without it the first step differs.
        plain, *_ = reference_training(
            initial, x64, y, clip=clip, batch_size=batch_size,
            physical=logical,
            make_rule=lambda p: ReferenceOptimizer(ref_rule, p, **hyper))
        self.assertGreater(max(np.abs(a - b).max() for a, b in
                               zip(plain[0], trajectory[0])), 1e-5)

        model = tf_dpadam.make_private(base, seed=0)
        model.compile(
            optimizer=cls(l2_norm_clip=clip, noise_multiplier=0.0,
                          batch_size=batch_size, weight_decay=weight_decay,
                          use_ema=True, ema_momentum=ema_momentum,
                          gradient_accumulation_steps=(
                              accumulation if accumulation > 1 else None),
                          **kwargs),
            loss=_LOSS, jit_compile=False,
        )
        recorder = _RecordWeights()
        model.fit(x, y, batch_size=_PHYSICAL, epochs=1, shuffle=False,
                  verbose=0, callbacks=[recorder], sampling="shuffled")
        steps = recorder.steps[accumulation - 1::accumulation]
        if len(recorder.steps) % accumulation:
            steps.append(recorder.steps[-1])  # the last, partial step
        self.assertLen(steps, len(trajectory))
        rtol = _RTOL.get(rule, 1e-5)
        for step, (got, want) in enumerate(zip(steps, trajectory)):
            for a, e in zip(got, want):
                np.testing.assert_allclose(a, e, rtol=rtol, atol=_ATOL,
                                           err_msg=f"step {step + 1}")
        # After fit the model holds the average (post-processing: free).
        for a, e in zip(_arrays(model.trainable_variables),
                        reference.average):
            np.testing.assert_allclose(a, e, rtol=rtol, atol=_ATOL)
        self.assertGreater(max(np.abs(a - b).max() for a, b in zip(
            reference.average, trajectory[-1])), 1e-5)

    @pytest.mark.slow
    def test_validation_on_averaged_weights_leaves_training_unchanged(self):
        # keras.callbacks.SwapEMAWeights evaluates on the averaged weights
        # during fit and swaps the trained ones back: the training trajectory
        # is the one without validation, and each epoch's validation loss is
        # that of the average at the time.
        x, y = _data()
        clip = _median_clip(_arrays(_mlp().trainable_variables), x, y)

        def train(callbacks, validation):
            model = tf_dpadam.make_private(_mlp(), seed=0)
            model.compile(
                optimizer=tf_dpadam.DPAdamCorrected(
                    l2_norm_clip=clip, noise_multiplier=0.0,
                    batch_size=_FIXED_B, learning_rate=0.05, use_ema=True,
                    ema_momentum=0.5),
                loss=_LOSS, jit_compile=False)
            recorder = _RecordWeights()
            history = model.fit(
                x, y, batch_size=_PHYSICAL, epochs=2, shuffle=False,
                verbose=0, callbacks=[recorder] + callbacks,
                validation_data=(x[:12], y[:12]) if validation else None,
                sampling="shuffled")
            return model, recorder.steps, history

        plain_model, plain, _ = train([], validation=False)
        swapped_model, steps, history = train(
            [keras.callbacks.SwapEMAWeights()], validation=True)
        # Keras swaps by arithmetic (a + b - b), which rounds: 1e-6.
        self.assertLen(steps, len(plain))
        for got, want in zip(steps, plain):
            for a, e in zip(got, want):
                np.testing.assert_allclose(a, e, atol=1e-6)
        # After fit both hold the average; evaluated now, it gives the loss
        # that validation reported for the last epoch.
        for a, e in zip(_arrays(swapped_model.trainable_variables),
                        _arrays(plain_model.trainable_variables)):
            np.testing.assert_allclose(a, e, atol=1e-6)
        final = swapped_model.evaluate(x[:12], y[:12], verbose=0)
        self.assertAlmostEqual(history.history["val_loss"][-1], final,
                               places=5)


def _keras_post_clip(grads, arg, value):
    """NumPy Keras clipping of the averaged gradient (after the noise)."""
    if arg == "clipnorm":  # Each tensor to L2 norm <= value.
        return [g * value / max(np.linalg.norm(g), value) for g in grads]
    if arg == "global_clipnorm":  # All tensors together.
        norm = math.sqrt(sum((g**2).sum() for g in grads))
        return [g * value / max(norm, value) for g in grads]
    return [np.clip(g, -value, value) for g in grads]  # clipvalue


class _PostClippedReference(ReferenceOptimizer):
    """A reference rule that first applies Keras' clipping to g_tilde."""

    def __init__(self, rule, params, *, arg, value, **hyper):
        super().__init__(rule, params, **hyper)
        self.arg, self.value = arg, value

    def step(self, params, grads):
        return super().step(params, _keras_post_clip(grads, self.arg,
                                                     self.value))


_CLIP_ARGS = ("clipnorm", "global_clipnorm", "clipvalue")


class KerasGradientClippingTest(parameterized.TestCase):
    """Keras' clipnorm / global_clipnorm / clipvalue act on the averaged,
    noised gradient. DPAdamCorrected refuses them (Phi is the noise variance
    of the unclipped gradient); DPSGD and DPAdam accept them (post-processing)
    and then follow the NumPy reference with the clipping."""

    def _corrected(self, **kwargs):
        return tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=8, **kwargs)

    @parameterized.parameters(*_CLIP_ARGS)
    def test_corrected_refuses_in_constructor(self, arg):
        with self.assertRaisesRegex(ValueError, rf"Expected {arg}=None.*Phi"):
            self._corrected(**{arg: 0.01})

    @parameterized.parameters(*_CLIP_ARGS)
    def test_corrected_refuses_saved_config(self, arg):
        config = self._corrected().get_config()
        self.assertIn(arg, config)  # Keras saves it (as None here).
        tf_dpadam.DPAdamCorrected.from_config(dict(config))  # Loads.
        config[arg] = 0.01
        with self.assertRaisesRegex(ValueError, rf"Expected {arg}=None"):
            tf_dpadam.DPAdamCorrected.from_config(config)
        with self.assertRaisesRegex(ValueError, rf"Expected {arg}=None"):
            keras.optimizers.deserialize(
                {"module": "tf_dpadam", "class_name": "DPAdamCorrected",
                 "config": config,
                 "registered_name": "tf_dpadam>DPAdamCorrected"})

    @parameterized.parameters(*_CLIP_ARGS)
    def test_corrected_refuses_clipping_set_after_construction(self, arg):
        optimizer = self._corrected()
        variable = keras.Variable(np.ones(3, np.float32))
        optimizer.build([variable])
        setattr(optimizer, arg, 0.01)
        with self.assertRaisesRegex(ValueError, rf"Expected {arg}=None"):
            optimizer.apply_private([np.ones(3, np.float32)], [variable], 8.0)
        np.testing.assert_array_equal(np.array(variable), np.ones(3))

    @parameterized.product(rule=("dpsgd", "dpadam"), arg=_CLIP_ARGS)
    @pytest.mark.slow
    def test_dpsgd_and_dpadam_train_with_keras_clipping(self, rule, arg):
        x, y = _data()
        x64 = x.astype(np.float64)
        base = _mlp()
        initial = _arrays(base.trainable_variables)
        clip = _median_clip(initial, x, y)
        cls, kwargs, ref_rule, hyper = _rule_setup(rule)
        plain, _, first_g, _ = reference_training(
            initial, x64, y, clip=clip, batch_size=_FIXED_B,
            physical=_PHYSICAL,
            make_rule=lambda p: ReferenceOptimizer(ref_rule, p, **hyper))
        # A threshold that binds on the first step's g_tilde.
        if arg == "clipnorm":
            value = 0.5 * min(np.linalg.norm(g) for g in first_g)
        elif arg == "global_clipnorm":
            value = 0.5 * math.sqrt(sum((g**2).sum() for g in first_g))
        else:
            value = float(np.median(np.abs(np.concatenate(
                [g.ravel() for g in first_g]))))
        trajectory, *_ = reference_training(
            initial, x64, y, clip=clip, batch_size=_FIXED_B,
            physical=_PHYSICAL,
            make_rule=lambda p: _PostClippedReference(
                ref_rule, p, arg=arg, value=value, **hyper))
        # The clipping matters: without it the trajectory differs (Adam's
        # first step is sign(g) either way, so compare the last).
        self.assertGreater(max(np.abs(a - b).max() for a, b in
                               zip(plain[-1], trajectory[-1])), 1e-4)

        model = tf_dpadam.make_private(base, seed=0)
        model.compile(
            optimizer=cls(l2_norm_clip=clip, noise_multiplier=0.0,
                          batch_size=_FIXED_B, **{arg: value}, **kwargs),
            loss=_LOSS, jit_compile=False)
        # The reference's consecutive batches, one step each.
        steps = []
        for start in range(0, _N, _PHYSICAL):
            model.train_on_batch(x[start:start + _PHYSICAL],
                                 y[start:start + _PHYSICAL])
            steps.append(_arrays(model.trainable_variables))
        self.assertLen(steps, len(trajectory))
        for step, (got, want) in enumerate(zip(steps, trajectory)):
            for a, e in zip(got, want):
                np.testing.assert_allclose(a, e, rtol=1e-5, atol=_ATOL,
                                           err_msg=f"step {step + 1}")
