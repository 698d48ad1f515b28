"""src/tf_dpadam/tools/diagnostics/report.py: tables and histograms of snapshots.

Runs on hand-made snapshots (small NumPy arrays), no training. The golden
tables in testdata/golden/MOMENT_SUMMARY_*.md were recorded from the module
before it was split out of src/tf_dpadam/tools/diagnostics.py.
(research/diagnostics_report.py, the example's report, has its own test.)
"""

import ast
import os
import sys
import tempfile
from unittest import mock

import pytest
from absl.testing import absltest

from tf_dpadam.tools import diagnostics
from tf_dpadam.tools.diagnostics import moments
from tf_dpadam.tools.diagnostics import report

import helpers

_GOLDEN = os.path.join(helpers.TESTS_DIR,
                       "testdata", "golden")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    diagnostics.__file__))))
# Importing any of these fails as if matplotlib were not installed.
_NO_MATPLOTLIB = dict.fromkeys(
    ("matplotlib", "matplotlib.figure", "matplotlib.backends",
     "matplotlib.backends.backend_agg")
)


def _golden(name):
    with open(os.path.join(_GOLDEN, name), encoding="utf-8") as f:
        return f.read()


def _noiseless_snapshot():
    s = helpers.hand_made_snapshot()
    return moments.MomentSnapshot(
        step=1, phi=0.0, gamma=1e-14, noise_phi=0.0, beta_1=0.9,
        beta_2=0.999, m_clean=s.m_clean, v_clean=s.v_clean,
        m_private=s.m_clean.copy(), v_private=s.v_clean.copy(),
    )


class MarkdownTest(absltest.TestCase):

    def test_tables_match_the_recorded_ones(self):
        self.assertEqual(report.summary_markdown(helpers.hand_made_snapshot()),
                         _golden("MOMENT_SUMMARY_noisy.md"))
        # Without noise the ratios to Phi are "n/a".
        self.assertEqual(report.summary_markdown(_noiseless_snapshot()),
                         _golden("MOMENT_SUMMARY_noiseless.md"))

    def test_tables_need_no_matplotlib(self):
        with mock.patch.dict(sys.modules, _NO_MATPLOTLIB):
            table = report.summary_markdown(helpers.hand_made_snapshot())
        self.assertIn("| v^p − Φ | 1 | 3.25 | 6.5 | 10.8 | 16 | 7.5 |", table)


class HistogramTest(absltest.TestCase):

    @pytest.mark.slow
    def test_render_report_writes_pngs_and_links_them(self):
        directory = tempfile.mkdtemp()
        snapshots = [helpers.hand_made_snapshot(), _noiseless_snapshot()]
        markdown = report.render_report(snapshots, directory, "diag")
        # In step order, each with its tables and its histogram.
        self.assertLess(markdown.index("### Step 1"),
                        markdown.index("### Step 3"))
        self.assertIn(report.summary_markdown(helpers.hand_made_snapshot()), markdown)
        for step in (1, 3):
            self.assertIn(f"![Histograms at step {step}](diag_step{step}.png)",
                          markdown)
            with open(os.path.join(directory, f"diag_step{step}.png"),
                      "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_missing_matplotlib_is_a_clear_import_error(self):
        path = os.path.join(tempfile.mkdtemp(), "h.png")
        with mock.patch.dict(sys.modules, _NO_MATPLOTLIB):
            with self.assertRaisesRegex(
                    ImportError, r"save_histograms needs matplotlib \(pip"
                    r" install matplotlib\)\."):
                report.save_histograms(helpers.hand_made_snapshot(), path)
        self.assertFalse(os.path.exists(path))

    def test_matplotlib_is_imported_only_where_plotting_happens(self):
        # Anywhere in the library: inside the function that plots, never at
        # module level.
        for root, _, files in os.walk(_PACKAGE):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in tree.body:
                    for child in ast.walk(node):
                        if isinstance(child, (ast.Import, ast.ImportFrom)):
                            modules = [a.name for a in child.names]
                            if isinstance(child, ast.ImportFrom):
                                modules = [child.module or ""]
                            self.assertFalse(
                                any(m.startswith("matplotlib")
                                    for m in modules)
                                and not isinstance(
                                    node, (ast.FunctionDef, ast.ClassDef)),
                                msg=f"{path}:{child.lineno}",
                            )


if __name__ == "__main__":
    absltest.main()
