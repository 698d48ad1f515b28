"""What the ablations' numbers say: noise thresholds and paragraphs.

Pure helpers on accuracies (fractions, None for a run not finished): the gap
below which two single-seed runs are called noise (`noise_threshold`), a
paragraph per ablation (`describe_phi`, `describe_gamma`, `describe_beta`,
`describe_lr`) and the closing summary (`describe_summary`).
"""

import math

import numpy as np

from research.ablation_sweeps import GAMMA_OVER_PHI

# When the seed spread is not measured (no --spread_seeds), a difference of
# two single-seed runs below this many points is called noise. For scale:
# the 3-seed standard deviations at full scale (RESULTS_fashion_mnist.md)
# are about 0.5 points, and a difference of two runs has sqrt(2) times that.
FALLBACK_NOISE_POINTS = 1.0


# Below this accuracy a run is called collapsed (10 classes: chance = 10%).
COLLAPSE_ACCURACY = 0.5


def noise_threshold(reference_accuracies, fallback=FALLBACK_NOISE_POINTS):
    """The gap (in points) below which two single-seed runs are called noise.

    With >= 2 seeds of the reference: 2 * sqrt(2) * their sample std (the
    std of a difference of two runs is sqrt(2) std; two of those), and a
    sentence saying so. Else `fallback`, marked as an assumption.

    Returns:
        `(points, sentence)`.
    """
    values = [a for a in reference_accuracies if a is not None]
    if len(values) < 2:
        return fallback, (
            f"One seed per setting and no measured spread, so gaps under "
            f"{fallback:g} points are treated as noise (an assumption: at "
            "full scale the 3-seed standard deviations were about 0.5 "
            "points).")
    std = 100 * float(np.std(values, ddof=1))
    points = 2 * math.sqrt(2) * std
    return points, (
        f"The reference setting over {len(values)} seeds scores "
        f"{100 * np.mean(values):.2f} ± {std:.2f}% (sample std); a gap "
        f"between two single-seed runs is called noise below 2·√2·std = "
        f"{points:.2f} points.")


def _gap_words(gap_points, noise_points):
    if abs(gap_points) < noise_points:
        return f"{gap_points:+.2f} points, within noise"
    return f"{gap_points:+.2f} points"


def describe_phi(results, noise_points):
    """A paragraph on the Phi' ablation.

    Args:
        results: `(multiple, accuracy)` pairs (accuracy a fraction, None if
            not run); the multiple 1 is the reference.
        noise_points: gaps below this are called noise.
    """
    done = [(m, a) for m, a in results if a is not None]
    reference = dict(done).get(1.0)
    if reference is None or len(done) < 2:
        return "Not enough finished runs for the Φ' ablation yet."
    parts = [f"Subtracting the true Φ scores {100 * reference:.2f}%"]
    for m, a in done:
        if m == 1.0:
            continue
        parts.append(f"Φ' = {m:g}·Φ scores {100 * a:.2f}% "
                     f"({_gap_words(100 * (a - reference), noise_points)})")
    text = "; ".join(parts) + "."
    worse = [m for m, a in done
             if m != 1.0 and 100 * (reference - a) >= noise_points]
    better = [m for m, a in done
              if m != 1.0 and 100 * (a - reference) >= noise_points]
    if not worse and not better:
        text += (" At this scale the choice of Φ' within the swept range "
                 "makes no difference beyond noise.")
    else:
        if worse:
            text += (" The true Φ beats Φ' = "
                     + ", ".join(f"{m:g}·Φ" for m in worse)
                     + " by more than the noise.")
        if better:
            text += (" Φ' = " + ", ".join(f"{m:g}·Φ" for m in better)
                     + " beats the true Φ by more than the noise, against "
                       "the paper's rationale for Φ' = Φ.")
    for m, _ in done:
        if m > 1:
            text += (f" Φ' = {m:g}·Φ makes v̂ − Φ' negative wherever the "
                     f"true second moment is below {m - 1:g}·Φ; there the "
                     "denominator is √γ' (momentum SGD at lr/√γ').")
        elif m < 1:
            text += (f" Φ' = {m:g}·Φ leaves {1 - m:g}·Φ of noise variance "
                     "in the denominator, which pulls DP-AdamBC toward the "
                     "biased DP-Adam.")
    return text


