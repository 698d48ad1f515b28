"""The paper's ablations of DP-AdamBC on Fashion-MNIST with the paper's CNN.

    python -m examples.ablations --ablation=all
    python -m examples.ablations --max_examples=20000 --noise_multiplier=0.59 \
        --eval_every=40 --spread_seeds=1,2    # docs/ABLATIONS_fashion_mnist.md

Tang & Lecuyer ablate three choices of DP-AdamBC (Algorithm 1,
theta <- theta - eta * m_hat / sqrt(max(v_hat - Phi', gamma'))). Each
ablation sweeps one hyperparameter with everything else fixed, one run
(`examples.train_image`) per setting at `--seed`, which also keys the DP
noise and the Poisson sampling (`reproduce.run_config`: reproducible research
runs on public data, not private ones):

1. `phi`: the subtracted Phi' = m * Phi for m in `--phi_multiples`
   (default 0.1, 1, 10), Phi = (sigma C / B)^2 the true noise variance.
   gamma' stays at 0.04 * Phi (of the true Phi) so that only Phi' moves.
2. `gamma`: gamma' in `--gammas` (default 1e-9 ... 1e-5 and `none`, the
   default 0.04 * Phi), lr 1e-3. gamma' only means something relative to Phi:
   the report gives gamma' / Phi for each.
3. `beta`: beta_2 in `--beta_2s` (default 0.99, 0.999, 0.9999) with
   (1 - beta_1) = sqrt(1 - beta_2), for DP-AdamBC (lr 1e-3, gamma' = 0.04
   Phi) and DP-Adam (biased; lr 1e-2, gamma = 1e-8, its best on
   Fashion-MNIST), next to Keras' defaults beta = (0.9, 0.999).
4. `lr`: the learning rate at this scale, DP-AdamBC over
   `--lr_sweep_corrected` (default 3e-4, 1e-3, 3e-3, 1e-2) and DP-Adam over
   `--lr_sweep_adam` (default 3e-3, 1e-2, 3e-2), everything else default:
   whether the other ablations' fixed learning rates (the main
   experiment's picks) still suit a shorter run.

`--ablation=all` runs the four (the DP-AdamBC run with the defaults, lr
1e-3, gamma' = 0.04 Phi, true Phi, beta = (0.9, 0.999), is the reference of
all four and trains once; DP-Adam's default run is shared by `beta` and
`lr`). `--spread_seeds` reruns that reference with
other seeds, which measures the seed-to-seed spread the report uses to tell
an effect from noise.

Each run is a model_dir `<runs_dir>/<variant>/<run name>` written by
`examples.reproduce.execute`: a finished run is read back, an interrupted one
resumes, a folder of other hyperparameters or data is refused. Every call
rewrites `<output_dir>/ABLATIONS_fashion_mnist.md` (a table per ablation,
plots, the command, a paragraph from the numbers) with a PNG per ablation,
from all the finished runs on disk; `--notrain` only writes the report.

C, sigma and B default to the main experiment's (C = 1, sigma = 0.52,
B = 256, epsilon = 7: 719 steps on the 60k images). For a cheaper run use a
subset and recalibrate sigma so that epsilon = 7 still takes a few hundred
steps, e.g. `--max_examples=20000 --noise_multiplier=0.59` (235 steps; the
22 runs of the report took 32 minutes on 2 CPU cores shared with other jobs).
The fixed learning rates are the main experiment's picks at every scale;
the `lr` ablation checks them at the scale of the run.
"""

import dataclasses
import math
import os
import shlex
import sys

from absl import app
from absl import flags
import numpy as np

import tf_dpadam
from examples import common
from examples import reproduce
from tf_dpadam import dp_math

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASK = "fashion_mnist"
ABLATIONS = ("phi", "gamma", "beta", "lr")
REPORT_STEM = "ABLATIONS_fashion_mnist"
# The main experiment (docs/RESULTS_fashion_mnist.md): all 60k training
# images at epsilon = 7 with PAPER_DEFAULTS' C, sigma and B.
MAIN_NUM_EXAMPLES = 60000
MAIN_TARGET_EPSILON = 7.0
DEFAULT_BETAS = (0.9, 0.999)  # Keras' (and the paper's main) beta_1, beta_2.
GAMMA_OVER_PHI = dp_math.DEFAULT_GAMMA_OVER_PHI  # gamma' = 0.04 * Phi.

# When the seed spread is not measured (no --spread_seeds), a difference of
# two single-seed runs below this many points is called noise. For scale:
# the 3-seed standard deviations at full scale (RESULTS_fashion_mnist.md)
# are about 0.5 points, and a difference of two runs has sqrt(2) times that.
FALLBACK_NOISE_POINTS = 1.0
# Below this accuracy a run is called collapsed (10 classes: chance = 10%).
COLLAPSE_ACCURACY = 0.5


