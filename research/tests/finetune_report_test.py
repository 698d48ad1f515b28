"""research/finetune_report.py: the fine-tuning page from task summaries."""

import json
import os
import tempfile

from absl.testing import absltest

from research import finetune_report

_PNG = b"\x89PNG\r\n\x1a\n"


def _row(mean, std, lr, seeds=3):
    return {"learning_rate": lr, "gamma": "-", "mean": mean, "std": std,
            "seeds": seeds, "epsilon": 6.999}


def _summary(task, rows, ceiling=None):
    summary = {
        "task": task, "name": task, "paper_dataset": "SNLI",
        "optimizers": rows, "verdict": "v",
        "privacy": {"l2_norm_clip": 0.1, "noise_multiplier": 0.5,
                    "batch_size": 256, "delta": 1e-5, "target_epsilon": 7.0,
                    "steps": [536]},
        "data": f"data of {task}.", "commands": ["c"], "machine": {},
        "runs": 16, "wall_seconds": 3600.0,
        "files": {"report": f"RESULTS_{task}.md"},
    }
    if ceiling is not None:
        summary["ceiling"] = {"accuracy": ceiling, "learning_rate": 1e-3}
    return summary


def _write(folder, summaries):
    for summary in summaries:
        path = os.path.join(folder, f"RESULTS_{summary['task']}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f)


class FinetuneReportTest(absltest.TestCase):

    def test_page_from_three_modes(self):
        docs = tempfile.mkdtemp()
        _write(docs, [
            # Last block: BC - Adam = +0.10 (spread 1.20).
            _summary("sst2", {"dpsgd": _row(0.795, 0.01, 4.0),
                              "dpadam": _row(0.810, 0.007, 3e-3),
                              "dpadam_corrected": _row(0.811, 0.005, 1e-3)}),
            # LoRA: best 84.00 +- 0.30; BC - Adam = +2.00 (spread 0.60).
            _summary("sst2_lora", {"dpsgd": _row(0.80, 0.02, 4.0),
                                   "dpadam": _row(0.82, 0.003, 3e-3),
                                   "dpadam_corrected": _row(0.84, 0.003,
                                                            1e-3)},
                     ceiling=0.88),
            # Full: best 81.50 +- 1.00, a tie with last block.
            _summary("sst2_full", {"dpadam": _row(0.815, 0.01, 3e-4)}),
        ])
        path = finetune_report.write_page(docs)
        self.assertEqual(path, os.path.join(docs, finetune_report.PAGE))
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(os.path.join(docs, finetune_report.PLOT), "rb") as f:
            self.assertEqual(f.read(8), _PNG)
        self.assertIn("| optimizer | last block | LoRA | full |", text)
        self.assertIn("| DP-AdamBC | 81.10 ± 0.50 (3 seeds, lr 0.001) | "
                      "84.00 ± 0.30 (3 seeds, lr 0.001) | not run |", text)
        self.assertIn("| Non-private Adam (ceiling, ε = ∞) | not run | "
                      "88.00 (1 seed, lr 0.001) | not run |", text)
        # 84.00 - 81.10 = +2.90 > 0.30 + 0.50.
        self.assertIn("LoRA: best private DP-AdamBC, 84.00 ± 0.30% (3 seeds);"
                      " against last block's best 81.10%: +2.90 points "
                      "(spread 0.80), better by more than the seed spread.",
                      text)
        # 81.50 - 81.10 = +0.40 < 1.00 + 0.50.
        self.assertIn("+0.40 points (spread 1.50), within the seed spread.",
                      text)
        self.assertIn("DP-AdamBC − DP-Adam, last block: +0.10 points (spread"
                      " 1.20): within the seed spread.", text)
        # LoRA's gap +2.00 vs +0.10: +1.90 > 0.60 + 1.20.
        self.assertIn("DP-AdamBC − DP-Adam, LoRA: +2.00 points (spread 0.60)"
                      ": DP-AdamBC better; against last block's gap, +1.90 "
                      "points (spread 1.80): the gap grows by more than the "
                      "seed spread.", text)
        self.assertNotIn("DP-AdamBC − DP-Adam, full", text)  # No BC run.
        self.assertIn("LoRA: non-private ceiling 88.00% (one untuned run), "
                      "4.00 points above the best private optimizer.", text)
        self.assertIn("Total wall time of these runs: 3.00 h", text)

    def test_unchanged_gap_and_a_single_task(self):
        docs = tempfile.mkdtemp()
        _write(docs, [_summary("sst2", {"dpadam": _row(0.81, 0.005, 3e-3),
                                        "dpadam_corrected": _row(0.81, 0.005,
                                                                 1e-3)})])
        self.assertIsNone(finetune_report.write_page(docs))
        _write(docs, [_summary("sst2_lora", {
            "dpadam": _row(0.785, 0.005, 3e-3),
            "dpadam_corrected": _row(0.79, 0.005, 1e-3)})])
        with open(finetune_report.write_page(docs), encoding="utf-8") as f:
            text = f.read()
        self.assertIn("against last block's gap, +0.50 points (spread 2.00):"
                      " the gap does not change beyond the seed spread.",
                      text)
        self.assertIn("81.00%: -2.00 points (spread 1.00), worse by more than"
                      " the seed spread.", text)


if __name__ == "__main__":
    absltest.main()
