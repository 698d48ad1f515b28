"""How well a score tells members from non-members: ROC, AUC, TPR at low FPR.

The attack predicts "member" when an example's score is >= a threshold t.
Over all thresholds (every distinct score, and +inf), with m members and n
non-members,

    TPR(t) = #{members with score >= t} / m,
    FPR(t) = #{non-members with score >= t} / n,

which is the ROC curve (`roc_curve`, the same points as scikit-learn's
`roc_curve(..., drop_intermediate=False)`). Its summaries:

* AUC, the trapezoidal area under the curve, equal to the Mann-Whitney
  statistic P[s_member > s_non] + P[s_member = s_non] / 2;
* TPR at FPR alpha: the largest TPR among the thresholds with FPR <= alpha
  (Carlini et al. 2022 argue that this, at alpha = 0.1% or 1%, is what
  matters: an attack that identifies a few members with confidence);
* balanced accuracy: max_t (TPR(t) + 1 - FPR(t)) / 2, the accuracy of the
  best threshold on a balanced set. The threshold is chosen on the data
  being scored, so this is optimistic for small sets.

Confidence intervals come from a stratified bootstrap (members and
non-members resampled separately; percentile intervals). Each replicate
reweights the examples by multinomial counts instead of re-sorting them.
At FPR alpha the estimate rests on about alpha * n non-members (2 of
2,000 at 0.1%): its interval is wide, and with alpha * n < 1 it is
meaningless.
"""

from typing import NamedTuple

import numpy as np

from tf_dpadam.common import validation

# The false-positive rates at which `evaluate_attack` reports the TPR.
FPR_TARGETS = (0.001, 0.01)


def _check_scores(member_scores, nonmember_scores):
    arrays = []
    for name, scores in (("member_scores", member_scores),
                         ("nonmember_scores", nonmember_scores)):
        scores = np.asarray(scores, dtype=np.float64)
        validation.check(scores.ndim == 1 and scores.size > 0, name,
                         f"<array of shape {scores.shape}>",
                         "to be a non-empty 1-D array")
        validation.check(not np.isnan(scores).any(), name, "<array>",
                         "to hold no NaN")
        arrays.append(scores)
    return arrays


def _sorted_points(member_scores, nonmember_scores):
    """Labels (1: member) sorted by descending score, the distinct scores,
    the index of the last example of each distinct score, and the sorting
    permutation (of members then non-members)."""
    scores = np.concatenate([member_scores, nonmember_scores])
    labels = np.concatenate([np.ones(len(member_scores)),
                             np.zeros(len(nonmember_scores))])
    order = np.argsort(-scores, kind="stable")
    scores, labels = scores[order], labels[order]
    last = np.flatnonzero(np.append(scores[1:] != scores[:-1], True))
    return labels, scores[last], last, order


def _curves(points, member_weights, nonmember_weights):
    """(fpr, tpr) arrays of shape (replicates, points + 1) for the examples
    weighted by counts (rows: replicates; columns: members then non-members
    in their given order)."""
    labels, _, last, order = points
    weights = np.concatenate([member_weights, nonmember_weights],
                             axis=1)[:, order]
    tp = np.cumsum(weights * labels, axis=1)[:, last]
    fp = np.cumsum(weights * (1 - labels), axis=1)[:, last]
    zero = np.zeros((tp.shape[0], 1))
    tpr = np.hstack([zero, tp / member_weights.sum(axis=1, keepdims=True)])
    fpr = np.hstack([zero, fp / nonmember_weights.sum(axis=1, keepdims=True)])
    return fpr, tpr


def _summaries(fpr, tpr, fpr_targets):
    """Per row: AUC, balanced accuracy and the TPR at each target FPR."""
    auc = np.sum(np.diff(fpr, axis=1) * (tpr[:, 1:] + tpr[:, :-1]) / 2, axis=1)
    balanced = np.max(tpr + 1 - fpr, axis=1) / 2
    # The curve is nondecreasing: the last point with FPR <= alpha has the
    # largest TPR among them (the first point, (0, 0), always qualifies).
    at = [np.take_along_axis(
        tpr, (np.sum(fpr <= alpha, axis=1) - 1)[:, None], axis=1)[:, 0]
          for alpha in fpr_targets]
    return auc, balanced, at


