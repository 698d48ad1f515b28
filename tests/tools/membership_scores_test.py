"""Tests of tf_dpadam.membership.scores.

References: the scores written from the softmax probabilities in NumPy
(where they are representable), their closed forms for logits whose
softmax rounds p_y to 1, and a Keras Dense layer with known weights.
Planted answer (slow): a non-private net that memorizes 64 random examples
with random labels is detected well above chance; a model that never saw
either set is not.
"""

import math

import keras
import numpy as np
import pytest

from tf_dpadam.tools import membership
from tf_dpadam.tools.membership import scores


def softmax(logits):
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_logit_confidence_and_loss_match_the_probabilities():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (50, 7))
    labels = rng.integers(0, 7, 50)
    p = softmax(logits)[np.arange(50), labels]
    np.testing.assert_allclose(scores.logit_confidence(logits, labels),
                               np.log(p) - np.log(1 - p), rtol=1e-9)
    np.testing.assert_allclose(scores.cross_entropy(logits, labels),
                               -np.log(p), rtol=1e-9)
    np.testing.assert_allclose(
        scores.scores_from_logits(logits, labels, "loss"), np.log(p),
        rtol=1e-9)


def test_stable_where_p_rounds_to_one():
    # softmax((1000, 0, 0))_0 is 1 in float64; phi = 1000 - log 2 exactly.
    logits = np.array([[1000.0, 0.0, 0.0], [0.0, 0.0, -1000.0],
                       [-50.0, 60.0, 60.0]])
    labels = np.array([0, 2, 0])
    np.testing.assert_allclose(
        scores.logit_confidence(logits, labels),
        [1000 - math.log(2), -1000 - math.log(2), -110 - math.log(2)])
    np.testing.assert_allclose(
        scores.cross_entropy(logits, labels),
        [math.log1p(2 * math.exp(-1000.0)), 1000 + math.log(2),
         110 + math.log(2)], rtol=1e-12)
    # Two classes: phi is the logit difference.
    two = np.array([[3.0, -1.0]])
    np.testing.assert_allclose(scores.logit_confidence(two, [0]), [4.0])


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="logits"):
        scores.logit_confidence(np.zeros((3, 1)), [0, 0, 0])
    with pytest.raises(ValueError, match="labels"):
        scores.logit_confidence(np.zeros((3, 2)), [0, 2, 0])
    with pytest.raises(ValueError, match="labels"):
        scores.cross_entropy(np.zeros((3, 2)), [0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="score"):
        scores.scores_from_logits(np.zeros((1, 2)), [0], "confidence")


def dense_model(weights, bias, softmax_output=False):
    layer = keras.layers.Dense(weights.shape[1],
                               activation="softmax" if softmax_output else None)
    model = keras.Sequential([keras.Input((weights.shape[0],)), layer])
    layer.set_weights([weights, bias])
    return model


def test_model_scores_batches_the_predictions():
    rng = np.random.default_rng(1)
    weights, bias = rng.normal(size=(4, 3)), rng.normal(size=3)
    x = rng.normal(size=(10, 4)).astype("float32")
    y = rng.integers(0, 3, 10)
    logits = x.astype(np.float64) @ weights + bias
    got = scores.model_scores(dense_model(weights, bias), x, y, batch_size=3)
    np.testing.assert_allclose(got, scores.logit_confidence(logits, y),
                               rtol=1e-4, atol=1e-4)
    probabilities = scores.model_scores(
        dense_model(weights, bias, softmax_output=True), x, y, score="loss",
        from_logits=False)
    np.testing.assert_allclose(probabilities,
                               -scores.cross_entropy(logits, y), atol=1e-4)
    with pytest.raises(ValueError, match="batch_size"):
        scores.model_scores(dense_model(weights, bias), x, y, batch_size=0)
    # Queries: one column per view of x.
    views = [lambda v: v, lambda v: -v, lambda v: v[:, ::-1]]
    got = scores.model_scores(dense_model(weights, bias), x, y,
                              batch_size=4, queries=views)
    assert got.shape == (10, 3)
    for column, view in zip(got.T, views):
        logits = view(x).astype(np.float64) @ weights + bias
        np.testing.assert_allclose(
            column, scores.logit_confidence(logits, y), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="queries"):
        scores.model_scores(dense_model(weights, bias), x, y, queries=[])
    with pytest.raises(ValueError, match="queries"):
        scores.model_scores(dense_model(weights, bias), x, y, queries=[1])


def test_evaluate_model_refuses_empty_or_malformed_sets():
    rng = np.random.default_rng(2)
    model = dense_model(rng.normal(size=(4, 3)), rng.normal(size=3))
    x, y = rng.normal(size=(5, 4)), rng.integers(0, 3, 5)
    # Keras' predict raised UnboundLocalError on zero inputs.
    with pytest.raises(ValueError, match=r"^Expected members='<0 examples>' "
                       r"to hold at least one example"):
        membership.evaluate_model(model, (x[:0], y[:0]), (x, y))
    with pytest.raises(ValueError,
                       match=r"^Expected nonmembers='<0 examples>'"):
        membership.evaluate_model(model, (x, y), (x[:0], y[:0]))
    with pytest.raises(ValueError,
                       match=r"^Expected members='<ndarray>' .*pair"):
        membership.evaluate_model(model, x, (x, y))


def memorizer(x, y, steps=300):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(x.shape[1:]),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    model.fit(np.tile(x, (steps, 1)), np.tile(y, steps), batch_size=len(y),
              shuffle=False, verbose=0)
    return model


@pytest.mark.slow
def test_a_memorizing_model_is_detected():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 20)).astype("float32")
    y = rng.integers(0, 10, 192)
    members, nonmembers, unseen = ((x[s], y[s]) for s in (
        slice(0, 64), slice(64, 128), slice(128, 192)))
    model = memorizer(*members)
    for score in ("loss", "logit_confidence"):
        result = membership.evaluate_model(model, members, nonmembers,
                                           score=score, num_bootstrap=200)
        # Random labels: only memorization separates the sets.
        assert result.auc > 0.95, result.describe()
        assert result.intervals["auc"][0] > 0.9
        assert result.tpr_at_fpr[0.01] > 0.5
    # Neither set trained on: chance (sd of the AUC 0.051 for 64 + 64).
    null = membership.evaluate_model(model, unseen, nonmembers,
                                     num_bootstrap=200)
    assert abs(null.auc - 0.5) < 4 * 0.051
    assert null.intervals["auc"][0] < 0.5 + 0.05
