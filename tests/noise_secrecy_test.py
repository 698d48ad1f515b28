"""The DP noise is secret: global seeds do not fix it and nothing saves it."""

import json
import math
import os
import tempfile
import zipfile

import h5py
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
from tf_dpadam.training import model_ledger

import helpers

pytestmark = pytest.mark.slow  # Trains and saves models, many times.

_UNITS_IN, _UNITS_OUT = 200, 250  # 50,000 kernel coordinates.
_EXAMPLES = 4
_STDDEV = 1.5  # sigma * C


def _zero_gradient_model(seed=None, secure_mode=False):
    """A private model whose clipped gradient sum is exactly 0.

    Zero inputs and targets, a zero bias-free kernel and MSE: every example's
    gradient is 0, so each DPSGD step (learning rate 1, B = 1) moves the
    kernel by minus the noise of that step.
    """
    base = keras.Sequential([
        keras.Input((_UNITS_IN,)),
        keras.layers.Dense(_UNITS_OUT, use_bias=False,
                           kernel_initializer="zeros"),
    ])
    return tf_dpadam.make_private(base, seed=seed, secure_mode=secure_mode)


def _compile(model, jit=False):
    model.compile(
        optimizer=tf_dpadam.DPSGD(l2_norm_clip=_STDDEV, noise_multiplier=1.0,
                                  learning_rate=1.0, batch_size=1),
        loss="mse", jit_compile=jit,
    )


def _noise_of_steps(model, steps):
    """The noise vector of each of `steps` steps, from the weight moves."""
    x = np.zeros((_EXAMPLES, _UNITS_IN), "float32")
    y = np.zeros((_EXAMPLES, _UNITS_OUT), "float32")
    kernel = model.base_model.weights[0]
    noises = []
    for _ in range(steps):
        before = np.array(kernel)
        model.train_on_batch(x, y)
        noises.append((before - np.array(kernel)).ravel())
    return noises


def _assert_independent(test, a, b):
    """Two noise vectors are independent draws, not equal or correlated.

    The sample correlation of independent vectors of n = 50,000 values has
    standard error 1/sqrt(n) = 0.45%; 5 standard errors.
    """
    correlation = np.corrcoef(a, b)[0, 1]
    test.assertLess(abs(correlation), 5 / math.sqrt(a.size))


