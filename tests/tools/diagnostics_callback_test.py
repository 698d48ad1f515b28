"""src/tf_dpadam/tools/diagnostics/callback.py: MomentDiagnostics on real training.

Also what it reads: make_private(diagnostics=True) and the clean gradient
(NOT private).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from helpers import LOSS
from helpers import classification_data
from helpers import mlp
from helpers import numpy_values
from tf_dpadam.tools import diagnostics

import helpers

# The diagnostics warning (not the explicit-seed warning of make_private).
_NOT_PRIVATE = "diagnostics=True. is NOT differentially private"


def _private(base, **kwargs):
    """make_private(diagnostics=True) without its warning (tested below)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*" + _NOT_PRIVATE)
        return tf_dpadam.make_private(base, diagnostics=True, **kwargs)


def _reference_clean_gradient(base, x, y, l2_norm_clip, denominator):
    """sum_i clip(g_i, C) / B, one example at a time, clipped in NumPy."""
    total = [np.zeros(v.shape, np.float64) for v in base.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], base(x[i:i + 1]))
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(loss, base.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        factor = min(1.0, l2_norm_clip / norm)
        total = [t + factor * g for t, g in zip(total, grads)]
    return [t / denominator for t in total]


class CleanGradientTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("ghost", "ghost", 1),
        ("vectorized", "vectorized", 1),
        ("ghost_accumulated", "ghost", 2),
    )
    @pytest.mark.slow
    def test_clean_gradient_is_the_clipped_mean(self, clipping, steps):
        base = mlp(seed=1)
        x, y = classification_data(8, seed=2)
        clip, denominator = 0.3, 10  # B = 10: the public constant, not 8.
        expected = _reference_clean_gradient(base, x, y, clip, denominator)
        model = _private(base, seed=0, clipping=clipping)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=clip, noise_multiplier=1.0,
                batch_size=denominator,
                gradient_accumulation_steps=steps if steps > 1 else None,
            ),
            loss=LOSS,
        )
        if steps > 1:
            # The first micro-batch completes no DP step: nothing recorded.
            model.fit(x[:4], y[:4], batch_size=4, verbose=0,
                      sampling="shuffled")
            self.assertEqual(int(model.optimizer.iterations), 0)
            for g in numpy_values(model.clean_gradients):
                np.testing.assert_array_equal(g, 0.0)
            model.fit(x[4:], y[4:], batch_size=4, verbose=0,
                      sampling="shuffled")
        else:
            model.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 1)
        self.assertEqual(model.clipping_used, clipping)
        # Clipped (some norms exceed C = 0.3), noise-free, divided by B once.
        for got, want in zip(numpy_values(model.clean_gradients), expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


class MomentsTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("dpadam", tf_dpadam.DPAdam, 1),
        ("corrected", tf_dpadam.DPAdamCorrected, 1),
        ("corrected_accumulated", tf_dpadam.DPAdamCorrected, 2),
    )
    @pytest.mark.slow
    def test_without_noise_clean_and_private_moments_coincide(self, cls,
                                                              steps):
        model = _private(mlp(seed=3), seed=0)
        model.compile(
            optimizer=cls(
                l2_norm_clip=0.5, noise_multiplier=0.0, batch_size=8,
                learning_rate=0.05,
                gradient_accumulation_steps=steps if steps > 1 else None,
            ),
            loss=LOSS,
        )
        callback = tf_dpadam.MomentDiagnostics(steps=(1, 6))
        x, y = classification_data(48, seed=4)
        model.fit(x, y, batch_size=8 // steps, epochs=1, shuffle=False,
                  callbacks=[callback], verbose=0, sampling="shuffled")
        self.assertEqual(callback.step, 6)
        self.assertEqual(sorted(callback.snapshots), [1, 6])
        for snapshot in callback.snapshots.values():
            # Without noise g_tilde is the clean gradient itself: the moments
            # differ only by float32 (optimizer) vs float64 (callback)
            # rounding of the same recursion.
            for clean, private in ((snapshot.m_clean, snapshot.m_private),
                                   (snapshot.v_clean, snapshot.v_private)):
                np.testing.assert_allclose(
                    private, clean, rtol=1e-5, atol=1e-6 * np.abs(clean).max()
                )
            self.assertEqual(snapshot.phi, 0.0)
        # The moments are not trivially zero, and training moved them.
        first, last = callback.snapshots[1], callback.snapshots[6]
        self.assertGreater(np.abs(first.m_clean).max(), 1e-3)
        self.assertFalse(np.allclose(first.v_clean, last.v_clean))

    @pytest.mark.slow
    def test_with_noise_private_second_moment_exceeds_clean_by_phi(self):
        # 41 * 80 = 3,280 coordinates, 5 steps. Per coordinate
        # v^p - v^c = avg_t (2 g_t z_t / B + z_t^2 / B^2) (bias-corrected,
        # beta_2 = 0.999: almost a plain average over t), whose mean is Phi.
        # The z^2 part has std sqrt(2 / (5 * 3280)) Phi = 1.1% of Phi over
        # all coordinates; the cross term ~0.2% (here g^2 << Phi). The
        # tolerance of 5% is about 4.5 standard deviations.
        sigma, clip, batch = 2.0, 1.0, 16
        keras.utils.set_random_seed(5)
        base = keras.Sequential([keras.Input((40,)), keras.layers.Dense(80)])
        model = _private(base, seed=6)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=clip, noise_multiplier=sigma, batch_size=batch,
                learning_rate=1e-3,
            ),
            loss=LOSS,
        )
        callback = tf_dpadam.MomentDiagnostics(steps=(5,))
        x, y = classification_data(80, d=40, classes=80, seed=7)
        model.fit(x, y, batch_size=batch, shuffle=False, callbacks=[callback],
                  verbose=0, sampling="shuffled")
        snapshot = callback.snapshots[5]
        phi = (sigma * clip / batch) ** 2
        self.assertAlmostEqual(snapshot.phi, phi, places=7)
        self.assertAlmostEqual(snapshot.noise_phi, phi, places=7)
        self.assertAlmostEqual(snapshot.gamma, 0.04 * phi, places=7)
        bias = np.mean(snapshot.v_private - snapshot.v_clean)
        self.assertAlmostEqual(bias / phi, 1.0, delta=0.05)
        comparison = diagnostics.moment_comparison(snapshot)
        self.assertAlmostEqual(comparison["bias_over_phi"], bias / phi)
        # The spread over coordinates is the noise's (the sample std of
        # 3,280 values has a relative error ~2%; 10% leaves room for the
        # cross term and the heavier tails of z^2).
        self.assertAlmostEqual(
            comparison["std_over_phi"] / comparison["noise_std_over_phi"],
            1.0, delta=0.1,
        )
        # Here Phi dominates v^p, as in the paper.
        self.assertLess(comparison["median_v_clean_over_phi"], 0.01)
        self.assertGreater(comparison["median_v_private_over_phi"], 0.5)
        # The private moments are the optimizer's own.
        m, _ = model.optimizer.moments(model.trainable_variables[0])
        m = keras.ops.convert_to_numpy(m).ravel()
        np.testing.assert_allclose(
            snapshot.m_private[:m.size], m / (1 - 0.9**5), rtol=1e-6
        )


