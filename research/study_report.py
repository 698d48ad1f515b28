"""The report of an issue-18 study (`research.study_plan`): markdown and PNGs.

`write_report` writes `<output_dir>/<STUDY>_fashion_mnist.md` from the
finished runs on disk: every setting of every cell and variant, the best
learning rate of each (cell, variant) with the mean ± std over its seeds and
its measured median (v_hat - Phi) / Phi, the accuracy gap of each DP-AdamBC
variant over DP-Adam per cell, every run, and the total training time. PNGs
next to it: the tuning curves, and the gaps against B and against the median
(v_hat - Phi) / Phi. A study whose runs held training images out for
validation (`--validation_examples`) says so, and its tuning section lists
each tuning run's validation accuracy (by which its rate was chosen) beside
its test accuracy (which the page reports); without one the page is as
before.
"""

import collections
import json
import math
import os

import numpy as np

from research import comparison
from research import plots
from research import runs
from research import study_plan

BASELINE = "dpadam"  # The gaps are DP-AdamBC variants minus this.
TITLES = {"best_recipe": "Best recipe",
          "regime_map": "Regime map: when does DP-AdamBC help?",
          "class_imbalance": "Class imbalance: the rare classes",
          "paper_cnn": "The paper CNN's cell with the newer optimizers"}


def report_stem(study):
    """e.g. REGIME_MAP_fashion_mnist."""
    return f"{study.upper()}_fashion_mnist"


