"""Clean vs private Adam moments: the paper's Table 2 and Figure 2.

WARNING: NOT DIFFERENTIALLY PRIVATE. This module is a research tool. It reads
the clipped but un-noised gradient of every step, which a model stores only
when made with `tf_dpadam.make_private(model, diagnostics=True)`, and every
number, table and picture it produces is computed from it. They reveal
information about individual training examples that no epsilon accounts for.
Use it on public or synthetic data to study the optimizer, never to release
anything.

Tang & Lecuyer compare, for the same training run, Adam's moments of

- the clean gradient g^c = sum_i clip(g_i) / B (clipped, no noise), and
- the private gradient g_tilde = (sum_i clip(g_i) + z) / B,
  z ~ N(0, sigma^2 C^2 I),

which the DP optimizer actually tracks. With the same betas and bias
correction,

    m^c, v^c:  Adam's (bias-corrected) moments of g^c,
    m^p, v^p:  Adam's (bias-corrected) moments of g_tilde (the optimizer's),

E[v^p - v^c] = Phi with Phi = (sigma C / B)^2, coordinate by coordinate, since
the noise of a step is independent of everything before it. The question is
whether Phi dominates v^p (then Adam's denominator sqrt(v^p) is about sqrt(Phi)
everywhere and Adam is scaled SGD with momentum) and whether v^p - Phi tracks
v^c. The update directions compared are

    clean:      m^c / sqrt(v^c)
    private:    m^p / sqrt(v^p)                       (DP-Adam, "biased")
    corrected:  m^p / sqrt(max(v^p - Phi, gamma'))    (DP-AdamBC)

Adam's epsilon outside the root is left out of the first two, so that they
show the denominators themselves.

The package has three modules, and re-exports their public names:

* `moments`: the math on flat float64 arrays (Adam's moments, the update
  directions, `MomentSnapshot` and its summaries and comparisons);
* `callback`: `MomentDiagnostics`, the Keras callback that collects
  `MomentSnapshot`s during `fit`;
* `report`: the tables (Markdown) and histograms (PNG; needs matplotlib,
  an optional dependency imported only to draw them).

The rows and columns of the tables: `SUMMARY_COLUMNS` (of a summary row),
`SUMMARY_ROWS` and `COMPARISON_ROWS` (the entries of `moment_summary` and
`moment_comparison`, with their Markdown labels).
"""

from tf_dpadam.tools.diagnostics.callback import MomentDiagnostics
from tf_dpadam.tools.diagnostics.moments import adam_direction
from tf_dpadam.tools.diagnostics.moments import adam_moments
from tf_dpadam.tools.diagnostics.moments import bias_correct
from tf_dpadam.tools.diagnostics.moments import corrected_direction
from tf_dpadam.tools.diagnostics.moments import moment_comparison
from tf_dpadam.tools.diagnostics.moments import moment_summary
from tf_dpadam.tools.diagnostics.moments import MomentSnapshot
from tf_dpadam.tools.diagnostics.moments import second_moment_noise_std
from tf_dpadam.tools.diagnostics.moments import SUMMARY_COLUMNS
from tf_dpadam.tools.diagnostics.moments import summary_statistics
from tf_dpadam.tools.diagnostics.report import COMPARISON_ROWS
from tf_dpadam.tools.diagnostics.report import render_report
from tf_dpadam.tools.diagnostics.report import save_histograms
from tf_dpadam.tools.diagnostics.report import SUMMARY_ROWS
from tf_dpadam.tools.diagnostics.report import summary_markdown

__all__ = [
    "COMPARISON_ROWS",
    "SUMMARY_COLUMNS",
    "SUMMARY_ROWS",
    "adam_direction",
    "adam_moments",
    "bias_correct",
    "corrected_direction",
    "moment_comparison",
    "moment_summary",
    "MomentDiagnostics",
    "MomentSnapshot",
    "render_report",
    "save_histograms",
    "second_moment_noise_std",
    "summary_markdown",
    "summary_statistics",
]
