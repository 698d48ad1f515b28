"""Tests of tf_dpadam.membership.plot: a PNG with log-log axes is written."""

import os
import tempfile

import numpy as np
import pytest

from tf_dpadam.tools.membership import plot
from tf_dpadam.tools.membership import roc


def test_saves_a_png_of_several_curves():
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    result = roc.evaluate_attack(rng.normal(1, 1, 500), rng.normal(0, 1, 500),
                                 num_bootstrap=0)
    fpr, tpr, _ = roc.roc_curve(rng.normal(size=100), rng.normal(size=100))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "roc.png")
        assert plot.save_roc_plot({"shifted": result, "null": (fpr, tpr)},
                                  path) == path
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 10_000


def test_legend_and_axes(monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib import figure  # pylint: disable=import-outside-toplevel
    saved = []
    monkeypatch.setattr(figure.Figure, "savefig",
                        lambda self, path, **kw: saved.append(self))
    rng = np.random.default_rng(1)
    result = roc.evaluate_attack(rng.normal(1, 1, 1000),
                                 rng.normal(0, 1, 1000), num_bootstrap=0)
    plot.save_roc_plot({"attack": result}, "unused.png")
    axes = saved[0].axes[0]
    assert (axes.get_xscale(), axes.get_yscale()) == ("log", "log")
    labels = [line.get_label() for line in axes.get_lines()]
    assert labels[0].startswith(f"attack (AUC {result.auc:.3f}, TPR@0.1%")
    assert labels[1] == "chance"
    # The axes reach down to the smallest positive FPR (1 / 1000).
    assert axes.get_xlim()[0] <= 1e-3


def test_no_curves_is_an_error():
    with pytest.raises(ValueError, match="curves"):
        plot.save_roc_plot({}, "unused.png")
