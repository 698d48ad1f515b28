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

The functions below are pure NumPy on flat arrays; `MomentDiagnostics` is the
Keras callback that collects `MomentSnapshot`s during `fit`, and
`render_report` writes their tables (Markdown) and histograms (PNG).
"""

import dataclasses
import math
import numbers
import os

import keras
import numpy as np
from keras import ops

from tf_dpadam import dp_math
from tf_dpadam import optimizers as dp_optimizers
from tf_dpadam import private_model

# The columns of a summary row, in order.
SUMMARY_COLUMNS = ("min", "25%", "median", "75%", "max", "mean")

# The rows of `moment_summary`, with their Markdown labels.
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

# The entries of `moment_comparison`, with their Markdown labels.
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


# --------------------------------------------------------------------------
# The math, on NumPy arrays.


def adam_moments(m, v, gradient, beta_1, beta_2):
    """One step of Adam's moment estimates, before bias correction.

    Returns:
        `(beta_1 m + (1 - beta_1) g, beta_2 v + (1 - beta_2) g^2)`.
    """
    gradient = np.asarray(gradient, np.float64)
    return (
        beta_1 * m + (1 - beta_1) * gradient,
        beta_2 * v + (1 - beta_2) * np.square(gradient),
    )


def bias_correct(m, v, beta_1, beta_2, step):
    """Adam's bias correction at step t >= 1: m/(1 - b1^t), v/(1 - b2^t)."""
    return m / (1 - beta_1**step), v / (1 - beta_2**step)


def adam_direction(m_hat, v_hat):
    """m_hat / sqrt(v_hat), and 0 where v_hat = 0 (where m_hat = 0 too)."""
    m_hat = np.asarray(m_hat, np.float64)
    v_hat = np.asarray(v_hat, np.float64)
    return np.divide(
        m_hat, np.sqrt(np.maximum(v_hat, 0.0)),
        out=np.zeros_like(m_hat), where=v_hat > 0,
    )


def corrected_direction(m_hat, v_hat, phi, gamma):
    """m_hat / sqrt(max(v_hat - Phi, gamma')), DP-AdamBC's update direction."""
    return np.asarray(m_hat, np.float64) / np.sqrt(
        np.maximum(np.asarray(v_hat, np.float64) - phi, gamma)
    )


def second_moment_noise_std(phi, beta_2, step):
    """The std that the noise alone gives v^p - v^c at step t.

    With w_s = (1 - b2) b2^(t-s) / (1 - b2^t) the bias-corrected EMA weights,
    v^p - v^c = sum_s w_s (2 g_s z_s / B + z_s^2 / B^2) per coordinate, with
    z_s / B ~ N(0, Phi) independent of the past. Its variance is
    sum_s w_s^2 (2 Phi^2 + 4 Phi g_s^2); the noise-only part is

        Phi * sqrt(2 sum_s w_s^2),
        sum_s w_s^2 = (1 - b2) (1 + b2^t) / ((1 + b2) (1 - b2^t)).

    It is Phi * sqrt(2) at t = 1 and shrinks to Phi * sqrt(2 (1 - b2) / (1 +
    b2)) (0.032 Phi for b2 = 0.999): the floor below which v^p - Phi cannot
    resolve v^c.
    """
    weights_squared = (1 - beta_2) * (1 + beta_2**step) / (
        (1 + beta_2) * (1 - beta_2**step)
    )
    return phi * math.sqrt(2 * weights_squared)


def summary_statistics(values):
    """min, quartiles, max and mean of `values` (flattened), as floats.

    Quartiles are NumPy's default (linear interpolation).

    Returns:
        A dict keyed by `SUMMARY_COLUMNS`.
    """
    values = np.ravel(np.asarray(values, np.float64))
    if values.size == 0:
        raise ValueError("Expected at least one value to summarize.")
    q25, q50, q75 = np.quantile(values, [0.25, 0.5, 0.75])
    return {
        "min": float(values.min()),
        "25%": float(q25),
        "median": float(q50),
        "75%": float(q75),
        "max": float(values.max()),
        "mean": float(values.mean()),
    }


