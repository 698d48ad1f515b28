"""research/results_report.py (and research/plots.py): the reports, rendered
from recorded runs (tests/testdata, docs/RESULTS_<task>.json) and from
hand-made records, without training."""

import ast
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

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
_STP = Setting("dpadam_stp", 1e-2, 1e-8)
_DISK = Setting("dpadam_disk", 1e-3, 1e-8)
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

def _plan(settings, base=None, **kwargs):
    """A Fashion-MNIST plan of one setting per optimizer, seeds 0 and 1."""
    return experiments.make_plan(
        "fashion_mnist", base=base or common.base_config("fashion_mnist"),
        learning_rates={s.optimizer: (s.learning_rate,) for s in settings},
        gammas={s.optimizer: (s.gamma,) for s in settings
                if s.optimizer != "dpsgd"},
        seeds=(0, 1), runs_dir="/runs",
        data=experiments.data_spec("fashion_mnist"),
        optimizers=[s.optimizer for s in settings], **kwargs)


def _record(setting, seed, accuracy):
    return runs.Record(
        name=runs.run_name(setting, seed), setting=setting, seed=seed,
        accuracy=accuracy, epsilon=6.99, steps=719, num_examples=60000,
        wall_seconds=60.0, resumed=False, history=((50, accuracy),),
        command="python -m x", machine=None)


def _render(plan, records, best):
    return results_report.render_markdown(
        plan=plan, records=records, best=best, command="c",
        machine={"platform": "Linux-test", "cpu_count": 2},
        plots={"curves": "c.png", "tuning": "t.png"})