def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("ablation", "all", list(ABLATIONS) + ["all"],
                      "Which ablation to train (the report shows every "
                      "finished run).")
    flags.DEFINE_integer("max_examples", None,
                         "Use only the first this many training examples.")
    flags.DEFINE_integer("seed", 0,
                         "Seed of every ablation run (model, data order, "
                         "DP noise and sampling: reproducible, not private).")
    flags.DEFINE_list("spread_seeds", [],
                      "Extra seeds of the reference DP-AdamBC run, to "
                      "measure the seed-to-seed spread.")
    flags.DEFINE_integer("eval_every", 50,
                         "Steps between test-set evaluations (the curves).")
    flags.DEFINE_string("runs_dir", None,
                        "Folder of the runs (default: runs/ablations in the "
                        "repository).")
    flags.DEFINE_string("output_dir", None,
                        "Where ABLATIONS_fashion_mnist.md and its PNGs go "
                        "(default: docs/ in the repository).")
    flags.DEFINE_string("data_dir", None,
                        "Folder of the Fashion-MNIST IDX files (default: "
                        "Debian's, else tfds).")
    flags.DEFINE_bool("train", True,
                      "Train the missing runs; --notrain only writes the "
                      "report.")
    flags.DEFINE_list("phi_multiples", ["0.1", "1", "10"],
                      "phi ablation: Phi' / Phi.")
    flags.DEFINE_list("gammas", ["1e-9", "1e-8", "1e-7", "1e-6", "1e-5",
                                 "none"],
                      "gamma ablation: DP-AdamBC's gamma'; 'none' = 0.04 * "
                      "Phi.")
    flags.DEFINE_list("beta_2s", ["0.99", "0.999", "0.9999"],
                      "beta ablation: beta_2, with beta_1 = 1 - sqrt(1 - "
                      "beta_2).")
    flags.DEFINE_list("lr_sweep_corrected", ["3e-4", "1e-3", "3e-3", "1e-2"],
                      "lr ablation: DP-AdamBC's learning rates.")
    flags.DEFINE_list("lr_sweep_adam", ["3e-3", "1e-2", "3e-2"],
                      "lr ablation: DP-Adam's learning rates.")
    flags.DEFINE_float("learning_rate_corrected", 1e-3,
                       "DP-AdamBC's learning rate (all ablations).")
    flags.DEFINE_float("learning_rate_adam", 1e-2,
                       "DP-Adam's learning rate (beta ablation).")
    flags.DEFINE_float("gamma_adam", 1e-8,
                       "DP-Adam's gamma, outside the root (beta ablation).")
    flags.DEFINE_float("l2_norm_clip", None, "C (default: 1).")
    flags.DEFINE_float("noise_multiplier", None, "sigma (default: 0.52).")
    flags.DEFINE_integer("batch_size", None,
                         "B, the expected batch size (default: 256).")
    flags.DEFINE_integer("physical_batch_size", None,
                         "Examples per forward/backward pass (default: all).")
    flags.DEFINE_float("target_epsilon", 7.0,
                       "Train for the most steps with epsilon <= this.")
    flags.DEFINE_float("delta", 1e-5, "delta.")


FLAGS = flags.FLAGS


# --------------------------------------------------------------------------
# Pure helpers: the swept values.


def true_phi(l2_norm_clip, noise_multiplier, batch_size):
    """Phi = (sigma C / B)^2, the noise's bias in each coordinate of v."""
    return dp_math.noise_variance_phi(l2_norm_clip, noise_multiplier,
                                      batch_size)


def phi_values(phi, multiples):
    """`(multiple, multiple * phi)` for each multiple (> 0)."""
    for m in multiples:
        if not m > 0:
            raise ValueError(f"Expected Phi' multiples > 0, got {m}.")
    return tuple((float(m), float(m) * phi) for m in multiples)


def paired_beta_1(beta_2):
    """beta_1 with (1 - beta_1) = sqrt(1 - beta_2), for beta_2 in (0, 1)."""
    if not 0 < beta_2 < 1:
        raise ValueError(f"Expected 0 < beta_2 < 1, got {beta_2}.")
    return 1.0 - math.sqrt(1.0 - beta_2)


@dataclasses.dataclass(frozen=True)
class Arm:
    """The hyperparameters one run changes from the shared `TrainConfig`.

    gamma: gamma' of DP-AdamBC (None: 0.04 * the Phi it subtracts) or gamma
    of DP-Adam. phi_multiple: None for the true Phi, else Phi' / Phi.
    """

    optimizer: str
    learning_rate: float
    gamma: float | None
    phi_multiple: float | None = None
    beta_1: float = DEFAULT_BETAS[0]
    beta_2: float = DEFAULT_BETAS[1]


