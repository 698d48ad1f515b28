"""The report of `research.diagnostics`: clean vs private Adam moments.

NOT differentially private: it is written from the clipped but un-noised
gradient of every step. `write_report` writes the Markdown and its
histograms (`tf_dpadam.diagnostics.render_report`, matplotlib); `findings`
puts into sentences what the numbers of the snapshots show.
"""

import math
import os
import platform

from research import common
from tf_dpadam.tools import diagnostics

def _fmt(value, digits=3):
    return f"{value:.{digits}g}"


def findings(snapshots):
    """Sentences on what the comparisons show, computed from the numbers."""
    rows = [(s.step, diagnostics.moment_comparison(s)) for s in snapshots]
    lines = []
    for step, c in rows:
        lines.append(
            f"- Step {step}: median v^c = {_fmt(c['median_v_clean_over_phi'])}"
            f" Φ and median v^p = {_fmt(c['median_v_private_over_phi'])} Φ;"
            f" (mean v^p − mean v^c) / Φ ="
            f" {c['bias_over_phi']:.3f}; v^p − v^c spreads with std"
            f" {_fmt(c['std_over_phi'])} Φ (noise alone:"
            f" {_fmt(c['noise_std_over_phi'])} Φ); v^p − Φ < γ' on"
            f" {c['floored_fraction']:.0%} of the coordinates; denominator"
            " error (median |log₁₀(· / v^c)|)"
            f" {_fmt(c['median_log10_error_private'])} decades for v^p,"
            f" {_fmt(c['median_log10_error_corrected'])} for"
            f" max(v^p − Φ, γ'); cosine with the clean update"
            f" {c['cosine_private']:.2f} (DP-Adam) and"
            f" {c['cosine_corrected']:.2f} (DP-AdamBC)."
        )
    paragraphs = ["\n".join(lines)]
    dominated = all(c["median_v_clean_over_phi"] < 0.1 for _, c in rows)
    clean_median = max(c["median_v_clean_over_phi"] for _, c in rows)
    if dominated:
        paragraphs.append(
            "**Is v^p dominated by Φ?** Yes. At every reported step the"
            " median clean second moment is below"
            f" {_fmt(clean_median, 2)} Φ, so"
            " v^p ≈ Φ on most coordinates and DP-Adam's denominator √v^p is"
            " nearly the same constant √Φ everywhere: DP-Adam behaves like"
            " SGD with momentum and a learning rate divided by √Φ. That is"
            " the bias the paper corrects."
        )
    else:
        paragraphs.append(
            "**Is v^p dominated by Φ?** Not everywhere: at some reported step"
            f" the median clean second moment reaches {_fmt(clean_median, 2)}"
            " Φ, so the clean signal is a sizeable part of v^p there."
        )
    last = rows[-1][1]
    last_summary = diagnostics.moment_summary(snapshots[-1])
    unbiased = all(abs(c["bias_over_phi"] - 1) < 0.1 for _, c in rows)
    paragraphs.append(_tracking_paragraph(last, last_summary, unbiased))
    m_ratio = (last_summary["abs_m_private"]["median"]
               / last_summary["abs_m_clean"]["median"])
    paragraphs.append(
        "**The updates.** The first moment is noisy too: at the last step"
        f" the median |m^p| is {_fmt(m_ratio, 2)}× the median |m^c|, so"
        " neither private update points near the clean one: cosine"
        f" {last['cosine_corrected']:.2f} for DP-AdamBC and"
        f" {last['cosine_private']:.2f} for DP-Adam. In size, DP-AdamBC's"
        f" update is {_fmt(last['norm_ratio_corrected'], 2)}× the clean"
        f" one's norm and DP-Adam's {_fmt(last['norm_ratio_private'], 2)}×."
    )
    return "\n\n".join(paragraphs)


