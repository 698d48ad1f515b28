"""RESULTS_<task>.md, its plots and JSON summary.

`write_report` renders one task's report from the finished runs of a
`experiments.Plan` (`render_markdown`), draws its two plots
(`research.plots`) and saves the summary that RESULTS.md shows
(`summary_record`, RESULTS_<task>.json); `results_index.write_index` then
rewrites RESULTS.md from every task's JSON. The tables, the verdict and the
summary cover the plan's optimizers (`plan.grids`, by default the paper's
three), labelled by `common.OPTIMIZER_LABELS`.
"""

import json
import os

from research import common
from research import comparison
from research import experiments
from research import finetune_report
from research import plots
from research import results_index
from research import runs

def describe_data(data, records):
    """One sentence on the data of the runs (`data` as of `data_spec`)."""
    task = experiments.TASKS[data["task"]]
    sizes = sorted({r.num_examples for r in records.values()})
    train = (f"{' / '.join(map(str, sizes))} training examples" if sizes
             else "training examples")
    if data.get("max_examples"):
        train += f" (subset: --max_examples={data['max_examples']})"
    text = f"{task['name']} (dataset `{data['dataset']}`), {train}"
    if task["kind"] == "text":
        backbone = data.get("preset") or "all-MiniLM-L6-v2 (offline)"
        text += (f"; {data.get('sequence_length')} tokens per example; "
                 f"backbone {backbone}")
        if data.get("lora_rank"):
            text += f"; LoRA rank {data['lora_rank']}"
        if data.get("pooling") == "mean":
            text += ("; the head reads the mean of the final token states"
                     " (over the unpadded tokens)")
        blocks = data.get("finetune_blocks")
        if blocks:
            text += (f"; only the top {blocks} transformer blocks fine-tuned,"
                     " the embeddings and the blocks below frozen")
        if data.get("cache_frozen"):
            trained = (f"the top {blocks} blocks" if blocks
                       else "the last block")
            text += ("; the frozen embeddings and lower blocks ran once "
                     "(inference mode, so without their dropout) and the "
                     f"runs trained {trained} and head on their cached "
                     "outputs (same per-example gradients and privacy)")
        if data.get("max_test_examples"):
            text += (f"; evaluated on {data['max_test_examples']} dev "
                     "examples drawn with each run's seed (so the test "
                     "subset differs between seeds)")
        else:
            text += "; evaluated on the whole dev set"
    else:
        text += "; evaluated on the whole test set"
    return text + "."


def describe_steps(records, few=100):
    """The step counts of the runs, with a warning when they are few."""
    steps = sorted({r.steps for r in records.values()})
    if not steps:
        return ""
    text = f" Steps per run: {' / '.join(map(str, steps))}."
    if steps[-1] < few:
        text += (f" Under {few} steps the optimizers have little room to "
                 "differ: raise σ (more steps for the same ε) for a "
                 "meaningful comparison.")
    return text


def describe_budget(plan):
    """The privacy budget of the plan's runs, for the settings line."""
    calibration = plan.calibration
    bands = plan.base.noise_bands
    # Correlated noise (said only for b > 1: the reports of independent
    # noise unchanged).
    noise = ("" if bands == 1 else
             f"; correlated (BandMF) noise of {bands} bands on cyclic"
             f" Poisson batches of {bands} groups, T steps accounted as"
             f" ceil(T/{bands}) steps at q = {bands}B/N")
    if calibration is not None:
        return (f"target ε = {calibration.target_epsilon:g} with the steps "
                f"calibrated by the {calibration.accountant.upper()} "
                f"accountant ({calibration.steps} steps for "
                f"{calibration.num_examples} examples, trained as "
                f"{plan.base.epochs:.4g} epochs; the runs' ε columns are "
                f"{common.ACCOUNTANT.upper()}'s for those steps){noise}")
    if plan.base.target_epsilon:
        return f"target ε = {plan.base.target_epsilon:g}{noise}"
    return f"{plan.base.epochs:g} epoch(s), no ε target{noise}"


def describe_gammas(names):
    """Where the γ of each of the optimizers `names` sits ("" if none has
    one): DP-Adam's (and its variants') outside the square root,
    DP-AdamBC's γ' inside it."""
    outside = [common.OPTIMIZER_LABELS[n] for n in names
               if n in common.KERAS_ADAM_EPSILON]
    parts = []
    if outside:
        parts.append(" and ".join(f"{label}'s" for label in outside)
                     + " γ is outside the square root")
    if "dpadam_corrected" in names:
        parts.append("DP-AdamBC's γ' inside it" if outside
                     else "DP-AdamBC's γ' is inside the square root")
    return f" {', '.join(parts)}." if parts else ""


