"""ABLATIONS_fashion_mnist.md and its PNGs, from the finished runs.

`write_report` reads back the runs of every ablation (`ablation_sweeps`),
draws a plot per ablation (`research.plots.plot_ablation`) and writes the
Markdown (`render_markdown`): the setup, a table and a paragraph per ablation
(`research.ablation_findings`), a summary and the seed spread.
"""

import os

import tf_dpadam
from research import ablation_findings
from research import ablation_sweeps
from research import common
from research import plots
from research import runs
from research.ablation_sweeps import GAMMA_OVER_PHI

REPORT_STEM = "ABLATIONS_fashion_mnist"
# The main experiment (research/results/RESULTS_fashion_mnist.md): all 60k
# training images at epsilon = 7 with PAPER_DEFAULTS' C, sigma and B.
MAIN_NUM_EXAMPLES = 60000
MAIN_TARGET_EPSILON = 7.0

def _fmt_gamma(arm):
    if arm.gamma is None:
        return f"{GAMMA_OVER_PHI:g}·Φ"
    return f"{arm.gamma:.3g}"


def _fmt_phi(arm):
    return "Φ" if arm.phi_multiple is None else f"{arm.phi_multiple:g}·Φ"


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
        records: `(arm, seed) -> runs.Record` of the finished runs.
        seed: the seed of the ablation runs.
        spread_seeds: extra seeds of the reference arm.
        base: the shared `TrainConfig`.
        sweeps: the `Sweeps`.
        runs_dir: folder of the runs, for the text.
        data: `experiments.data_spec(...)`.
        command: this command line.
        machine: `runs.machine_info()`.
        plots: ablation name -> PNG file name (relative to the report), for
            the ablations with a plot.
        scale: `scale_sentence(...)`.
        full_steps: steps of the main experiment, for the summary.
    """
    phi = ablation_sweeps.true_phi(base.l2_norm_clip, base.noise_multiplier,
                                   base.batch_size)
    finished = list(records.values())
    steps = sorted({r.steps for r in finished})
    eps = sorted({round(r.epsilon, 3) for r in finished})
    sizes = sorted({r.num_examples for r in finished})
    reference = ablation_sweeps.reference_arm(sweeps)
    ref_accs = [records[(reference, s)].accuracy
                for s in (seed,) + tuple(spread_seeds)
                if (reference, s) in records]
    noise_points, noise_text = ablation_findings.noise_threshold(ref_accs)
    lines = [
        "# Ablations of DP-AdamBC on Fashion-MNIST (the paper's CNN)",
        "",
        f"Written by `research/ablations.py` from the runs in `{runs_dir}`.",
        "",
        "## Setup",
        "",
        f"- Command (this report): `{command}`",
    ]
    train_commands = sorted({r.command for r in finished if r.command})
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
        "- Model: the paper's 5-layer tanh CNN (research.models.make_cnn).",
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
            name = common.OPTIMIZER_NAMES[arm.optimizer]
            head = (f"| {p.label} | {name} | {arm.learning_rate:g} | "
                    f"{_fmt_gamma(arm)} | {_fmt_phi(arm)} | "
                    f"{arm.beta_1:.4g} | {arm.beta_2:g} |")
            if record is None:
                lines.append(head + " not run | | | |")
            else:
                lines.append(
                    head + f" {runs.format_percent(record.accuracy)} | "
                    f"{record.epsilon:.3f} | {record.steps} | "
                    f"{runs.format_seconds(record.wall_seconds)} |")
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
                f"| {s} | {runs.format_percent(record.accuracy)} | "
                f"{record.epsilon:.3f} | {record.steps} |")
        lines.append("")
    total = sum(r.wall_seconds or 0.0 for r in finished)
    lines += [f"Total wall time: {total:.0f} s ({total / 60:.1f} min) over "
              f"{len(finished)} runs (the session that finished each run,"
              " plus the training time of its earlier sessions if it was"
              " resumed; runs resumed before `elapsed.json` existed,"
              " 2026-11-24, count only their last session).", ""]
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
        tuned = ablation_findings.best_learning_rates(
            _lr_results(by_name["lr"], records, seed))
    reference = records.get((ablation_sweeps.reference_arm(sweeps), seed))
    drops = []
    for ablation in ablations:
        for p in ablation.points:
            record = records.get((p.arm, seed))
            peak = record and ablation_findings.peak_then_drop(
                record.history, noise_points)
            if peak and p.label not in [d[0] for d in drops]:
                drops.append((p.label, peak[0], peak[1], record.accuracy))
    return ablation_findings.describe_summary(
        corrected=reference and reference.accuracy, adam=adam,
        larger_steps=ablation_findings.favours_larger_steps(
            phi_results, gamma_results, phi, noise_points),
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
        return ablation_findings.describe_phi(
            [(p.x, acc(p)) for p in ablation.points], noise_points)
    if ablation.name == "gamma":
        return ablation_findings.describe_gamma(
            [(None if p.reference else p.x, acc(p))
             for p in ablation.points], phi, noise_points)
    if ablation.name == "lr":
        return ablation_findings.describe_lr(
            _lr_results(ablation, records, seed), noise_points)
    results = {}
    for p in ablation.points:
        key = "default" if p.reference else p.arm.beta_2
        results.setdefault(p.series, []).append((key, acc(p)))
    return ablation_findings.describe_beta(results, noise_points)


def write_report(*, ablations, base, sweeps, seed, spread_seeds, runs_dir,
                 data, output_dir, command, machine):
    """Writes the report and a PNG per ablation with runs; returns its path."""
    os.makedirs(output_dir, exist_ok=True)
    where = dict(base=base, runs_dir=runs_dir, data=data)
    arms = ablation_sweeps.unique_arms(ablations.values())
    records = ablation_sweeps.collect(arms, (seed,), **where)
    records.update(ablation_sweeps.collect(
        (ablation_sweeps.reference_arm(sweeps),), tuple(spread_seeds),
        **where))
    phi = ablation_sweeps.true_phi(base.l2_norm_clip, base.noise_multiplier,
                                   base.batch_size)
    pngs = {}
    for name, ablation in ablations.items():
        if any((p.arm, seed) in records for p in ablation.points):
            pngs[name] = f"{REPORT_STEM}_{name}.png"
            plots.plot_ablation(os.path.join(output_dir, pngs[name]),
                                ablation, records, seed, phi)
    defaults = common.PAPER_DEFAULTS[ablation_sweeps.TASK]
    # The main experiment's published runs were calibrated with RDP.
    full_steps = tf_dpadam.calibrate_steps(
        target_epsilon=MAIN_TARGET_EPSILON, num_examples=MAIN_NUM_EXAMPLES,
        batch_size=defaults["batch_size"],
        noise_multiplier=defaults["noise_multiplier"], delta=base.delta,
        accountant="rdp")
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
        plots=pngs, scale=scale, full_steps=full_steps)
    path = os.path.join(output_dir, f"{REPORT_STEM}.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path

