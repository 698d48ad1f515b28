"""The numbers of the optimizer comparison, and what they say.

Pure helpers: mean and spread over seeds and over curves, which accuracy
tuning selects a learning rate by (`selection_accuracies`), whether a best
learning rate sits at the edge of its grid, and a short verdict paragraph
that compares two optimizers against their seed spread and the paper's
numbers (`PAPER_RESULTS`).
"""

import math

import numpy as np

from research import common

# Test accuracy (%) at epsilon = 7 of the paper's Table (Tang & Lecuyer).
PAPER_RESULTS = {
    "CIFAR-10": {"dpsgd": 61.94, "dpadam": 56.35, "dpadam_corrected": 60.27},
    "SNLI": {"dpsgd": 41.31, "dpadam": 53.04, "dpadam_corrected": 56.62},
}


def aggregate_seeds(values):
    """`(mean, std, n)`; std is the sample standard deviation (ddof=1), 0.0
    for a single value. NaN if `values` is empty."""
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan, 0
    std = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return float(values.mean()), std, int(values.size)


def aggregate_curves(histories):
    """Mean and std over seeds of accuracy-vs-step curves.

    Args:
        histories: one list of `(step, accuracy)` per seed.

    Returns:
        `(steps, mean, std)` arrays over the steps all seeds evaluated at
        (std with ddof=1; 0 for one seed).
    """
    if not histories:
        return np.array([]), np.array([]), np.array([])
    maps = [dict(h) for h in histories]
    steps = sorted(set.intersection(*(set(m) for m in maps)))
    values = np.array([[m[s] for s in steps] for m in maps], np.float64)
    mean = values.mean(axis=0) if steps else np.array([])
    std = (values.std(axis=0, ddof=1) if len(maps) > 1
           else np.zeros(len(steps)))
    return np.array(steps), mean, std


def selection_accuracies(records, group):
    """The accuracies tuning compares the `records` of one grid by (one
    (cell, variant) of a study, one optimizer of `research.reproduce`):
    each run's validation accuracy (`runs.Record.validation_accuracy`, the
    training examples it held out) when the runs have one, else their test
    accuracy (runs recorded before the validation split, or without one).

    Args:
        records: objects with `accuracy` and `validation_accuracy` (None:
            none), e.g. `runs.Record`s or `study_plan.StudyRecord`s.
        group: what the records tune, for the error (e.g. "eps3_B256 /
            dpsgd").

    Returns:
        A list of accuracies (fractions, NaN for a diverged run), in order.

    Raises:
        ValueError: some records have a validation accuracy and others not:
            they would be compared on different sets.
    """
    records = list(records)
    held_out = [r.validation_accuracy is not None for r in records]
    if any(held_out) and not all(held_out):
        raise ValueError(
            f"The tuning runs of {group} mix {sum(held_out)} with a"
            f" validation accuracy and {held_out.count(False)} without:"
            " their learning rates cannot be compared on one set; rerun"
            " them with the same --validation_examples (another"
            " --runs_dir).")
    return [r.validation_accuracy if validated else r.accuracy
            for r, validated in zip(records, held_out)]


def at_edge(rate, rates):
    """Whether `rate` is the lowest or highest of `rates` (with more than
    one), i.e. the optimum may lie outside them."""
    rates = sorted(set(rates))
    return len(rates) > 1 and rate in (rates[0], rates[-1])


def half_decades(lr):
    """k of the grid rate 10^(k / 2) nearest `lr`."""
    return round(2 * math.log10(lr))


def half_decade(k):
    """10^(k / 2) to 3 significant digits: the grids' rates (0.1, 0.316,
    1, 3.16, ...)."""
    return float(f"{10 ** (k / 2):.3g}")


def edge_direction(best, rates, grid, extensions):
    """Where tuning should try one more rate: +1 (above) when `best` is the
    highest of `rates` (the grid's and those added beyond it), -1 (below)
    when it is the lowest, provided the grid has two rates or more and
    fewer than `extensions` were added beyond the grid on that side; else
    None."""
    grid = sorted(set(grid))
    rates = sorted(set(rates))
    if len(grid) < 2:
        return None
    if best == rates[-1]:
        added, direction = sum(lr > grid[-1] for lr in rates), 1
    elif best == rates[0]:
        added, direction = sum(lr < grid[0] for lr in rates), -1
    else:
        return None
    return direction if added < extensions else None


def at_grid_edge(setting, grid):
    """`at_edge` of `setting`'s learning rate among its grid's."""
    return at_edge(setting.learning_rate, (s.learning_rate for s in grid))


def compare(a, b):
    """How summary a = (mean, std, n) compares to b, in accuracy points.

    Returns:
        `(gap, spread, verdict)`: gap = mean_a - mean_b, spread = std_a +
        std_b, and verdict "better" / "worse" if |gap| > spread (the mean +-
        std intervals do not overlap), "within" if not, "unknown" with fewer
        than 2 seeds on either side.
    """
    gap = a[0] - b[0]
    spread = a[1] + b[1]
    if a[2] < 2 or b[2] < 2 or math.isnan(gap):
        return gap, spread, "unknown"
    if abs(gap) <= spread:
        return gap, spread, "within"
    return gap, spread, "better" if gap > 0 else "worse"


def compare_sentence(summary, a, b):
    """How optimizer `a` compares with `b` over seeds (`compare` of their
    `(mean, std, n)` in `summary`, accuracies as fractions), one sentence."""
    first, second = common.OPTIMIZER_LABELS[a], common.OPTIMIZER_LABELS[b]
    if a not in summary or b not in summary:
        return (f"Not enough finished runs to compare {first} with {second}"
                " yet.")
    gap, spread, verdict_word = compare(summary[a], summary[b])
    head = (f"{first} scores {100 * summary[a][0]:.2f}% against "
            f"{100 * summary[b][0]:.2f}% for {second} (a gap of "
            f"{100 * gap:+.2f} points")
    if verdict_word == "unknown":
        return head + ("); with fewer than two seeds on a side the seed "
                       "spread is unknown, so this says little.")
    head += (f", seed spread {100 * spread:.2f} points = the sum of the two"
             " standard deviations)")
    if verdict_word == "within":
        return head + (": the difference is within the seed spread, not a"
                       " clear win either way.")
    word = "beats" if verdict_word == "better" else "loses to"
    return head + f": {first} {word} {second} by more than the seed spread."


def verdict_paragraph(summary, paper, paper_dataset, dataset):
    """A short honest paragraph from the numbers.

    Args:
        summary: optimizer -> `(mean, std, n)` of test accuracy (fractions).
        paper: optimizer -> the paper's accuracy (%).
        paper_dataset, dataset: names for the text.
    """
    if "dpadam_corrected" not in summary or "dpadam" not in summary:
        return ("Not enough finished runs to compare DP-AdamBC with DP-Adam "
                "yet.")
    text = [compare_sentence(summary, "dpadam_corrected", "dpadam")]
    if "dpsgd" in summary:
        text.append(compare_sentence(summary, "dpadam_corrected", "dpsgd"))
    paper_gap = paper["dpadam_corrected"] - paper["dpadam"]
    text.append(
        f"In the paper ({paper_dataset}) DP-AdamBC beats DP-Adam by "
        f"{paper_gap:.2f} points and DP-SGD scores "
        f"{paper['dpsgd']:.2f}%; {dataset} is a different (and easier) "
        "task with a different model, so compare the ordering and the gaps, "
        "not the accuracies themselves."
    )
    return " ".join(text)

