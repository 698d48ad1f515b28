"""research/ablation_findings.py: the noise threshold and the paragraphs of
the ablations report, on hand-computed cases."""

from absl.testing import absltest

from research import ablation_findings


class JudgingTest(absltest.TestCase):

    def test_noise_threshold(self):
        # std of (0.80, 0.82) = 0.01 * sqrt(2) -> 1.414 points;
        # 2 * sqrt(2) * that = 4 points.
        points, text = ablation_findings.noise_threshold([0.80, 0.82, None])
        self.assertAlmostEqual(points, 4.0)
        self.assertIn("81.00 ± 1.41%", text)
        points, text = ablation_findings.noise_threshold([0.8])
        self.assertEqual(points, ablation_findings.FALLBACK_NOISE_POINTS)
        self.assertIn("assumption", text)

    def test_describe_phi(self):
        text = ablation_findings.describe_phi(
            [(0.1, 0.79), (1.0, 0.80), (10.0, 0.60)], noise_points=1.5)
        self.assertIn("true Φ scores 80.00%", text)
        self.assertIn("0.1·Φ scores 79.00% (-1.00 points, within noise)",
                      text)
        self.assertIn("10·Φ scores 60.00% (-20.00 points)", text)
        self.assertIn("The true Φ beats Φ' = 10·Φ by more", text)
        self.assertNotIn("0.1·Φ by more", text)
        self.assertIn("true second moment is below 9·Φ", text)
        self.assertIn("leaves 0.9·Φ of noise variance", text)
        flat = ablation_findings.describe_phi([(0.1, 0.80), (1.0, 0.80)], 1.0)
        self.assertIn("no difference beyond noise", flat)
        self.assertIn("Not enough", ablation_findings.describe_phi(
            [(0.1, 0.8), (1.0, None)], 1.0))

    def test_describe_gamma(self):
        phi = 4e-6  # 0.04 Phi = 1.6e-7, between 1e-7 and 1e-6.
        text = ablation_findings.describe_gamma(
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
        text = ablation_findings.describe_beta(
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
        self.assertEqual(ablation_findings.best_learning_rates(results),
                         {"DP-AdamBC": (3e-3, 0.78),
                          "DP-Adam": (1e-2, 0.7915)})
        text = ablation_findings.describe_lr(results, noise_points=1.0)
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
        self.assertIn("within noise", ablation_findings.describe_lr(
            {"DP-AdamBC": [(1e-3, 0.75, True), (3e-3, 0.755, False)]}, 1.0))
        self.assertIn("Not enough", ablation_findings.describe_lr(
            {"DP-AdamBC": [(1e-3, None, True)]}, 1.0))

    def test_peak_then_drop(self):
        # Peak 0.68 at step 40, final 0.42: 26 points below, beyond 1.
        self.assertEqual(ablation_findings.peak_then_drop(
            [(40, 0.68), (80, 0.63), (120, 0.42)], 1.0), (40, 0.68))
        # 0.5 points below the peak: noise.
        self.assertIsNone(ablation_findings.peak_then_drop(
            [(40, 0.70), (80, 0.755), (120, 0.75)], 1.0))
        self.assertIsNone(ablation_findings.peak_then_drop([], 1.0))

    def test_favours_larger_steps(self):
        phi = 5e-6  # Default gamma' = 2e-7.
        gammas = [(1e-8, 0.755), (1e-6, 0.71), (None, 0.74)]
        # Phi' = 10 Phi +1.5 points and gamma' = 1e-8 +1.5 points: both.
        self.assertTrue(ablation_findings.favours_larger_steps(
            [(0.1, 0.67), (1.0, 0.74), (10.0, 0.755)], gammas, phi, 1.0))
        # Phi' = 10 Phi within noise: not both.
        self.assertFalse(ablation_findings.favours_larger_steps(
            [(1.0, 0.74), (10.0, 0.745)], gammas, phi, 1.0))
        # gamma' = 1e-6 is above the default: does not count.
        self.assertFalse(ablation_findings.favours_larger_steps(
            [(1.0, 0.74), (10.0, 0.76)], [(1e-6, 0.76), (None, 0.74)], phi,
            1.0))
        self.assertFalse(ablation_findings.favours_larger_steps([], gammas, phi, 1.0))

    def test_describe_summary(self):
        text = ablation_findings.describe_summary(
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
        text = ablation_findings.describe_summary(
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
        text = ablation_findings.describe_summary(
            tuned={"DP-AdamBC": (3e-3, 0.78), "DP-Adam": (1e-2, 0.79)},
            **summary)
        self.assertIn("the lr sweep re-tunes them for 235 steps: DP-AdamBC "
                      "is best at lr 0.003 (78.00%), DP-Adam is best at lr "
                      "0.01 (79.00%).", text)
        self.assertNotIn("not re-tuned", text)
        self.assertIn("the lr sweep agrees that lr 0.001 is on the small "
                      "side at this scale (best: 0.003)", text)
        text = ablation_findings.describe_summary(
            tuned={"DP-AdamBC": (1e-3, 0.744)}, **summary)
        self.assertIn("finds no larger learning rate better than 0.001", text)


if __name__ == "__main__":
    absltest.main()