@dataclasses.dataclass(frozen=True)
class Point:
    """One setting of an ablation: its run, where it goes on the plot
    (`series` line, `x` on the log axis) and its row label."""

    series: str
    x: float
    label: str
    arm: Arm
    reference: bool = False  # The default setting (a star in the plot).


@dataclasses.dataclass(frozen=True)
class Ablation:
    name: str
    title: str
    x_label: str
    points: tuple
    fixed: str  # What is held fixed, for the report.


@dataclasses.dataclass(frozen=True)
class Sweeps:
    """The values each ablation sweeps, and the fixed optimizer settings."""

    phi_multiples: tuple = (0.1, 1.0, 10.0)
    gammas: tuple = (1e-9, 1e-8, 1e-7, 1e-6, 1e-5, None)
    beta_2s: tuple = (0.99, 0.999, 0.9999)
    lr_sweep_corrected: tuple = (3e-4, 1e-3, 3e-3, 1e-2)
    lr_sweep_adam: tuple = (3e-3, 1e-2, 3e-2)
    learning_rate_corrected: float = 1e-3
    learning_rate_adam: float = 1e-2
    gamma_adam: float = 1e-8


def reference_arm(sweeps):
    """DP-AdamBC with every default: the shared reference run."""
    return Arm("dpadam_corrected", sweeps.learning_rate_corrected, None)


def _lr_points(series, swept, fixed, make_arm):
    """The lr ablation's points of one optimizer: the swept learning rates
    and the fixed one (the reference, added if not swept)."""
    points = []
    for lr in sorted(set(swept) | {fixed}):
        if not lr > 0:
            raise ValueError(f"Expected learning rates > 0, got {lr}.")
        points.append(Point(
            series, lr,
            f"{series}, lr {lr:g}" + (" (default)" if lr == fixed else ""),
            make_arm(lr), reference=lr == fixed))
    return points


def make_ablations(phi, sweeps):
    """name -> `Ablation`, for the true Phi of the runs."""
    lr_bc = sweeps.learning_rate_corrected
    gamma_at_phi = GAMMA_OVER_PHI * phi
    phi_points = []
    for m, value in phi_values(phi, sweeps.phi_multiples):
        # m = 1 is the reference run itself (true Phi, gamma' = 0.04 Phi).
        arm = (reference_arm(sweeps) if m == 1 else
               Arm("dpadam_corrected", lr_bc, gamma_at_phi, phi_multiple=m))
        phi_points.append(Point("DP-AdamBC", m,
                                f"Φ' = {m:g}·Φ = {value:.3g}", arm,
                                reference=m == 1))
    gamma_points = []
    for gamma in sweeps.gammas:
        if gamma is None:
            gamma_points.append(Point(
                "DP-AdamBC", gamma_at_phi,
                f"γ' = {GAMMA_OVER_PHI:g}·Φ = {gamma_at_phi:.3g} (default)",
                reference_arm(sweeps), reference=True))
        else:
            if not gamma > 0:
                raise ValueError(f"Expected gamma' > 0, got {gamma}.")
            gamma_points.append(Point(
                "DP-AdamBC", gamma,
                f"γ' = {gamma:g} = {gamma / phi:.3g}·Φ",
                Arm("dpadam_corrected", lr_bc, float(gamma))))
    beta_points = []
    for series, optimizer, lr, gamma in (
            ("DP-AdamBC", "dpadam_corrected", lr_bc, None),
            ("DP-Adam", "dpadam", sweeps.learning_rate_adam,
             sweeps.gamma_adam)):
        for beta_2 in sweeps.beta_2s:
            beta_1 = paired_beta_1(beta_2)
            beta_points.append(Point(
                series, 1.0 - beta_2,
                f"{series}, β₂ = {beta_2:g}, β₁ = {beta_1:.4g}",
                Arm(optimizer, lr, gamma, beta_1=beta_1, beta_2=beta_2)))
        beta_points.append(Point(
            series, 1.0 - DEFAULT_BETAS[1],
            f"{series}, β = {DEFAULT_BETAS} (default, unpaired)",
            Arm(optimizer, lr, gamma), reference=True))
    lr_points = _lr_points(
        "DP-AdamBC", sweeps.lr_sweep_corrected, lr_bc,
        lambda lr: Arm("dpadam_corrected", lr, None))
    lr_points += _lr_points(
        "DP-Adam", sweeps.lr_sweep_adam, sweeps.learning_rate_adam,
        lambda lr: Arm("dpadam", lr, sweeps.gamma_adam))
    return {
        "phi": Ablation(
            "phi", "Φ' ablation: the subtracted noise variance",
            "Φ' / Φ", tuple(phi_points),
            f"DP-AdamBC, lr {lr_bc:g}, γ' = {GAMMA_OVER_PHI:g}·Φ = "
            f"{gamma_at_phi:.3g} (of the true Φ, in every run), β = "
            f"{DEFAULT_BETAS}"),
        "gamma": Ablation(
            "gamma", "γ' sweep: the floor inside the square root",
            "γ'", tuple(gamma_points),
            f"DP-AdamBC, lr {lr_bc:g}, true Φ = {phi:.3g}, β = "
            f"{DEFAULT_BETAS}"),
        "beta": Ablation(
            "beta", "β sweep with (1 − β₁) = √(1 − β₂)",
            "1 − β₂", tuple(beta_points),
            f"DP-AdamBC: lr {lr_bc:g}, γ' = {GAMMA_OVER_PHI:g}·Φ; DP-Adam "
            f"(biased): lr {sweeps.learning_rate_adam:g}, γ = "
            f"{sweeps.gamma_adam:g} outside the root"),
        "lr": Ablation(
            "lr", "Learning rate at this scale", "learning rate",
            tuple(lr_points),
            f"DP-AdamBC: γ' = {GAMMA_OVER_PHI:g}·Φ, true Φ; DP-Adam "
            f"(biased): γ = {sweeps.gamma_adam:g} outside the root; β = "
            f"{DEFAULT_BETAS} for both"),
    }