class SecretNoiseTest(parameterized.TestCase):

    @parameterized.named_parameters(("graph", False), ("xla", True))
    def test_global_seeds_do_not_fix_the_noise(self, jit):
        runs = []
        for _ in range(2):
            helpers.seed_everything(0)
            model = _zero_gradient_model()
            _compile(model, jit)
            runs.append(_noise_of_steps(model, 1)[0])
        _assert_independent(self, runs[0], runs[1])

    @parameterized.named_parameters(("graph", False), ("xla", True))
    def test_an_explicit_seed_reproduces_the_noise_and_warns(self, jit):
        runs = []
        for global_seed in (0, 1):
            helpers.seed_everything(global_seed)
            with self.assertWarnsRegex(UserWarning, "explicit seed=7"):
                model = _zero_gradient_model(seed=7)
            _compile(model, jit)
            runs.append(_noise_of_steps(model, 2))
        np.testing.assert_array_equal(runs[0][0], runs[1][0])
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        _assert_independent(self, runs[0][0], runs[0][1])

    @parameterized.named_parameters(
        ("negative", -1), ("float", 1.5), ("string", "7"), ("bool", True),
        ("too_large", 2**63),
    )
    def test_bad_seeds_are_refused(self, seed):
        with self.assertRaisesRegex(ValueError, "seed="):
            _zero_gradient_model(seed=seed)

    def test_no_noise_state_is_tracked_or_saved(self):
        model = _zero_gradient_model()
        _compile(model)
        _noise_of_steps(model, 1)
        tracked = {v.path for v in model.variables}
        tracked |= {v.path for v in model.optimizer.variables}
        self.assertFalse([p for p in tracked if "seed" in p], tracked)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        saved, ledger = [], []
        with zipfile.ZipFile(path) as archive:
            with archive.open("model.weights.h5") as f, h5py.File(f) as h5:
                h5.visititems(
                    lambda name, item: saved.append((name, item.shape))
                    if isinstance(item, h5py.Dataset) else None
                )
                ledger = [bytes(h5[name][()]).decode() for name, _ in saved
                          if name.endswith(model_ledger.STORE_KEY)]
        # The model's weights, the optimizer's variables and the privacy
        # ledger (public: the steps and their sampling and sigma), nothing
        # else (the noise seed state was a [2] int64 variable of the model).
        self.assertLen(
            saved, len(model.weights) + len(model.optimizer.variables) + 1
        )
        self.assertLen(ledger, 1)
        self.assertEqual(json.loads(ledger[0]),
                         model.privacy_ledger.to_json())
        self.assertNotIn("seed", ledger[0])
        self.assertNotIn((2,), [shape for _, shape in saved], saved)
        checkpoint_dir = tempfile.mkdtemp()
        tf.train.Checkpoint(model=model).write(
            os.path.join(checkpoint_dir, "ckpt")
        )
        names = [name for name, _ in tf.train.list_variables(
            os.path.join(checkpoint_dir, "ckpt"))]
        self.assertFalse([n for n in names if "seed" in n], names)

    @parameterized.named_parameters(("secret", None), ("explicit", 7))
    def test_a_resumed_run_does_not_replay_noise(self, seed):
        model = _zero_gradient_model(seed=seed)
        _compile(model)
        first = _noise_of_steps(model, 2)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        continued = _noise_of_steps(model, 1)[0]
        resumed = keras.models.load_model(path)
        self.assertEqual(int(resumed.optimizer.iterations), 2)
        after_resume = _noise_of_steps(resumed, 1)[0]
        for earlier in first + ([continued] if seed is None else []):
            _assert_independent(self, after_resume, earlier)

    def test_a_new_optimizer_does_not_replay_noise(self):
        # Recompiling resets the optimizer's step count to 0; the draws
        # still never repeat.
        model = _zero_gradient_model(seed=7)
        _compile(model)
        first = _noise_of_steps(model, 1)[0]
        _compile(model)
        second = _noise_of_steps(model, 1)[0]
        _assert_independent(self, first, second)

    def test_seeds_are_64_bit_secrets(self):
        drawn = {seeds.secret_seed() for _ in range(100)}
        self.assertLen(drawn, 100)
        self.assertTrue(all(0 <= s < 2**63 for s in drawn))
        # The top bit is used: some of 100 seeds exceed 2**62 (chance of
        # none: 2**-100).
        self.assertTrue(any(s >= 2**62 for s in drawn))


class SecureModeTest(parameterized.TestCase):

    @parameterized.named_parameters(("graph", False), ("xla", True))
    def test_noise_is_gaussian_with_the_same_std(self, jit):
        model = _zero_gradient_model(secure_mode=True)
        _compile(model, jit)
        noise = np.concatenate(_noise_of_steps(model, 2)).astype(np.float64)
        n = noise.size
        # Sample std: relative standard error 1/sqrt(2n) = 0.22% at
        # n = 100,000; 5 standard errors.
        self.assertAlmostEqual(np.std(noise) / _STDDEV, 1.0,
                               delta=5 / math.sqrt(2 * n))
        # Mean: standard error stddev/sqrt(n); 5 standard errors.
        self.assertLess(abs(np.mean(noise)), 5 * _STDDEV / math.sqrt(n))
        # A sum of normals is normal: Kolmogorov-Smirnov against
        # N(0, stddev^2) at the 1e-4 level.
        self.assertGreater(
            stats.kstest(noise / _STDDEV, "norm").pvalue, 1e-4
        )

    def test_secure_mode_draws_differ_from_a_single_normal(self):
        seed = tf.constant([3, 4], tf.int64)
        plain = noise.gaussian([1000], 1.0, tf.float32, seed)
        secure = noise.gaussian([1000], 1.0, tf.float32, seed,
                                     secure_mode=True)
        self.assertGreater(np.max(np.abs(plain - secure)), 0.1)

    def test_secure_mode_refuses_an_explicit_seed(self):
        with self.assertRaisesRegex(ValueError, "secure_mode.*seed=3"):
            _zero_gradient_model(seed=3, secure_mode=True)

    def test_secure_mode_is_saved_in_the_config(self):
        model = _zero_gradient_model(secure_mode=True)
        _compile(model)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        self.assertTrue(keras.models.load_model(path).secure_mode)


if __name__ == "__main__":
    absltest.main()
