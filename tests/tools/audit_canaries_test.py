"""Tests of tf_dpadam.audit's canaries, guesses and deliberate breaks.

Lockstep: a private model with gradient canaries against the same model
without them (noise-free, so the difference is exactly the canaries'
clipped gradients / B); the breaks against the step they claim to be (no
noise = sigma 0; no clipping = plain SGD on the mean gradient).
Statistics: inclusion ~ Bin(m, 1/2) and per-step sampling ~ q, within 4
standard deviations.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadam
from tests import helpers
from tf_dpadam.tools import audit

LR = 0.1


def private_mlp(noise_multiplier=0.0, l2_norm_clip=1.0, batch_size=8,
                accumulation_steps=None, seed=0):
    model = tf_dpadam.make_private(helpers.mlp(seed=seed), seed=1)
    model.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
            batch_size=batch_size, learning_rate=LR,
            gradient_accumulation_steps=accumulation_steps,
        ),
        loss=helpers.LOSS,
    )
    return model


def train(model, x, y, batch_size=8):
    # The same fixed batches for private models and Keras' reference ones.
    fixed = ({"sampling": "shuffled"}
             if isinstance(model, tf_dpadam.PrivateModel) else {})
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
              **fixed)
    return helpers.numpy_values(model.trainable_variables)


def flat(values):
    return np.concatenate([np.reshape(v, -1) for v in values])


@pytest.mark.parametrize("accumulation_steps", [None, 2])
@pytest.mark.slow
def test_gradient_canaries_add_exactly_their_clipped_gradient(
        accumulation_steps):
    x, y = helpers.classification_data(16 if accumulation_steps else 8)
    with_canaries = private_mlp(accumulation_steps=accumulation_steps)
    canaries = audit.GradientCanaries(
        num_canaries=40, sampling_probability=1.0, norm_multiple=3.0, seed=3)
    canaries.attach(with_canaries)
    plain = private_mlp(accumulation_steps=accumulation_steps)
    start = flat(helpers.numpy_values(plain.trainable_variables))
    difference = flat(train(with_canaries, x, y)) - flat(train(plain, x, y))
    # Sampled with q = 1, norm 3C clipped to C, divided by B = 8, times -lr.
    expected = np.zeros_like(difference)
    sizes = [int(np.prod(v.shape)) for v in plain.trainable_variables]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    positions = offsets[canaries._variables] + canaries._coordinates
    expected[positions] = np.where(canaries.included,
                                   -LR * canaries._signs * 1.0 / 8, 0.0)
    np.testing.assert_allclose(difference, expected, atol=1e-6)
    assert canaries.included.any() and not canaries.included.all()
    # For DP-SGD (no momentum) the weight moves by -lr times the privatized
    # gradient, so the two scores agree exactly.
    np.testing.assert_allclose(canaries.scores(with_canaries, "movement"),
                               LR * canaries.scores(with_canaries, "gradients"),
                               atol=1e-6)
    moved = canaries._signs * (start[positions]
                               - flat(helpers.numpy_values(
                                   with_canaries.trainable_variables))[positions])
    np.testing.assert_allclose(canaries.scores(with_canaries), moved,
                               atol=1e-7)


@pytest.mark.slow
def test_gradient_canaries_follow_the_adaptive_clip_norm():
    # Adaptive clipping (noise-free): each sampled canary adds its norm
    # (3 C_t) clipped to the step's C_t, so over two steps a canary's
    # coordinate moves by -lr sign (C_0 + C_1) / B. The canaries do not
    # take part in the count of unclipped examples. The loss is linear in
    # the output, so the canaries of step 1 do not change step 2's
    # gradients.
    x, y = helpers.classification_data(16)

    def model():
        keras.utils.set_random_seed(0)
        private = tf_dpadam.make_private(keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(30)]), seed=1)
        private.compile(optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=0.05, noise_multiplier=0.0, batch_size=8,
            learning_rate=LR, target_unclipped_quantile=0.5,
            clipped_count_stddev=0.0, clip_learning_rate=1.0),
            loss=lambda y_true, y_pred: keras.ops.sum(y_pred, axis=-1))
        return private

    with_canaries, plain = model(), model()
    canaries = audit.GradientCanaries(
        num_canaries=40, sampling_probability=1.0, norm_multiple=3.0, seed=3)
    canaries.attach(with_canaries)
    clips = []

    class Clips(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            clips.append(plain.optimizer.l2_norm_clip)

    with_canaries.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                      sampling="shuffled")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0,
              sampling="shuffled", callbacks=[Clips()])
    assert clips[1] > clips[0] * 1.2  # C moved (every example clipped)
    assert (with_canaries.optimizer.l2_norm_clip
            == pytest.approx(plain.optimizer.l2_norm_clip, rel=1e-6))
    difference = (flat(helpers.numpy_values(with_canaries.trainable_variables))
                  - flat(helpers.numpy_values(plain.trainable_variables)))
    sizes = [int(np.prod(v.shape)) for v in plain.trainable_variables]
    positions = (np.concatenate([[0], np.cumsum(sizes)])[canaries._variables]
                 + canaries._coordinates)
    expected = np.zeros_like(difference)
    expected[positions] = np.where(
        canaries.included, -LR * canaries._signs * sum(clips) / 8, 0.0)
    np.testing.assert_allclose(difference, expected, atol=1e-6)


def test_gradient_canaries_refuse_per_layer_clipping():
    model = tf_dpadam.make_private(helpers.mlp(), seed=1)
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=8,
        per_layer_clipping=True), loss=helpers.LOSS)
    with pytest.raises(ValueError, match="per-layer clipping"):
        audit.GradientCanaries(num_canaries=4, sampling_probability=0.5,
                               seed=0).attach(model)


def test_gradient_canaries_refuse_correlated_noise():
    model = tf_dpadam.make_private(helpers.mlp(), seed=1)
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=8,
        noise_strategy=4), loss=helpers.LOSS)
    with pytest.raises(ValueError, match="noise_strategy"):
        audit.GradientCanaries(num_canaries=4, sampling_probability=0.5,
                               seed=0).attach(model)


def wide_private_model():
    keras.utils.set_random_seed(0)
    model = tf_dpadam.make_private(
        keras.Sequential([keras.Input((50,)), keras.layers.Dense(50)]), seed=1)
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=10,
        learning_rate=0.1), loss="mse")
    return model


def test_inclusion_and_per_step_sampling_statistics():
    m, q, steps = 2000, 0.1, 40
    canaries = audit.GradientCanaries(num_canaries=m, sampling_probability=q,
                                      seed=7)
    model = wide_private_model()
    canaries.attach(model)
    # Inclusion ~ Bin(m, 1/2): within 4 standard deviations.
    assert abs(canaries.included.mean() - 0.5) < 4 * math.sqrt(0.25 / m)
    variables = model.trainable_variables
    zeros = [tf.zeros_like(v) for v in variables]
    counts, first = [], None
    for step in range(steps):
        summed, count = canaries.add_to_step(
            zeros, tf.constant(0.0), variables, 1.0, tf.constant(step))
        counts.append(float(count))
        if step == 0:
            first = flat([s.numpy() for s in summed])
    # Only included canaries are ever sampled, each with probability q.
    trials = steps * canaries.included.sum()
    rate = sum(counts) / trials
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / trials)
    assert len(set(counts)) > 1  # a fresh draw at every step ...
    again, _ = canaries.add_to_step(zeros, tf.constant(0.0), variables, 1.0,
                                    tf.constant(0))
    np.testing.assert_array_equal(flat([s.numpy() for s in again]), first)
    # ... each sampled canary adds its (clipped) norm C at one coordinate.
    assert set(np.abs(first[first != 0])) == {1.0}
    assert (first != 0).sum() == counts[0]


@pytest.mark.slow
def test_no_noise_break_is_the_noise_free_step():
    x, y = helpers.classification_data(8)
    broken = private_mlp(noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="DELIBERATELY BROKEN"):
        audit.break_privatizer(broken, "no_noise")
    noise_free = private_mlp(noise_multiplier=0.0)
    noisy = private_mlp(noise_multiplier=1.0)
    np.testing.assert_allclose(flat(train(broken, x, y)),
                               flat(train(noise_free, x, y)), atol=1e-6)
    assert np.abs(flat(train(noisy, x, y))
                  - flat(helpers.numpy_values(broken.trainable_variables))
                  ).max() > 1e-3


@pytest.mark.slow
def test_no_clipping_break_is_plain_sgd_on_the_mean_gradient():
    x, y = helpers.classification_data(8)
    # C = 1e-3 clips every example of the real privatizer.
    broken = private_mlp(l2_norm_clip=1e-3)
    with pytest.warns(UserWarning, match="not clipped"):
        audit.break_privatizer(broken, "no_clipping")
    reference = helpers.mlp(seed=0)
    reference.compile(optimizer=keras.optimizers.SGD(LR), loss=helpers.LOSS)
    clipped = private_mlp(l2_norm_clip=1e-3)
    np.testing.assert_allclose(flat(train(broken, x, y)),
                               flat(train(reference, x, y)), atol=1e-6)
    assert np.abs(flat(train(clipped, x, y))
                  - flat(helpers.numpy_values(broken.trainable_variables))
                  ).max() > 1e-3


@pytest.mark.slow
def test_break_none_changes_nothing_and_bad_breaks_are_refused():
    x, y = helpers.classification_data(8)
    model = private_mlp()
    audit.break_privatizer(model, "none")
    np.testing.assert_allclose(flat(train(model, x, y)),
                               flat(train(private_mlp(), x, y)), atol=1e-7)
    with pytest.raises(ValueError, match="Expected how='noise'"):
        audit.break_privatizer(model, "noise")
    with pytest.raises(ValueError, match="PrivateModel"):
        audit.break_privatizer(helpers.mlp(), "no_noise")


def test_gradient_canaries_refuse_bad_use():
    with pytest.raises(ValueError, match="Expected num_canaries="):
        audit.GradientCanaries(num_canaries=0, sampling_probability=0.1)
    with pytest.raises(ValueError, match="Expected sampling_probability="):
        audit.GradientCanaries(num_canaries=5, sampling_probability=0.0)
    with pytest.raises(ValueError, match="Expected norm_multiple="):
        audit.GradientCanaries(num_canaries=5, sampling_probability=0.1,
                               norm_multiple=0.5)
    too_many = audit.GradientCanaries(num_canaries=1000,
                                      sampling_probability=0.1)
    with pytest.raises(ValueError, match="trainable scalars"):
        too_many.attach(private_mlp())
    uncompiled = tf_dpadam.make_private(helpers.mlp(), seed=1)
    with pytest.raises(ValueError, match="compile"):
        audit.GradientCanaries(num_canaries=5,
                               sampling_probability=0.1).attach(uncompiled)
    canaries = audit.GradientCanaries(num_canaries=5, sampling_probability=0.1)
    with pytest.raises(ValueError, match="attach"):
        canaries.scores(private_mlp())
    canaries.attach(private_mlp())
    with pytest.raises(ValueError, match="Expected kind="):
        canaries.scores(private_mlp(), "loss")


def test_guess_takes_the_highest_and_lowest_scores():
    scores = np.array([5.0, 0.0, 9.0, 1.0, 7.0, 3.0])
    np.testing.assert_array_equal(audit.guess(scores, 4),
                                  [0, -1, 1, -1, 1, 0])
    np.testing.assert_array_equal(audit.guess(scores, 3), [0, -1, 1, 0, 1, 0])
    np.testing.assert_array_equal(audit.guess(scores, 0), [0] * 6)
    with pytest.raises(ValueError, match="Expected num_guesses=7"):
        audit.guess(scores, 7)
    with pytest.raises(ValueError, match="not all finite"):
        audit.guess([1.0, np.nan], 2)


def test_audit_result_counts_correct_guesses():
    included = np.array([True, False, True, False, True, False, True, False])
    # Perfect scores: every guess right.
    perfect = audit.audit_result(included.astype(float), included, 8, 1e-5)
    assert (perfect.num_guesses, perfect.num_correct) == (8, 8)
    # Inverted scores: every guess wrong.
    inverted = audit.audit_result(-included.astype(float), included, 4, 1e-5)
    assert (inverted.num_guesses, inverted.num_correct) == (4, 0)
    assert inverted.epsilon_lower_bound == 0.0
    assert perfect.epsilon_lower_bound == audit.epsilon_lower_bound(
        8, 8, 8, 1e-5)
    assert "8 of 8 guesses correct" in perfect.describe(1.0)
    assert "claimed epsilon 1.000" in perfect.describe(1.0)


@pytest.mark.slow
def test_input_canaries_label_include_and_score():
    m, classes = 200, 4
    x, y = helpers.classification_data(m, d=20, classes=classes, seed=5)
    canaries = audit.InputCanaries(x, y, num_classes=classes, seed=2)
    assert np.all(canaries.labels != y)
    assert canaries.labels.min() >= 0 and canaries.labels.max() < classes
    assert abs(canaries.included.mean() - 0.5) < 4 * math.sqrt(0.25 / m)
    x_train, y_train = canaries.training_data(x[:0], y[:0])
    np.testing.assert_array_equal(x_train, x[canaries.included])
    np.testing.assert_array_equal(y_train, canaries.labels[canaries.included])
    # A model that memorizes its training data (not private) gives the
    # included canaries the largest loss drops: a large bound.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(classes)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=helpers.LOSS)
    with pytest.raises(ValueError, match="start"):
        canaries.scores(model)
    canaries.start(model)
    model.fit(x_train, y_train, epochs=60, batch_size=32, verbose=0)
    result = canaries.result(model, num_guesses=100, delta=1e-5)
    assert result.num_correct >= 95
    assert result.epsilon_lower_bound > 2.0