def describe_gamma(results, phi, noise_points):
    """A paragraph on the gamma' sweep.

    Args:
        results: `(gamma, accuracy)` pairs, gamma None for the default
            0.04 * Phi; accuracy a fraction, None if not run.
        phi: the true Phi of the runs.
        noise_points: gaps below this are called noise.
    """
    done = [(g, a) for g, a in results if a is not None]
    default = dict(done).get(None, "missing")
    swept = sorted((g, a) for g, a in done if g is not None)
    if default == "missing" or not swept:
        return "Not enough finished runs for the γ' sweep yet."
    best_g, best_a = max(swept, key=lambda p: p[1])
    default_value = GAMMA_OVER_PHI * phi
    below = [g for g, _ in swept if g < default_value]
    above = [g for g, _ in swept if g > default_value]
    where = ("below every swept value" if not below else
             "above every swept value" if not above else
             f"between γ' = {max(below):g} and {min(above):g}")
    text = (f"Relative to Φ = {phi:.3g}, the swept γ' run from "
            f"{swept[0][0] / phi:.2g}·Φ to {swept[-1][0] / phi:.2g}·Φ. The "
            f"best swept value is γ' = {best_g:g} ({best_g / phi:.2g}·Φ, "
            f"{100 * best_a:.2f}%). The default 0.04·Φ = "
            f"{default_value:.3g} lands {where} and scores "
            f"{100 * default:.2f}% "
            f"({_gap_words(100 * (default - best_a), noise_points)} from the "
            "best swept value).")
    collapsed = [g for g, a in swept if a < COLLAPSE_ACCURACY]
    if collapsed:
        text += (" γ' = " + ", ".join(f"{g:g}" for g in collapsed)
                 + f" ({', '.join(f'{g / phi:.2g}' for g in collapsed)}·Φ) "
                   f"ends below {100 * COLLAPSE_ACCURACY:.0f}%.")
        if any(g < phi for g in collapsed):
            text += (" With γ' ≪ Φ the floor rarely binds, and the "
                     "coordinates where the noisy v̂ − Φ is close to 0 get "
                     "steps of up to lr·m̂/√γ'.")
    near = [g for g, a in swept if 100 * (best_a - a) < noise_points]
    text += (" Within noise of the best: γ' = "
             + ", ".join(f"{g:g}" for g in near) + ".")
    return text


def describe_beta(results, noise_points):
    """A paragraph on the beta sweep.

    Args:
        results: series name -> list of `(beta_2, accuracy)` for the paired
            betas, plus `("default", accuracy)` for beta = (0.9, 0.999)
            (accuracy a fraction, None if not run).
        noise_points: gaps below this are called noise.
    """
    sentences = []
    for series, rows in results.items():
        paired = [(b, a) for b, a in rows if b != "default" and a is not None]
        default = dict(rows).get("default")
        if not paired:
            continue
        best_b, best_a = max(paired, key=lambda p: p[1])
        worst_b, worst_a = min(paired, key=lambda p: p[1])
        text = (f"{series}: paired β₂ = " + ", ".join(
            f"{b:g} → {100 * a:.2f}%" for b, a in paired)
            + f"; spread {100 * (best_a - worst_a):.2f} points"
            + (" (within noise)" if 100 * (best_a - worst_a) < noise_points
               else f", best β₂ = {best_b:g}"))
        if default is not None:
            text += (f"; Keras' default β = (0.9, 0.999) scores "
                     f"{100 * default:.2f}% "
                     f"({_gap_words(100 * (default - best_a), noise_points)}"
                     " from the best paired setting)")
        sentences.append(text + ".")
    if not sentences:
        return "Not enough finished runs for the β sweep yet."
    return " ".join(sentences)


def best_learning_rates(results):
    """series -> `(lr, accuracy)` of its best finished lr-ablation run.

    Args:
        results: series name -> list of `(lr, accuracy, is_default)`
            (accuracy a fraction, None if not run).
    """
    best = {}
    for series, rows in results.items():
        done = [(lr, a) for lr, a, _ in rows if a is not None]
        if done:
            best[series] = max(done, key=lambda p: p[1])
    return best


def describe_lr(results, noise_points):
    """A paragraph on the learning-rate sweep.

    Args:
        results: series name -> list of `(lr, accuracy, is_default)`, the
            default being the learning rate the other ablations fix
            (accuracy a fraction, None if not run).
        noise_points: gaps below this are called noise.
    """
    best = best_learning_rates(results)
    sentences = []
    for series, rows in results.items():
        if series not in best:
            continue
        done = sorted((lr, a, d) for lr, a, d in rows if a is not None)
        best_lr, best_a = best[series]
        text = (f"{series}: lr " + ", ".join(
            f"{lr:g} → {100 * a:.2f}%" + (" (fixed elsewhere)" if d else "")
            for lr, a, d in done) + f"; best lr {best_lr:g}")
        if len(done) > 1 and best_lr in (done[0][0], done[-1][0]):
            text += " (at the edge of the sweep)"
        fixed = [(lr, a) for lr, a, d in done if d]
        if fixed and fixed[0][0] != best_lr:
            lr, a = fixed[0]
            text += (f"; the fixed lr {lr:g} is "
                     f"{_gap_words(100 * (a - best_a), noise_points)} from "
                     "it")
        sentences.append(text + ".")
    if not sentences:
        return "Not enough finished runs for the learning-rate sweep yet."
    if {"DP-AdamBC", "DP-Adam"} <= set(best):
        (lr_bc, a_bc), (lr_adam, a_adam) = best["DP-AdamBC"], best["DP-Adam"]
        sentences.append(
            f"At their best learning rates here, DP-AdamBC scores "
            f"{100 * a_bc:.2f}% and DP-Adam {100 * a_adam:.2f}% "
            f"(DP-AdamBC {_gap_words(100 * (a_bc - a_adam), noise_points)}).")
    return " ".join(sentences)