def variant_name(arm):
    """The folder of the runs sharing `arm`'s Phi' and betas."""
    parts = []
    if arm.phi_multiple is not None:
        parts.append(f"phi{arm.phi_multiple:g}x")
    if (arm.beta_1, arm.beta_2) != DEFAULT_BETAS:
        parts.append(f"b1_{arm.beta_1:.6g}_b2_{arm.beta_2:g}")
    return "_".join(parts) or "default"


def arm_plan(arm, *, base, seed, runs_dir, data):
    """The one-run `reproduce.Plan` and `reproduce.Setting` of `arm`.

    The plan's base carries Phi' and the betas (which `reproduce.run_config`
    keeps); the setting carries optimizer, lr and gamma; the run lives in
    `<runs_dir>/<variant_name(arm)>/<reproduce.run_name(setting, seed)>`.
    """
    phi = None
    if arm.phi_multiple is not None:
        phi = arm.phi_multiple * true_phi(base.l2_norm_clip,
                                          base.noise_multiplier,
                                          base.batch_size)
    plan = reproduce.Plan(
        task=TASK,
        base=dataclasses.replace(base, phi=phi, beta_1=arm.beta_1,
                                 beta_2=arm.beta_2),
        grids={}, seeds=(seed,),
        runs_dir=os.path.join(runs_dir, variant_name(arm)), data=data)
    setting = reproduce.Setting(arm.optimizer, arm.learning_rate, arm.gamma)
    return plan, setting


def unique_arms(ablations):
    """The distinct arms of the ablations, in order of first appearance."""
    return tuple(dict.fromkeys(p.arm for a in ablations for p in a.points))


# --------------------------------------------------------------------------
# Pure helpers: judging the numbers.


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


# --------------------------------------------------------------------------
# Runs on disk.


def load_arm(arm, *, base, seed, runs_dir, data):
    """The finished `reproduce.Record` of `arm` at `seed`, or None."""
    plan, setting = arm_plan(arm, base=base, seed=seed, runs_dir=runs_dir,
                             data=data)
    model_dir = os.path.join(plan.runs_dir, reproduce.run_name(setting, seed))
    config = reproduce.run_config(plan.base, setting, seed, model_dir)
    return reproduce.load_record(model_dir, setting, seed, config, plan.data)


def collect(arms, seeds, **where):
    """`(arm, seed) -> Record` of the finished runs among arms x seeds."""
    records = {}
    for arm in arms:
        for seed in seeds:
            record = load_arm(arm, seed=seed, **where)
            if record is not None:
                records[(arm, seed)] = record
    return records


# --------------------------------------------------------------------------
# The report.


def _fmt_gamma(arm):
    return f"{GAMMA_OVER_PHI:g}·Φ" if arm.gamma is None else f"{arm.gamma:.3g}"


def _fmt_phi(arm):
    return "Φ" if arm.phi_multiple is None else f"{arm.phi_multiple:g}·Φ"


