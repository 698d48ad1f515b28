"""research/results_index.py: RESULTS.md from the recorded summaries in
docs/ (byte for byte) and from hand-made ones."""

import json
import os
import tempfile

from absl.testing import absltest

from research import experiments
from research import results_index
from research import runs

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


class ResultsIndexTest(absltest.TestCase):

    def test_results_md_from_the_recorded_task_summaries(self):
        docs = os.path.join(_ROOT, "research", "results")
        # Where reproduce, study and ablations write unless told.
        self.assertEqual(experiments.RESULTS_DIR, docs)
        # The tasks with recorded results (the fine-tuning ones may have
        # none yet), as write_index reads them.
        recorded = [t for t in experiments.TASKS if os.path.exists(
            os.path.join(docs, f"RESULTS_{t}.json"))]
        self.assertGreaterEqual(len(recorded), 2)
        summaries = [runs.read_json(os.path.join(docs, f"RESULTS_{t}.json"))
                     for t in recorded]
        # And the studies' summaries (research.study) recorded there.
        studies_by_stem = results_index.study_summaries(docs)
        self.assertIn("BEST_RECIPE_fashion_mnist", studies_by_stem)
        self.assertIn("REGIME_MAP_fashion_mnist", studies_by_stem)
        stems, studies = (list(studies_by_stem),
                          list(studies_by_stem.values()))
        self.assertEqual(results_index.render_index(summaries, studies),
                         _read(os.path.join(docs, "RESULTS.md")))
        output_dir = tempfile.mkdtemp()
        for name, summary in zip(
                [f"RESULTS_{t}" for t in recorded] + stems,
                summaries + studies):
            with open(os.path.join(output_dir, f"{name}.json"),
                      "w", encoding="utf-8") as f:
                json.dump(summary, f)
        self.assertEqual(_read(results_index.write_index(output_dir)),
                         _read(os.path.join(docs, "RESULTS.md")))

    def test_two_tasks_side_by_side(self):
        def summary(task, name, paper, rows):
            return {
                "task": task, "name": name, "paper_dataset": paper,
                "optimizers": rows, "verdict": f"verdict of {name}",
                "privacy": {"l2_norm_clip": 1.0, "noise_multiplier": 0.5,
                            "batch_size": 256, "delta": 1e-5,
                            "target_epsilon": 7.0, "steps": [536]},
                "data": "some data", "commands": [f"python -m {task}"],
                "machine": {"platform": "p", "cpu_count": 2},
                "runs": 15, "wall_seconds": 7200.0,
                "files": {"report": f"R_{task}.md",
                          "curves": f"R_{task}_curves.png"},
            }

        def row(mean, std, lr):
            return {"learning_rate": lr, "gamma": "-", "mean": mean,
                    "std": std, "seeds": 3, "epsilon": 6.99}

        text = results_index.render_index([
            summary("fashion_mnist", "Fashion-MNIST", "CIFAR-10",
                    {"dpsgd": row(0.78, 0.004, 1.0),
                     "dpadam_corrected": row(0.81, 0.005, 1e-3)}),
            summary("sst2", "SST-2", "SNLI", {"dpadam": row(0.8, 0.01, 0.01)}),
        ])
        self.assertIn("| optimizer | Fashion-MNIST, ε = 7 (ours) |"
                      " SST-2, ε = 7 (ours) | "
                      "CIFAR-10 (paper) | SNLI (paper) |", text)
        self.assertIn("| DP-SGD | 78.00 ± 0.40 (3 seeds, lr 1) | not run | "
                      "61.94 | 41.31 |", text)
        self.assertIn("| DP-Adam | not run | 80.00 ± 1.00 (3 seeds, lr 0.01)"
                      " | 56.35 | 53.04 |", text)
        self.assertIn("verdict of SST-2", text)
        self.assertIn("2.00 h over 15 runs", text)
        self.assertIn("steps per run: 536", text)
        self.assertIn("- Command: `python -m sst2`", text)


if __name__ == "__main__":
    absltest.main()
