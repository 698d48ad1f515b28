"""research/ablations_report.py: the ablations report rendered from recorded
runs (tests/testdata), and its scale sentence."""

import os
import tempfile

from absl.testing import absltest

from research import ablation_sweeps
from research import ablations_report
from research import common
from research import experiments

from research.tests import research_helpers

_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "testdata", "golden")
# The machine of the golden report.
_MACHINE = {"platform": "Linux-recorded", "cpu_count": 2, "python": "3.11",
            "tensorflow": "2.21.0", "keras": "3.15.0",
            "processor": "x86_64"}


def recorded_ablations(runs_dir):
    """The write_report arguments of the recorded runs in
    tests/testdata/runs_ablations: 64 images, B = 16, 2 steps, seed 0."""
    base = common.base_config(
        "fashion_mnist", batch_size=16, noise_multiplier=1.0,
        target_epsilon=None, epochs=0.5, eval_every=2)
    sweeps = ablation_sweeps.Sweeps(
        phi_multiples=(1.0, 10.0), gammas=(1e-8, None), beta_2s=(0.99,),
        lr_sweep_corrected=(1e-3, 1e-2), lr_sweep_adam=(1e-2,))
    phi = ablation_sweeps.true_phi(1.0, 1.0, 16)
    return dict(ablations=ablation_sweeps.make_ablations(phi, sweeps),
                base=base, sweeps=sweeps, seed=0, runs_dir=runs_dir,
                data=experiments.data_spec("fashion_mnist"))


class RecordedRunsTest(absltest.TestCase):

    def test_report_of_the_recorded_runs_is_unchanged(self):
        # tests/testdata/golden was rendered from the same runs before the
        # report code moved out of research/ablations.py (seed 1 of the
        # reference was never run: "not run").
        runs_dir = research_helpers.copy_testdata("runs_ablations")
        output_dir = tempfile.mkdtemp()
        path = ablations_report.write_report(
            spread_seeds=(1,), output_dir=output_dir,
            command="python -m research.ablations --notrain",
            machine=_MACHINE, **recorded_ablations(runs_dir))
        with open(path, encoding="utf-8") as f:
            text = f.read().replace(runs_dir, "runs/ablations")
        with open(os.path.join(_GOLDEN, "ABLATIONS_fashion_mnist.md"),
                  encoding="utf-8") as f:
            self.assertEqual(text, f.read())
        for name in ("phi", "gamma", "beta", "lr"):
            with open(os.path.join(
                    output_dir, f"ABLATIONS_fashion_mnist_{name}.png"),
                    "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_ablations_without_runs_have_no_plot(self):
        output_dir = tempfile.mkdtemp()
        path = ablations_report.write_report(
            spread_seeds=(), output_dir=output_dir, command="x",
            machine=_MACHINE,
            **recorded_ablations(os.path.join(output_dir, "no_runs")))
        self.assertEqual(os.listdir(output_dir),
                         ["ABLATIONS_fashion_mnist.md"])
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn("Not enough finished runs for the Φ' ablation yet.",
                      text)
        self.assertIn("not run", text)


class ScaleTest(absltest.TestCase):

    def test_scale_sentence(self):
        same = dict(full_examples=60000, full_noise=0.52, full_batch=256,
                    full_steps=719)
        self.assertIn("comparable", ablations_report.scale_sentence(
            num_examples=60000, noise_multiplier=0.52, batch_size=256,
            steps=719, **same))
        text = ablations_report.scale_sentence(
            num_examples=20000, noise_multiplier=0.59, batch_size=256,
            steps=235, **same)
        self.assertIn("**reduced**", text)
        self.assertIn("N = 20000", text)
        self.assertIn("σ = 0.59", text)
        self.assertIn("235 steps (σ recalibrated", text)


if __name__ == "__main__":
    absltest.main()
