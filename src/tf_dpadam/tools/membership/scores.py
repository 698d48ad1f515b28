"""Per-example membership scores of a trained classifier (higher: "member").

Two scores, from the model's logits z (one row per example, label y):

* `loss` (Yeom et al. 2018): minus the cross-entropy,
  `-(logsumexp(z) - z_y)`; a training example tends to have a lower loss.
* `logit_confidence` (Carlini et al. 2022, "Membership Inference Attacks
  From First Principles", Section 4.3): the logit of the softmax confidence
  p_y, `phi(p) = log(p_y) - log(1 - p_y)`. It spreads p_y near 1 (where
  members and non-members differ) and is close to Gaussian across training
  runs, which LiRA assumes. Computed stably from the logits:

      phi = z_y - logsumexp_{j != y} z_j,

  exact for any z (no p_y = 1 rounding, no log(0)).

The pure functions take NumPy arrays; `model_scores` runs a Keras model's
`predict` in batches and applies them.
"""

import numpy as np

from tf_dpadam.common import validation
from tf_dpadam.tools.membership import queries as queries_lib
from tf_dpadam.tools.membership import roc

# The scores `model_scores` computes, by name.
SCORES = ("logit_confidence", "loss")


def _check_logits(logits, labels):
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels)
    validation.check(logits.ndim == 2 and logits.shape[1] >= 2, "logits",
                     f"<array of shape {logits.shape}>",
                     "to have shape (num_examples, num_classes >= 2)")
    validation.check(
        labels.shape == (logits.shape[0],)
        and np.issubdtype(labels.dtype, np.integer)
        and (labels.size == 0 or (labels.min() >= 0
                                  and labels.max() < logits.shape[1])),
        "labels", f"<array of shape {labels.shape}, dtype {labels.dtype}>",
        f"to be {logits.shape[0]} integer class ids in"
        f" [0, {logits.shape[1]})")
    return logits, labels.astype(np.int64)


def _logsumexp(values, axis):
    top = np.max(values, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf: all entries -inf.
        return np.squeeze(top, axis) + np.log(
            np.sum(np.exp(values - top), axis=axis))


def logit_confidence(logits, labels):
    """The logit-scaled confidence phi(p_y) = log p_y - log(1 - p_y).

    With p = softmax(z): log p_y = z_y - logsumexp(z) and log(1 - p_y) =
    logsumexp_{j != y} z_j - logsumexp(z), so

        phi = z_y - logsumexp_{j != y}(z_j),

    which is what this computes (in float64), finite wherever z is.

    Args:
        logits: (n, num_classes) unnormalized log-probabilities (a model's
            output before the softmax; log-probabilities work too).
        labels: (n,) integer labels.

    Returns:
        (n,) float64 array; higher means the model is more confident in the
        true label.
    """
    logits, labels = _check_logits(logits, labels)
    rows = np.arange(len(labels))
    true = logits[rows, labels]
    others = logits.copy()
    others[rows, labels] = -np.inf
    return true - _logsumexp(others, axis=1)


def cross_entropy(logits, labels):
    """The per-example cross-entropy `logsumexp(z) - z_y` (natural log).

    Args:
        logits: (n, num_classes) logits.
        labels: (n,) integer labels.

    Returns:
        (n,) float64 losses, >= 0.
    """
    logits, labels = _check_logits(logits, labels)
    return _logsumexp(logits, axis=1) - logits[np.arange(len(labels)),
                                               labels]


def scores_from_logits(logits, labels, score="logit_confidence"):
    """The membership score `score` of each example (higher: "member").

    Args:
        logits: (n, num_classes) logits.
        labels: (n,) integer labels.
        score: "logit_confidence" (`logit_confidence`) or "loss" (minus
            `cross_entropy`, so that higher still means "member").

    Returns:
        (n,) float64 scores.
    """
    validation.check(score in SCORES, "score", score, f"to be one of {SCORES}")
    if score == "loss":
        return -cross_entropy(logits, labels)
    return logit_confidence(logits, labels)


def model_scores(model, x, y, *, score="logit_confidence", batch_size=512,
                 from_logits=True, queries=None):
    """Membership scores of the examples (x, y) under a trained Keras model.

    Runs `model.predict(x, batch_size=batch_size)` (a `PrivateModel`
    predicts as Keras does) and applies `scores_from_logits`.

    Args:
        model: a Keras classifier whose output is (n, num_classes) logits,
            or probabilities with `from_logits=False`.
        x: the inputs (anything `predict` takes; a NumPy array with
            `queries`).
        y: (n,) integer labels.
        score: "logit_confidence" or "loss".
        batch_size: examples per `predict` batch.
        from_logits: whether the model outputs logits; if False its outputs
            are probabilities and their logs (floored at 1e-30) are used as
            logits, which loses precision where p_y rounds to 1.
        queries: None, or a list of Q functions of a batch of inputs (views
            of each example, e.g. `queries.image_queries()`): the scores
            of `query(x)` for each.

    Returns:
        (n,) float64 scores, or (n, Q) with `queries`.
    """
    validation.check_count("batch_size", batch_size)
    y = np.asarray(y).reshape(-1)
    if queries is not None:
        return np.stack([
            model_scores(model, query(x), y, score=score,
                         batch_size=batch_size, from_logits=from_logits)
            for query in queries_lib.check_queries(queries)], axis=1)
    outputs = np.asarray(model.predict(x, batch_size=batch_size, verbose=0),
                         dtype=np.float64)
    if not from_logits:
        outputs = np.log(np.maximum(outputs, 1e-30))
    return scores_from_logits(outputs, y, score)


def _check_examples(name, examples):
    """`examples` is an `(x, y)` pair with at least one label (Keras'
    `predict` fails obscurely on no inputs)."""
    validation.check(
        isinstance(examples, (tuple, list)) and len(examples) == 2, name,
        f"<{type(examples).__name__}>", "to be a pair (x, y)")
    num = np.size(examples[1])
    validation.check(num > 0, name, f"<{num} examples>",
                     "to hold at least one example")


def evaluate_model(model, members, nonmembers, *, score="logit_confidence",
                   batch_size=512, **evaluate_options):
    """A threshold attack on one score of a trained model, evaluated.

    Scores the members and non-members with `model_scores` and passes them
    to `roc.evaluate_attack` (ROC, AUC, balanced accuracy, TPR at FPR 0.1%
    and 1%, bootstrap intervals). The same threshold applies to every
    example (a "global" attack); LiRA (`lira`) calibrates each example.

    Args:
        model: a trained Keras classifier with logits as outputs.
        members: `(x, y)`, examples the model trained on.
        nonmembers: `(x, y)`, examples from the same distribution that it
            never saw.
        score: "logit_confidence" or "loss".
        batch_size: `predict` batch size.
        **evaluate_options: `fpr_targets`, `confidence`, `num_bootstrap`,
            `seed` of `roc.evaluate_attack`.

    Returns:
        `roc.AttackResult`.
    """
    _check_examples("members", members)
    _check_examples("nonmembers", nonmembers)
    member_scores = model_scores(model, *members, score=score,
                                 batch_size=batch_size)
    nonmember_scores = model_scores(model, *nonmembers, score=score,
                                    batch_size=batch_size)
    return roc.evaluate_attack(member_scores, nonmember_scores,
                               **evaluate_options)