def peak_then_drop(history, noise_points):
    """`(step, peak accuracy)` if a curve ended more than `noise_points`
    below its peak (a run that got worse while training), else None.

    Args:
        history: `(step, accuracy)` pairs in step order.
    """
    if not history:
        return None
    step, peak = max(history, key=lambda r: r[1])
    if 100 * (peak - history[-1][1]) > noise_points:
        return step, peak
    return None


def favours_larger_steps(phi_results, gamma_results, phi, noise_points):
    """Whether both ablations prefer, beyond noise, a setting that takes
    larger steps than the reference: Phi' > Phi (the floor sqrt(gamma')
    binds more often) and gamma' below the default 0.04 Phi.

    Args:
        phi_results: `(multiple, accuracy)` pairs, as for `describe_phi`.
        gamma_results: `(gamma, accuracy)` pairs, as for `describe_gamma`.
        phi: the true Phi.
        noise_points: gaps below this are called noise.
    """
    phi_reference = dict(phi_results).get(1.0)
    gamma_default = dict(gamma_results).get(None)
    if phi_reference is None or gamma_default is None:
        return False
    larger_phi = any(m > 1 and a is not None
                     and 100 * (a - phi_reference) >= noise_points
                     for m, a in phi_results)
    smaller_gamma = any(g is not None and g < GAMMA_OVER_PHI * phi
                        and a is not None
                        and 100 * (a - gamma_default) >= noise_points
                        for g, a in gamma_results)
    return larger_phi and smaller_gamma


def describe_summary(*, corrected, adam, larger_steps, drops, noise_points,
                     lr_corrected, lr_adam, steps, full_steps, tuned=None):
    """The closing paragraph: the two optimizers at this scale, the runs that
    got worse while training, and what the learning rates were tuned for.

    Args:
        corrected, adam: final accuracy of DP-AdamBC's reference run and of
            DP-Adam with the default betas (None if not run).
        larger_steps: `favours_larger_steps(...)`.
        drops: `(label, step, peak, final)` of the runs that fell after
            their peak.
        noise_points: gaps below this are called noise.
        lr_corrected, lr_adam: their learning rates.
        steps: steps per run here (None if unknown or mixed).
        full_steps: steps of the main experiment.
        tuned: `best_learning_rates(...)` of the lr ablation (None or
            empty if it has not run).
    """
    tuned = tuned or {}
    text = []
    if corrected is not None and adam is not None:
        gap = 100 * (corrected - adam)
        text.append(
            f"At this scale DP-AdamBC (lr {lr_corrected:g}, all defaults) "
            f"scores {100 * corrected:.2f}% and DP-Adam (lr {lr_adam:g}, "
            f"β = (0.9, 0.999)) {100 * adam:.2f}%: "
            + (f"DP-AdamBC {'leads' if gap > 0 else 'trails'} by "
               f"{abs(gap):.2f} points." if abs(gap) >= noise_points else
               f"a gap of {gap:+.2f} points, within noise."))
    if tuned:
        text.append(
            f"The fixed learning rates are the main experiment's picks "
            f"({full_steps} steps); the lr sweep re-tunes them for "
            f"{steps or 'these'} steps: "
            + ", ".join(f"{series} is best at lr {lr:g} ({100 * a:.2f}%)"
                        for series, (lr, a) in tuned.items()) + ".")
    else:
        text.append(
            f"Both learning rates are the main experiment's picks "
            f"({full_steps} steps) and were not re-tuned for "
            f"{steps or 'these'} steps.")
    if larger_steps:
        text.append(
            "Both the Φ' and the γ' ablation favour a setting that takes "
            "larger steps than the reference (Φ' > Φ, γ' < 0.04·Φ)")
        best_bc = tuned.get("DP-AdamBC")
        if best_bc is None:
            text[-1] += (
                f", which suggests that lr {lr_corrected:g} is on the small "
                "side for this shorter run; telling that apart from a real "
                "preference needs a learning-rate sweep at this scale.")
        elif best_bc[0] > lr_corrected:
            text[-1] += (
                f", and the lr sweep agrees that lr {lr_corrected:g} is on "
                f"the small side at this scale (best: {best_bc[0]:g}): "
                "those two ablations partly measure an under-tuned step "
                "size.")
        else:
            text[-1] += (
                f"; the lr sweep finds no larger learning rate better than "
                f"{lr_corrected:g} (best: {best_bc[0]:g}), so the larger "
                "steps they prefer come from Φ' and γ' themselves.")
    if drops:
        text.append(
            "Runs that ended more than the noise below their peak: "
            + "; ".join(f"{label} peaked at {100 * peak:.2f}% (step {step}) "
                        f"and ended at {100 * final:.2f}%"
                        for label, step, peak, final in drops) + ".")
    return " ".join(text)