def _mean_of(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else math.nan


def best_summaries(plan, records):
    """(cell, variant) -> dict of the best learning rate's runs over seeds:
    lr, accuracy mean/std/n, median (v_hat - Phi) / Phi and the fraction
    below gamma' (means over seeds; NaN for DP-SGD), and `edge`: whether lr
    is the lowest or highest of the rates tuned."""
    summaries = {}
    tuned = study_plan.tuned_rates(plan, records)
    for key, lr in study_plan.best_learning_rates(plan, records).items():
        found = [records[r] for r in (
            study_plan.Run(*key, lr, seed) for seed in plan.seeds)
            if r in records]
        mean, std, n = comparison.aggregate_seeds(r.accuracy for r in found)
        worst = [r.worst_class_accuracy for r in found
                 if r.worst_class_accuracy is not None]
        worst_mean, worst_std, _ = (comparison.aggregate_seeds(worst)
                                    if worst else (math.nan, math.nan, 0))
        summaries[key] = dict(
            worst_mean=worst_mean, worst_std=worst_std,
            lr=lr, mean=mean, std=std, n=n,
            edge=comparison.at_edge(lr, tuned[key]),
            vc=_mean_of(r.moments.get("median_vc_over_phi") for r in found),
            below=_mean_of(r.moments.get("below_gamma") for r in found))
    return summaries


def gaps(plan, summaries):
    """(cell, variant) -> (gap, standard error) of each DP-AdamBC variant's
    best mean accuracy minus DP-Adam's, where both are tuned."""
    result = {}
    for cell in plan.cells:
        base = summaries.get((cell.name, BASELINE))
        if base is None:
            continue
        for variant in plan.variants:
            mine = summaries.get((cell.name, variant.name))
            if variant.optimizer != "dpadam_corrected" or mine is None:
                continue
            error = math.sqrt(mine["std"] ** 2 / mine["n"]
                              + base["std"] ** 2 / base["n"])
            result[(cell.name, variant.name)] = (mine["mean"] - base["mean"],
                                                 error)
    return result


def _number(x, spec=".3g"):
    return "n/a" if x is None or math.isnan(x) else format(x, spec)


def _points(x):
    return _number(100 * x, "+.2f")


def _header(*columns):
    """The first two lines of a markdown table."""
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def _validated(plan):
    """Whether a cell of `plan` holds training examples out for
    validation (the page then says so; without, it is as before)."""
    return any(c.base.validation_examples for c in plan.cells)


def _settings_table(plan):
    # The bands of correlated noise: a column only when a cell has b > 1
    # (the pages of the studies with independent noise unchanged); so is
    # the validation split's.
    bands = any(c.base.noise_bands != 1 for c in plan.cells)
    validated = _validated(plan)
    lines = _header("cell", "ε (target)", "calibrated by", "δ", "B", "N",
                    "steps", "epochs", "σ", "Φ = (σC/B)²", "C", "augmult K", "EMA momentum",
                    "normalization", "CNN",
                    *(["noise bands b (cyclic Poisson, q = bB/N)"]
                      if bands else []),
                    *(["validation V (held out of training)"]
                      if validated else []))
    for cell in plan.cells:
        c = cell.base
        phi = (c.noise_multiplier * c.l2_norm_clip / c.batch_size) ** 2
        lines.append(
            f"| {cell.name} | {cell.target_epsilon:g} |"
            f" {cell.accountant.upper()} | {c.delta:g} |"
            f" {c.batch_size} | {cell.num_examples} | {cell.steps} |"
            f" {cell.steps * c.batch_size / cell.num_examples:.3g} |"
            f" {c.noise_multiplier:.5g} | {phi:.3g} | {c.l2_norm_clip:g} |"
            f" {c.augmult or 'none'} |"
            f" {c.ema_momentum if c.ema else 'none'} | {c.normalization} |"
            f" {c.cnn} |" + (f" {c.noise_bands} |" if bands else "")
            + (f" {c.validation_examples} |" if validated else ""))
    return lines


def _variants_table(plan):
    lines = _header("variant", "optimizer", "γ (DP-Adam) / γ' (DP-AdamBC)",
                    "β₁", "β₂", "weight decay", "learning rates")
    for variant in plan.variants:
        config = study_plan.planned_config(
            plan, study_plan.Run(plan.cells[0].name, variant.name, 1.0, 0))
        grids = "; ".join(
            f"{cell.name}: " + ", ".join(
                f"{lr:g}" for lr in plan.grids[(cell.name, variant.name)])
            for cell in plan.cells)
        adam = variant.optimizer != "dpsgd"
        gamma = runs.format_gamma(runs.Setting(variant.optimizer, 1.0,
                                               variant.gamma))
        lines.append(
            f"| {variant.label} | {variant.optimizer} | {gamma} |"
            f" {config.beta_1 if adam else '-'} |"
            f" {config.beta_2 if adam else '-'} |"
            f" {config.weight_decay:g} | {grids} |")
    return lines


def _best_table(plan, summaries):
    # Imbalanced cells: the worst class's test accuracy too (the test set is
    # balanced, so the accuracy is the mean over the classes).
    classes = any(c.base.imbalance_ratio < 1 for c in plan.cells)
    lines = _header("cell", "variant", "best lr", "seeds",
                    "test accuracy (%), mean ± std",
                    *(["worst class (%), mean ± std"] if classes else []),
                    "median (v̂ − Φ)/Φ", "v̂ − Φ < γ'")
    for cell in plan.cells:
        for variant in plan.variants:
            s = summaries.get((cell.name, variant.name))
            if s is None:
                continue
            accuracy = (f"{runs.format_percent(s['mean'])} ±"
                        f" {_number(100 * s['std'], '.2f')}")
            below = ("n/a" if math.isnan(s["below"])
                     else f"{100 * s['below']:.0f}%")
            edge = " (at an end of the rates tried)" if s["edge"] else ""
            worst = (f" {_number(100 * s['worst_mean'], '.2f')} ±"
                     f" {_number(100 * s['worst_std'], '.2f')} |"
                     if classes else "")
            lines.append(f"| {cell.name} | {variant.label} |"
                         f" {s['lr']:g}{edge} |"
                         f" {s['n']} | {accuracy} |{worst}"
                         f" {_number(s['vc'])} | {below} |")
    return lines


def _gap_table(plan, gap_values, summaries):
    lines = _header("cell", "B", "variant",
                    "gap over DP-Adam (points) ± s.e.", "median (v̂ − Φ)/Φ")
    for (cell, variant), (gap, error) in gap_values.items():
        lines.append(
            f"| {cell} | {plan.cell(cell).base.batch_size} |"
            f" {plan.variant(variant).label} | {_points(gap)} ±"
            f" {_number(100 * error, '.2f')} |"
            f" {_number(summaries[(cell, variant)]['vc'])} |")
    return lines


def _epsilon_note(records):
    """A bullet when the runs of a cell report different epsilons: one
    cell's runs share sigma, the sampling rate and the steps (a run with
    other hyperparameters is not read back), so it is the accountant of
    the binary that trained each run."""
    spent = {}
    for run, r in records.items():
        spent.setdefault(run.cell, set()).add(round(r.record.epsilon, 3))
    mixed = {cell: values for cell, values in spent.items() if len(values) > 1}
    if not mixed:
        return []
    example = next(iter(mixed))
    values = sorted(mixed[example])
    return [
        "- ε spent differs within a cell (e.g. "
        f"{', '.join(f'{v:.2f}' for v in values)} in {example}): the runs of"
        " a cell share σ, the sampling rate and the steps, so they are the"
        " same mechanism with the same guarantee; each reports ε by the"
        " accountant of the binary that trained it, RDP until 2026-11-26 and"
        " PLD since (the tighter bound). `--calibration_accountant` names"
        " the accountant that calibrated σ."]


def _moment_note(plan):
    """Where v̂'s noise is not Φ: DiSK's and scale-then-privatize's."""
    optimizers = {v.optimizer for v in plan.variants}
    notes = []
    if "dpadam_disk" in optimizers:
        notes.append(
            "- DiSK's Adam sees the Kalman-filtered gradient, whose noise"
            " adds about κ/(2 − κ)·Φ to v̂ in the steady state (0.54 Φ at"
            " the default κ = 0.7): its (v̂ − Φ)/Φ is about −0.46 from the"
            " noise alone.")
    if "dpadam_stp" in optimizers:
        notes.append(
            "- Scale-then-privatize unscales the noise: Φ/s_j² on coordinate"
            " j, Φ on average over the coordinates (the RMS of 1/s is 1) but"
            " skewed, so its mean (v̂ − Φ)/Φ, not its median, is about 0"
            " from the noise alone.")
    return notes


def _imbalance_note(records):
    """A bullet on the imbalanced cells' data and their worst class."""
    worst = [r.worst_class for r in records.values()
             if r.worst_class is not None]
    if not worst:
        return []
    counts = collections.Counter(worst)
    ranked = ", ".join(f"class {c} in {n}" for c, n in counts.most_common())
    return [
        "- Class imbalance (the cells named `_imbalance<r>`): class c of"
        " the training set's K keeps a fraction r^(c/(K − 1)) of its images"
        " (class 0 all, class K − 1 the fraction r; N in the settings"
        " table), the test set is the balanced one; \"test accuracy\" is"
        " over all of it and \"worst class\" is the lowest accuracy of a"
        " class. The worst class of the"
        f" {len(worst)} runs: {ranked}."]


def _validation_note(plan):
    """The bullet on how the learning rates were chosen, when the runs
    held training images out (none otherwise: the page as before)."""
    if not _validated(plan):
        return []
    splits = {(c.base.validation_examples, c.num_examples)
              for c in plan.cells}
    if len(splits) == 1:
        ((held_out, trained),) = splits
        split = (f"a validation split of {held_out} training images held"
                 f" out from training ({trained} trained on)")
    else:
        split = ("a validation split of training images held out from"
                 " training (per cell: " + ", ".join(
                     f"{c.name} {c.base.validation_examples} held out,"
                     f" {c.num_examples} trained on" for c in plan.cells)
                 + ")")
    return [
        f"- Learning rates were chosen by accuracy on {split}, the same"
        " images for every run (`research.datasets.split_validation`), and"
        " the accuracies reported on this page are on the test set; N in"
        " the settings table, which σ or the steps were calibrated for and"
        " the privacy accounting counts, is the images trained on. The"
        " tuning section lists each tuning run's validation accuracy beside"
        " its test accuracy."]


def _tuning_table(plan, records):
    """Each tuning run's validation and test accuracy, the rate chosen
    marked; only when the runs have a validation accuracy (none
    otherwise)."""
    tuned = study_plan.tuned_rates(plan, records)
    if not any(r.validation_accuracy is not None
               for found in tuned.values() for r in found.values()):
        return []
    best = study_plan.best_learning_rates(plan, records)
    lines = _header("cell", "variant", "lr", "validation accuracy (%)",
                    "test accuracy (%)", "chosen")
    for cell in plan.cells:
        for variant in plan.variants:
            key = (cell.name, variant.name)
            found = tuned.get(key, {})
            for lr in sorted(found):
                r = found[lr]
                lines.append(
                    f"| {cell.name} | {variant.label} | {lr:g} |"
                    f" {runs.format_percent(r.validation_accuracy)} |"
                    f" {runs.format_percent(r.accuracy)} |"
                    f" {'✓' if best.get(key) == lr else ''} |")
    return lines + [""]


def _runs_table(plan, records):
    lines = _header("cell", "variant", "lr", "seed", "test accuracy (%)",
                    "ε spent", "steps", "median (v̂ − Φ)/Φ", "wall (s)")
    order = {c.name: i for i, c in enumerate(plan.cells)}
    vorder = {v.name: i for i, v in enumerate(plan.variants)}
    for run in sorted(records, key=lambda r: (
            order[r.cell], vorder[r.variant], r.learning_rate, r.seed)):
        r = records[run]
        lines.append(
            f"| {run.cell} | {plan.variant(run.variant).label} |"
            f" {run.learning_rate:g} | {run.seed} |"
            f" {runs.format_percent(r.accuracy)} | {r.record.epsilon:.4f} |"
            f" {r.record.steps} |"
            f" {_number(r.moments.get('median_vc_over_phi'))} |"
            f" {runs.format_seconds(r.record.wall_seconds)} |")
    return lines


def plot_tuning(path, plan, records):
    """Final accuracy vs learning rate at the tuning seed, one panel per
    cell, one line per variant; with a validation split its accuracy too
    (dashed, the same colour)."""
    figure = plots.new_figure(4.0 * len(plan.cells), 3.6)
    tuned = study_plan.tuned_rates(plan, records)
    validated = False
    for i, cell in enumerate(plan.cells):
        axes = figure.add_subplot(1, len(plan.cells), i + 1)
        for variant in plan.variants:
            found = tuned.get((cell.name, variant.name), {})
            points = [(lr, found[lr].accuracy) for lr in sorted(found)]
            if points:
                (line,) = axes.plot([p[0] for p in points],
                                    [100 * p[1] for p in points],
                                    marker="o", label=variant.label)
                held_out = [(lr, found[lr].validation_accuracy)
                            for lr in sorted(found)
                            if found[lr].validation_accuracy is not None]
                if held_out:
                    validated = True
                    axes.plot([p[0] for p in held_out],
                              [100 * p[1] for p in held_out], marker="x",
                              linestyle="--", color=line.get_color())
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("final accuracy (%): test (solid), validation"
                        " (dashed)" if validated else
                        "final test accuracy (%)")
        axes.set_title(cell.name)
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend(fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path)


def plot_gaps(path, plan, gap_values, summaries, against):
    """The gaps (points, ± s.e.) against B (`against="batch"`) or the
    measured median (v_hat - Phi) / Phi ("vc"), one series per variant."""
    figure = plots.new_figure(5.5, 4.0)
    axes = figure.add_subplot()
    xs = []
    for variant in plan.variants:
        points = sorted(
            (plan.cell(cell).base.batch_size if against == "batch"
             else summaries[(cell, name)]["vc"], 100 * gap, 100 * error)
            for (cell, name), (gap, error) in gap_values.items()
            if name == variant.name)
        if points:
            x, y, e = zip(*points)
            xs += x
            axes.errorbar(x, y, yerr=e, marker="o", capsize=3,
                          label=variant.label)
    axes.axhline(0, color="gray", linewidth=0.8)
    if against == "batch":
        axes.set_xscale("log", base=2)
        axes.set_xlabel("expected batch size B")
    else:
        if xs and all(x is not None and x > 0 for x in xs):
            axes.set_xscale("log")  # the medians span decades with B
        axes.set_xlabel("median (v̂ − Φ)/Φ at the end of training")
    axes.set_ylabel("accuracy gap over DP-Adam (points)")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def write_report(plan, records, output_dir, command, machine):
    """Writes the markdown page and its PNGs; returns the page's path."""
    os.makedirs(output_dir, exist_ok=True)
    stem = report_stem(plan.study)
    summaries = best_summaries(plan, records)
    gap_values = gaps(plan, summaries)
    wall = sum(r.record.wall_seconds or 0.0 for r in records.values())
    planned = len(study_plan.tuning_runs(plan)) + len(plan.cells) * len(
        plan.variants) * (len(plan.seeds) - 1)
    added = sum(lr not in plan.grids[key]
                for key, found in study_plan.tuned_rates(plan, records).items()
                for lr in found)
    lines = [
        f"# {TITLES.get(plan.study, plan.study)} (Fashion-MNIST)", "",
        "Written by `research.study` from the runs in "
        f"`{os.path.relpath(plan.runs_dir, output_dir)}`: the CNN of the"
        " settings table (`research.models.make_cnn`: the paper's 5-layer"
        " CNN, or `make_small_cnn`, TF-Privacy's small tutorial CNN) trained"
        " from scratch,"
        " Poisson"
        " sampling, noise and sampling keyed by each run's seed. Each"
        " (cell, variant) is tuned over its learning rates at seed"
        f" {plan.tune_seed}, and its best rerun with seeds"
        f" {', '.join(map(str, plan.seeds))}.", "",
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Runs: {len(records)} finished: {len(records) - added} of the"
        f" {planned} planned, and {added} at learning rates that tuning"
        f" added beyond an end of a grid (up to {plan.edge_extensions} per"
        " end, while the best sat there); total training time"
        f" {wall:.0f} s ({wall / 3600:.2f} h, the sum of the runs' wall"
        " seconds).",
        *_validation_note(plan),
        *_epsilon_note(records),
        *_imbalance_note(records),
        "- (v̂ − Φ)/Φ: from the optimizer's state after the last step,"
        " v̂ = v/(1 − β₂ᵗ), over every coordinate; v̂ − Φ estimates the clean"
        " second moment v^c, with noise of about Φ·√(2(1 − β₂)) per"
        " coordinate (more after few steps, whose skewed average also pulls"
        " the median below the median v^c: about −0.16 Φ after 4 steps of"
        " noise alone). \"v̂ − Φ < γ'\": the coordinates on which DP-AdamBC"
        " divides by √γ' (DP-SGD has no v).", *_moment_note(plan), "",
        "## Settings", "", *_settings_table(plan), "",
        *_variants_table(plan), "",
        "## Best learning rate of each variant", "",
        *_best_table(plan, summaries), "",
    ]
    tuning_png = f"{stem}_tuning.png"
    plot_tuning(os.path.join(output_dir, tuning_png), plan, records)
    if plan.study == "regime_map" or gap_values:
        pngs = {f"{stem}_gap_vs_batch.png": "batch",
                f"{stem}_gap_vs_vc.png": "vc"}
        for name, against in pngs.items():
            plot_gaps(os.path.join(output_dir, name), plan, gap_values,
                      summaries, against)
        lines += [
            "## DP-AdamBC − DP-Adam", "",
            "Each tuned variant's mean accuracy minus tuned DP-Adam's, in"
            " points; ± the standard error of the difference,"
            " √(s₁²/n₁ + s₂²/n₂).", "",
            *_gap_table(plan, gap_values, summaries), "",
            *[f"![gap against {a}]({n})" for n, a in pngs.items()], ""]
    lines += ["## Tuning", "", *_tuning_table(plan, records),
              f"![tuning curves]({tuning_png})", "",
              "## Every run", "", *_runs_table(plan, records), ""]
    path = os.path.join(output_dir, f"{stem}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    summary = summary_record(plan, summaries, gap_values, wall=wall,
                             runs_done=len(records), planned=planned,
                             added=added)
    with open(os.path.join(output_dir, f"{stem}.json"), "w") as f:
        json.dump(summary, f, indent=1, allow_nan=False)
    return path


def _finite(x):
    return None if x is None or math.isnan(x) else float(x)


def summary_record(plan, summaries, gap_values, *, wall, runs_done, planned,
                   added=0):
    """What RESULTS.md shows of a study (saved as <STUDY>_fashion_mnist.json
    beside its page): the cells, every (cell, variant)'s best learning rate
    with its mean ± std over seeds, and the gaps over DP-Adam."""
    stem = report_stem(plan.study)
    cells = {cell.name: cell for cell in plan.cells}
    return {
        "study": plan.study, "title": TITLES.get(plan.study, plan.study),
        "files": {"report": f"{stem}.md",
                  **({"gap_vs_batch": f"{stem}_gap_vs_batch.png"}
                     if gap_values else {})},
        "runs": runs_done, "planned": planned, "added": added,
        "wall_seconds": wall,
        "cells": [{
            "name": cell.name, "target_epsilon": cell.target_epsilon,
            "batch_size": cell.base.batch_size, "steps": cell.steps,
            "noise_multiplier": cell.base.noise_multiplier,
            "epochs": cell.steps * cell.base.batch_size / cell.num_examples,
            "augmult": cell.base.augmult,
            "ema_momentum": (cell.base.ema_momentum if cell.base.ema
                             else None),
            "normalization": cell.base.normalization, "cnn": cell.base.cnn,
            "imbalance_ratio": cell.base.imbalance_ratio,
            "calibrated_by": cell.accountant,
            # Correlated noise's bands, only when b > 1 (a missing one: 1).
            **({"noise_bands": cell.base.noise_bands}
               if cell.base.noise_bands != 1 else {}),
            # The validation split, only when V > 0 (a missing one: 0, the
            # rates chosen by test accuracy); N without it.
            **({"validation_examples": cell.base.validation_examples,
                "num_examples": cell.num_examples}
               if cell.base.validation_examples else {}),
        } for cell in plan.cells],
        "best": [{
            "cell": cell, "variant": variant,
            "label": plan.variant(variant).label, "learning_rate": s["lr"],
            "mean": s["mean"], "std": s["std"], "seeds": s["n"],
            "at_edge": s["edge"], "median_vc_over_phi": _finite(s["vc"]),
            "worst_class_mean": _finite(s["worst_mean"]),
            "worst_class_std": _finite(s["worst_std"]),
        } for cell in cells for variant in (v.name for v in plan.variants)
            for s in [summaries.get((cell, variant))] if s is not None],
        "gaps": [{
            "cell": cell, "batch_size": cells[cell].base.batch_size,
            "variant": variant, "label": plan.variant(variant).label,
            "gap": gap, "error": error,
            "median_vc_over_phi": _finite(summaries[(cell, variant)]["vc"]),
        } for (cell, variant), (gap, error) in gap_values.items()],
    }


def render_summary(summary):
    """RESULTS.md's section of a study: its best table and gap plot."""
    cells = {c["name"]: c for c in summary["cells"]}
    held_out = sorted({c["validation_examples"] for c in summary["cells"]
                       if c.get("validation_examples")})
    chosen = (" (chosen by accuracy on a validation split of"
              f" {', '.join(map(str, held_out))} training images held out"
              " from training)" if held_out else "")
    lines = [
        f"## {summary['title']} (Fashion-MNIST, from scratch)", "",
        f"{summary['runs']} runs finished ({summary.get('added', 0)} of"
        " them at learning rates added past a grid end) for"
        f" {summary['planned']} planned"
        f" ({summary['wall_seconds'] / 3600:.2f} h of training). Each"
        f" cell: the best learning rate of each optimizer{chosen}, test"
        " accuracy (%)"
        " mean ± std over its seeds; \"(edge)\": the best rate is the lowest"
        " or highest tried, so the optimum may lie beyond. Details, every"
        " setting and every run:"
        f" [{summary['files']['report']}]({summary['files']['report']}).", "",
        *_header("ε", "B", "σ", "steps", "CNN", "augmult K", "EMA",
                 "optimizer", "lr", "test accuracy (%)", "median (v̂ − Φ)/Φ"),
    ]
    for row in summary["best"]:
        c = cells[row["cell"]]
        vc = row["median_vc_over_phi"]
        lines.append(
            f"| {c['target_epsilon']:g} | {c['batch_size']} |"
            f" {c['noise_multiplier']:.4g} | {c['steps']} | {c['cnn']} |"
            f" {c['augmult'] or 'none'} | {c['ema_momentum'] or 'none'} |"
            f" {row['label']} | {row['learning_rate']:g}"
            f"{' (edge)' if row['at_edge'] else ''} |"
            f" {runs.format_percent(row['mean'])} ±"
            f" {100 * row['std']:.2f} ({row['seeds']} seed"
            f"{'' if row['seeds'] == 1 else 's'}) |"
            f" {'n/a' if vc is None else _number(vc)} |")
    if "gap_vs_batch" in summary["files"]:
        plot = summary["files"]["gap_vs_batch"]
        lines += ["", f"![{summary['title']}: gap against B]({plot})"]
    return lines