def plot_ablation(path, ablation, records, seed, phi):
    """Final accuracy vs the swept value (log axis) and accuracy vs step."""
    figure = reproduce.new_figure(11.0, 4.0)
    left = figure.add_subplot(1, 2, 1)
    right = figure.add_subplot(1, 2, 2)
    colors = {}
    for series in dict.fromkeys(p.series for p in ablation.points):
        line_points = sorted(
            (p.x, records[(p.arm, seed)].accuracy) for p in ablation.points
            if p.series == series and not p.reference
            and (p.arm, seed) in records)
        # In the gamma sweep the default belongs on the line (at 0.04 Phi).
        if ablation.name in ("phi", "gamma", "lr"):
            line_points = sorted(line_points + [
                (p.x, records[(p.arm, seed)].accuracy)
                for p in ablation.points if p.series == series
                and p.reference and (p.arm, seed) in records])
        (line,) = left.plot([x for x, _ in line_points],
                            [100 * a for _, a in line_points], marker="o",
                            label=series)
        colors[series] = line.get_color()
    several = len(colors) > 1
    styles = ("-", "--", ":", "-.")
    seen = {}  # series -> curves drawn so far.
    for p in ablation.points:
        record = records.get((p.arm, seed))
        if record is None:
            continue
        if p.reference:
            left.plot([p.x], [100 * record.accuracy], marker="*",
                      markersize=14, color=colors[p.series],
                      linestyle="none", label=f"{p.series} default")
        # Several series: one color per series, one line style per setting.
        index = seen[p.series] = seen.get(p.series, -1) + 1
        style = dict(color=colors[p.series],
                     linestyle=styles[index % len(styles)]) if several else (
            dict(linestyle="--" if p.reference else "-"))
        right.plot([s for s, _ in record.history],
                   [100 * a for _, a in record.history], marker=".",
                   label=p.label, **style)
    if ablation.name == "gamma":
        left.axvline(phi, color="gray", linestyle=":", label="Φ")
    left.set_xscale("log")
    left.set_xlabel(ablation.x_label)
    left.set_ylabel("final test accuracy (%)")
    left.set_title(ablation.title, fontsize="medium")
    left.grid(alpha=0.3)
    left.legend(fontsize="small")
    right.set_xlabel("step")
    right.set_ylabel("test accuracy (%)")
    right.set_title("test accuracy vs step", fontsize="medium")
    right.grid(alpha=0.3)
    right.legend(fontsize="x-small", loc="lower right")
    figure.tight_layout()
    figure.savefig(path)


def scale_sentence(*, num_examples, noise_multiplier, batch_size, steps,
                   full_examples, full_noise, full_batch, full_steps,
                   calibrated=True):
    """How the runs' scale compares to the main experiment's.

    Args:
        num_examples, steps: of the runs (None when unknown or mixed).
        noise_multiplier, batch_size: of the runs.
        full_examples, full_noise, full_batch, full_steps: of the main
            experiment.
        calibrated: whether the runs train to an epsilon target (else for a
            number of epochs).
    """
    if (num_examples, noise_multiplier, batch_size) == (
            full_examples, full_noise, full_batch):
        return ("Scale: the main experiment's (RESULTS_fashion_mnist.md), "
                "so the reference run is comparable with it.")
    return (
        f"Scale: **reduced** from the main experiment "
        f"(RESULTS_fashion_mnist.md: N = {full_examples}, σ = "
        f"{full_noise:g}, B = {full_batch}, {full_steps} steps at "
        f"ε = {MAIN_TARGET_EPSILON:g}) to N = {num_examples or '?'} "
        "training images (the first ones), "
        f"σ = {noise_multiplier:g}, B = {batch_size}, {steps or '?'} steps"
        + (" (σ recalibrated so that ε stays at the target)" if calibrated
           else " (a number of epochs, no ε target)")
        + ". Compare settings within an ablation, not with the main "
        "results.")