class DefaultAndSerializationTest(absltest.TestCase):

    def _compiled(self, diagnostics_on, noise=1.0):
        make = _private if diagnostics_on else tf_dpadam.make_private
        model = make(mlp(seed=8), seed=9)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=0.5, noise_multiplier=noise, batch_size=8
            ),
            loss=LOSS,
        )
        return model

    @pytest.mark.slow
    def test_default_is_off_silent_and_adds_nothing(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = self._compiled(False)
        self.assertFalse(
            [w for w in caught if re.search(_NOT_PRIVATE, str(w.message))]
        )
        self.assertFalse(model.diagnostics)
        self.assertFalse(model.get_config()["diagnostics"])
        x, y = classification_data(24)
        model.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")
        self.assertIsNone(model.clean_gradients)
        with self.assertRaisesRegex(ValueError, "diagnostics=True"):
            model.fit(x, y, batch_size=8, verbose=0,
                      callbacks=[tf_dpadam.MomentDiagnostics()],
                      sampling="shuffled")

    @pytest.mark.slow
    def test_diagnostics_warn_and_leave_weights_and_trajectory_alone(self):
        with self.assertWarnsRegex(UserWarning, _NOT_PRIVATE):
            tf_dpadam.make_private(mlp(), diagnostics=True)
        plain, diagnosed = self._compiled(False), self._compiled(True)
        # The clean gradients are not model weights (nor saved).
        self.assertEqual(len(plain.variables), len(diagnosed.variables))
        x, y = classification_data(24)
        for model in (plain, diagnosed):
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                      sampling="shuffled")
        # Same noise draws, same updates: the weights stay private.
        for a, b in zip(numpy_values(plain.variables),
                        numpy_values(diagnosed.variables)):
            np.testing.assert_array_equal(a, b)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "diagnostics='yes'"):
            tf_dpadam.make_private(mlp(), diagnostics="yes")
        for steps in ((0,), (2.5,), (True,)):
            with self.assertRaisesRegex(ValueError, "ints >= 1"):
                tf_dpadam.MomentDiagnostics(steps=steps)
        model = _private(mlp())
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=LOSS,
        )
        x, y = classification_data(8)
        with self.assertRaisesRegex(ValueError, "DPAdam or DPAdamCorrected"):
            model.fit(x, y, verbose=0,
                      callbacks=[tf_dpadam.MomentDiagnostics()],
                      sampling="shuffled")

    @pytest.mark.slow
    def test_save_load_round_trips_the_flag_but_not_the_clean_gradient(self):
        model = self._compiled(True)
        x, y = classification_data(16)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                  sampling="shuffled")
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        with self.assertWarnsRegex(UserWarning, _NOT_PRIVATE):
            loaded = keras.models.load_model(path)
        self.assertTrue(loaded.diagnostics)
        saved, revived = model.get_config(), loaded.get_config()
        for config in (saved, revived):
            del config["base_model"]  # Keras' own (lists vs tuples).
        self.assertEqual(revived, saved)
        for g in numpy_values(loaded.clean_gradients):
            np.testing.assert_array_equal(g, 0.0)
        # Clean moments must start with the optimizer's, at step 0.
        with self.assertRaisesRegex(ValueError, "at step 2"):
            loaded.fit(x, y, batch_size=8, verbose=0,
                       callbacks=[tf_dpadam.MomentDiagnostics()],
                       sampling="shuffled")
        loaded.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")
        self.assertGreater(
            max(np.abs(g).max()
                for g in numpy_values(loaded.clean_gradients)), 0
        )
        # Off round-trips as off, and configs from before the flag load.
        config = tf_dpadam.make_private(mlp()).get_config()
        self.assertFalse(
            tf_dpadam.PrivateModel.from_config(config).diagnostics
        )
        del config["diagnostics"]
        self.assertFalse(
            tf_dpadam.PrivateModel.from_config(config).diagnostics
        )


