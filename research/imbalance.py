"""Heavy-tailed class imbalance (issue 37): the training subset and the
per-class accuracies.

Tang, Zhiyanov & Lecuyer (arXiv 2507.10536, 2025) report that DP-AdamBC's
correction helps the rare classes under heavy-tailed class imbalance. The
setting here: Fashion-MNIST's training set with class sizes falling
geometrically, class c keeping a fraction `ratio^(c / (K - 1))` of its
images (class 0 all of them, the last class `ratio` of them), and the
balanced test set, on which the run reports every class's accuracy, their
mean and the worst.
"""

import numpy as np


def check_ratio_flag(name, value):
    """A flag check (`shared_flags.check_flag`): `value` in (0, 1]."""
    if not 0 < value <= 1:
        raise ValueError(f"Expected --{name}={value!r} in (0, 1].")


def geometric_class_sizes(counts, ratio):
    """How many examples of each class to keep.

    Args:
        counts: the number of examples of each of the K classes.
        ratio: in (0, 1], the fraction the last class keeps.

    Returns:
        A list of K ints, max(1, floor(counts[c] * ratio^(c / (K - 1)))).
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"Expected ratio={ratio!r} in (0, 1].")
    counts = [int(c) for c in counts]
    k = len(counts)
    if k < 2:
        raise ValueError(f"Expected at least 2 classes, got counts={counts}.")
    return [max(1, int(np.floor(n * ratio ** (c / (k - 1)))))
            for c, n in enumerate(counts)]


def imbalanced_subset(x, y, ratio, seed=0):
    """`(x, y)` with class c cut to `geometric_class_sizes`, drawn uniformly
    without replacement per class; the examples keep their order."""
    y = np.asarray(y)
    num_classes = int(y.max()) + 1
    counts = np.bincount(y, minlength=num_classes)
    sizes = geometric_class_sizes(counts, ratio)
    rng = np.random.default_rng(seed)
    keep = np.concatenate([
        rng.choice(np.flatnonzero(y == c), size=size, replace=False)
        for c, size in enumerate(sizes)])
    keep = np.sort(keep)
    return np.asarray(x)[keep], y[keep]


def class_accuracies(labels, predicted, num_classes):
    """Each class's accuracy (NaN for a class absent from `labels`)."""
    labels = np.asarray(labels)
    predicted = np.asarray(predicted)
    out = []
    for c in range(num_classes):
        rows = labels == c
        out.append(float(np.mean(predicted[rows] == c)) if rows.any()
                   else float("nan"))
    return out


def per_class_measure(x_test, y_test, batch_size=512):
    """A `measure(model)` for `training.fit_private`: the test set's
    `class_accuracies`, their mean and the worst (lowest)."""
    def measure(model):
        logits = model.predict(x_test, batch_size=batch_size, verbose=0)
        accuracies = class_accuracies(y_test, np.argmax(logits, axis=-1),
                                      logits.shape[-1])
        return {"class_accuracies": accuracies,
                "mean_class_accuracy": float(np.nanmean(accuracies)),
                "worst_class_accuracy": float(np.nanmin(accuracies))}

    return measure


def combine_measures(*measures):
    """One `measure(model)` returning the union of the dicts of `measures`
    (None entries skipped; a key measured twice raises)."""
    measures = [m for m in measures if m is not None]

    def measure(model):
        results = {}
        for m in measures:
            found = m(model)
            twice = set(found) & set(results)
            if twice:
                raise ValueError(f"Measured twice: {sorted(twice)}.")
            results.update(found)
        return results

    return measure
