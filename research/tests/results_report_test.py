"""research/results_report.py (and research/plots.py): the reports, rendered
from recorded runs (tests/testdata, docs/RESULTS_<task>.json) and from
hand-made records, without training."""

import ast
import os
import tempfile

from absl.testing import absltest

from research import common
from research import experiments
from research import results_report
from research import runs
from research.runs import Setting

from research.tests import research_helpers

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_GOLDEN = os.path.join(_ROOT, "research", "tests", "testdata", "golden")
_PNG = b"\x89PNG\r\n\x1a\n"
_SGD = Setting("dpsgd", 1.0, None)
_ADAM = Setting("dpadam", 1e-3, 1e-8)
_BC = Setting("dpadam_corrected", 1e-3, None)
# The machine of the golden reports.
_MACHINE = {"platform": "Linux-recorded", "cpu_count": 2, "python": "3.11",
            "tensorflow": "2.21.0", "keras": "3.15.0",
            "processor": "x86_64"}


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


class RecordedRunsTest(absltest.TestCase):

    def test_report_of_the_recorded_runs_is_unchanged(self):
        # tests/testdata/golden was rendered from the same runs before the
        # report code moved out of research/reproduce.py.
        runs_dir = research_helpers.copy_testdata("runs_fashion_mnist")
        output_dir = tempfile.mkdtemp()
        path = results_report.write_report(
            research_helpers.recorded_plan(runs_dir), output_dir,
            "python -m research.reproduce --phase=report", _MACHINE)
        self.assertEqual(path, os.path.join(output_dir,
                                            "RESULTS_fashion_mnist.md"))
        for name in ("RESULTS_fashion_mnist.md", "RESULTS_fashion_mnist.json",
                     "RESULTS.md"):
            got = _read(os.path.join(output_dir, name))
            self.assertEqual(got.replace(runs_dir, "runs/fashion_mnist"),
                             _read(os.path.join(_GOLDEN, name)), name)
        for name in ("RESULTS_fashion_mnist_curves.png",
                     "RESULTS_fashion_mnist_tuning.png"):
            with open(os.path.join(output_dir, name), "rb") as f:
                self.assertEqual(f.read(8), _PNG)

    def test_summary_record_of_the_recorded_runs(self):
        plan = research_helpers.recorded_plan(research_helpers.copy_testdata("runs_fashion_mnist"))
        records = experiments.collect(plan)
        best = experiments.best_of_tuning(plan, records)
        summary = results_report.summary_record(
            plan, records, best, "cmd", _MACHINE, {"report": "r.md"})
        self.assertEqual(summary["runs"], 9)
        self.assertEqual(summary["privacy"]["steps"], [4])
        self.assertEqual(summary["commands"], ["python -m research.reproduce"])
        self.assertEqual(sorted(summary["optimizers"]),
                         ["dpadam", "dpadam_corrected", "dpsgd"])
        self.assertTrue(all(row["seeds"] == 2
                            for row in summary["optimizers"].values()))


class HandMadeRecordsTest(absltest.TestCase):

    def test_render_markdown(self):
        base = common.base_config("fashion_mnist")
        plan = experiments.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpsgd": (1.0,), "dpadam": (1e-3,),
                            "dpadam_corrected": (1e-3,)},
            gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
            seeds=(0, 1), runs_dir="/runs",
            data=experiments.data_spec("fashion_mnist"))

        def record(setting, seed, accuracy):
            return runs.Record(
                name=runs.run_name(setting, seed), setting=setting,
                seed=seed, accuracy=accuracy, epsilon=6.99, steps=719,
                num_examples=60000, wall_seconds=60.0, resumed=False,
                history=((50, accuracy),), command="python -m x",
                machine=None)

        records = {r.name: r for r in (
            record(_SGD, 0, 0.80), record(_SGD, 1, 0.82),
            record(_ADAM, 0, 0.70), record(_ADAM, 1, 0.72),
            record(_BC, 0, 0.84),  # Seed 1 not run yet.
        )}
        best = {"dpsgd": _SGD, "dpadam": _ADAM, "dpadam_corrected": _BC}
        text = results_report.render_markdown(
            plan=plan, records=records, best=best, command="python -m y",
            machine={"platform": "Linux-test", "cpu_count": 2},
            plots={"curves": "c.png", "tuning": "t.png"})
        self.assertIn("| DP-SGD | 1 | - | 2 | 81.00 ± 1.41 | 6.990 | 61.94 |",
                      text)
        self.assertIn("| DP-Adam | 0.001 | 1e-08 | 2 | 71.00 ± 1.41 |", text)
        self.assertIn("| DP-AdamBC | 0.001 | 0.04·Φ | 1 | 84.00 ± 0.00 |",
                      text)
        self.assertIn("fewer than two seeds", text)
        self.assertIn("Linux-test", text)
        self.assertIn("`python -m y`", text)
        self.assertIn("Total wall time: 300 s", text)
        self.assertIn("60000 training examples", text)
        self.assertIn("Steps per run: 719.", text)
        self.assertNotIn("little room", text)

    def test_describe_data_of_a_text_task(self):
        spec = experiments.data_spec("sst2", max_test_examples=16,
                                     sequence_length=32)
        text = results_report.describe_data(spec, {})
        self.assertIn("SST-2 (dataset `sst2_tsv`)", text)
        self.assertIn("32 tokens per example", text)
        self.assertIn("evaluated on 16 dev examples", text)

class LazyPlottingTest(absltest.TestCase):

    def test_no_research_module_imports_matplotlib_on_import(self):
        # (TensorFlow itself may import it here, so sys.modules cannot tell.)
        folder = os.path.join(_ROOT, "research")
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            tree = ast.parse(_read(os.path.join(folder, name)))
            for node in tree.body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    modules = ([a.name for a in node.names]
                               if isinstance(node, ast.Import)
                               else [node.module or ""])
                    self.assertFalse(
                        any(m.split(".")[0] == "matplotlib" for m in modules),
                        f"research/{name}:{node.lineno} imports matplotlib")


if __name__ == "__main__":
    absltest.main()
