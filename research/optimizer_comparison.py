"""Issue 37's table: every optimizer in every regime, and the best of each.

    python -m research.optimizer_comparison --results_dir=research/results

Reads the summaries that `research.study` and `research.reproduce` write
beside their reports (`<STUDY>_fashion_mnist.json`, `RESULTS_<task>.json`)
and writes `OPTIMIZERS_COMPARISON.md` and its PNG: for each regime (a cell
of a study, or a task of the comparison), each optimizer's tuned test
accuracy (mean ± std over seeds), the best optimizer's margin over the
runner-up with the standard error of the difference, √(s₁²/n₁ + s₂²/n₂),
and on imbalanced data the worst class's accuracy too. An optimizer whose
runs are not there yet is "not run"; nothing is estimated.
"""

import dataclasses
import json
import math
import os

from absl import app
from absl import flags

from research import common

# The optimizers compared (labels: `common.OPTIMIZER_LABELS`).
OPTIMIZERS = ("dpsgd", "dpadam", "dpadam_corrected", "dpadam_stp",
              "dpadam_disk")
COLORS = dict(zip(OPTIMIZERS, ("tab:gray", "tab:blue", "tab:orange",
                                "tab:green", "tab:purple")))
# Means closer than this (a fraction of the test set, far below one
# example) are the same score.
TIE = 1e-6
PAGE = "OPTIMIZERS_COMPARISON.md"
FIGURE = "OPTIMIZERS_COMPARISON.png"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where some optimizers' numbers of a regime are: a study summary's
    cell (`kind="study"`, `cell` one of its cells) or a reproduce summary
    (`kind="reproduce"`), `path` relative to the results folder."""

    kind: str
    path: str
    cell: str | None = None


@dataclasses.dataclass(frozen=True)
class Regime:
    label: str
    sources: tuple


# Issue 37's regimes. A later source overrides an earlier one's optimizer.
REGIMES = (
    Regime("Small CNN, Fashion-MNIST, ε = 3, B = 256", (
        Source("study", "REGIME_MAP_fashion_mnist.json", "eps3_B256"),)),
    Regime("Small CNN, Fashion-MNIST, ε = 3, B = 1024", (
        Source("study", "REGIME_MAP_fashion_mnist.json", "eps3_B1024"),)),
    Regime("Small CNN, Fashion-MNIST, ε = 3, B = 4096", (
        Source("study", "REGIME_MAP_fashion_mnist.json", "eps3_B4096"),)),
    Regime("Paper CNN, Fashion-MNIST, ε = 7, B = 256", (
        Source("reproduce", "RESULTS_fashion_mnist.json"),
        Source("study", "PAPER_CNN_fashion_mnist.json", "eps7_B256"))),
    Regime("SST-2, MiniLM's last block, ε = 7, B = 256", (
        Source("reproduce", "RESULTS_sst2.json"),
        Source("reproduce", "sst2_stp_disk/RESULTS_sst2.json"))),
    Regime("Class imbalance 1/20, small CNN, ε = 3, B = 256", (
        Source("study", "CLASS_IMBALANCE_fashion_mnist.json",
               "eps3_B256_imbalance0.05"),)),
)


def _read(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def source_rows(source, results_dir):
    """optimizer -> {mean, std, seeds, learning_rate[, worst_class_mean,
    worst_class_std]} of one source ({} when its summary is absent)."""
    summary = _read(os.path.join(results_dir, source.path))
    if summary is None:
        return {}
    rows = {}
    if source.kind == "study":
        for row in summary["best"]:
            if row["cell"] == source.cell and row["variant"] in OPTIMIZERS:
                rows[row["variant"]] = dict(row)
    elif source.kind == "reproduce":
        for name, row in summary["optimizers"].items():
            if name in OPTIMIZERS:
                rows[name] = dict(row)
    else:
        raise ValueError(f"Unknown source kind {source.kind!r}.")
    return rows


def regime_rows(regime, results_dir):
    """optimizer -> row of a regime, over its sources."""
    rows = {}
    for source in regime.sources:
        rows.update(source_rows(source, results_dir))
    return rows


def margin(rows, key="mean", spread="std"):
    """`(best, runner_up, gap, standard error)` by `key` over the
    optimizers of `rows` (None with fewer than two)."""
    ranked = sorted((r[key], name) for name, r in rows.items()
                    if r.get(key) is not None)
    if len(ranked) < 2:
        return None
    (second_value, second), (best_value, best) = ranked[-2], ranked[-1]
    a, b = rows[best], rows[second]
    error = math.sqrt(a[spread] ** 2 / a["seeds"]
                      + b[spread] ** 2 / b["seeds"])
    return best, second, best_value - second_value, error


def _cell(row, key="mean", spread="std"):
    if row is None or row.get(key) is None:
        return "not run"
    return (f"{100 * row[key]:.2f} ± {100 * row[spread]:.2f}"
            f" ({row['seeds']})")


def _verdict(rows, key="mean", spread="std"):
    found = margin(rows, key, spread)
    if found is None:
        return "fewer than two optimizers run"
    best, second, gap, error = found
    label = common.OPTIMIZER_LABELS
    lowest = min(r[key] for r in rows.values() if r.get(key) is not None)
    # Every optimizer at the lowest mean: two that scored the same examples
    # (one summary in float32, one in float64) tie rather than one of them
    # being named last by a rounding error.
    last = [n for n in OPTIMIZERS if n in rows and rows[n].get(key) is not None
            and rows[n][key] - lowest < TIE]
    tied = " (tied)" if len(last) > 1 else ""
    clear = "" if gap > 2 * error else " (within 2 s.e.)"
    return (f"**{label[best]}**, by {100 * gap:+.2f} ± {100 * error:.2f}"
            f" over {label[second]}{clear}; last:"
            f" {' and '.join(label[n] for n in last)}{tied}"
            f" ({100 * (lowest - rows[best][key]):+.2f})")


def render(regimes, results_dir):
    """The page's lines."""
    label = common.OPTIMIZER_LABELS
    header = ("| regime | " + " | ".join(label[n] for n in OPTIMIZERS)
              + " | best, margin over the runner-up ± s.e. (points) |")
    rule = "|---" * (len(OPTIMIZERS) + 2) + "|"
    lines = [
        "# Every optimizer in every regime (issue 37)", "",
        "Written by `research/optimizer_comparison.py` from the summaries"
        " beside it. Each cell: test accuracy (%) of the optimizer's best"
        " learning rate, mean ± std over seeds (the number of seeds in"
        " brackets); each optimizer tuned on its own grid at seed 0 (see each"
        " regime's report). The margin is the best mean minus the"
        " runner-up's, ± the standard error of the difference"
        " √(s₁²/n₁ + s₂²/n₂); \"within 2 s.e.\" marks a margin smaller than"
        " twice it. \"not run\": no runs yet.", "",
        header, rule]
    all_rows = []
    for regime in regimes:
        rows = regime_rows(regime, results_dir)
        all_rows.append(rows)
        lines.append(f"| {regime.label} | " + " | ".join(
            _cell(rows.get(n)) for n in OPTIMIZERS)
            + f" | {_verdict(rows)} |")
    worst = [(regime, rows) for regime, rows in zip(regimes, all_rows)
             if any(r.get("worst_class_mean") is not None
                    for r in rows.values())]
    if worst:
        lines += ["", "## The worst class", "",
                  "Each optimizer's (best mean accuracy's) run: the lowest"
                  " test accuracy of a class (%), mean ± std over seeds.", "",
                  header, rule]
        for regime, rows in worst:
            lines.append(f"| {regime.label} | " + " | ".join(
                _cell(rows.get(n), "worst_class_mean", "worst_class_std")
                for n in OPTIMIZERS)
                + f" | {_verdict(rows, 'worst_class_mean', 'worst_class_std')}"
                " |")
    lines += ["", f"![every optimizer in every regime]({FIGURE})", ""]
    return lines, all_rows