class PlanOptimizersTest(parameterized.TestCase):
    """Plans of other optimizers than the paper's three (issue 37's DP-Adam
    STP and DiSK), or of some of them."""

    def test_report_of_stp_and_disk_only(self):
        plan = _plan((_STP, _DISK))
        records = {r.name: r for r in (
            _record(_STP, 0, 0.80), _record(_STP, 1, 0.82),
            _record(_DISK, 0, 0.70), _record(_DISK, 1, 0.72))}
        best = {"dpadam_stp": _STP, "dpadam_disk": _DISK}
        text = _render(plan, records, best)
        self.assertTrue(text.startswith(
            "# DP-Adam STP vs DP-Adam DiSK on Fashion-MNIST"), text[:80])
        # Not in the paper: no paper column value.
        self.assertIn("| DP-Adam STP | 0.01 | 1e-08 | 2 | 81.00 ± 1.41 | "
                      "6.990 | n/a |", text)
        self.assertIn("| DP-Adam DiSK | 0.001 | 1e-08 | 2 | 71.00 ± 1.41 | "
                      "6.990 | n/a |", text)
        self.assertIn("| DP-Adam STP | 0.01 | 1e-08 | 80.00 **(best)** | "
                      "6.990 | 719 |", text)
        self.assertNotIn("DP-SGD", text)
        self.assertNotIn("DP-AdamBC", text)
        self.assertIn("Φ = (σC/B)² = 4.13e-06. Steps per run: 719.", text)
        self.assertIn("DP-Adam STP's and DP-Adam DiSK's γ is outside the "
                      "square root.", text)
        # DiSK against the plan's first optimizer (no DP-Adam here).
        self.assertIn("DP-Adam DiSK scores 71.00% against 81.00% for "
                      "DP-Adam STP (a gap of -10.00 points, seed spread 2.83 "
                      "points", text)
        self.assertIn("DP-Adam DiSK loses to DP-Adam STP by more than the "
                      "seed spread.", text)
        self.assertIn("DP-Adam STP and DP-Adam DiSK are not in the paper.",
                      text)
        summary = results_report.summary_record(
            plan, records, best, "c", {}, {"report": "r.md"})
        self.assertEqual(list(summary["optimizers"]),
                         ["dpadam_stp", "dpadam_disk"])
        self.assertEqual(summary["verdict"], results_report.verdict(
            plan, results_report.best_rows(plan, records, best)))

    def test_all_five_compare_the_newer_ones_with_dp_adam(self):
        settings = (_SGD, _ADAM, _BC, _STP, _DISK)
        plan = _plan(settings)
        records = {_record(s, seed, 0.7 + 0.01 * i + 0.001 * seed).name:
                   _record(s, seed, 0.7 + 0.01 * i + 0.001 * seed)
                   for i, s in enumerate(settings) for seed in (0, 1)}
        best = {s.optimizer: s for s in settings}
        text = _render(plan, records, best)
        self.assertIn("# DP-SGD vs DP-Adam vs DP-AdamBC vs DP-Adam STP vs "
                      "DP-Adam DiSK on Fashion-MNIST", text)
        for label in ("DP-SGD", "DP-Adam", "DP-AdamBC", "DP-Adam STP",
                      "DP-Adam DiSK"):
            self.assertIn(f"\n| {label} | ", text)
        rows = results_report.best_rows(plan, records, best)
        verdict = results_report.verdict(plan, rows)
        # The paper's paragraph first, then the newer ones against DP-Adam.
        self.assertTrue(verdict.startswith("DP-AdamBC scores 72.05% against "
                                           "71.05% for DP-Adam"), verdict)
        self.assertIn("In the paper (CIFAR-10) DP-AdamBC beats DP-Adam",
                      verdict)
        self.assertIn("DP-Adam STP scores 73.05% against 71.05% for DP-Adam",
                      verdict)
        self.assertIn("DP-Adam DiSK scores 74.05% against 71.05% for DP-Adam",
                      verdict)
        self.assertNotIn("Not enough", verdict)

    @parameterized.named_parameters(
        ("without_dpadam_corrected", (_SGD, _ADAM),
         "DP-SGD scores 80.00% against 70.00% for DP-Adam"),
        ("without_dpadam", (_SGD, _BC),
         "DP-AdamBC scores 70.00% against 80.00% for DP-SGD"),
        ("without_dpsgd", (_ADAM, _BC),
         "DP-AdamBC scores 70.00% against 80.00% for DP-Adam"),
        ("only_dpadam", (_ADAM,),
         "Only DP-Adam in this plan: nothing to compare."),
        ("only_stp", (_STP,),
         "Only DP-Adam STP in this plan: nothing to compare. DP-Adam STP is"
         " not in the paper."),
    )
    def test_some_of_the_paper_optimizers(self, settings, expected):
        plan = _plan(settings)
        # The first optimizer scores 0.8, the others 0.7 (one seed).
        records = {r.name: r for r in (
            _record(s, 0, 0.8 if i == 0 else 0.7)
            for i, s in enumerate(settings))}
        best = {s.optimizer: s for s in settings}
        text = _render(plan, records, best)
        self.assertIn(expected, text)
        for name, label in common.OPTIMIZER_LABELS.items():
            rows = [line for line in text.splitlines()
                    if line.startswith(f"| {label} | ")]
            self.assertLen(rows, 2 if name in plan.grids else 0, label)
        # Missing runs: no KeyError, and a sentence that says so.
        self.assertIsInstance(results_report.verdict(plan, {}), str)

    def test_rdp_calibration_in_the_settings_and_the_summary(self):
        base = common.base_config("fashion_mnist")
        plan = _plan((_ADAM, _BC), base=base, calibration_accountant="rdp",
                     num_examples=60000)
        records = {r.name: r for r in (_record(_ADAM, 0, 0.8),)}
        best = {"dpadam": _ADAM}
        text = _render(plan, records, best)
        self.assertIn("δ = 1e-05, target ε = 7 with the steps calibrated by "
                      "the RDP accountant (719 steps for 60000 examples, "
                      "trained as 3.068 epochs; the runs' ε columns are "
                      "PLD's for those steps); Φ", text)
        self.assertIn("Steps per run: 719.", text)
        summary = results_report.summary_record(
            plan, records, best, "c", {}, {"report": "r.md"})
        self.assertEqual(summary["privacy"]["target_epsilon"], 7.0)
        self.assertEqual(summary["privacy"]["calibration_accountant"], "rdp")
        # PLD (the default): the settings line and summary as before.
        pld = _plan((_ADAM, _BC), base=base)
        self.assertIn("δ = 1e-05, target ε = 7; Φ", _render(pld, records,
                                                             best))
        self.assertNotIn("calibration_accountant", results_report.
                         summary_record(pld, records, best, "c", {},
                                        {"report": "r.md"})["privacy"])


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
