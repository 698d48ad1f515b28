"""research/ablations.py: the binary's pipeline (which runs train, which are
read back or refused) on a fake training; the report itself is tested on
recorded runs in ablations_report_test.py."""

import os
import tempfile

from absl.testing import absltest
from absl.testing import flagsaver

from research import ablation_sweeps
from research import ablations
from research import common
from research import experiments

from research.tests import research_helpers


class PipelineTest(absltest.TestCase):

    def test_ablations_train_each_distinct_run_once(self):
        work = tempfile.mkdtemp()
        base = common.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, epochs=1.0, eval_every=2)
        sweeps = ablation_sweeps.Sweeps(
            phi_multiples=(1.0, 10.0), gammas=(1e-8, None), beta_2s=(0.99,),
            lr_sweep_corrected=(1e-3, 1e-2), lr_sweep_adam=(1e-2,))
        trained = []
        kwargs = dict(base=base, sweeps=sweeps, seed=0, spread_seeds=(1,),
                      runs_dir=os.path.join(work, "runs"),
                      data=experiments.data_spec("fashion_mnist"),
                      output_dir=os.path.join(work, "docs"),
                      machine={"platform": "test-machine", "cpu_count": 2})
        path = ablations.run_ablations(
            ablation_sweeps.ABLATIONS,
            train_fn=research_helpers.fake_train_fn(lambda c: 0.8, trained),
            command="python -m research.ablations", **kwargs)
        # phi: 2 (with the reference); gamma: + 1e-8; beta: DP-AdamBC
        # paired, DP-Adam paired and DP-Adam default; lr: + DP-AdamBC at
        # 1e-2 (its 1e-3 and DP-Adam's 1e-2 are runs above); then seed 1
        # of the reference.
        self.assertLen(trained, 8)
        self.assertEqual([c.seed for c in trained], [0] * 7 + [1])
        by_phi = {c.phi: c for c in trained}
        # Phi' = 10 Phi = 0.0390625 with gamma' = 0.04 Phi = 1.5625e-4;
        # every other run subtracts the true Phi (phi=None).
        self.assertEqual(sorted(by_phi, key=lambda p: p or 0.0),
                         [None, 0.0390625])
        self.assertEqual(by_phi[0.0390625].epsilon, 1.5625e-4)
        paired = [c for c in trained if c.beta_2 == 0.99]
        self.assertEqual(sorted((c.optimizer, round(c.beta_1, 12),
                                 c.learning_rate) for c in paired),
                         [("dpadam", 0.9, 1e-2),
                          ("dpadam_corrected", 0.9, 1e-3)])
        self.assertEqual(path, os.path.join(work, "docs",
                                            "ABLATIONS_fashion_mnist.md"))
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn("| 1 | 80.00 | 4.870 | 4 |", text)  # The seed spread.

        # Finished runs are read back, never retrained.
        def refuse(config):
            raise AssertionError(f"Retrained {config}.")

        ablations.run_ablations(ablation_sweeps.ABLATIONS, train_fn=refuse,
                                command="again", **kwargs)
        # Other data in the same folders is refused before any training.
        kwargs["data"] = experiments.data_spec("fashion_mnist",
                                               max_examples=32)
        with self.assertRaisesRegex(ValueError, "other data"):
            ablations.run_ablations(("phi",), train_fn=refuse,
                                    command="x", **kwargs)
        with self.assertRaisesRegex(ValueError, "Unknown ablation"):
            ablations.run_ablations(("nope",), train_fn=refuse,
                                    command="x", **kwargs)

    def test_notrain_only_writes_the_report(self):
        work = tempfile.mkdtemp()
        path = ablations.run_ablations(
            ("phi",), base=common.base_config("fashion_mnist"),
            sweeps=ablation_sweeps.Sweeps(), seed=0, spread_seeds=(),
            runs_dir=os.path.join(work, "runs"), data={},
            train_fn=None, output_dir=work, command="x", machine={},
            train=False)
        self.assertTrue(os.path.exists(path))
        self.assertFalse(os.path.exists(os.path.join(work, "runs")))

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                ablations.main(["ablations", "stray"])


if __name__ == "__main__":
    absltest.main()
