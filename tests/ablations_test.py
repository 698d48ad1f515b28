"""examples/ablations.py: the swept values and the judging helpers on
hand-computed cases, and the whole pipeline on tiny injected images."""

import json
import os
import re
import tempfile

import keras
import numpy as np
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized

from examples import ablations
from examples import reproduce
from examples import common
from examples import models
from examples.ablations import Arm

_PNG = b"\x89PNG\r\n\x1a\n"


def _tiny_images(num_train=64, num_test=32, size=8):
    """8x8 images whose brightness gives the class, as the binaries' arrays
    (float32 in [0, 1], shape (n, 8, 8, 1); int labels)."""
    rng = np.random.default_rng(0)
    arrays = []
    for n in (num_train, num_test):
        labels = rng.integers(0, 10, n)
        images = (labels[:, None, None] * 25
                  + rng.integers(0, 20, (n, size, size))) / 255.0
        arrays.append((images[..., None].astype(np.float32), labels))
    return tuple(arrays)


class SweptValuesTest(parameterized.TestCase):

    def test_true_phi_and_multiples(self):
        # The main setting: (0.52 * 1 / 256)^2 = 0.00203125^2.
        phi = ablations.true_phi(1.0, 0.52, 256)
        self.assertAlmostEqual(phi, 4.1259765625e-06, delta=1e-18)
        # C = 2, sigma = 1, B = 16: (2 / 16)^2 = 1 / 64.
        self.assertEqual(ablations.true_phi(2.0, 1.0, 16), 0.015625)
        values = ablations.phi_values(phi, (0.1, 1, 10))
        self.assertEqual([m for m, _ in values], [0.1, 1.0, 10.0])
        for (_, got), want in zip(values, (4.1259765625e-07,
                                           4.1259765625e-06,
                                           4.1259765625e-05)):
            self.assertAlmostEqual(got, want, delta=1e-18)
        with self.assertRaisesRegex(ValueError, "multiples > 0"):
            ablations.phi_values(phi, (0.0,))

    @parameterized.parameters(
        (0.99, 0.9),          # sqrt(0.01) = 0.1.
        (0.9999, 0.99),       # sqrt(1e-4) = 0.01.
        (0.999, 1 - 0.031622776601683794),  # sqrt(1e-3).
        (0.75, 0.5),          # sqrt(0.25) = 0.5.
    )
    def test_paired_beta_1(self, beta_2, beta_1):
        self.assertAlmostEqual(ablations.paired_beta_1(beta_2), beta_1,
                               places=12)

    @parameterized.parameters(0.0, 1.0, -0.5)
    def test_paired_beta_1_rejects(self, beta_2):
        with self.assertRaisesRegex(ValueError, "0 < beta_2 < 1"):
            ablations.paired_beta_1(beta_2)

    def test_make_ablations_shares_the_reference(self):
        phi = ablations.true_phi(1.0, 0.52, 256)
        sweeps = ablations.Sweeps()
        abl = ablations.make_ablations(phi, sweeps)
        self.assertEqual(list(abl), ["phi", "gamma", "beta", "lr"])
        reference = Arm("dpadam_corrected", 1e-3, None)
        # Phi': m = 1 is the reference; 0.1 and 10 keep gamma' = 0.04 Phi.
        arms = [p.arm for p in abl["phi"].points]
        self.assertEqual(arms[1], reference)
        self.assertEqual(arms[0].phi_multiple, 0.1)
        self.assertEqual(arms[2].phi_multiple, 10.0)
        self.assertAlmostEqual(arms[0].gamma, 1.650390625e-07, delta=1e-19)
        self.assertEqual(arms[0].gamma, arms[2].gamma)
        # gamma': five numbers at lr 1e-3 and the default (the reference).
        gammas = [(p.arm.gamma, p.reference) for p in abl["gamma"].points]
        self.assertEqual(gammas, [(1e-9, False), (1e-8, False),
                                  (1e-7, False), (1e-6, False),
                                  (1e-5, False), (None, True)])
        self.assertIn("1e-09 = 0.000242·Φ", abl["gamma"].points[0].label)
        # beta: 3 paired + the default per optimizer.
        betas = [(p.series, p.arm.beta_1, p.arm.beta_2, p.reference)
                 for p in abl["beta"].points]
        self.assertLen(betas, 8)
        self.assertEqual(betas[0][0], "DP-AdamBC")
        self.assertAlmostEqual(betas[0][1], 0.9, places=12)  # 1 - 0.1.
        self.assertEqual(betas[0][2], 0.99)
        self.assertAlmostEqual(betas[1][1], 0.968377223398, places=12)
        self.assertEqual(betas[3], ("DP-AdamBC", 0.9, 0.999, True))
        self.assertEqual(abl["beta"].points[3].arm, reference)
        adam = [p.arm for p in abl["beta"].points if p.series == "DP-Adam"]
        self.assertTrue(all((a.optimizer, a.learning_rate, a.gamma)
                            == ("dpadam", 1e-2, 1e-8) for a in adam))
        # lr: DP-AdamBC's 4 (1e-3 is the reference), DP-Adam's 3 (1e-2 is
        # the beta ablation's default run).
        lrs = [(p.series, p.x, p.reference) for p in abl["lr"].points]
        self.assertEqual(lrs, [
            ("DP-AdamBC", 3e-4, False), ("DP-AdamBC", 1e-3, True),
            ("DP-AdamBC", 3e-3, False), ("DP-AdamBC", 1e-2, False),
            ("DP-Adam", 3e-3, False), ("DP-Adam", 1e-2, True),
            ("DP-Adam", 3e-2, False)])
        self.assertEqual(abl["lr"].points[1].arm, reference)
        self.assertEqual(abl["lr"].points[5].arm, adam[-1])
        self.assertEqual(abl["lr"].points[0].arm,
                         Arm("dpadam_corrected", 3e-4, None))
        self.assertEqual(abl["lr"].points[6].arm, Arm("dpadam", 3e-2, 1e-8))
        # 3 + 5 + 7 + 5 distinct runs: the shared ones train once.
        self.assertLen(ablations.unique_arms(abl.values()), 20)
        # A fixed lr outside the sweep is added to it, as its default.
        abl = ablations.make_ablations(phi, ablations.Sweeps(
            lr_sweep_corrected=(1e-2,), lr_sweep_adam=(1e-2,)))
        self.assertEqual([(p.x, p.reference) for p in abl["lr"].points],
                         [(1e-3, True), (1e-2, False), (1e-2, True)])
        with self.assertRaisesRegex(ValueError, "learning rates > 0"):
            ablations.make_ablations(phi, ablations.Sweeps(
                lr_sweep_corrected=(0.0,)))

    def test_variant_names_and_plans(self):
        self.assertEqual(ablations.variant_name(
            Arm("dpadam_corrected", 1e-3, None)), "default")
        self.assertEqual(ablations.variant_name(
            Arm("dpadam_corrected", 1e-3, 1e-7, phi_multiple=10.0)),
            "phi10x")
        self.assertEqual(ablations.variant_name(
            Arm("dpadam", 1e-2, 1e-8, beta_1=0.99, beta_2=0.9999)),
            "b1_0.99_b2_0.9999")
        base = reproduce.base_config("fashion_mnist")
        plan, setting = ablations.arm_plan(
            Arm("dpadam_corrected", 1e-3, 2e-7, phi_multiple=0.1,
                beta_1=0.9, beta_2=0.99),
            base=base, seed=3, runs_dir="/runs", data={})
        self.assertEqual(plan.runs_dir, "/runs/phi0.1x_b1_0.9_b2_0.99")
        config = reproduce.run_config(plan.base, setting, 3, "/m")
        self.assertAlmostEqual(config.phi, 4.1259765625e-07, delta=1e-18)
        self.assertEqual((config.optimizer, config.learning_rate,
                          config.epsilon, config.beta_1, config.beta_2,
                          config.seed),
                         ("dpadam_corrected", 1e-3, 2e-7, 0.9, 0.99, 3))


