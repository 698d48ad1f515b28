"""The diagnostics report: Markdown tables and Figure-2-style histograms.

WARNING: NOT DIFFERENTIALLY PRIVATE (see `tf_dpadam.tools.diagnostics`).

`summary_markdown` needs nothing beyond NumPy. The histograms
(`save_histograms`, `render_report`) need matplotlib, an optional dependency
(`pip install matplotlib`, or the `examples` extra): it is imported when a
histogram is drawn, and its absence raises an `ImportError` that says so.
"""

import math
import os

import numpy as np

from tf_dpadam.tools.diagnostics import moments

# The rows of `moments.moment_summary`, with their Markdown labels.
SUMMARY_ROWS = {
    "v_clean": "v^c",
    "v_private": "v^p",
    "v_private_minus_phi": "v^p − Φ",
    "abs_m_clean": "\\|m^c\\|",
    "abs_m_private": "\\|m^p\\|",
    "abs_update_clean": "\\|m^c / √v^c\\|",
    "abs_update_private": "\\|m^p / √v^p\\|",
    "abs_update_corrected": "\\|m^p / √max(v^p − Φ, γ')\\|",
}

# The entries of `moments.moment_comparison`, with their Markdown labels.
COMPARISON_ROWS = {
    "phi": "Φ = (σC/B)²",
    "gamma": "γ' (floor of the corrected denominator)",
    "median_v_clean_over_phi": "median v^c / Φ",
    "median_v_private_over_phi": "median v^p / Φ",
    "bias_over_phi": "(mean v^p − mean v^c) / Φ (expected: 1)",
    "std_over_phi": "std of v^p − v^c over coordinates / Φ",
    "noise_std_over_phi": "the same, from the noise alone (predicted)",
    "floored_fraction": "share of coordinates with v^p − Φ < γ'",
    "median_log10_error_private": "median \\|log₁₀(v^p / v^c)\\|",
    "median_log10_error_corrected":
        "median \\|log₁₀(max(v^p − Φ, γ') / v^c)\\|",
    "cosine_private": "cos(clean update, private update)",
    "cosine_corrected": "cos(clean update, corrected update)",
    "norm_ratio_private": "‖private update‖ / ‖clean update‖",
    "norm_ratio_corrected": "‖corrected update‖ / ‖clean update‖",
}


def _number(value):
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return f"{value:.3g}"


def summary_markdown(snapshot):
    """The summary and comparison tables of one snapshot, in Markdown."""
    summary = moments.moment_summary(snapshot)
    columns = moments.SUMMARY_COLUMNS
    lines = [
        "| quantity | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, label in SUMMARY_ROWS.items():
        row = summary[name]
        lines.append(
            f"| {label} | "
            + " | ".join(_number(row[c]) for c in columns) + " |"
        )
    lines += ["", "| comparison | value |", "|---|---|"]
    for name, value in moments.moment_comparison(snapshot).items():
        lines.append(f"| {COMPARISON_ROWS[name]} | {_number(value)} |")
    return "\n".join(lines) + "\n"


def _log_bins(arrays, count=80):
    positive = [a[a > 0] for a in arrays]
    positive = [a for a in positive if a.size]
    if not positive:
        return None
    low = min(a.min() for a in positive)
    high = max(a.max() for a in positive)
    if high <= low:
        high = low * 10
    return np.logspace(np.log10(low), np.log10(high), count + 1)


def _log_histogram(axis, series, title, lines=()):
    """Histograms of the positive values of each series, on a log x axis."""
    bins = _log_bins([values for _, values in series])
    for label, values in series:
        zeros = int(np.sum(values <= 0))
        if zeros:
            label += f" ({zeros} ≤ 0 not shown)"
        if bins is not None:
            axis.hist(values[values > 0], bins=bins, histtype="step",
                      linewidth=1.4, label=label)
    for label, x, style in lines:
        axis.axvline(x, color="black", linestyle=style, linewidth=1,
                     label=label)
    axis.set_xscale("log")
    axis.set_title(title)
    axis.set_ylabel("coordinates")
    axis.legend(fontsize=7)


def save_histograms(snapshot, path):
    """Saves Figure-2-style histograms of one snapshot as a PNG.

    Three panels, log x axes: `|m|` (clean, private); v (v^c, v^p and the
    corrected max(v^p - Phi, gamma'), with Phi and gamma' marked); and the
    magnitude of the update m / sqrt(v) (clean, private, corrected).
    Uses matplotlib's object API with the Agg canvas (no pyplot, no global
    backend change).

    Returns:
        `path`.

    Raises:
        ImportError: if matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "save_histograms needs matplotlib (pip install matplotlib)."
        ) from error
    s = snapshot
    updates = s.updates()
    figure = Figure(figsize=(15, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    left, middle, right = figure.subplots(1, 3)
    _log_histogram(left, [("|m^c| clean", np.abs(s.m_clean)),
                          ("|m^p| private", np.abs(s.m_private))],
                   "first moment |m|")
    floored = np.mean(s.v_private - s.phi < s.gamma)
    _log_histogram(
        middle,
        [("v^c clean", s.v_clean), ("v^p private", s.v_private),
         (f"max(v^p − Φ, γ') corrected ({floored:.0%} at γ')",
          np.maximum(s.v_private - s.phi, s.gamma))],
        "second moment v",
        lines=[(f"Φ = {s.phi:.3g}", s.phi, "--"),
               (f"γ' = {s.gamma:.3g}", s.gamma, ":")] if s.phi > 0 else [],
    )
    _log_histogram(right, [(f"{name}", np.abs(u))
                           for name, u in updates.items()],
                   "update magnitude |m / √v|")
    for axis in (left, middle, right):
        axis.set_xlabel("value (log scale)")
    figure.suptitle(f"Step {s.step}: clean vs private Adam moments"
                    " (NOT private: uses un-noised gradients)")
    figure.savefig(path, dpi=110)
    return path


def render_report(snapshots, directory, prefix):
    """Writes one histogram PNG per snapshot; returns the Markdown section.

    Args:
        snapshots: `MomentSnapshot`s (e.g. `MomentDiagnostics.snapshots`
            values), reported in step order.
        directory: where the PNGs go (created if needed).
        prefix: file name prefix; the PNG of step t is `{prefix}_step{t}.png`
            and the Markdown links it relative to `directory`.

    Returns:
        Markdown with, per step, the tables of `summary_markdown` and the
        histograms.

    Raises:
        ImportError: if matplotlib is not installed.
    """
    os.makedirs(directory, exist_ok=True)
    sections = []
    for snapshot in sorted(snapshots, key=lambda s: s.step):
        name = f"{prefix}_step{snapshot.step}.png"
        save_histograms(snapshot, os.path.join(directory, name))
        sections.append(
            f"### Step {snapshot.step}\n\n{summary_markdown(snapshot)}\n"
            f"![Histograms at step {snapshot.step}]({name})\n"
        )
    return "\n".join(sections)