def roc_curve(member_scores, nonmember_scores):
    """The attack's ROC curve: predict "member" when score >= threshold.

    Args:
        member_scores: (m,) scores of training examples.
        nonmember_scores: (n,) scores of examples not trained on.

    Returns:
        `(fpr, tpr, thresholds)`, 1-D arrays of equal length: `thresholds`
        is +inf followed by the distinct scores in decreasing order, and
        `fpr[i]`, `tpr[i]` are the fractions of non-members and members with
        score >= `thresholds[i]` (so the curve starts at (0, 0) and ends at
        (1, 1)).
    """
    members, nonmembers = _check_scores(member_scores, nonmember_scores)
    points = _sorted_points(members, nonmembers)
    fpr, tpr = _curves(points, np.ones((1, len(members))),
                       np.ones((1, len(nonmembers))))
    return fpr[0], tpr[0], np.concatenate([[np.inf], points[1]])


def auc(fpr, tpr):
    """Trapezoidal area under the curve through the points (fpr, tpr).

    Args:
        fpr: nondecreasing false-positive rates, e.g. from `roc_curve`.
        tpr: the true-positive rates at the same points.

    Returns:
        The area, a float in [0, 1] for a ROC curve from (0, 0) to (1, 1).
    """
    fpr, tpr = np.asarray(fpr, np.float64), np.asarray(tpr, np.float64)
    validation.check(fpr.shape == tpr.shape and fpr.ndim == 1, "tpr",
                     f"<array of shape {tpr.shape}>",
                     f"to have the shape of fpr, {fpr.shape}")
    return float(_summaries(fpr[None], tpr[None], ())[0][0])


def tpr_at_fpr(fpr, tpr, target_fpr):
    """The largest TPR among the points with FPR <= `target_fpr`.

    Args:
        fpr: nondecreasing false-positive rates starting at 0 (`roc_curve`).
        tpr: the true-positive rates at the same points.
        target_fpr: alpha in [0, 1].

    Returns:
        max {tpr[i] : fpr[i] <= alpha}, a float.
    """
    validation.check(validation.is_real(target_fpr) and 0 <= target_fpr <= 1,
                     "target_fpr", target_fpr, "to be in [0, 1]")
    fpr, tpr = np.asarray(fpr, np.float64), np.asarray(tpr, np.float64)
    validation.check(fpr.ndim == 1 and fpr.size and fpr[0] == 0, "fpr",
                     "<array>", "to be a 1-D curve starting at 0")
    validation.check(tpr.shape == fpr.shape, "tpr",
                     f"<array of shape {tpr.shape}>",
                     f"to have the shape of fpr, {fpr.shape}")
    return float(_summaries(fpr[None], tpr[None], (target_fpr,))[2][0][0])