def _ratio(a, b):
    """a / b, or nan when b is 0 (e.g. Phi without noise)."""
    return float(a) / float(b) if b else math.nan


def _cosine(a, b):
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(np.dot(a, b) / norm) if norm else math.nan


@dataclasses.dataclass(frozen=True, eq=False)
class MomentSnapshot:
    """Clean and private Adam moments at one step (NOT private).

    All arrays are bias-corrected, flattened over every trainable variable
    (in the model's order) and float64.

    Attributes:
        step: t, the optimizer's step (1 for the first update).
        phi: Phi, what the corrected update subtracts: (sigma C / B)^2 of the
            step, or the optimizer's `phi` override (the paper's Phi').
        gamma: gamma', the floor inside the corrected square root.
        noise_phi: (sigma C / B)^2, the noise's bias in E[v^p] (equal to
            `phi` unless `phi` is overridden).
        beta_1, beta_2: the optimizer's (and the clean moments') betas.
        m_clean, v_clean: m^c, v^c, Adam's moments of the clean gradient.
        m_private, v_private: m^p, v^p, the DP optimizer's own moments.
    """

    step: int
    phi: float
    gamma: float
    noise_phi: float
    beta_1: float
    beta_2: float
    m_clean: np.ndarray
    v_clean: np.ndarray
    m_private: np.ndarray
    v_private: np.ndarray

    def updates(self):
        """The three update directions (see the module docstring)."""
        return {
            "clean": adam_direction(self.m_clean, self.v_clean),
            "private": adam_direction(self.m_private, self.v_private),
            "corrected": corrected_direction(
                self.m_private, self.v_private, self.phi, self.gamma
            ),
        }


def moment_summary(snapshot):
    """The paper's Table 2 for one snapshot, plus the update magnitudes.

    Returns:
        A dict keyed by `SUMMARY_ROWS`, each a `summary_statistics` dict.
    """
    s = snapshot
    updates = s.updates()
    rows = {
        "v_clean": s.v_clean,
        "v_private": s.v_private,
        "v_private_minus_phi": s.v_private - s.phi,
        "abs_m_clean": np.abs(s.m_clean),
        "abs_m_private": np.abs(s.m_private),
        "abs_update_clean": np.abs(updates["clean"]),
        "abs_update_private": np.abs(updates["private"]),
        "abs_update_corrected": np.abs(updates["corrected"]),
    }
    return {name: summary_statistics(values) for name, values in rows.items()}


def moment_comparison(snapshot):
    """How far the private second moments and updates are from the clean ones.

    `bias_over_phi` is (mean v^p - mean v^c) / Phi over all coordinates,
    whose expectation is 1 (the noise's bias, with `noise_phi`), and
    `std_over_phi` the spread of v^p - v^c over coordinates, to compare with
    `noise_std_over_phi` (`second_moment_noise_std`; the measured spread also
    has the cross term 2 g z / B and the spread of the bias). The
    log-errors compare each coordinate's denominator with the clean one,
    over the coordinates with v^c > 0 (and v^p > 0, which holds unless a
    coordinate never had a gradient): 0 means v^p (or the corrected
    max(v^p - Phi, gamma')) equals v^c, 1 a factor of 10. Cosines and norm
    ratios compare the update directions with the clean one. Ratios to Phi
    are nan without noise.

    Returns:
        A dict keyed by `COMPARISON_ROWS`, of floats.
    """
    s = snapshot
    updates = s.updates()
    corrected_v = np.maximum(s.v_private - s.phi, s.gamma)
    positive = (s.v_clean > 0) & (s.v_private > 0)
    clean_norm = np.linalg.norm(updates["clean"])
    return {
        "phi": float(s.phi),
        "gamma": float(s.gamma),
        "median_v_clean_over_phi": _ratio(np.median(s.v_clean), s.phi),
        "median_v_private_over_phi": _ratio(np.median(s.v_private), s.phi),
        "bias_over_phi": _ratio(
            np.mean(s.v_private) - np.mean(s.v_clean), s.noise_phi
        ),
        "std_over_phi": _ratio(np.std(s.v_private - s.v_clean), s.noise_phi),
        "noise_std_over_phi": _ratio(
            second_moment_noise_std(s.noise_phi, s.beta_2, s.step),
            s.noise_phi,
        ),
        "floored_fraction": float(np.mean(s.v_private - s.phi < s.gamma)),
        "median_log10_error_private": float(np.median(np.abs(np.log10(
            s.v_private[positive] / s.v_clean[positive]
        )))) if positive.any() else math.nan,
        "median_log10_error_corrected": float(np.median(np.abs(np.log10(
            corrected_v[positive] / s.v_clean[positive]
        )))) if positive.any() else math.nan,
        "cosine_private": _cosine(updates["clean"], updates["private"]),
        "cosine_corrected": _cosine(updates["clean"], updates["corrected"]),
        "norm_ratio_private": _ratio(
            np.linalg.norm(updates["private"]), clean_norm
        ),
        "norm_ratio_corrected": _ratio(
            np.linalg.norm(updates["corrected"]), clean_norm
        ),
    }