_REPLICAS = 2


def _distribute_child():
    """Runs in its own process: the clean gradient under MirroredStrategy.

    Logical devices must be set before TensorFlow initializes, which the
    test process has already done.
    """
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * _REPLICAS,
    )
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(_REPLICAS)]
    )
    x, y = classification_data(8, seed=10)
    result = {}
    for name, scope in (("single", tf.distribute.get_strategy()),
                        ("replicated", strategy)):
        with scope.scope():
            model = _private(mlp(seed=11), seed=12)
            model.compile(
                optimizer=tf_dpadam.DPAdamCorrected(
                    l2_norm_clip=0.3, noise_multiplier=1.0
                ),
                loss=LOSS,
            )
        callback = tf_dpadam.MomentDiagnostics(steps=(1,))
        model.fit(x, y, batch_size=8, callbacks=[callback], verbose=0,
                  sampling="shuffled")
        result[name] = [g.tolist()
                        for g in numpy_values(model.clean_gradients)]
        result[name + "_m_clean"] = callback.snapshots[1].m_clean.tolist()
    print("RESULT " + json.dumps(result))


class DistributeTest(absltest.TestCase):

    @pytest.mark.slow
    def test_clean_gradient_under_mirrored_strategy(self):
        root = helpers.REPO_ROOT
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [root, helpers.TESTS_DIR] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        run = subprocess.run(
            [sys.executable, __file__, "distribute_child"],
            capture_output=True, text=True, timeout=300, check=False, env=env,
        )
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            raise AssertionError(f"The child process failed:\n{run.stderr}")
        result = json.loads(lines[-1][len("RESULT "):])
        # The whole clipped sum over both replicas, divided by B = 8 once.
        for single, replicated in zip(result["single"], result["replicated"]):
            np.testing.assert_allclose(replicated, single, rtol=1e-5,
                                       atol=1e-7)
        np.testing.assert_allclose(
            result["replicated_m_clean"], result["single_m_clean"],
            rtol=1e-5, atol=1e-7,
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["distribute_child"]:
        _distribute_child()
    else:
        absltest.main()
