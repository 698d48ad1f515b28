"""research/diagnostics_report.py: the report on synthetic snapshots."""

import os
import platform
import tempfile

import numpy as np
from absl.testing import absltest

from research import common
from research import diagnostics_report
from tf_dpadam.tools import diagnostics

_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "testdata", "golden", "DIAGNOSTICS_synthetic.md")


def _snapshots(phi=4e-6, n=5000):
    """Clean second moments far below Phi, private ones Phi above them."""
    rng = np.random.default_rng(0)
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
    return snapshots


class ReportTest(absltest.TestCase):

    def test_write_report(self):
        config = common.TrainConfig(
            optimizer="dpadam_corrected", l2_norm_clip=1.0,
            noise_multiplier=0.52, batch_size=256, physical_batch_size=None,
            learning_rate=1e-3, epsilon=None, phi=None, beta_1=0.9,
            beta_2=0.999, momentum=0.0, target_epsilon=7.0, delta=1e-5,
            epochs=None, eval_every=100, model_dir=None, seed=0,
            jit_compile=False,
        )
        results = {"num_examples": 60000, "steps": 700, "capacity": 360,
                   "accumulation_steps": 1, "num_parameters": 5000,
                   "epsilon": 6.9, "test_accuracy": 0.8, "test_loss": 0.5,
                   "wall_seconds": 1.0}
        path = os.path.join(tempfile.mkdtemp(), "DIAG.md")
        diagnostics_report.write_report(path, "fashion_mnist", config,
                                        results, _snapshots(),
                                        "python -m research.diagnostics")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn("**Not differentially private.**", text)
        self.assertIn("**Is v^p dominated by Φ?** Yes.", text)
        self.assertIn("**Does v^p − Φ track v^c?** On average, yes", text)
        for step in (10, 700):
            self.assertIn(f"![Histograms at step {step}](DIAG_step{step}"
                          ".png)", text)
            self.assertTrue(os.path.exists(os.path.join(
                os.path.dirname(path), f"DIAG_step{step}.png")))
        # The golden file was written by the same code before it moved out
        # of research/diagnostics.py.
        machine = f"`{platform.platform()}`, {os.cpu_count()} CPUs;"
        with open(_GOLDEN, encoding="utf-8") as f:
            self.assertEqual(text.replace(machine, "`MACHINE`, N CPUs;"),
                             f.read())


if __name__ == "__main__":
    absltest.main()
