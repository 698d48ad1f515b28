"""FINETUNE_sst2.md: what to fine-tune privately, as measured on SST-2.

`research.reproduce` writes one summary per task (`RESULTS_<task>.json`).
This page puts the three text tasks side by side: last block re-initialized
(`sst2`, the paper's setting), LoRA (`sst2_lora`) and full fine-tuning
(`sst2_full`), each with DP-SGD, DP-Adam and DP-AdamBC at their tuned best
(mean ± std over seeds) and the non-private ceiling where it was run. The
findings below the table are computed from those numbers: whether a mode
beats last-block by more than the seed spread, and whether DP-AdamBC's gap
over DP-Adam grows when Adam adapts over more of the pretrained network.
`results_report.write_report` rewrites the page whenever it writes one of
these tasks' reports.
"""

import os

from research import common
from research import runs

# Task -> the mode's short name, in the page's order.
MODES = {"sst2": "last block", "sst2_lora": "LoRA", "sst2_full": "full"}
PAGE = "FINETUNE_sst2.md"
PLOT = "FINETUNE_sst2.png"


def load_summaries(docs_dir):
    """task -> its `RESULTS_<task>.json` summary, for the tasks on disk."""
    summaries = {}
    for task in MODES:
        summary = runs.read_json(os.path.join(docs_dir,
                                              f"RESULTS_{task}.json"))
        if summary is not None:
            summaries[task] = summary
    return summaries


def best_private(summary):
    """`(optimizer, row)` of the summary's highest mean accuracy, or None."""
    rows = summary["optimizers"]
    if not rows:
        return None
    return max(rows.items(), key=lambda item: item[1]["mean"])


def gap(first, second):
    """`(first − second, spread)` in points; spread: the sum of the two
    standard deviations (over seeds)."""
    return (100 * (first["mean"] - second["mean"]),
            100 * (first["std"] + second["std"]))


def judge(difference, spread, more, less):
    """`more` / `less` if `difference` is beyond ± spread, else a tie."""
    if difference > spread:
        return more
    if difference < -spread:
        return less
    return "within the seed spread"


def correction_gap(summary):
    """DP-AdamBC − DP-Adam of `summary` as `(gap, spread)`, or None."""
    rows = summary["optimizers"]
    if "dpadam_corrected" not in rows or "dpadam" not in rows:
        return None
    return gap(rows["dpadam_corrected"], rows["dpadam"])


def findings(summaries):
    """The page's conclusions, one sentence per item, from the numbers."""
    lines = []
    base = summaries.get("sst2")
    base_best = base and best_private(base)
    for task, mode in MODES.items():
        if task == "sst2" or task not in summaries:
            continue
        best = best_private(summaries[task])
        if best is None:
            continue
        name, row = best
        text = (f"{mode}: best private {common.OPTIMIZER_LABELS[name]}, "
                f"{runs.format_percent(row['mean'])} ± "
                f"{runs.format_percent(row['std'])}% ({row['seeds']} seeds)")
        if base_best:
            difference, spread = gap(row, base_best[1])
            text += (f"; against last block's best "
                     f"{runs.format_percent(base_best[1]['mean'])}%: "
                     f"{difference:+.2f} points (spread {spread:.2f}), "
                     + judge(difference, spread,
                             "better by more than the seed spread",
                             "worse by more than the seed spread"))
        lines.append(text + ".")
    gaps = {task: correction_gap(s) for task, s in summaries.items()}
    for task, mode in MODES.items():
        if gaps.get(task) is None:
            continue
        difference, spread = gaps[task]
        text = (f"DP-AdamBC − DP-Adam, {mode}: {difference:+.2f} points "
                f"(spread {spread:.2f}): "
                + judge(difference, spread, "DP-AdamBC better",
                        "DP-AdamBC worse"))
        if task != "sst2" and gaps.get("sst2") is not None:
            change = difference - gaps["sst2"][0]
            change_spread = spread + gaps["sst2"][1]
            text += (f"; against last block's gap, {change:+.2f} points "
                     f"(spread {change_spread:.2f}): the gap "
                     + judge(change, change_spread,
                             "grows by more than the seed spread",
                             "shrinks by more than the seed spread")
                     .replace("within the seed spread",
                              "does not change beyond the seed spread"))
        lines.append(text + ".")
    for task, mode in MODES.items():
        summary = summaries.get(task)
        if not summary or not summary.get("ceiling"):
            continue
        best = best_private(summary)
        ceiling = summary["ceiling"]["accuracy"]
        text = (f"{mode}: non-private ceiling "
                f"{runs.format_percent(ceiling)}% (one untuned run)")
        if best:
            text += (f", {100 * (ceiling - best[1]['mean']):.2f} points "
                     "above the best private optimizer")
        lines.append(text + ".")
    return lines