class JudgingTest(absltest.TestCase):

    def test_noise_threshold(self):
        # std of (0.80, 0.82) = 0.01 * sqrt(2) -> 1.414 points;
        # 2 * sqrt(2) * that = 4 points.
        points, text = ablations.noise_threshold([0.80, 0.82, None])
        self.assertAlmostEqual(points, 4.0)
        self.assertIn("81.00 ± 1.41%", text)
        points, text = ablations.noise_threshold([0.8])
        self.assertEqual(points, ablations.FALLBACK_NOISE_POINTS)
        self.assertIn("assumption", text)

    def test_describe_phi(self):
        text = ablations.describe_phi(
            [(0.1, 0.79), (1.0, 0.80), (10.0, 0.60)], noise_points=1.5)
        self.assertIn("true Φ scores 80.00%", text)
        self.assertIn("0.1·Φ scores 79.00% (-1.00 points, within noise)",
                      text)
        self.assertIn("10·Φ scores 60.00% (-20.00 points)", text)
        self.assertIn("The true Φ beats Φ' = 10·Φ by more", text)
        self.assertNotIn("0.1·Φ by more", text)
        self.assertIn("true second moment is below 9·Φ", text)
        self.assertIn("leaves 0.9·Φ of noise variance", text)
        flat = ablations.describe_phi([(0.1, 0.80), (1.0, 0.80)], 1.0)
        self.assertIn("no difference beyond noise", flat)
        self.assertIn("Not enough", ablations.describe_phi(
            [(0.1, 0.8), (1.0, None)], 1.0))

    def test_describe_gamma(self):
        phi = 4e-6  # 0.04 Phi = 1.6e-7, between 1e-7 and 1e-6.
        text = ablations.describe_gamma(
            [(1e-9, 0.18), (1e-7, 0.805), (1e-6, 0.81), (None, 0.805)],
            phi, noise_points=1.0)
        self.assertIn("from 0.00025·Φ to 0.25·Φ", text)
        self.assertIn("best swept value is γ' = 1e-06 (0.25·Φ, 81.00%)",
                      text)
        self.assertIn("lands between γ' = 1e-07 and 1e-06", text)
        self.assertIn("80.50% (-0.50 points, within noise", text)
        self.assertIn("γ' = 1e-09 (0.00025·Φ) ends below 50%. With γ' ≪ Φ",
                      text)
        self.assertIn("Within noise of the best: γ' = 1e-07, 1e-06.", text)

    def test_describe_beta(self):
        text = ablations.describe_beta(
            {"DP-AdamBC": [(0.99, 0.78), (0.999, 0.81), ("default", 0.80)],
             "DP-Adam": [(0.99, 0.800), (0.999, 0.805), ("default", None)]},
            noise_points=1.0)
        self.assertIn("DP-AdamBC: paired β₂ = 0.99 → 78.00%, 0.999 → "
                      "81.00%; spread 3.00 points, best β₂ = 0.999; Keras' "
                      "default β = (0.9, 0.999) scores 80.00% (-1.00 points"
                      " from the best paired setting).", text)
        self.assertIn("DP-Adam: paired β₂ = 0.99 → 80.00%, 0.999 → 80.50%; "
                      "spread 0.50 points (within noise).", text)

    def test_describe_lr(self):
        results = {
            "DP-AdamBC": [(3e-4, 0.70, False), (1e-3, 0.744, True),
                          (3e-3, 0.78, False), (1e-2, 0.60, False)],
            "DP-Adam": [(3e-3, 0.77, False), (1e-2, 0.7915, True),
                        (3e-2, None, False)],
        }
        self.assertEqual(ablations.best_learning_rates(results),
                         {"DP-AdamBC": (3e-3, 0.78),
                          "DP-Adam": (1e-2, 0.7915)})
        text = ablations.describe_lr(results, noise_points=1.0)
        self.assertIn("DP-AdamBC: lr 0.0003 → 70.00%, 0.001 → 74.40% (fixed "
                      "elsewhere), 0.003 → 78.00%, 0.01 → 60.00%; best lr "
                      "0.003; the fixed lr 0.001 is -3.60 points from it.",
                      text)
        # Best at the edge of what ran; the fixed lr is the best.
        self.assertIn("DP-Adam: lr 0.003 → 77.00%, 0.01 → 79.15% (fixed "
                      "elsewhere); best lr 0.01 (at the edge of the sweep).",
                      text)
        self.assertIn("At their best learning rates here, DP-AdamBC scores "
                      "78.00% and DP-Adam 79.15% (DP-AdamBC -1.15 points).",
                      text)
        self.assertIn("within noise", ablations.describe_lr(
            {"DP-AdamBC": [(1e-3, 0.75, True), (3e-3, 0.755, False)]}, 1.0))
        self.assertIn("Not enough", ablations.describe_lr(
            {"DP-AdamBC": [(1e-3, None, True)]}, 1.0))

    def test_peak_then_drop(self):
        # Peak 0.68 at step 40, final 0.42: 26 points below, beyond 1.
        self.assertEqual(ablations.peak_then_drop(
            [(40, 0.68), (80, 0.63), (120, 0.42)], 1.0), (40, 0.68))
        # 0.5 points below the peak: noise.
        self.assertIsNone(ablations.peak_then_drop(
            [(40, 0.70), (80, 0.755), (120, 0.75)], 1.0))
        self.assertIsNone(ablations.peak_then_drop([], 1.0))

    def test_favours_larger_steps(self):
        phi = 5e-6  # Default gamma' = 2e-7.
        gammas = [(1e-8, 0.755), (1e-6, 0.71), (None, 0.74)]
        # Phi' = 10 Phi +1.5 points and gamma' = 1e-8 +1.5 points: both.
        self.assertTrue(ablations.favours_larger_steps(
            [(0.1, 0.67), (1.0, 0.74), (10.0, 0.755)], gammas, phi, 1.0))
        # Phi' = 10 Phi within noise: not both.
        self.assertFalse(ablations.favours_larger_steps(
            [(1.0, 0.74), (10.0, 0.745)], gammas, phi, 1.0))
        # gamma' = 1e-6 is above the default: does not count.
        self.assertFalse(ablations.favours_larger_steps(
            [(1.0, 0.74), (10.0, 0.76)], [(1e-6, 0.76), (None, 0.74)], phi,
            1.0))
        self.assertFalse(ablations.favours_larger_steps([], gammas, phi, 1.0))

    def test_describe_summary(self):
        text = ablations.describe_summary(
            corrected=0.744, adam=0.7915, larger_steps=True,
            drops=[("γ' = 1e-09", 40, 0.68, 0.42)], noise_points=0.65,
            lr_corrected=1e-3, lr_adam=1e-2, steps=235, full_steps=719)
        self.assertIn("DP-AdamBC (lr 0.001, all defaults) scores 74.40% and "
                      "DP-Adam (lr 0.01, β = (0.9, 0.999)) 79.15%: "
                      "DP-AdamBC trails by 4.75 points.", text)
        self.assertIn("(719 steps) and were not re-tuned for 235 steps",
                      text)
        self.assertIn("lr 0.001 is on the small side", text)
        self.assertIn("γ' = 1e-09 peaked at 68.00% (step 40) and ended at "
                      "42.00%", text)
        text = ablations.describe_summary(
            corrected=0.80, adam=0.799, larger_steps=False, drops=[],
            noise_points=0.65, lr_corrected=1e-3, lr_adam=1e-2, steps=None,
            full_steps=719)
        self.assertIn("a gap of +0.10 points, within noise.", text)
        self.assertNotIn("small side", text)
        self.assertNotIn("peaked", text)
        # With the lr sweep: what it found replaces the caveat.
        summary = dict(corrected=0.744, adam=0.7915, larger_steps=True,
                       drops=[], noise_points=0.65, lr_corrected=1e-3,
                       lr_adam=1e-2, steps=235, full_steps=719)
        text = ablations.describe_summary(
            tuned={"DP-AdamBC": (3e-3, 0.78), "DP-Adam": (1e-2, 0.79)},
            **summary)
        self.assertIn("the lr sweep re-tunes them for 235 steps: DP-AdamBC "
                      "is best at lr 0.003 (78.00%), DP-Adam is best at lr "
                      "0.01 (79.00%).", text)
        self.assertNotIn("not re-tuned", text)
        self.assertIn("the lr sweep agrees that lr 0.001 is on the small "
                      "side at this scale (best: 0.003)", text)
        text = ablations.describe_summary(
            tuned={"DP-AdamBC": (1e-3, 0.744)}, **summary)
        self.assertIn("finds no larger learning rate better than 0.001", text)

    def test_scale_sentence(self):
        same = dict(full_examples=60000, full_noise=0.52, full_batch=256,
                    full_steps=719)
        self.assertIn("comparable", ablations.scale_sentence(
            num_examples=60000, noise_multiplier=0.52, batch_size=256,
            steps=719, **same))
        text = ablations.scale_sentence(
            num_examples=20000, noise_multiplier=0.59, batch_size=256,
            steps=235, **same)
        self.assertIn("**reduced**", text)
        self.assertIn("N = 20000", text)
        self.assertIn("σ = 0.59", text)
        self.assertIn("235 steps (σ recalibrated", text)


