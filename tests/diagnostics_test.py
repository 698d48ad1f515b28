"""make_private(diagnostics=True) and tf_dpadam.diagnostics (NOT private)."""

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
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam import diagnostics

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# The diagnostics warning (not the explicit-seed warning of make_private).
_NOT_PRIVATE = "diagnostics=True. is NOT differentially private"


def _data(n, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


def _base(d=6, classes=3, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((d,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(classes),
    ])


def _private(base, **kwargs):
    """make_private(diagnostics=True) without its warning (tested below)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*" + _NOT_PRIVATE)
        return tf_dpadam.make_private(base, diagnostics=True, **kwargs)


def _numpy(variables):
    return [keras.ops.convert_to_numpy(v) for v in variables]


def _reference_clean_gradient(base, x, y, l2_norm_clip, denominator):
    """sum_i clip(g_i, C) / B, one example at a time, clipped in NumPy."""
    total = [np.zeros(v.shape, np.float64) for v in base.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = _LOSS(y[i:i + 1], base(x[i:i + 1]))
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(loss, base.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        factor = min(1.0, l2_norm_clip / norm)
        total = [t + factor * g for t, g in zip(total, grads)]
    return [t / denominator for t in total]


class SummaryFunctionsTest(absltest.TestCase):
    """The pure NumPy functions, against hand-computed values and NumPy."""

    def _snapshot(self):
        # v^p = v^c + Phi exactly, m^p = m^c: the corrected update is the
        # clean one, the biased one is shrunk by sqrt(v / (v + Phi)).
        m = np.array([1.0, -2.0, 3.0, -4.0])
        v = np.array([1.0, 4.0, 9.0, 16.0])
        return diagnostics.MomentSnapshot(
            step=3, phi=0.5, gamma=0.01, noise_phi=0.5, beta_1=0.9,
            beta_2=0.999,
            m_clean=m, v_clean=v, m_private=m.copy(), v_private=v + 0.5,
        )

    def test_summary_statistics(self):
        values = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], "float32")
        stats = diagnostics.summary_statistics(values)
        # Sorted: 1 1 2 3 4 5 6 9. Linear quartiles at positions 1.75, 3.5
        # and 5.25: 1 + 0.75 * (2 - 1), (3 + 4) / 2, 5 + 0.25 * (6 - 5).
        self.assertEqual(stats, {"min": 1.0, "25%": 1.75, "median": 3.5,
                                 "75%": 5.25, "max": 9.0, "mean": 3.875})
        rng = np.random.default_rng(0)
        values = rng.lognormal(size=1001)
        stats = diagnostics.summary_statistics(values)
        np.testing.assert_allclose(
            [stats[c] for c in diagnostics.SUMMARY_COLUMNS],
            [values.min(), *np.percentile(values, [25, 50, 75]),
             values.max(), values.mean()],
            rtol=1e-12,
        )
        with self.assertRaisesRegex(ValueError, "at least one"):
            diagnostics.summary_statistics([])

    def test_adam_moments_and_bias_correction_in_lockstep(self):
        beta_1, beta_2 = 0.9, 0.999
        gradients = [np.array([1.0, -2.0]), np.array([0.5, 0.0]),
                     np.array([-1.0, 4.0])]
        m = v = np.zeros(2)
        ref_m = ref_v = np.zeros(2)
        for t, g in enumerate(gradients, start=1):
            m, v = diagnostics.adam_moments(m, v, g, beta_1, beta_2)
            ref_m = beta_1 * ref_m + (1 - beta_1) * g
            ref_v = beta_2 * ref_v + (1 - beta_2) * g * g
            m_hat, v_hat = diagnostics.bias_correct(m, v, beta_1, beta_2, t)
            np.testing.assert_allclose(m_hat, ref_m / (1 - beta_1**t))
            np.testing.assert_allclose(v_hat, ref_v / (1 - beta_2**t))
        # After one step the corrected moments are g and g^2 themselves.
        m, v = diagnostics.adam_moments(np.zeros(2), np.zeros(2),
                                        gradients[0], beta_1, beta_2)
        m_hat, v_hat = diagnostics.bias_correct(m, v, beta_1, beta_2, 1)
        np.testing.assert_allclose(m_hat, gradients[0])
        np.testing.assert_allclose(v_hat, gradients[0] ** 2)

    def test_second_moment_noise_std(self):
        # One step: v^p - v^c = 2 g z / B + (z / B)^2, noise part std
        # sqrt(2) Phi; many steps: sqrt(2 (1 - b2) / (1 + b2)) Phi.
        self.assertAlmostEqual(
            diagnostics.second_moment_noise_std(2.0, 0.999, 1), 2 * 2**0.5
        )
        self.assertAlmostEqual(
            diagnostics.second_moment_noise_std(1.0, 0.999, 10**6),
            (2 * 0.001 / 1.999) ** 0.5,
        )
        # Against the sum of the squared EMA weights itself.
        beta, t = 0.9, 7
        weights = [(1 - beta) * beta ** (t - s) / (1 - beta**t)
                   for s in range(1, t + 1)]
        self.assertAlmostEqual(sum(weights), 1.0)
        self.assertAlmostEqual(
            diagnostics.second_moment_noise_std(3.0, beta, t),
            3.0 * (2 * sum(w * w for w in weights)) ** 0.5,
        )

    def test_directions(self):
        # 0 / sqrt(0) is 0, not nan (a coordinate that never had a gradient).
        np.testing.assert_array_equal(
            diagnostics.adam_direction([2.0, 0.0, -3.0], [4.0, 0.0, 9.0]),
            [1.0, 0.0, -1.0],
        )
        # v - Phi = 3.5 for the first; 0.2 - 0.5 < gamma' = 0.25 is floored.
        np.testing.assert_allclose(
            diagnostics.corrected_direction([7.0, 1.0], [4.0, 0.2], 0.5, 0.25),
            [7.0 / np.sqrt(3.5), 1.0 / 0.5],
        )

    def test_moment_summary_and_comparison_of_a_hand_made_snapshot(self):
        snapshot = self._snapshot()
        summary = diagnostics.moment_summary(snapshot)
        self.assertEqual(list(summary), list(diagnostics.SUMMARY_ROWS))
        v = np.array([1.0, 4.0, 9.0, 16.0])
        expected = {
            "v_clean": v,
            "v_private": v + 0.5,
            "v_private_minus_phi": v,
            "abs_m_clean": np.sqrt(v),
            "abs_m_private": np.sqrt(v),
            "abs_update_clean": np.ones(4),
            "abs_update_private": np.sqrt(v / (v + 0.5)),
            "abs_update_corrected": np.ones(4),
        }
        for name, values in expected.items():
            for column in diagnostics.SUMMARY_COLUMNS:
                np.testing.assert_allclose(
                    summary[name][column],
                    diagnostics.summary_statistics(values)[column],
                    rtol=1e-12, err_msg=f"{name} {column}",
                )
        comparison = diagnostics.moment_comparison(snapshot)
        self.assertEqual(list(comparison), list(diagnostics.COMPARISON_ROWS))
        self.assertAlmostEqual(comparison["median_v_clean_over_phi"], 13.0)
        self.assertAlmostEqual(comparison["median_v_private_over_phi"], 14.0)
        self.assertAlmostEqual(comparison["bias_over_phi"], 1.0)
        self.assertAlmostEqual(comparison["std_over_phi"], 0.0)
        # sqrt(2 * 0.001 * (1 + b^3) / (1.999 * (1 - b^3))), b = 0.999.
        self.assertAlmostEqual(comparison["noise_std_over_phi"],
                               0.81650, places=4)
        self.assertEqual(comparison["floored_fraction"], 0.0)
        self.assertAlmostEqual(comparison["median_log10_error_corrected"], 0.0)
        self.assertAlmostEqual(
            comparison["median_log10_error_private"],
            np.median(np.log10((v + 0.5) / v)),
        )
        self.assertAlmostEqual(comparison["cosine_corrected"], 1.0)
        self.assertAlmostEqual(comparison["norm_ratio_corrected"], 1.0)
        # Same signs, shrunk unevenly: cosine just below 1, norm below 1.
        self.assertLess(comparison["cosine_private"], 1.0)
        self.assertGreater(comparison["cosine_private"], 0.99)
        self.assertLess(comparison["norm_ratio_private"], 1.0)

    def test_markdown_and_histograms(self):
        snapshot = self._snapshot()
        table = diagnostics.summary_markdown(snapshot)
        self.assertIn("| v^p − Φ | 1 | 3.25 | 6.5 | 10.8 | 16 | 7.5 |", table)
        self.assertIn("| (mean v^p − mean v^c) / Φ (expected: 1) | 1 |", table)
        directory = tempfile.mkdtemp()
        markdown = diagnostics.render_report([snapshot], directory, "diag")
        self.assertIn("![Histograms at step 3](diag_step3.png)", markdown)
        with open(os.path.join(directory, "diag_step3.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class CleanGradientTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("ghost", "ghost", 1),
        ("vectorized", "vectorized", 1),
        ("ghost_accumulated", "ghost", 2),
    )
    def test_clean_gradient_is_the_clipped_mean(self, clipping, steps):
        base = _base(seed=1)
        x, y = _data(8, seed=2)
        clip, denominator = 0.3, 10  # B = 10: the public constant, not 8.
        expected = _reference_clean_gradient(base, x, y, clip, denominator)
        model = _private(base, seed=0, clipping=clipping)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=clip, noise_multiplier=1.0,
                batch_size=denominator,
                gradient_accumulation_steps=steps if steps > 1 else None,
            ),
            loss=_LOSS,
        )
        if steps > 1:
            # The first micro-batch completes no DP step: nothing recorded.
            model.fit(x[:4], y[:4], batch_size=4, verbose=0)
            self.assertEqual(int(model.optimizer.iterations), 0)
            for g in _numpy(model.clean_gradients):
                np.testing.assert_array_equal(g, 0.0)
            model.fit(x[4:], y[4:], batch_size=4, verbose=0)
        else:
            model.fit(x, y, batch_size=8, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 1)
        self.assertEqual(model.clipping_used, clipping)
        # Clipped (some norms exceed C = 0.3), noise-free, divided by B once.
        for got, want in zip(_numpy(model.clean_gradients), expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


class MomentsTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("dpadam", tf_dpadam.DPAdam, 1),
        ("corrected", tf_dpadam.DPAdamCorrected, 1),
        ("corrected_accumulated", tf_dpadam.DPAdamCorrected, 2),
    )
    def test_without_noise_clean_and_private_moments_coincide(self, cls,
                                                              steps):
        model = _private(_base(seed=3), seed=0)
        model.compile(
            optimizer=cls(
                l2_norm_clip=0.5, noise_multiplier=0.0, batch_size=8,
                learning_rate=0.05,
                gradient_accumulation_steps=steps if steps > 1 else None,
            ),
            loss=_LOSS,
        )
        callback = tf_dpadam.MomentDiagnostics(steps=(1, 6))
        x, y = _data(48, seed=4)
        model.fit(x, y, batch_size=8 // steps, epochs=1, shuffle=False,
                  callbacks=[callback], verbose=0)
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
            loss=_LOSS,
        )
        callback = tf_dpadam.MomentDiagnostics(steps=(5,))
        x, y = _data(80, d=40, classes=80, seed=7)
        model.fit(x, y, batch_size=batch, shuffle=False, callbacks=[callback],
                  verbose=0)
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
        optimizer = model.optimizer
        index = optimizer._get_variable_index(model.trainable_variables[0])
        m = keras.ops.convert_to_numpy(optimizer._momentums[index]).ravel()
        np.testing.assert_allclose(
            snapshot.m_private[:m.size], m / (1 - 0.9**5), rtol=1e-6
        )


class DefaultAndSerializationTest(absltest.TestCase):

    def _compiled(self, diagnostics_on, noise=1.0):
        make = _private if diagnostics_on else tf_dpadam.make_private
        model = make(_base(seed=8), seed=9)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=0.5, noise_multiplier=noise, batch_size=8
            ),
            loss=_LOSS,
        )
        return model

    def test_default_is_off_silent_and_adds_nothing(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = self._compiled(False)
        self.assertFalse(
            [w for w in caught if re.search(_NOT_PRIVATE, str(w.message))]
        )
        self.assertFalse(model.diagnostics)
        self.assertFalse(model.get_config()["diagnostics"])
        x, y = _data(24)
        model.fit(x, y, batch_size=8, verbose=0)
        self.assertIsNone(model.clean_gradients)
        with self.assertRaisesRegex(ValueError, "diagnostics=True"):
            model.fit(x, y, batch_size=8, verbose=0,
                      callbacks=[tf_dpadam.MomentDiagnostics()])

    def test_diagnostics_warn_and_leave_weights_and_trajectory_alone(self):
        with self.assertWarnsRegex(UserWarning, _NOT_PRIVATE):
            tf_dpadam.make_private(_base(), diagnostics=True)
        plain, diagnosed = self._compiled(False), self._compiled(True)
        # The clean gradients are not model weights (nor saved).
        self.assertEqual(len(plain.variables), len(diagnosed.variables))
        x, y = _data(24)
        for model in (plain, diagnosed):
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        # Same noise draws, same updates: the weights stay private.
        for a, b in zip(_numpy(plain.variables), _numpy(diagnosed.variables)):
            np.testing.assert_array_equal(a, b)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "diagnostics='yes'"):
            tf_dpadam.make_private(_base(), diagnostics="yes")
        for steps in ((0,), (2.5,), (True,)):
            with self.assertRaisesRegex(ValueError, "ints >= 1"):
                tf_dpadam.MomentDiagnostics(steps=steps)
        model = _private(_base())
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=_LOSS,
        )
        x, y = _data(8)
        with self.assertRaisesRegex(ValueError, "DPAdam or DPAdamCorrected"):
            model.fit(x, y, verbose=0,
                      callbacks=[tf_dpadam.MomentDiagnostics()])

    def test_save_load_round_trips_the_flag_but_not_the_clean_gradient(self):
        model = self._compiled(True)
        x, y = _data(16)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        with self.assertWarnsRegex(UserWarning, _NOT_PRIVATE):
            loaded = keras.models.load_model(path)
        self.assertTrue(loaded.diagnostics)
        saved, revived = model.get_config(), loaded.get_config()
        for config in (saved, revived):
            del config["base_model"]  # Keras' own (lists vs tuples).
        self.assertEqual(revived, saved)
        for g in _numpy(loaded.clean_gradients):
            np.testing.assert_array_equal(g, 0.0)
        # Clean moments must start with the optimizer's, at step 0.
        with self.assertRaisesRegex(ValueError, "at step 2"):
            loaded.fit(x, y, batch_size=8, verbose=0,
                       callbacks=[tf_dpadam.MomentDiagnostics()])
        loaded.fit(x, y, batch_size=8, verbose=0)
        self.assertGreater(
            max(np.abs(g).max() for g in _numpy(loaded.clean_gradients)), 0
        )
        # Off round-trips as off, and configs from before the flag load.
        config = tf_dpadam.make_private(_base()).get_config()
        self.assertFalse(
            tf_dpadam.PrivateModel.from_config(config).diagnostics
        )
        del config["diagnostics"]
        self.assertFalse(
            tf_dpadam.PrivateModel.from_config(config).diagnostics
        )


class ExampleReportTest(absltest.TestCase):
    """examples/diagnostics.py's report, on synthetic snapshots."""

    def test_write_report(self):
        from examples import common
        from examples import diagnostics as example

        rng = np.random.default_rng(0)
        phi, n = 4e-6, 5000
        snapshots = []
        for step in (10, 700):
            v_clean = phi * 1e-3 * rng.lognormal(size=n)
            m_clean = np.sqrt(v_clean) * rng.uniform(-1, 1, size=n)
            noise_std = diagnostics.second_moment_noise_std(phi, 0.999, step)
            snapshots.append(diagnostics.MomentSnapshot(
                step=step, phi=phi, gamma=0.04 * phi, noise_phi=phi,
                beta_1=0.9, beta_2=0.999, m_clean=m_clean, v_clean=v_clean,
                m_private=m_clean + 0.2 * np.sqrt(phi) * rng.normal(size=n),
                v_private=np.abs(v_clean + phi
                                 + noise_std * rng.normal(size=n)),
            ))
        config = common.TrainConfig(
            optimizer="dpadam_corrected", l2_norm_clip=1.0,
            noise_multiplier=0.52, batch_size=256, physical_batch_size=None,
            learning_rate=1e-3, epsilon=None, phi=None, beta_1=0.9,
            beta_2=0.999, momentum=0.0, target_epsilon=7.0, delta=1e-5,
            epochs=None, eval_every=100, model_dir=None, seed=0,
            jit_compile=False,
        )
        results = {"num_examples": 60000, "steps": 700, "capacity": 360,
                   "accumulation_steps": 1, "num_parameters": n,
                   "epsilon": 6.9, "test_accuracy": 0.8, "test_loss": 0.5,
                   "wall_seconds": 1.0}
        path = os.path.join(tempfile.mkdtemp(), "REPORT.md")
        example.write_report(path, "fashion_mnist", config, results,
                             snapshots, "python -m examples.diagnostics")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn("**Not differentially private.**", text)
        self.assertIn("**Is v^p dominated by Φ?** Yes.", text)
        self.assertIn("**Does v^p − Φ track v^c?** On average, yes", text)
        for step in (10, 700):
            self.assertIn(f"![Histograms at step {step}](REPORT_step{step}"
                          ".png)", text)
            self.assertTrue(os.path.exists(os.path.join(
                os.path.dirname(path), f"REPORT_step{step}.png"
            )))


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
    x, y = _data(8, seed=10)
    result = {}
    for name, scope in (("single", tf.distribute.get_strategy()),
                        ("replicated", strategy)):
        with scope.scope():
            model = _private(_base(seed=11), seed=12)
            model.compile(
                optimizer=tf_dpadam.DPAdamCorrected(
                    l2_norm_clip=0.3, noise_multiplier=1.0
                ),
                loss=_LOSS,
            )
        callback = tf_dpadam.MomentDiagnostics(steps=(1,))
        model.fit(x, y, batch_size=8, callbacks=[callback], verbose=0)
        result[name] = [g.tolist() for g in _numpy(model.clean_gradients)]
        result[name + "_m_clean"] = callback.snapshots[1].m_clean.tolist()
    print("RESULT " + json.dumps(result))


class DistributeTest(absltest.TestCase):

    def test_clean_gradient_under_mirrored_strategy(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [root] + [p for p in [env.get("PYTHONPATH")] if p]
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