def render(summaries, plot_file):
    """The page as markdown text."""
    lines = [
        "# Private fine-tuning on SST-2: last block, LoRA, full",
        "",
        "Written by `research/finetune_report.py` from the "
        "`RESULTS_<task>.json` summaries of `research/reproduce.py` "
        f"({', '.join(f'`{t}`' for t in summaries)}). Each cell: dev "
        "accuracy (%) of the optimizer's best tuned learning rate, mean ± "
        "std over seeds, at ε ≈ 7 (δ = 1e-5). Hyperparameters are selected "
        "on the dev set, equally for every optimizer.",
        "",
        "| optimizer | " + " | ".join(MODES[t] for t in summaries) + " |",
        "|---" * (1 + len(summaries)) + "|",
    ]
    for name, label in common.OPTIMIZER_NAMES.items():
        cells = []
        for summary in summaries.values():
            row = summary["optimizers"].get(name)
            cells.append("not run" if row is None else
                         f"{runs.format_percent(row['mean'])} ± "
                         f"{runs.format_percent(row['std'])} "
                         f"({row['seeds']} seeds, lr {row['learning_rate']:g})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = ["not run" if not s.get("ceiling") else
             f"{runs.format_percent(s['ceiling']['accuracy'])} (1 seed, lr "
             f"{s['ceiling']['learning_rate']:g})" for s in summaries.values()]
    lines += [
        "| Non-private Adam (ceiling, ε = ∞) | " + " | ".join(cells) + " |",
        "",
        "## Findings",
        "",
        *(f"- {line}" for line in findings(summaries)),
        "",
        f"![Accuracy by fine-tuning mode and optimizer]({plot_file})",
        "",
        "## Setups",
        "",
    ]
    total = 0.0
    for task, summary in summaries.items():
        privacy = summary["privacy"]
        total += summary["wall_seconds"]
        lines += [
            f"- **{MODES[task]}** ([{summary['files']['report']}]"
            f"({summary['files']['report']})): {summary['data']} C = "
            f"{privacy['l2_norm_clip']:g}, σ = "
            f"{privacy['noise_multiplier']:g}, B = {privacy['batch_size']}"
            f" (Poisson), steps {' / '.join(map(str, privacy['steps']))}; "
            f"{summary['runs']} runs, {summary['wall_seconds'] / 3600:.2f} h"
            " of wall time.",
        ]
    lines += ["", f"Total wall time of these runs: {total / 3600:.2f} h "
              "(a resumed run counts its earlier sessions too, except runs"
              " resumed before `elapsed.json` existed, 2026-11-24; the"
              " machine was shared).", ""]
    return "\n".join(lines)


def plot(path, summaries):
    """Grouped bars: accuracy per mode and optimizer, ± std; the ceiling
    as a black tick."""
    from research import plots

    figure = plots.new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    names = list(common.OPTIMIZER_NAMES)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, means, stds = [], [], []
        for x, summary in enumerate(summaries.values()):
            row = summary["optimizers"].get(name)
            if row:
                xs.append(x + (i - (len(names) - 1) / 2) * width)
                means.append(100 * row["mean"])
                stds.append(100 * row["std"])
        axes.bar(xs, means, width, yerr=stds, capsize=3,
                 label=common.OPTIMIZER_LABELS[name])
    for x, summary in enumerate(summaries.values()):
        if summary.get("ceiling"):
            axes.hlines(100 * summary["ceiling"]["accuracy"], x - 0.45,
                        x + 0.45, colors="black",
                        label="non-private" if x == 0 else None)
    axes.set_xticks(range(len(summaries)),
                    [MODES[t] for t in summaries])
    bottoms = [100 * r["mean"] for s in summaries.values()
               for r in s["optimizers"].values()]
    if bottoms:
        axes.set_ylim(max(0.0, min(bottoms) - 5), None)
    axes.set_ylabel("dev accuracy (%)")
    axes.set_title("SST-2 at ε ≈ 7: what to fine-tune")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def write_page(docs_dir):
    """Writes FINETUNE_sst2.md and its PNG from the summaries in
    `docs_dir`; returns the page's path (None when fewer than two of the
    tasks have a summary)."""
    summaries = load_summaries(docs_dir)
    if len(summaries) < 2:
        return None
    plot(os.path.join(docs_dir, PLOT), summaries)
    path = os.path.join(docs_dir, PAGE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(summaries, PLOT))
    return path
