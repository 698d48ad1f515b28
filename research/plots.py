"""The PNGs of the reports (matplotlib, imported only when a plot is drawn).

`plot_curves` and `plot_tuning` for `research.reproduce`'s
RESULTS_<task>.md, `plot_ablation` for `research.ablations`' report. Each
draws on a `Figure` of the Agg backend, without pyplot's global state.
"""

from research import common
from research import comparison
from research import experiments
from research import runs

def new_figure(width, height):
    """A matplotlib Figure of `width` x `height` inches on the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)  # The Agg backend, without pyplot's state.
    return figure


def plot_curves(path, plan, records, best):
    """Test accuracy vs step of each best setting, mean ± std over seeds."""
    figure = new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    for name, setting in best.items():
        names = [runs.run_name(setting, s) for s in plan.seeds]
        histories = [records[n].history for n in names if n in records]
        steps, mean, std = comparison.aggregate_curves(histories)
        if not len(steps):
            continue
        label = (f"{common.OPTIMIZER_LABELS[name]} (lr "
                 f"{setting.learning_rate:g}, {len(histories)} seeds)")
        (line,) = axes.plot(steps, 100 * mean, marker=".", label=label)
        axes.fill_between(steps, 100 * (mean - std), 100 * (mean + std),
                          color=line.get_color(), alpha=0.2)
    axes.set_xlabel("step")
    axes.set_ylabel("test accuracy (%)")
    task = experiments.TASKS[plan.task]
    axes.set_title(f"{task['name']}: best setting per optimizer")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def plot_tuning(path, plan, records):
    """Final accuracy vs learning rate, one panel per optimizer, one line
    per gamma."""
    figure = new_figure(4.0 * len(plan.grids), 3.6)
    for i, (name, grid) in enumerate(plan.grids.items()):
        axes = figure.add_subplot(1, len(plan.grids), i + 1)
        gammas = list(dict.fromkeys(s.gamma for s in grid))
        for gamma in gammas:
            points = sorted(
                (s.learning_rate,
                 records[runs.run_name(s, plan.tune_seed)].accuracy)
                for s in grid if s.gamma == gamma
                and runs.run_name(s, plan.tune_seed) in records
            )
            if not points:
                continue
            lrs, accs = zip(*points)
            setting = runs.Setting(name, 1.0, gamma)
            label = ("" if name == "dpsgd" else
                     f"γ = {runs.format_gamma(setting)}")
            axes.plot(lrs, [100 * a for a in accs], marker="o",
                      label=label or None)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("final test accuracy (%)")
        axes.set_title(common.OPTIMIZER_LABELS[name])
        axes.grid(alpha=0.3)
        if name != "dpsgd" and axes.lines:
            axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def plot_ablation(path, ablation, records, seed, phi):
    """Final accuracy vs the swept value (log axis) and accuracy vs step."""
    figure = new_figure(11.0, 4.0)
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

