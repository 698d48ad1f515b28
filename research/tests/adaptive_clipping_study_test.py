"""The adaptive clipping study's bookkeeping: its report and its resume."""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

from research import adaptive_clipping_study as study

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def result(seed, clip, adaptive, accuracy):
    return dict(seed=seed, initial_clip=clip, adaptive=adaptive,
                accuracy=accuracy, epsilon=6.9995, steps=719,
                final_clip=0.13, clips=[[50, 0.02]], wall_s=1.0)


class ReportTest(absltest.TestCase):

    def test_mean_and_sample_std_per_setting(self):
        table = study.report([result(0, 0.01, True, 0.80),
                              result(1, 0.01, True, 0.82),
                              result(0, 1.0, False, 0.81)])
        lines = table.splitlines()
        self.assertLen(lines, 4)
        self.assertIn("| fixed | 1 | 1 | 81.00 ± 0.00 |", lines[2])
        # mean 81, sample std sqrt(2) = 1.41
        self.assertIn("| adaptive | 0.01 | 2 | 81.00 ± 1.41 |", lines[3])

    def test_a_rerun_skips_finished_runs_and_writes_the_page(self):
        folder = tempfile.mkdtemp()
        output = os.path.join(folder, "runs.json")
        with open(output, "w") as f:
            json.dump([result(0, 0.01, True, 0.8)], f)
        env = dict(os.environ, PYTHONPATH=ROOT)
        run = subprocess.run(
            [sys.executable, "-m", "research.adaptive_clipping_study",
             f"--output={output}", "--seeds=0", "--initial_clips=0.01",
             "--fixed_clip=0", f"--report={folder}/page.md"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
            check=False)
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        with open(os.path.join(folder, "page.md")) as f:
            self.assertIn("| adaptive | 0.01 | 1 | 80.00 ± 0.00 |", f.read())
        with open(output) as f:
            self.assertLen(json.load(f), 1)  # nothing trained
        self.assertGreater(os.path.getsize(os.path.join(folder, "page.png")),
                           1000)

    def test_a_file_of_another_gamma_is_refused(self):
        folder = tempfile.mkdtemp()
        output = os.path.join(folder, "runs.json")
        with open(output, "w") as f:
            json.dump([dict(result(0, 0.01, True, 0.8),
                            target_unclipped_quantile=0.9)], f)
        env = dict(os.environ, PYTHONPATH=ROOT)
        run = subprocess.run(
            [sys.executable, "-m", "research.adaptive_clipping_study",
             f"--output={output}", "--seeds=0", "--initial_clips=0.01",
             "--fixed_clip=0", "--target_unclipped_quantile=0.5",
             "--data_dir=/nonexistent"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
            check=False)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("ValueError: --output=", run.stderr)
        self.assertIn("--target_unclipped_quantile=0.9, not 0.5",
                      run.stderr)
        self.assertEqual(study.quantile_of(result(0, 0.01, True, 0.8)), 0.5)


if __name__ == "__main__":
    absltest.main()