class AttackResult(NamedTuple):
    """A membership attack's ROC and its summaries (`evaluate_attack`).

    Attributes:
        fpr: the ROC curve's false-positive rates (`roc_curve`).
        tpr: its true-positive rates.
        auc: the area under it.
        balanced_accuracy: max over thresholds of (TPR + 1 - FPR) / 2.
        tpr_at_fpr: {alpha: TPR at FPR alpha}.
        intervals: {"auc" | "balanced_accuracy" | alpha: (low, high)}, the
            bootstrap confidence intervals (empty without bootstrap).
        confidence: the intervals' confidence level.
        num_members: m.
        num_nonmembers: n.
    """

    fpr: np.ndarray
    tpr: np.ndarray
    auc: float
    balanced_accuracy: float
    tpr_at_fpr: dict
    intervals: dict
    confidence: float
    num_members: int
    num_nonmembers: int

    def describe(self):
        """One line: AUC, balanced accuracy and each TPR at FPR, with their
        intervals."""

        def value(key, number, percent=False):
            text = f"{100 * number:.2f}%" if percent else f"{number:.3f}"
            if key in self.intervals:
                low, high = self.intervals[key]
                text += (f" [{100 * low:.2f}%, {100 * high:.2f}%]" if percent
                         else f" [{low:.3f}, {high:.3f}]")
            return text

        parts = [f"AUC {value('auc', self.auc)}",
                 f"balanced accuracy "
                 f"{value('balanced_accuracy', self.balanced_accuracy)}"]
        parts += [f"TPR at FPR {100 * alpha:g}% {value(alpha, tpr, True)}"
                  for alpha, tpr in self.tpr_at_fpr.items()]
        level = (f" ({100 * self.confidence:g}% intervals)" if self.intervals
                 else "")
        return (", ".join(parts) + f"; {self.num_members} members,"
                f" {self.num_nonmembers} non-members{level}")


def evaluate_attack(member_scores, nonmember_scores, *,
                    fpr_targets=FPR_TARGETS, confidence=0.95,
                    num_bootstrap=1000, seed=0):
    """ROC, AUC, balanced accuracy and TPR at low FPR, with bootstrap CIs.

    Args:
        member_scores: (m,) attack scores of members (higher: "member").
        nonmember_scores: (n,) scores of non-members.
        fpr_targets: the alphas of `tpr_at_fpr` (default 0.1% and 1%).
        confidence: level of the percentile intervals, in (0, 1).
        num_bootstrap: stratified bootstrap replicates; 0 for no intervals.
        seed: seed of the bootstrap's generator.

    Returns:
        An `AttackResult`.
    """
    members, nonmembers = _check_scores(member_scores, nonmember_scores)
    fpr_targets = tuple(fpr_targets)
    for alpha in fpr_targets:
        validation.check(validation.is_real(alpha) and 0 <= alpha <= 1,
                         "fpr_targets", fpr_targets, "to hold rates in [0, 1]")
    validation.check(validation.is_real(confidence) and 0 < confidence < 1,
                     "confidence", confidence, "to be in (0, 1)")
    validation.check(validation.is_int(num_bootstrap) and num_bootstrap >= 0,
                     "num_bootstrap", num_bootstrap, "to be an int >= 0")
    points = _sorted_points(members, nonmembers)
    m, n = len(members), len(nonmembers)
    fpr, tpr = _curves(points, np.ones((1, m)), np.ones((1, n)))
    area, balanced, at = _summaries(fpr, tpr, fpr_targets)
    intervals = {}
    if num_bootstrap:
        rng = np.random.default_rng(seed)
        tails = [(1 - confidence) / 2, (1 + confidence) / 2]
        stats = {"auc": [], "balanced_accuracy": []}
        stats.update({alpha: [] for alpha in fpr_targets})
        for start in range(0, num_bootstrap, 100):  # Bounded memory.
            size = min(100, num_bootstrap - start)
            curves = _curves(points,
                             rng.multinomial(m, np.full(m, 1 / m), size),
                             rng.multinomial(n, np.full(n, 1 / n), size))
            b_auc, b_balanced, b_at = _summaries(*curves, fpr_targets)
            stats["auc"].append(b_auc)
            stats["balanced_accuracy"].append(b_balanced)
            for alpha, values in zip(fpr_targets, b_at):
                stats[alpha].append(values)
        intervals = {key: tuple(float(q) for q in np.quantile(
            np.concatenate(values), tails)) for key, values in stats.items()}
    return AttackResult(
        fpr=fpr[0], tpr=tpr[0], auc=float(area[0]),
        balanced_accuracy=float(balanced[0]),
        tpr_at_fpr={alpha: float(v[0]) for alpha, v in zip(fpr_targets, at)},
        intervals=intervals, confidence=float(confidence), num_members=m,
        num_nonmembers=n)