def render_markdown(*, plan, records, best, command, machine, plots,
                    ceiling=None):
    """The report as markdown text.

    Args:
        plan: the `Plan`.
        records: name -> `Record` of the finished runs.
        best: optimizer -> best `Setting` (tuning).
        command: the command line that writes this report.
        machine: `machine_info()` of this process.
        plots: `{"curves": file, "tuning": file}` relative to the report.
        ceiling: the `Record` of the non-private run, if any.
    """
    task = experiments.TASKS[plan.task]
    paper = comparison.PAPER_RESULTS[task["paper_dataset"]]
    base = plan.base
    phi = (base.noise_multiplier * base.l2_norm_clip / base.batch_size) ** 2
    labels = {name: common.OPTIMIZER_LABELS[name] for name in plan.grids}
    lines = [
        f"# {' vs '.join(labels.values())} on {task['name']} "
        f"(the paper's {task['paper_dataset']} experiment)",
        "",
        "Written by `research/reproduce.py` from the runs in "
        f"`{plan.runs_dir}`.",
        "",
        "## Setup",
        "",
        f"- Machine (this report): `{machine.get('platform')}`, "
        f"{machine.get('cpu_count')} CPUs"
        + (f" ({machine['usable_cpus']} usable)" if "usable_cpus" in machine
           else "")
        + f", processor `{machine.get('processor')}`, Python "
        f"{machine.get('python')}, TensorFlow {machine.get('tensorflow')}, "
        f"Keras {machine.get('keras')}.",
        f"- Command (this report): `{command}`",
    ]
    train_commands = sorted({r.command for r in records.values()
                             if r.command})
    other_machines = sorted({json.dumps(r.machine, sort_keys=True)
                             for r in records.values() if r.machine}
                            - {json.dumps(machine, sort_keys=True)})
    if train_commands == [command]:
        lines.append("- The runs were trained by this same command.")
    elif train_commands:
        lines.append("- Commands that trained the runs: "
                     + "; ".join(f"`{c}`" for c in train_commands))
    for other in other_machines:
        lines.append(f"- Some runs were trained on another machine: "
                     f"`{other}`")
    lines += [
        f"- Data: {describe_data(plan.data, records)}",
        f"- Model: {task['model']}.",
        f"- Privacy: C = {base.l2_norm_clip:g}, σ = "
        f"{base.noise_multiplier:g}, expected batch B = {base.batch_size} "
        f"(Poisson sampling), δ = {base.delta:g}, {describe_budget(plan)}; "
        f"Φ = (σC/B)² = {phi:.3g}"
        + (f", so DP-AdamBC's 0.04·Φ = {0.04 * phi:.3g}."
           if "dpadam_corrected" in plan.grids else ".")
        + describe_steps(records),
        f"- Tuning: each optimizer's learning rate × γ grid at seed "
        f"{plan.tune_seed}; the best setting (final test accuracy) is rerun "
        f"with seeds {', '.join(map(str, plan.seeds))}."
        + describe_gammas(plan.grids),
        "- Caveat: hyperparameters are selected on the test set, as the "
        "paper reports them; that selection is not itself private and "
        "flatters the best numbers a little (equally for all optimizers).",
        "",
    ]

    # Final comparison.
    rows = best_rows(plan, records, best)
    lines += [
        "## Best setting of each optimizer, mean ± std over seeds",
        "",
        f"| optimizer | lr | γ | seeds | {task['name']} test accuracy (%) "
        f"| ε | paper, {task['paper_dataset']} (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in labels.items():
        row = rows.get(name)
        if row:
            acc = (f"{runs.format_percent(row['mean'])} ± "
                   f"{runs.format_percent(row['std'])}")
            eps, n = f"{row['epsilon']:.3f}", row["seeds"]
            lr, gamma = f"{row['learning_rate']:g}", row["gamma"]
        else:
            acc, eps, n, lr, gamma = "not run", "n/a", 0, "n/a", "n/a"
        reported = f"{paper[name]:.2f}" if name in paper else "n/a"
        lines.append(f"| {label} | {lr} | {gamma} | {n} | {acc} | {eps} | "
                     f"{reported} |")
    lines += ["", verdict(plan, rows), ""]
    lines += ceiling_lines(plan, ceiling, rows)
    edges = [labels[n] for n, s in best.items()
             if comparison.at_grid_edge(s, plan.grids[n])]
    if edges:
        lines += [
            f"The best learning rate of {', '.join(edges)} is at the edge of "
            "its grid: a wider grid might do better.",
            "",
        ]
    lines += [
        f"![Test accuracy vs step]({plots['curves']})",
        "",
        "Test accuracy against the step for the best setting of each "
        "optimizer: mean over seeds, band ± one standard deviation.",
        "",
        f"## Tuning at seed {plan.tune_seed}",
        "",
        "| optimizer | lr | γ | final test accuracy (%) | ε | steps | "
        "wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, grid in plan.grids.items():
        for setting in grid:
            record = records.get(runs.run_name(setting, plan.tune_seed))
            mark = " **(best)**" if best.get(name) == setting else ""
            if record is None:
                lines.append(f"| {labels[name]} | "
                             f"{setting.learning_rate:g} | "
                             f"{runs.format_gamma(setting)} | not run | | | |")
                continue
            lines.append(
                f"| {labels[name]} | "
                f"{setting.learning_rate:g} | {runs.format_gamma(setting)} | "
                f"{runs.format_percent(record.accuracy)}{mark} | "
                f"{record.epsilon:.3f} | {record.steps} | "
                f"{runs.format_seconds(record.wall_seconds)} |")
    lines += [
        "",
        f"![Tuning grid]({plots['tuning']})",
        "",
        "## Every run",
        "",
        "Wall time: the session that finished the run, data loading "
        "included, plus the training time of its earlier sessions if it was "
        "resumed (runs resumed before `elapsed.json` existed, 2026-11-24, "
        "count only their last session).",
        "",
        "| run | seed | test accuracy (%) | ε | steps | wall (s) | resumed |",
        "|---|---|---|---|---|---|---|",
    ]
    every = dict(records)
    if ceiling is not None:
        every[ceiling.name] = ceiling
    for name in sorted(every):
        r = every[name]
        lines.append(f"| `{name}` | {r.seed} | "
                     f"{runs.format_percent(r.accuracy)} | "
                     f"{r.epsilon:.3f} | {r.steps} | "
                     f"{runs.format_seconds(r.wall_seconds)} | "
                     f"{'yes' if r.resumed else 'no'} |")
    total = sum(r.wall_seconds or 0.0 for r in every.values())
    lines += ["", f"Total wall time: {total:.0f} s ({total / 3600:.2f} h) "
              f"over {len(every)} runs.", ""]
    return "\n".join(lines)


def ceiling_lines(plan, ceiling, rows):
    """The report's paragraph on the non-private ceiling run."""
    if plan.ceiling_learning_rate is None:
        return []
    if ceiling is None:
        return [f"Non-private ceiling (Adam, lr "
                f"{plan.ceiling_learning_rate:g}): not run yet.", ""]
    text = (f"**Non-private ceiling:** {runs.format_percent(ceiling.accuracy)}"
            f"% (one run, seed {ceiling.seed}: Adam at lr "
            f"{ceiling.setting.learning_rate:g}, γ = "
            f"{runs.format_gamma(ceiling.setting)}, without clipping or "
            f"noise, on the same Poisson batches for the same {ceiling.steps}"
            " steps; untuned).")
    if rows:
        name, row = max(rows.items(), key=lambda item: item[1]["mean"])
        text += (f" The best private optimizer, "
                 f"{common.OPTIMIZER_LABELS[name]}, is "
                 f"{100 * (ceiling.accuracy - row['mean']):.2f} points below"
                 " it.")
    return [text, ""]


def best_rows(plan, records, best):
    """optimizer -> the seed runs of its best setting, summarized.

    Each row: `learning_rate`, `gamma` (as printed), `mean`, `std`, `seeds`
    (test accuracy as fractions, over the finished seeds) and `epsilon` (the
    largest spent), for the plan's optimizers. Optimizers without a
    finished run are left out.
    """
    rows = {}
    for name in plan.grids:
        setting = best.get(name)
        done = [] if setting is None else [
            records[runs.run_name(setting, s)] for s in plan.seeds
            if runs.run_name(setting, s) in records
        ]
        if done:
            mean, std, n = comparison.aggregate_seeds(r.accuracy for r in done)
            rows[name] = {
                "learning_rate": setting.learning_rate,
                "gamma": runs.format_gamma(setting),
                "mean": mean, "std": std, "seeds": n,
                "epsilon": max(r.epsilon for r in done),
            }
    return rows


def verdict(plan, rows):
    """What the rows of `best_rows` say: the paper's comparison
    (`comparison.verdict_paragraph`: DP-AdamBC against DP-Adam and DP-SGD)
    when the plan has DP-AdamBC and DP-Adam; then each other optimizer of
    the plan against DP-Adam (without DP-Adam, against the plan's first)."""
    task = experiments.TASKS[plan.task]
    summary = {name: (row["mean"], row["std"], row["seeds"])
               for name, row in rows.items()}
    names = list(plan.grids)
    reference = "dpadam" if "dpadam" in names else names[0]
    text, compared = [], [reference]
    if {"dpadam", "dpadam_corrected"} <= set(names):
        text.append(comparison.verdict_paragraph(
            {n: s for n, s in summary.items() if n in common.OPTIMIZER_NAMES},
            comparison.PAPER_RESULTS[task["paper_dataset"]],
            task["paper_dataset"], task["name"]))
        compared += list(common.OPTIMIZER_NAMES)
    if len(names) == 1:
        text.append(f"Only {common.OPTIMIZER_LABELS[reference]} in this "
                    "plan: nothing to compare.")
    text += [comparison.compare_sentence(summary, name, reference)
             for name in names if name not in compared]
    newer = [common.OPTIMIZER_LABELS[n] for n in names
             if n not in common.OPTIMIZER_NAMES]
    if newer:
        verb = "is" if len(newer) == 1 else "are"
        text.append(f"{' and '.join(newer)} {verb} not in the paper.")
    return " ".join(text)


def summary_record(plan, records, best, command, machine, files,
                   ceiling=None):
    """What RESULTS.md shows of one task (saved as RESULTS_<task>.json)."""
    task = experiments.TASKS[plan.task]
    base = plan.base
    rows = best_rows(plan, records, best)
    return {
        "task": plan.task,
        "name": task["name"],
        "paper_dataset": task["paper_dataset"],
        "optimizers": rows,
        **({} if ceiling is None else {"ceiling": {
            "accuracy": ceiling.accuracy,
            "learning_rate": ceiling.setting.learning_rate}}),
        "verdict": verdict(plan, rows),
        "privacy": {
            "l2_norm_clip": base.l2_norm_clip,
            "noise_multiplier": base.noise_multiplier,
            "batch_size": base.batch_size, "delta": base.delta,
            "target_epsilon": plan.target_epsilon,
            "steps": sorted({r.steps for r in records.values()}),
            **({} if plan.calibration is None else {
                "calibration_accountant": plan.calibration.accountant}),
        },
        "data": describe_data(plan.data, records),
        # The commands that trained the runs (this one if none is known).
        "commands": sorted({r.command for r in records.values()
                            if r.command}) or [command],
        "machine": machine,
        "runs": len(records),
        "wall_seconds": sum(r.wall_seconds or 0.0 for r in records.values()),
        "files": files,
    }


def write_report(plan, output_dir, command, machine):
    """Writes RESULTS_<task>.md, its two PNGs and its summary JSON, then
    RESULTS.md (all tasks); returns the task's .md path."""
    os.makedirs(output_dir, exist_ok=True)
    # The grids with the rates tuning added past their ends.
    plan = experiments.extended_plan(plan)
    records = experiments.collect(plan)
    best = experiments.best_of_tuning(plan, records)
    ceiling = experiments.collect_ceiling(plan, records)
    stem = f"RESULTS_{plan.task}"
    pngs = {"curves": f"{stem}_curves.png", "tuning": f"{stem}_tuning.png"}
    plots.plot_curves(os.path.join(output_dir, pngs["curves"]), plan,
                      records, best)
    plots.plot_tuning(os.path.join(output_dir, pngs["tuning"]), plan, records)
    path = os.path.join(output_dir, f"{stem}.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_markdown(plan=plan, records=records, best=best,
                                command=command, machine=machine,
                                plots=pngs, ceiling=ceiling))
    summary = summary_record(plan, records, best, command, machine,
                             {"report": f"{stem}.md", **pngs}, ceiling)
    with open(os.path.join(output_dir, f"{stem}.json"), "w",
              encoding="utf-8") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    results_index.write_index(output_dir)
    if plan.task in finetune_report.MODES:
        finetune_report.write_page(output_dir)
    return path

