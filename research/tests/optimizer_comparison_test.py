"""research/optimizer_comparison.py on summaries written here: each
regime's cells from its sources, the margins against NumPy, "not run" for
what is missing, the worst-class table, the PNG."""

import json
import os
import tempfile

import numpy as np
from absl.testing import absltest

from research import optimizer_comparison as oc


def _write(folder, name, summary):
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f)


def _row(mean, std, seeds=3, **extra):
    return dict(mean=mean, std=std, seeds=seeds, learning_rate=0.01, **extra)


class OptimizerComparisonTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.folder = tempfile.mkdtemp()
        # A study summary with two cells (and a variant that is not one of
        # the five), a reproduce summary, and a second one that adds (and
        # overrides) optimizers.
        _write(self.folder, "STUDY.json", {"best": [
            dict(cell="a", variant="dpadam", **_row(0.80, 0.01,
                 worst_class_mean=0.40, worst_class_std=0.05)),
            dict(cell="a", variant="dpadam_stp", **_row(0.83, 0.02,
                 worst_class_mean=0.30, worst_class_std=0.02)),
            dict(cell="a", variant="dpadam_corrected_wd", **_row(0.99, 0.0)),
            dict(cell="b", variant="dpsgd", **_row(0.5, 0.1)),
        ]})
        _write(self.folder, "RESULTS_x.json", {"optimizers": {
            "dpsgd": _row(0.70, 0.03), "dpadam": _row(0.72, 0.01, seeds=2),
            "dpadam_corrected": _row(0.725, 0.02)}})
        _write(self.folder, "more/RESULTS_x.json", {"optimizers": {
            "dpadam_disk": _row(0.60, 0.05),
            "dpsgd": _row(0.71, 0.03)}})
        self.regimes = (
            oc.Regime("cell a", (oc.Source("study", "STUDY.json", "a"),)),
            oc.Regime("task x", (oc.Source("reproduce", "RESULTS_x.json"),
                                 oc.Source("reproduce",
                                           "more/RESULTS_x.json"))),
            oc.Regime("missing", (oc.Source("study", "NONE.json", "a"),)),
        )

    def test_rows_margins_and_page(self):
        rows = oc.regime_rows(self.regimes[1], self.folder)
        self.assertEqual(sorted(rows), ["dpadam", "dpadam_corrected",
                                        "dpadam_disk", "dpsgd"])
        self.assertEqual(rows["dpsgd"]["mean"], 0.71)  # The later source.
        best, second, gap, error = oc.margin(rows)
        self.assertEqual((best, second), ("dpadam_corrected", "dpadam"))
        self.assertAlmostEqual(gap, 0.005)
        self.assertAlmostEqual(error, np.sqrt(0.02**2 / 3 + 0.01**2 / 2))
        self.assertIsNone(oc.margin({"dpsgd": _row(0.5, 0.1)}))

        path = oc.write(self.folder, self.regimes)
        with open(path) as f:
            page = f.read()
        self.assertIn("| cell a | not run | 80.00 ± 1.00 (3) | not run |"
                      " 83.00 ± 2.00 (3) | not run |", page)
        a_error = 100 * np.sqrt(0.02**2 / 3 + 0.01**2 / 3)
        self.assertIn(f"**DP-Adam STP**, by +3.00 ± {a_error:.2f} over"
                      " DP-Adam; last: DP-Adam (-3.00)", page)
        self.assertIn("**DP-AdamBC**, by +0.50 ± "
                      f"{100 * np.sqrt(0.02**2 / 3 + 0.01**2 / 2):.2f} over"
                      " DP-Adam (within 2 s.e.); last: DP-Adam DiSK", page)
        self.assertIn("| missing | not run | not run | not run | not run |"
                      " not run | fewer than two optimizers run |", page)
        self.assertNotIn("99.00", page)  # Not one of the five.
        # Two optimizers at the lowest mean (one float32, one float64) are
        # both last.
        tied = oc._verdict({"dpsgd": _row(0.7947247823, 0.01),
                            "dpadam": _row(0.81, 0.01),
                            "dpadam_stp": _row(np.float32(0.7947247823), 0.01),
                            "dpadam_disk": _row(0.7947347, 0.01)})
        self.assertTrue(tied.endswith(
            "; last: DP-SGD and DP-Adam STP (tied) (-1.53)"), tied)
        # The worst class, where measured: DP-Adam's is higher.
        worst = page[page.index("## The worst class"):]
        self.assertIn("| cell a | not run | 40.00 ± 5.00 (3) | not run |"
                      " 30.00 ± 2.00 (3) |", worst)
        self.assertIn("**DP-Adam**, by +10.00", worst)
        self.assertNotIn("task x", worst)
        self.assertGreater(
            os.path.getsize(os.path.join(self.folder, oc.FIGURE)), 1000)


if __name__ == "__main__":
    absltest.main()
