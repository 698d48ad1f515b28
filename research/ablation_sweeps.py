"""What the ablations of DP-AdamBC sweep, and where their runs live.

Each ablation (`make_ablations`) is a list of `Point`s, each one run of an
`Arm`: the hyperparameters it changes from the shared `TrainConfig` (Phi' as
a multiple of the true Phi, gamma', the betas, the learning rate). Arms that
several ablations share (the DP-AdamBC reference with every default) train
once. An arm's run lives in `<runs_dir>/<variant_name(arm)>/<run name>`
(`arm_config`) and is read back by `load_arm` / `collect`.
"""

import dataclasses
import math
import os

from research import runs
from tf_dpadam.optimizers import arguments
from tf_dpadam.privatizer import dp_math
from tf_dpadam.privatizer import noise

TASK = "fashion_mnist"
ABLATIONS = ("phi", "gamma", "beta", "lr")
DEFAULT_BETAS = (0.9, 0.999)  # Keras' (and the paper's main) beta_1, beta_2.
GAMMA_OVER_PHI = dp_math.DEFAULT_GAMMA_OVER_PHI  # gamma' = 0.04 * Phi.

def true_phi(l2_norm_clip, noise_multiplier, batch_size):
    """Phi = (sigma C / B)^2, the noise's bias in each coordinate of v."""
    return noise.noise_variance_phi(
        arguments.noise_stddev(l2_norm_clip, noise_multiplier), batch_size)


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


def arm_config(arm, *, base, seed, runs_dir):
    """The `TrainConfig` of `arm`'s run at `seed`.

    Phi' and the betas go to the base (which `runs.run_config` keeps); the
    `runs.Setting` carries optimizer, lr and gamma; the run lives in
    `<runs_dir>/<variant_name(arm)>/<runs.run_name(setting, seed)>`.
    """
    phi = None
    if arm.phi_multiple is not None:
        phi = arm.phi_multiple * true_phi(base.l2_norm_clip,
                                          base.noise_multiplier,
                                          base.batch_size)
    setting = runs.Setting(arm.optimizer, arm.learning_rate, arm.gamma)
    model_dir = os.path.join(runs_dir, variant_name(arm),
                             runs.run_name(setting, seed))
    base = dataclasses.replace(base, phi=phi, beta_1=arm.beta_1,
                               beta_2=arm.beta_2)
    return runs.run_config(base, setting, seed, model_dir)

def unique_arms(ablations):
    """The distinct arms of the ablations, in order of first appearance."""
    return tuple(dict.fromkeys(p.arm for a in ablations for p in a.points))


def load_arm(arm, *, base, seed, runs_dir, data):
    """The finished `runs.Record` of `arm` at `seed`, or None."""
    config = arm_config(arm, base=base, seed=seed, runs_dir=runs_dir)
    return runs.load_record(config.model_dir, config, data)

def collect(arms, seeds, **where):
    """`(arm, seed) -> Record` of the finished runs among arms x seeds."""
    records = {}
    for arm in arms:
        for seed in seeds:
            record = load_arm(arm, seed=seed, **where)
            if record is not None:
                records[(arm, seed)] = record
    return records