def render_markdown(*, ablations, records, seed, spread_seeds, base, sweeps,
                    runs_dir, data, command, machine, plots, scale,
                    full_steps):
    """The report as markdown text.

    Args:
        ablations: the `Ablation`s to show, in order.
        records: `(arm, seed) -> reproduce.Record` of the finished runs.
        seed: the seed of the ablation runs.
        spread_seeds: extra seeds of the reference arm.
        base: the shared `TrainConfig`.
        sweeps: the `Sweeps`.
        runs_dir: folder of the runs, for the text.
        data: `reproduce.data_spec(...)`.
        command: this command line.
        machine: `reproduce.machine_info()`.
        plots: ablation name -> PNG file name (relative to the report), for
            the ablations with a plot.
        scale: `scale_sentence(...)`.
        full_steps: steps of the main experiment, for the summary.
    """
    phi = true_phi(base.l2_norm_clip, base.noise_multiplier, base.batch_size)
    runs = list(records.values())
    steps = sorted({r.steps for r in runs})
    eps = sorted({round(r.epsilon, 3) for r in runs})
    sizes = sorted({r.num_examples for r in runs})
    reference = reference_arm(sweeps)
    ref_accs = [records[(reference, s)].accuracy
                for s in (seed,) + tuple(spread_seeds)
                if (reference, s) in records]
    noise_points, noise_text = noise_threshold(ref_accs)
    lines = [
        "# Ablations of DP-AdamBC on Fashion-MNIST (the paper's CNN)",
        "",
        f"Written by `examples/ablations.py` from the runs in `{runs_dir}`.",
        "",
        "## Setup",
        "",
        f"- Command (this report): `{command}`",
    ]
    train_commands = sorted({r.command for r in runs if r.command})
    if train_commands and train_commands != [command]:
        lines.append("- Commands that trained the runs: "
                     + "; ".join(f"`{c}`" for c in train_commands))
    lines += [
        f"- Machine: `{machine.get('platform')}`, {machine.get('cpu_count')} "
        f"CPUs (shared with other jobs), Python {machine.get('python')}, "
        f"TensorFlow {machine.get('tensorflow')}, Keras "
        f"{machine.get('keras')}.",
        f"- Data: Fashion-MNIST, "
        + (" / ".join(map(str, sizes)) if sizes else "?")
        + " training examples"
        + (f" (`--max_examples={data['max_examples']}`)"
           if data.get("max_examples") else "")
        + "; evaluated on the whole test set.",
        "- Model: the paper's 5-layer tanh CNN (examples.models.make_cnn).",
        f"- Privacy: C = {base.l2_norm_clip:g}, σ = "
        f"{base.noise_multiplier:g}, expected batch B = {base.batch_size} "
        f"(Poisson sampling), δ = {base.delta:g}, "
        + (f"target ε = {base.target_epsilon:g}" if base.target_epsilon
           else f"{base.epochs:g} epoch(s), no ε target")
        + "; steps per run: "
        f"{' / '.join(map(str, steps)) or 'n/a'}; ε spent: "
        f"{' / '.join(f'{e:.3f}' for e in eps) or 'n/a'}. Φ = (σC/B)² = "
        f"{phi:.3g}, so 0.04·Φ = {GAMMA_OVER_PHI * phi:.3g}.",
        f"- {scale}",
        f"- Runs: one per setting, seed {seed}"
        + (f"; the reference DP-AdamBC setting (lr "
           f"{sweeps.learning_rate_corrected:g}, γ' = 0.04·Φ, true Φ, β = "
           f"(0.9, 0.999)) also with seeds "
           f"{', '.join(map(str, spread_seeds))}" if spread_seeds else "")
        + f". Test accuracy evaluated every {base.eval_every} steps; the "
        "final one is after the last step.",
        f"- Noise: {noise_text}",
        "",
    ]
    for ablation in ablations:
        lines += [f"## {ablation.title}", "",
                  f"Fixed: {ablation.fixed}.", "",
                  "| setting | optimizer | lr | γ' (γ for DP-Adam) | Φ' | "
                  "β₁ | β₂ | final test accuracy (%) | ε | steps | "
                  "wall (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in ablation.points:
            arm = p.arm
            record = records.get((arm, seed))
            name = reproduce.OPTIMIZER_NAMES[arm.optimizer]
            head = (f"| {p.label} | {name} | {arm.learning_rate:g} | "
                    f"{_fmt_gamma(arm)} | {_fmt_phi(arm)} | "
                    f"{arm.beta_1:.4g} | {arm.beta_2:g} |")
            if record is None:
                lines.append(head + " not run | | | |")
            else:
                lines.append(
                    head + f" {reproduce.format_percent(record.accuracy)} | "
                    f"{record.epsilon:.3f} | {record.steps} | "
                    f"{reproduce.format_seconds(record.wall_seconds)} |")
        lines.append("")
        lines.append(_describe(ablation, records, seed, phi, noise_points))
        lines.append("")
        if ablation.name in plots:
            lines += [f"![{ablation.title}]({plots[ablation.name]})", "",
                      "Left: final test accuracy against the swept value "
                      "(log axis; stars: the default setting). Right: test "
                      "accuracy against the step.", ""]
    lines += ["## Summary", "",
              _summary(ablations, records, seed, phi, noise_points, sweeps,
                       steps[0] if len(steps) == 1 else None, full_steps),
              ""]
    if spread_seeds:
        lines += ["## Seed spread of the reference setting", "",
                  "| seed | final test accuracy (%) | ε | steps |",
                  "|---|---|---|---|"]
        for s in (seed,) + tuple(spread_seeds):
            record = records.get((reference, s))
            lines.append(
                f"| {s} | not run | | |" if record is None else
                f"| {s} | {reproduce.format_percent(record.accuracy)} | "
                f"{record.epsilon:.3f} | {record.steps} |")
        lines.append("")
    total = sum(r.wall_seconds or 0.0 for r in runs)
    lines += [f"Total wall time: {total:.0f} s ({total / 60:.1f} min) over "
              f"{len(runs)} runs (the session that finished each run; a "
              "resumed run counts only its last session).", ""]
    return "\n".join(lines)


def _accuracies(ablation, records, seed):
    """`(point, accuracy or None)` of an ablation's points."""
    return [(p, records[(p.arm, seed)].accuracy
             if (p.arm, seed) in records else None)
            for p in ablation.points]


def _summary(ablations, records, seed, phi, noise_points, sweeps, steps,
             full_steps):
    by_name = {a.name: a for a in ablations}
    phi_results = gamma_results = []
    if "phi" in by_name:
        phi_results = [(p.x, a) for p, a in
                       _accuracies(by_name["phi"], records, seed)]
    if "gamma" in by_name:
        gamma_results = [(None if p.reference else p.x, a) for p, a in
                         _accuracies(by_name["gamma"], records, seed)]
    adam = None
    if "beta" in by_name:
        adam = next((a for p, a in _accuracies(by_name["beta"], records,
                                               seed)
                     if p.reference and p.arm.optimizer == "dpadam"), None)
    tuned = {}
    if "lr" in by_name:
        tuned = best_learning_rates(_lr_results(by_name["lr"], records, seed))
    reference = records.get((reference_arm(sweeps), seed))
    drops = []
    for ablation in ablations:
        for p in ablation.points:
            record = records.get((p.arm, seed))
            peak = record and peak_then_drop(record.history, noise_points)
            if peak and p.label not in [d[0] for d in drops]:
                drops.append((p.label, peak[0], peak[1], record.accuracy))
    return describe_summary(
        corrected=reference and reference.accuracy, adam=adam,
        larger_steps=favours_larger_steps(phi_results, gamma_results, phi,
                                          noise_points),
        drops=drops, noise_points=noise_points,
        lr_corrected=sweeps.learning_rate_corrected,
        lr_adam=sweeps.learning_rate_adam, steps=steps,
        full_steps=full_steps, tuned=tuned)


def _lr_results(ablation, records, seed):
    """The lr ablation's `series -> [(lr, accuracy or None, is_default)]`."""
    results = {}
    for p, a in _accuracies(ablation, records, seed):
        results.setdefault(p.series, []).append((p.x, a, p.reference))
    return results


def _describe(ablation, records, seed, phi, noise_points):
    def acc(point):
        record = records.get((point.arm, seed))
        return None if record is None else record.accuracy

    if ablation.name == "phi":
        return describe_phi([(p.x, acc(p)) for p in ablation.points],
                            noise_points)
    if ablation.name == "gamma":
        return describe_gamma(
            [(None if p.reference else p.x, acc(p))
             for p in ablation.points], phi, noise_points)
    if ablation.name == "lr":
        return describe_lr(_lr_results(ablation, records, seed),
                           noise_points)
    results = {}
    for p in ablation.points:
        key = "default" if p.reference else p.arm.beta_2
        results.setdefault(p.series, []).append((key, acc(p)))
    return describe_beta(results, noise_points)


# --------------------------------------------------------------------------
# The pipeline.


def write_report(*, ablations, base, sweeps, seed, spread_seeds, runs_dir,
                 data, output_dir, command, machine):
    """Writes the report and a PNG per ablation with runs; returns its path."""
    os.makedirs(output_dir, exist_ok=True)
    where = dict(base=base, runs_dir=runs_dir, data=data)
    arms = unique_arms(ablations.values())
    records = collect(arms, (seed,), **where)
    records.update(collect((reference_arm(sweeps),), tuple(spread_seeds),
                           **where))
    phi = true_phi(base.l2_norm_clip, base.noise_multiplier, base.batch_size)
    plots = {}
    for name, ablation in ablations.items():
        if any((p.arm, seed) in records for p in ablation.points):
            plots[name] = f"{REPORT_STEM}_{name}.png"
            plot_ablation(os.path.join(output_dir, plots[name]), ablation,
                          records, seed, phi)
    defaults = common.PAPER_DEFAULTS[TASK]
    full_steps = tf_dpadam.calibrate_steps(
        target_epsilon=MAIN_TARGET_EPSILON, num_examples=MAIN_NUM_EXAMPLES,
        batch_size=defaults["batch_size"],
        noise_multiplier=defaults["noise_multiplier"], delta=base.delta)
    sizes = sorted({r.num_examples for r in records.values()})
    steps = sorted({r.steps for r in records.values()})
    scale = scale_sentence(
        num_examples=sizes[0] if len(sizes) == 1 else None,
        noise_multiplier=base.noise_multiplier, batch_size=base.batch_size,
        steps=steps[0] if len(steps) == 1 else None,
        full_examples=MAIN_NUM_EXAMPLES,
        full_noise=defaults["noise_multiplier"],
        full_batch=defaults["batch_size"], full_steps=full_steps,
        calibrated=base.target_epsilon is not None)
    text = render_markdown(
        ablations=list(ablations.values()), records=records, seed=seed,
        spread_seeds=tuple(spread_seeds), base=base, sweeps=sweeps,
        runs_dir=runs_dir, data=data, command=command, machine=machine,
        plots=plots, scale=scale, full_steps=full_steps)
    path = os.path.join(output_dir, f"{REPORT_STEM}.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def run_ablations(names, *, base, sweeps, seed, spread_seeds, runs_dir, data,
                  train_fn, output_dir, command, machine=None, train=True):
    """Trains the missing runs of the ablations `names`, writes the report.

    Args:
        names: ablations to train (a subset of `ABLATIONS`); the report
            shows all of them.
        base: the shared `TrainConfig` (e.g. `reproduce.base_config`).
        sweeps: the `Sweeps`.
        seed: seed of the ablation runs.
        spread_seeds: extra seeds of the reference arm (trained last).
        runs_dir: folder of the runs.
        data: `reproduce.data_spec(...)`, saved with every run.
        train_fn: config -> results (e.g. `reproduce.make_train_fn`); only
            called for runs that are not finished.
        output_dir: folder of the report.
        command: the command line, for the report.
        machine: `reproduce.machine_info()` (computed if None).
        train: False only writes the report.

    Returns:
        The path of the report.
    """
    for name in names:
        if name not in ABLATIONS:
            raise ValueError(f"Unknown ablation {name!r}; expected one of "
                             f"{ABLATIONS}.")
    machine = machine or reproduce.machine_info()
    phi = true_phi(base.l2_norm_clip, base.noise_multiplier, base.batch_size)
    ablations = make_ablations(phi, sweeps)
    where = dict(base=base, runs_dir=runs_dir, data=data)
    todo = [(arm, seed) for arm in
            unique_arms(ablations[n] for n in names)]
    todo += [(reference_arm(sweeps), s) for s in spread_seeds]
    # Check every run folder first: a mismatch fails before any training.
    for arm, s in todo:
        load_arm(arm, seed=s, **where)
    if train:
        for arm, s in todo:
            plan, setting = arm_plan(arm, seed=s, **where)
            reproduce.execute(plan, setting, s, train_fn, command, machine)
    return write_report(ablations=ablations, base=base, sweeps=sweeps,
                        seed=seed, spread_seeds=spread_seeds,
                        runs_dir=runs_dir, data=data, output_dir=output_dir,
                        command=command, machine=machine)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    try:
        base = reproduce.base_config(
            reproduce.TASKS[TASK]["dataset"],
            l2_norm_clip=FLAGS.l2_norm_clip,
            noise_multiplier=FLAGS.noise_multiplier,
            batch_size=FLAGS.batch_size,
            physical_batch_size=FLAGS.physical_batch_size,
            target_epsilon=FLAGS.target_epsilon, delta=FLAGS.delta,
            eval_every=FLAGS.eval_every)
        sweeps = Sweeps(
            phi_multiples=reproduce.parse_floats(FLAGS.phi_multiples),
            gammas=reproduce.parse_gammas(FLAGS.gammas),
            beta_2s=reproduce.parse_floats(FLAGS.beta_2s),
            lr_sweep_corrected=reproduce.parse_floats(
                FLAGS.lr_sweep_corrected),
            lr_sweep_adam=reproduce.parse_floats(FLAGS.lr_sweep_adam),
            learning_rate_corrected=FLAGS.learning_rate_corrected,
            learning_rate_adam=FLAGS.learning_rate_adam,
            gamma_adam=FLAGS.gamma_adam)
        spread_seeds = tuple(int(s) for s in FLAGS.spread_seeds)
        if FLAGS.seed in spread_seeds:
            raise ValueError(f"--spread_seeds repeats --seed={FLAGS.seed}.")
        names = ABLATIONS if FLAGS.ablation == "all" else (FLAGS.ablation,)
        data = reproduce.data_spec(TASK, max_examples=FLAGS.max_examples)
        train_fn = reproduce.make_train_fn(TASK, data_dir=FLAGS.data_dir,
                                           max_examples=FLAGS.max_examples)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    path = run_ablations(
        names, base=base, sweeps=sweeps, seed=FLAGS.seed,
        spread_seeds=spread_seeds,
        runs_dir=FLAGS.runs_dir or os.path.join(_ROOT, "runs", "ablations"),
        data=data, train_fn=train_fn,
        output_dir=FLAGS.output_dir or os.path.join(_ROOT, "docs"),
        command=shlex.join(sys.orig_argv), train=FLAGS.train)
    print(f"Wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