def _tracking_paragraph(last, last_summary, unbiased):
    """Whether v^p - Phi tracks v^c: on average, then per coordinate."""
    floored = last["floored_fraction"]
    q75 = (last_summary["v_clean"]["75%"] / last["phi"] if last["phi"]
           else math.nan)
    text = ["**Does v^p − Φ track v^c?**"]
    if unbiased:
        text.append(
            "On average, yes: over all coordinates mean v^p − mean v^c is Φ"
            " within 10% at every reported step, as E[v^p − v^c] = Φ"
            " predicts."
        )
    else:
        text.append(
            "Not even on average here: (mean v^p − mean v^c) / Φ is off by"
            " more than 10% at some reported step."
        )
    text.append(
        "Coordinate by coordinate, "
        + ("hardly" if q75 < last["noise_std_over_phi"] else "partly")
        + ": at the last step the noise alone spreads v^p − v^c with std"
        f" {_fmt(last['noise_std_over_phi'])} Φ (measured:"
        f" {_fmt(last['std_over_phi'])} Φ), while three quarters of the"
        f" coordinates have v^c below {_fmt(q75, 2)} Φ (median"
        f" {_fmt(last['median_v_clean_over_phi'])} Φ)."
    )
    text.append(
        f"So {floored:.0%} of the coordinates of v^p − Φ fall below γ' and"
        " DP-AdamBC divides them by √γ'"
        + (", again one constant for all of them, √(Φ/γ') ="
           f" {_fmt(math.sqrt(last['phi'] / last['gamma']), 2)} times"
           " smaller than DP-Adam's √Φ." if floored > 0.5 else ".")
    )
    corrected = last["median_log10_error_corrected"]
    private = last["median_log10_error_private"]
    if corrected < private:
        text.append(
            "Subtracting Φ does bring the denominator closer to the clean"
            f" one (a median error of {_fmt(corrected)} decades instead of"
            f" {_fmt(private)})"
            + (", but mostly through that floor, which is nearer to v^c"
               " than Φ is." if floored > 0.5 else ".")
        )
    else:
        text.append(
            "Subtracting Φ does not bring the denominator closer to the"
            f" clean one here (a median error of {_fmt(corrected)} decades"
            f" against {_fmt(private)} for v^p)."
        )
    return " ".join(text)


def write_report(path, dataset, config, results, snapshots, command):
    """Writes the Markdown report and its PNGs; returns `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    prefix = os.path.splitext(os.path.basename(path))[0]
    snapshots = sorted(snapshots, key=lambda s: s.step)
    phi = snapshots[-1].phi
    gamma = snapshots[-1].gamma
    name = common.OPTIMIZER_LABELS[config.optimizer]
    sections = diagnostics.render_report(snapshots, directory, prefix)
    steps_text = ", ".join(str(s.step) for s in snapshots)
    noise_seed_text = ("secret" if config.noise_seed is None
                       else config.noise_seed)
    if config.optimizer == "dpadam":
        gamma_text = "what DP-AdamBC would use; DP-Adam subtracts nothing"
    elif config.epsilon is None:
        gamma_text = "0.04·Φ"
    else:
        gamma_text = "set by --epsilon"
    text = f"""# Clean vs private Adam moments: {dataset} ({name})

> **Not differentially private.** These diagnostics use the clipped but
> un-noised gradient of every step (`make_private(..., diagnostics=True)`).
> The tables and pictures below reveal information about individual
> training examples that no ε accounts for; they are for studying the
> optimizer on public data. (The trained weights themselves follow the same
> trajectory as without diagnostics.)

Written by `research/diagnostics.py`: `{command}`

## Setup

- Machine: `{platform.platform()}`, {os.cpu_count()} CPUs; training took
  {results['wall_seconds']:.0f} s (snapshots included).
- Data: {dataset}, {results['num_examples']} training examples. Model: the
  paper's CNN (`research.models.make_cnn`), {results['num_parameters']:,}
  parameters, i.e. coordinates of m and v.
- Optimizer: {name}, C = {config.l2_norm_clip:g},
  σ = {config.noise_multiplier:g}, expected B = {config.batch_size}
  (Poisson sampling, padded to {results['capacity']}),
  lr = {config.learning_rate:g}, β = ({config.beta_1:g}, {config.beta_2:g}),
  Φ = (σC/B)² = {phi:.3g},
  γ' = {gamma:.3g} ({gamma_text}); seed {config.seed}, noise and
  sampling seed {noise_seed_text}.
- Result: {results['steps']} steps, test accuracy
  {100 * results['test_accuracy']:.2f}%; the weights are
  (ε = {results['epsilon']:.3f}, δ = {config.delta:g})-DP.
- Snapshots at steps {steps_text}. m and v are Adam's bias-corrected
  moments with the optimizer's betas: clean (c) of sum_i clip(g_i)/B,
  private (p) of the noised gradient (the optimizer's own slots). The
  updates leave out Adam's ε: clean m^c/√v^c, DP-Adam m^p/√v^p, DP-AdamBC
  m^p/√max(v^p − Φ, γ').

## What the numbers show

{findings(snapshots)}

## Tables and histograms

Histograms have log x axes; the dashed line is Φ, the dotted one γ'. The
middle panel's "corrected" curve is DP-AdamBC's denominator squared,
max(v^p − Φ, γ'); v^p − Φ itself is negative on many coordinates.

{sections}"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path

