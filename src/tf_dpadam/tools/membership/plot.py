"""ROC curves on log-log axes, as Carlini et al. (2022) draw them.

On linear axes every attack near chance looks alike; on log-log axes the
region that matters, TPR at FPR 1e-3 and below, is visible, and the chance
line TPR = FPR is the diagonal. Needs matplotlib, an optional dependency
(`pip install matplotlib`, or the `examples` extra), imported when a plot
is made; the object API with the Agg canvas (no pyplot, no global backend).
"""

import numpy as np

from tf_dpadam.common import validation


def save_roc_plot(curves, path, *, title="Membership inference ROC"):
    """Saves the ROC curves of several attacks, log-log, as a PNG.

    Args:
        curves: {label: `roc.AttackResult`} (or {label: (fpr, tpr)}); each
            label is followed by its AUC and TPR at FPR 0.1% when known.
        path: the PNG file to write.
        title: the figure's title.

    Returns:
        `path`.

    Raises:
        ImportError: if matplotlib is not installed.
    """
    validation.check(len(curves) > 0, "curves", curves,
                     "to hold at least one curve")
    try:  # pylint: disable=import-outside-toplevel
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "save_roc_plot needs matplotlib (pip install matplotlib)."
        ) from error
    figure = Figure(figsize=(5.2, 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    lowest = 1.0
    for label, curve in curves.items():
        fpr, tpr = (curve.fpr, curve.tpr) if hasattr(curve, "fpr") else curve
        fpr, tpr = np.asarray(fpr, np.float64), np.asarray(tpr, np.float64)
        positive = fpr[fpr > 0]
        lowest = min(lowest, positive.min() if positive.size else 1.0)
        if hasattr(curve, "auc"):
            label = f"{label} (AUC {curve.auc:.3f}"
            if 0.001 in curve.tpr_at_fpr:
                label += f", TPR@0.1% {100 * curve.tpr_at_fpr[0.001]:.2f}%"
            label += ")"
        axes.plot(fpr, tpr, label=label)
    low = 10 ** np.floor(np.log10(max(lowest, 1e-6)))
    axes.plot([low, 1], [low, 1], "k:", linewidth=1, label="chance")
    axes.set(xscale="log", yscale="log", xlim=(low, 1), ylim=(low, 1),
             xlabel="false positive rate", ylabel="true positive rate",
             title=title)
    axes.legend(loc="lower right", fontsize="small")
    figure.savefig(path, dpi=110)
    return path