class PipelineTest(absltest.TestCase):

    def test_ablations_on_tiny_fashion_mnist(self):
        work = tempfile.mkdtemp()
        runs_dir = os.path.join(work, "runs")
        output_dir = os.path.join(work, "docs")
        # 64 examples, B = 16, half an epoch: 2 steps, one evaluation.
        base = reproduce.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, epochs=0.5, eval_every=2)
        phi = 1.0 / 256  # (sigma C / B)^2 = (1 / 16)^2.
        sweeps = ablations.Sweeps(phi_multiples=(1.0, 10.0),
                                  gammas=(1e-8, None), beta_2s=(0.99,),
                                  lr_sweep_corrected=(1e-3, 1e-2),
                                  lr_sweep_adam=(1e-2,))
        data = reproduce.data_spec("fashion_mnist")
        train, test = _tiny_images()
        trained = []

        def train_fn(config):  # examples.train_image.run on injected data.
            trained.append(config)
            return common.fit_private(
                lambda: models.make_cnn((8, 8, 1), 10), train, test, config,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))

        machine = {"platform": "test-machine", "cpu_count": 2}
        kwargs = dict(base=base, sweeps=sweeps, seed=0, spread_seeds=(),
                      runs_dir=runs_dir, data=data, output_dir=output_dir,
                      machine=machine)
        path = ablations.run_ablations(
            ablations.ABLATIONS, train_fn=train_fn,
            command="python -m examples.ablations", **kwargs)
        # phi: 2 (with the reference); gamma: + 1e-8; beta: DP-AdamBC
        # paired, DP-Adam paired and DP-Adam default; lr: + DP-AdamBC at
        # 1e-2 (its 1e-3 and DP-Adam's 1e-2 are runs above).
        self.assertLen(trained, 7)
        by_phi = {c.phi: c for c in trained}
        # Phi' = 10 Phi = 0.0390625 with gamma' = 0.04 Phi = 1.5625e-4;
        # every other run subtracts the true Phi (phi=None).
        self.assertEqual(sorted(by_phi, key=lambda p: p or 0.0),
                         [None, 0.0390625])
        self.assertEqual(by_phi[0.0390625].epsilon, 1.5625e-4)
        paired = [c for c in trained if c.beta_2 == 0.99]
        self.assertEqual(sorted((c.optimizer, round(c.beta_1, 12),
                                 c.learning_rate)
                                for c in paired),
                         [("dpadam", 0.9, 1e-2),
                          ("dpadam_corrected", 0.9, 1e-3)])
        # Each run wrote its metrics: 2 steps, evaluated at step 2.
        for config in trained:
            with open(os.path.join(config.model_dir, "metrics.json")) as f:
                metrics = json.load(f)
            self.assertEqual(metrics["steps"], 2)
            self.assertEqual([r["step"] for r in metrics["history"]], [2])

        self.assertEqual(path, os.path.join(
            output_dir, "ABLATIONS_fashion_mnist.md"))
        for name in ("phi", "gamma", "beta", "lr"):
            with open(os.path.join(
                    output_dir, f"ABLATIONS_fashion_mnist_{name}.png"),
                    "rb") as f:
                self.assertEqual(f.read(8), _PNG)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        abl = ablations.make_ablations(phi, sweeps)
        records = ablations.collect(ablations.unique_arms(abl.values()),
                                    (0,), base=base, runs_dir=runs_dir,
                                    data=data)
        self.assertLen(records, 7)
        # Every setting is a row with its run's accuracy.
        for ablation in abl.values():
            self.assertIn(f"## {ablation.title}", text)
            self.assertIn(f"ABLATIONS_fashion_mnist_{ablation.name}.png",
                          text)
            for point in ablation.points:
                accuracy = records[(point.arm, 0)].accuracy
                self.assertRegex(
                    text, rf"\| {re.escape(point.label)} \| [^\n]* \| "
                          rf"{100 * accuracy:.2f} \| \d\.\d{{3}} \| 2 \| ")
        for expected in (
                "Φ' = 1·Φ = 0.00391", "Φ' = 10·Φ = 0.0391",
                "γ' = 1e-08 = 2.56e-06·Φ",
                "γ' = 0.04·Φ = 0.000156 (default)",
                "DP-AdamBC, β₂ = 0.99, β₁ = 0.9",
                "DP-Adam, β = (0.9, 0.999) (default, unpaired)",
                "DP-AdamBC, lr 0.01", "DP-AdamBC, lr 0.001 (default)",
                "At their best learning rates here",
                "the lr sweep re-tunes them for 2 steps",
                "`python -m examples.ablations`", "test-machine",
                "**reduced**", "no ε target", "assumption", "## Summary"):
            self.assertIn(expected, text)

        # Finished runs are read back, never retrained.
        def refuse(config):
            raise AssertionError(f"Retrained {config}.")

        ablations.run_ablations(ablations.ABLATIONS, train_fn=refuse,
                                command="again", **kwargs)
        # Other data in the same folders is refused before any training.
        kwargs["data"] = reproduce.data_spec("fashion_mnist",
                                             max_examples=32)
        with self.assertRaisesRegex(ValueError, "other data"):
            ablations.run_ablations(("phi",), train_fn=refuse,
                                    command="x", **kwargs)
        with self.assertRaisesRegex(ValueError, "Unknown ablation"):
            ablations.run_ablations(("nope",), train_fn=refuse,
                                    command="x", **kwargs)

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                ablations.main(["ablations", "stray"])


if __name__ == "__main__":
    absltest.main()