# --------------------------------------------------------------------------
# Rendering.


def _number(value):
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return f"{value:.3g}"


def summary_markdown(snapshot):
    """The summary and comparison tables of one snapshot, in Markdown."""
    summary = moment_summary(snapshot)
    lines = [
        "| quantity | " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|---|" + "---|" * len(SUMMARY_COLUMNS),
    ]
    for name, label in SUMMARY_ROWS.items():
        row = summary[name]
        lines.append(
            f"| {label} | "
            + " | ".join(_number(row[c]) for c in SUMMARY_COLUMNS) + " |"
        )
    lines += ["", "| comparison | value |", "|---|---|"]
    for name, value in moment_comparison(snapshot).items():
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

    Three panels, log x axes: |m| (clean, private); v (v^c, v^p and the
    corrected max(v^p - Phi, gamma'), with Phi and gamma' marked); and the
    magnitude of the update m / sqrt(v) (clean, private, corrected).
    Uses matplotlib's object API with the Agg canvas (no pyplot, no global
    backend change).

    Returns:
        `path`.
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


# --------------------------------------------------------------------------
# The Keras callback.


class MomentDiagnostics(keras.callbacks.Callback):
    """Tracks Adam's clean moments beside the DP optimizer's (NOT private).

    Needs a model made with `make_private(model, diagnostics=True)` and
    compiled with `DPAdam` or `DPAdamCorrected`. After every DP step (every
    k-th batch with gradient accumulation) it reads the step's clean
    gradient `model.clean_gradients` and advances m^c, v^c with the
    optimizer's betas, in float64 NumPy; at each step of `steps` it stores a
    `MomentSnapshot` of the bias-corrected m^c, v^c and the optimizer's own
    m^p, v^p in `snapshots`. The callback must see every step from the first
    (`iterations == 0` when training begins) and needs
    `steps_per_execution=1`; it keeps its state across `fit` calls.

    Attributes:
        steps: the sorted steps to snapshot.
        snapshots: dict step -> `MomentSnapshot`.
        step: the last step folded into the clean moments.
    """

    def __init__(self, steps=(10, 500)):
        """Creates the callback.

        Args:
            steps: the optimizer steps (>= 1) at which to take a snapshot.

        Raises:
            ValueError: if a step is not an int >= 1.
        """
        super().__init__()
        steps = tuple(steps)
        for step in steps:
            if (not isinstance(step, numbers.Integral)
                    or isinstance(step, bool) or step < 1):
                raise ValueError(f"Expected steps={steps!r} to be ints >= 1.")
        self.steps = tuple(sorted({int(s) for s in steps}))
        self.snapshots = {}
        self.step = 0
        self._m = None
        self._v = None

    def _check_model(self):
        model = self.model
        if not (isinstance(model, private_model.PrivateModel)
                and model.diagnostics):
            raise ValueError(
                "MomentDiagnostics needs a model made with"
                " tf_dpadam.make_private(model, diagnostics=True), which"
                " stores the clean gradient of each step."
            )
        optimizer = model.optimizer
        if not (dp_optimizers.is_dp_optimizer(optimizer)
                and isinstance(optimizer, keras.optimizers.Adam)):
            raise ValueError(
                "MomentDiagnostics compares Adam moments: compile with"
                " tf_dpadam.DPAdam or DPAdamCorrected, not"
                f" {type(optimizer).__name__}."
            )
        if getattr(optimizer, "amsgrad", False):
            raise ValueError("MomentDiagnostics needs amsgrad=False.")
        if getattr(model, "steps_per_execution", 1) != 1:
            raise ValueError(
                "MomentDiagnostics needs steps_per_execution=1, to see the"
                " clean gradient of every step."
            )
        return optimizer

    def _iterations(self):
        return int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_begin(self, logs=None):
        self._check_model()
        iterations = self._iterations()
        if iterations != self.step:
            raise ValueError(
                f"The optimizer is at step {iterations} but MomentDiagnostics"
                f" has seen {self.step} steps: the clean moments must start"
                " with the optimizer's (attach the callback before the first"
                " step and keep it for the whole run)."
            )

    def on_train_batch_end(self, batch, logs=None):
        iterations = self._iterations()
        if iterations == self.step:
            return  # A micro-batch of an accumulated step.
        if iterations != self.step + 1:
            raise RuntimeError(
                f"The optimizer went from step {self.step} to {iterations}"
                " between two batches; MomentDiagnostics must see every"
                " step."
            )
        optimizer = self.model.optimizer
        gradients = [
            ops.convert_to_numpy(g).astype(np.float64)
            for g in self.model.clean_gradients
        ]
        if self._m is None:
            self._m = [np.zeros_like(g) for g in gradients]
            self._v = [np.zeros_like(g) for g in gradients]
        for i, g in enumerate(gradients):
            self._m[i], self._v[i] = adam_moments(
                self._m[i], self._v[i], g, optimizer.beta_1, optimizer.beta_2
            )
        self.step = iterations
        if iterations in self.steps:
            self.snapshots[iterations] = self.snapshot()

    def snapshot(self):
        """A `MomentSnapshot` of the current step (after the first step)."""
        if self._m is None:
            raise ValueError("No step has been taken yet.")
        optimizer = self.model.optimizer
        beta_1, beta_2, t = optimizer.beta_1, optimizer.beta_2, self.step

        def flat(arrays):
            return np.concatenate([np.ravel(a) for a in arrays])

        private_m, private_v = [], []
        for variable in self.model.trainable_variables:
            index = optimizer._get_variable_index(variable)
            private_m.append(ops.convert_to_numpy(optimizer._momentums[index]))
            private_v.append(
                ops.convert_to_numpy(optimizer._velocities[index])
            )
        m_clean, v_clean = bias_correct(
            flat(self._m), flat(self._v), beta_1, beta_2, t
        )
        m_private, v_private = bias_correct(
            flat(private_m).astype(np.float64),
            flat(private_v).astype(np.float64), beta_1, beta_2, t,
        )
        noise_phi = float(ops.convert_to_numpy(optimizer.noise_phi()))
        if isinstance(optimizer, dp_optimizers.DPAdamCorrected):
            phi_tensor = optimizer.step_phi()
            phi = float(ops.convert_to_numpy(phi_tensor))
            gamma = float(ops.convert_to_numpy(
                optimizer.step_gamma(phi_tensor)
            ))
        else:
            # DP-Adam subtracts nothing; show what DP-AdamBC would do.
            phi = noise_phi
            gamma = float(ops.convert_to_numpy(dp_math.default_gamma(phi)))
        return MomentSnapshot(
            step=t, phi=phi, gamma=gamma, noise_phi=noise_phi,
            beta_1=float(beta_1), beta_2=float(beta_2),
            m_clean=m_clean, v_clean=v_clean,
            m_private=m_private, v_private=v_private,
        )
