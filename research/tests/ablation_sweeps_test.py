"""research/ablation_sweeps.py: the swept values, the arms of each ablation
and where their runs live, by hand and on recorded runs (tests/testdata)."""

from absl.testing import absltest
from absl.testing import parameterized

from research import ablation_sweeps
from research import common
from research import experiments
from research.ablation_sweeps import Arm

from research.tests import research_helpers


class SweptValuesTest(parameterized.TestCase):

    def test_true_phi_and_multiples(self):
        # The main setting: (0.52 * 1 / 256)^2 = 0.00203125^2.
        phi = ablation_sweeps.true_phi(1.0, 0.52, 256)
        self.assertAlmostEqual(phi, 4.1259765625e-06, delta=1e-18)
        # C = 2, sigma = 1, B = 16: (2 / 16)^2 = 1 / 64.
        self.assertEqual(ablation_sweeps.true_phi(2.0, 1.0, 16), 0.015625)
        values = ablation_sweeps.phi_values(phi, (0.1, 1, 10))
        self.assertEqual([m for m, _ in values], [0.1, 1.0, 10.0])
        for (_, got), want in zip(values, (4.1259765625e-07,
                                           4.1259765625e-06,
                                           4.1259765625e-05)):
            self.assertAlmostEqual(got, want, delta=1e-18)
        with self.assertRaisesRegex(ValueError, "multiples > 0"):
            ablation_sweeps.phi_values(phi, (0.0,))

    @parameterized.parameters(
        (0.99, 0.9),          # sqrt(0.01) = 0.1.
        (0.9999, 0.99),       # sqrt(1e-4) = 0.01.
        (0.999, 1 - 0.031622776601683794),  # sqrt(1e-3).
        (0.75, 0.5),          # sqrt(0.25) = 0.5.
    )
    def test_paired_beta_1(self, beta_2, beta_1):
        self.assertAlmostEqual(ablation_sweeps.paired_beta_1(beta_2), beta_1,
                               places=12)

    @parameterized.parameters(0.0, 1.0, -0.5)
    def test_paired_beta_1_rejects(self, beta_2):
        with self.assertRaisesRegex(ValueError, "0 < beta_2 < 1"):
            ablation_sweeps.paired_beta_1(beta_2)

    def test_make_ablations_shares_the_reference(self):
        phi = ablation_sweeps.true_phi(1.0, 0.52, 256)
        sweeps = ablation_sweeps.Sweeps()
        abl = ablation_sweeps.make_ablations(phi, sweeps)
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
        self.assertLen(ablation_sweeps.unique_arms(abl.values()), 20)
        # A fixed lr outside the sweep is added to it, as its default.
        abl = ablation_sweeps.make_ablations(phi, ablation_sweeps.Sweeps(
            lr_sweep_corrected=(1e-2,), lr_sweep_adam=(1e-2,)))
        self.assertEqual([(p.x, p.reference) for p in abl["lr"].points],
                         [(1e-3, True), (1e-2, False), (1e-2, True)])
        with self.assertRaisesRegex(ValueError, "learning rates > 0"):
            ablation_sweeps.make_ablations(phi, ablation_sweeps.Sweeps(
                lr_sweep_corrected=(0.0,)))

    def test_variant_names_and_plans(self):
        self.assertEqual(ablation_sweeps.variant_name(
            Arm("dpadam_corrected", 1e-3, None)), "default")
        self.assertEqual(ablation_sweeps.variant_name(
            Arm("dpadam_corrected", 1e-3, 1e-7, phi_multiple=10.0)),
            "phi10x")
        self.assertEqual(ablation_sweeps.variant_name(
            Arm("dpadam", 1e-2, 1e-8, beta_1=0.99, beta_2=0.9999)),
            "b1_0.99_b2_0.9999")
        base = common.base_config("fashion_mnist")
        config = ablation_sweeps.arm_config(
            Arm("dpadam_corrected", 1e-3, 2e-7, phi_multiple=0.1,
                beta_1=0.9, beta_2=0.99),
            base=base, seed=3, runs_dir="/runs")
        self.assertEqual(config.model_dir,
                         "/runs/phi0.1x_b1_0.9_b2_0.99/"
                         "dpadam_corrected_lr0.001_g2e-07_seed3")
        self.assertAlmostEqual(config.phi, 4.1259765625e-07, delta=1e-18)
        self.assertEqual((config.optimizer, config.learning_rate,
                          config.epsilon, config.beta_1, config.beta_2,
                          config.seed, config.noise_seed),
                         ("dpadam_corrected", 1e-3, 2e-7, 0.9, 0.99, 3, 3))

    def test_collect_the_recorded_runs(self):
        base = common.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, epochs=0.5, eval_every=2)
        sweeps = ablation_sweeps.Sweeps(
            phi_multiples=(1.0, 10.0), gammas=(1e-8, None), beta_2s=(0.99,),
            lr_sweep_corrected=(1e-3, 1e-2), lr_sweep_adam=(1e-2,))
        ablations = ablation_sweeps.make_ablations(1.0 / 256, sweeps)
        arms = ablation_sweeps.unique_arms(ablations.values())
        self.assertLen(arms, 7)
        records = ablation_sweeps.collect(
            arms, (0, 1), base=base, runs_dir=research_helpers.copy_testdata("runs_ablations"),
            data=experiments.data_spec("fashion_mnist"))
        # Every arm at seed 0 (seed 1 was not run).
        self.assertEqual(set(records), {(arm, 0) for arm in arms})
        self.assertTrue(all(r.steps == 2 for r in records.values()))


if __name__ == "__main__":
    absltest.main()
