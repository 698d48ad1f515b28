"""RESULTS.md: every task's best settings, and the studies' sections.

`write_index` rewrites RESULTS.md from the summaries beside it: each task's
RESULTS_<task>.json (`results_report.summary_record`) in a table beside the
paper's numbers (`render_index`), then a section for each study of
`research.study` whose summary JSON is there (`study_summaries`).
"""

import os

from research import common
from research import comparison
from research import experiments
from research import runs
from research import study_report


def _epsilon_of(summary):
    """", ε = 7" (the target), or the largest spent if there was none."""
    target = summary["privacy"]["target_epsilon"]
    if target is not None:
        return f", ε = {target:g}"
    spent = [row["epsilon"] for row in summary["optimizers"].values()]
    return f", ε ≈ {max(spent):.2g}" if spent else ""


def render_index(summaries, studies=()):
    """RESULTS.md: every task's best settings beside the paper's numbers,
    then the studies' sections (`study_report.summary_record`s)."""
    papers = []
    for summary in summaries:
        if summary["paper_dataset"] not in papers:
            papers.append(summary["paper_dataset"])
    lines = [
        "# DP-SGD vs DP-Adam vs DP-AdamBC: results",
        "",
        "Written by `research/reproduce.py` and `research/study.py` (they "
        "rewrite this page whenever they write a report) from the "
        "`RESULTS_<task>.json` and study summaries beside it. "
        "Each cell: test accuracy (%) of the optimizer's best tuned setting, "
        "mean ± standard deviation over seeds, at the ε of its column "
        "(δ = 1e-5). The paper's numbers (Tang & Lécuyer, ε ≈ 7) are on "
        "other datasets and models: compare orderings and gaps, not "
        "accuracies.",
        "",
    ]
    table = [
        "| optimizer | " + " | ".join(
            f"{s['name']}{_epsilon_of(s)} (ours)" for s in summaries)
        + " | " + " | ".join(f"{p} (paper)" for p in papers) + " |",
        "|---" * (1 + len(summaries) + len(papers)) + "|",
    ]
    for name, label in common.OPTIMIZER_NAMES.items():
        cells = []
        for summary in summaries:
            row = summary["optimizers"].get(name)
            cells.append(
                "not run" if row is None else
                f"{runs.format_percent(row['mean'])} ± "
                f"{runs.format_percent(row['std'])}"
                f" ({row['seeds']} seeds, lr {row['learning_rate']:g})")
        cells += [f"{comparison.PAPER_RESULTS[p][name]:.2f}" for p in papers]
        table.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(s.get("ceiling") for s in summaries):
        cells = ["not run" if not s.get("ceiling") else
                 f"{runs.format_percent(s['ceiling']['accuracy'])} (1 seed,"
                 f" lr {s['ceiling']['learning_rate']:g})"
                 for s in summaries]
        table.append("| Non-private Adam (ceiling, ε = ∞) | "
                     + " | ".join(cells + ["" for _ in papers]) + " |")
    if summaries:  # (No table without a task.)
        lines += table
    for summary in summaries:
        privacy = summary["privacy"]
        machine = summary["machine"] or {}
        files = summary["files"]
        lines += [
            "",
            f"## {summary['name']} (in place of the paper's "
            f"{summary['paper_dataset']})",
            "",
            summary["verdict"],
            "",
            f"- Data: {summary['data']}",
            f"- Privacy: C = {privacy['l2_norm_clip']:g}, σ = "
            f"{privacy['noise_multiplier']:g}, expected batch "
            f"{privacy['batch_size']} (Poisson), target ε = "
            f"{privacy['target_epsilon']}, δ = {privacy['delta']:g}; steps "
            f"per run: {' / '.join(map(str, privacy['steps']))}.",
            "- Command: " + "; ".join(f"`{c}`" for c in summary["commands"]),
            f"- Machine: `{machine.get('platform')}`, "
            f"{machine.get('cpu_count')} CPUs, TensorFlow "
            f"{machine.get('tensorflow')}; wall time "
            f"{summary['wall_seconds'] / 3600:.2f} h over {summary['runs']} "
            "runs (tuning and seeds).",
            f"- Details (tuning grid, every run): [{files['report']}]"
            f"({files['report']}).",
            "",
            f"![{summary['name']}: test accuracy vs step]({files['curves']})",
        ]
    for study in studies:
        lines += ["", *study_report.render_summary(study)]
    return "\n".join(lines) + "\n"


def write_index(output_dir):
    """Rewrites output_dir/RESULTS.md from its RESULTS_<task>.json files."""
    summaries = []
    for task in experiments.TASKS:
        path = os.path.join(output_dir, f"RESULTS_{task}.json")
        if os.path.exists(path):
            summaries.append(runs.read_json(path))
    studies = list(study_summaries(output_dir).values())
    path = os.path.join(output_dir, "RESULTS.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_index(summaries, studies))
    return path


def study_summaries(output_dir):
    """Stem -> the summary JSON of each study (`research.study`) written to
    output_dir, in `study_report.TITLES`' order."""
    found = {}
    for study in study_report.TITLES:
        stem = study_report.report_stem(study)
        summary = runs.read_json(os.path.join(output_dir, f"{stem}.json"))
        if summary is not None:
            found[stem] = summary
    return found