def plot(path, regimes, all_rows):
    """Grouped bars: each regime's optimizers, ± std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(regimes), 1,
                             figsize=(7, 1.9 * len(regimes) + 0.5),
                             squeeze=False)
    for ax, regime, rows in zip(axes[:, 0], regimes, all_rows):
        names = [n for n in OPTIMIZERS if n in rows]
        means = [100 * rows[n]["mean"] for n in names]
        stds = [100 * rows[n]["std"] for n in names]
        if not names:
            ax.text(0.5, 0.5, "no runs yet", transform=ax.transAxes,
                    ha="center", va="center")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(regime.label, fontsize=9)
            continue
        ax.barh(range(len(names)), means, xerr=stds,
                color=[COLORS[n] for n in names])
        ax.set_yticks(range(len(names)),
                      [common.OPTIMIZER_LABELS[n] for n in names])
        low = min(m - s for m, s in zip(means, stds))
        high = max(m + s for m, s in zip(means, stds))
        ax.set_xlim(low - 1.0, high + 0.5)
        ax.set_title(regime.label, fontsize=9)
        ax.set_xlabel("test accuracy (%)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(results_dir, regimes=REGIMES):
    """Writes the page and its PNG into `results_dir`; returns the page's
    path."""
    os.makedirs(results_dir, exist_ok=True)
    lines, all_rows = render(regimes, results_dir)
    plot(os.path.join(results_dir, FIGURE), regimes, all_rows)
    path = os.path.join(results_dir, PAGE)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def define_flags():
    """This binary's flags (when run as a program, not on import)."""
    flags.DEFINE_string("results_dir", None, "The folder of the summaries"
                        " (default: research/results).")


FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from research import experiments

    print("Wrote", write(FLAGS.results_dir or experiments.RESULTS_DIR))


if __name__ == "__main__":
    define_flags()
    app.run(main)
