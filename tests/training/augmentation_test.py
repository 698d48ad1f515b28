"""Augmentation multiplicity (`make_private(augment=..., augmult=K)`).

Against brute force, in lockstep, noise-free: for each present example i, a
`tf.GradientTape` over the unwrapped model on example i's K views alone
(rebuilt here from the deterministic augmentation), of its mean loss over the
views plus the full regularization term; clipped once to C in NumPy
(float64), summed over the present examples and divided by their count. One
DPSGD step (learning rate 1, noise 0, `batch_size=None`) must move the
weights by exactly minus that. C is just above the median norm, so about half
of the examples are clipped. The batch has padding rows of sample weight 0
(as `tf_dpadam.data.poisson_batches` makes): they contribute nothing and are
not counted.
"""

import functools
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from keras import layers

import tf_dpadam

_B = 8
_VOCABULARY = 7
# Sample weights: general weights, then two absent (padding) rows.
_WEIGHTS = np.array([1.0, 0.5, 2.0, 1.0, 1.0, 1.5, 0.0, 0.0], "float32")
_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _rng(seed):
    return np.random.default_rng(seed)


def _view(x, k):
    """View k (a `[N]` int vector) of each row of `x`: deterministic, so the
    brute force can rebuild it; nonlinear, and on images a flip for odd k
    (positions move); ids are shifted (views of one example share some)."""
    if x.dtype.is_integer:
        return (x + 2 * tf.reshape(k, [-1, 1])) % _VOCABULARY
    kf = tf.reshape(tf.cast(k, x.dtype), [-1] + [1] * (len(x.shape) - 1))
    v = tf.tanh(x * (1.0 + 0.5 * kf)) + 0.3 * kf
    if len(x.shape) == 4:
        odd = tf.reshape(k % 2 == 1, [-1, 1, 1, 1])
        v = tf.where(odd, tf.reverse(v, axis=[2]), v)
    return v


def _augment(x, augmult):
    """Row r is view r mod K of its example (rows of one example in a row)."""
    return _view(x, tf.range(tf.shape(x)[0]) % augmult)


def _mlp(**regularizers):
    return keras.Sequential([
        keras.Input((5,)),
        layers.Dense(7, activation="tanh", **regularizers),
        layers.Dense(3),
    ]), _rng(1).normal(size=(_B, 5)).astype("float32")


def _cnn():
    # Conv2D (ghost), DepthwiseConv2D (the fallback rule), Dense (ghost).
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        layers.Conv2D(3, 3, activation="tanh"),
        layers.DepthwiseConv2D(2, activation="tanh"),
        layers.Flatten(),
        layers.Dense(3),
    ]), _rng(1).normal(size=(_B, 6, 6, 2)).astype("float32")


def _group_normalized_cnn():
    # WSConv2D and GroupNormalization (ghost rules of their own), Dense.
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        tf_dpadam.layers.WSConv2D(4, 3, use_bias=True),
        layers.GroupNormalization(2),
        layers.Activation("tanh"),
        layers.Flatten(),
        layers.Dense(3),
    ]), _rng(1).normal(size=(_B, 6, 6, 2)).astype("float32")


def _sequence():
    # Embedding, a Dense at 4 positions, LayerNormalization (all ghost).
    return keras.Sequential([
        keras.Input((4,), dtype="int32"),
        layers.Embedding(_VOCABULARY, 3),
        layers.Dense(5, activation="tanh"),
        layers.LayerNormalization(),
        layers.Flatten(),
        layers.Dense(3),
    ]), _rng(1).integers(0, _VOCABULARY, size=(_B, 4)).astype("int32")


_MODELS = {
    "mlp": functools.partial(
        _mlp, kernel_regularizer=keras.regularizers.L2(0.01)),
    "cnn": _cnn,
    "group_normalized_cnn": _group_normalized_cnn,
    "sequence": _sequence,
    # Ghost clipping refuses activity regularization: "auto" is vectorized.
    "activity": functools.partial(
        _mlp, activity_regularizer=keras.regularizers.L2(0.05)),
}
# What `clipping="ghost"` raises for a model (then "auto" is vectorized).
_GHOST_ERRORS = {"activity": "activity regularizer"}


def _build(name, seed=0):
    keras.utils.set_random_seed(seed)
    model, x = _MODELS[name]()
    y = _rng(2).integers(0, 3, size=_B)
    return model, x, y


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v), "float64")
            for v in variables]


def _brute_force_grads(model, x, y, weights, augmult):
    """`[example][variable]` gradients of the present examples' mean losses
    over their views (plus the regularization), one example at a time."""
    out = []
    for i in np.flatnonzero(weights):
        views = _view(tf.repeat(x[i:i + 1], augmult, axis=0),
                      tf.range(augmult))
        with tf.GradientTape() as tape:
            loss = 0.0
            for k in range(augmult):
                # The view's loss with the losses of its call (activity
                # regularization) and the weight regularization R: the mean
                # over the views has R once.
                loss += _LOSS(y[i:i + 1], model(views[k:k + 1], training=True),
                              sample_weight=weights[i:i + 1])
                loss += sum(model.losses)
            loss = loss / augmult
        grads = tape.gradient(loss, model.trainable_variables)
        out.append([np.array(tf.convert_to_tensor(g), "float64")
                    for g in grads])
    return out


def _norms(grads):
    """Each example's L2 norm over all variables."""
    return np.sqrt([sum(np.sum(np.square(g)) for g in example)
                    for example in grads])


def _clipped_mean(grads, clip):
    """`mean_i min(1, C / ||g_i||) g_i` and the norms."""
    norms = _norms(grads)
    factors = np.minimum(1.0, clip / norms)
    mean = [sum(f * example[j] for f, example in zip(factors, grads))
            / len(grads) for j in range(len(grads[0]))]
    return mean, norms


def _private(model, clipping, clip, augmult):
    """`model` made private with the deterministic views, DPSGD without
    noise at learning rate 1, divided by the count of present examples."""
    private = tf_dpadam.make_private(
        model, clipping=clipping, augmult=augmult,
        augment=functools.partial(_augment, augmult=augmult))
    private.compile(
        optimizer=tf_dpadam.DPSGD(l2_norm_clip=clip, noise_multiplier=0.0,
                                  learning_rate=1.0),
        loss=_LOSS)
    return private


def _layer_configs(sequential):
    return [(type(layer).__name__, layer.get_config())
            for layer in sequential.layers]


class AugmultTest(parameterized.TestCase):

    def assert_update(self, got, want, atol=2e-6):
        """Max |got - want| below `atol` times the largest expected entry."""
        scale = max(float(np.max(np.abs(w))) for w in want)
        error = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
        self.assertGreater(scale, 0.0)
        self.assertLess(error, atol * scale, f"max |error| {error:.3g}")

    @parameterized.parameters(("mlp", 1), ("mlp", 3), ("cnn", 3),
                              ("group_normalized_cnn", 3),
                              ("sequence", 3), ("activity", 3))
    @pytest.mark.slow
    def test_brute_force_ghost_vectorized(self, model, augmult):
        base, x, y = _build(model)
        grads = _brute_force_grads(base, x, y, _WEIGHTS, augmult)
        clip = float(np.median(_norms(grads))) * 1.0001
        want, norms = _clipped_mean(grads, clip)
        want = [-m for m in want]
        self.assertGreater(np.sum(norms > clip), 0)
        self.assertGreater(np.sum(norms < clip), 0)
        start = _values(base.trainable_variables)
        ghost_error = _GHOST_ERRORS.get(model)
        for clipping in ("ghost", "auto" if ghost_error else "vectorized"):
            for v, value in zip(base.trainable_variables, start):
                v.assign(value.astype("float32"))
            private = _private(base, clipping, clip, augmult)
            if clipping == "ghost" and ghost_error:
                with self.assertRaisesRegex(ValueError, ghost_error):
                    private.train_on_batch(x, y, sample_weight=_WEIGHTS)
                continue
            if clipping == "vectorized":
                private.train_on_batch(x, y, sample_weight=_WEIGHTS)
            else:  # fit traces with an unknown batch size.
                private.fit(x, y, sample_weight=_WEIGHTS, batch_size=_B,
                            shuffle=False, verbose=0, sampling="shuffled")
            self.assertEqual(
                private.clipping_used,
                "ghost" if clipping == "ghost" else "vectorized")
            got = [a - b for a, b in
                   zip(_values(base.trainable_variables), start)]
            self.assert_update(got, want)

    @pytest.mark.slow
    def test_one_view_is_augmenting_the_inputs(self):
        # K = 1 with an augmentation is the step without augmult on the
        # augmented inputs.
        results = []
        for augment in (True, False):
            base, x, y = _build("mlp")
            if augment:
                private = _private(base, "auto", 0.5, 1)
            else:
                private = tf_dpadam.make_private(base)
                private.compile(optimizer=tf_dpadam.DPSGD(
                    l2_norm_clip=0.5, noise_multiplier=0.0,
                    learning_rate=1.0), loss=_LOSS)
                x = _augment(tf.constant(x), 1)
            private.train_on_batch(x, y, sample_weight=_WEIGHTS)
            results.append(_values(base.trainable_variables))
        for a, b in zip(*results):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    @pytest.mark.slow
    def test_poisson_batches_with_accumulation(self):
        # One logical step of Poisson-sampled, padded physical batches,
        # accumulated: against the brute force over the sampled examples,
        # divided by the public B. (Padding on the vectorized path: above.)
        base, _, _ = _build("mlp")
        rng = _rng(3)
        x = rng.normal(size=(24, 5)).astype("float32")
        y = rng.integers(0, 3, size=24)
        with self.assertWarnsRegex(UserWarning, "seed"):
            batches = tf_dpadam.data.poisson_batches(
                (x, y), expected_batch_size=6, physical_batch_size=8,
                seed=5)
        k = batches.accumulation_steps
        self.assertGreater(k, 1)
        physical = list(batches.dataset.take(k).as_numpy_iterator())
        bx, by, bw = (np.concatenate(t) for t in zip(*physical))
        self.assertGreater(np.sum(bw == 0), 0)  # padding rows
        self.assertGreater(np.sum(bw), 0)
        grads = _brute_force_grads(base, bx, by, bw, 3)
        want, norms = _clipped_mean(grads, 0.3)
        self.assertGreater(np.sum(norms > 0.3), 0)
        want = [-m * len(grads) / 6 for m in want]  # divided by B = 6
        start = _values(base.trainable_variables)
        with self.assertWarnsRegex(UserWarning, "NOT differentially"):
            private = tf_dpadam.make_private(
                base, augmult=3, diagnostics=True,
                augment=functools.partial(_augment, augmult=3))
        private.compile(optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=1.0,
            batch_size=6, gradient_accumulation_steps=k), loss=_LOSS)
        data = tf.data.Dataset.from_tensor_slices(
            tuple(np.stack(t) for t in zip(*physical)))
        private.fit(data, epochs=1, shuffle=False, verbose=0,
                    sampling="shuffled")
        self.assertEqual(int(private.optimizer.iterations), 1)
        got = [a - b for a, b in zip(_values(base.trainable_variables), start)]
        self.assert_update(got, want)
        # The clean gradient (diagnostics) is the same mean, un-noised.
        self.assert_update(
            [-np.array(c, "float64") for c in private.clean_gradients], want)

    @pytest.mark.slow
    def test_keras_preprocessing_layers_in_fit(self):
        keras.utils.set_random_seed(0)
        base = keras.Sequential([
            keras.Input((8, 8, 1)), layers.Conv2D(2, 3), layers.Flatten(),
            layers.Dense(3),
        ])
        flip_and_shift = keras.Sequential([
            layers.RandomFlip("horizontal"),
            layers.RandomTranslation(0.2, 0.2),
        ])
        batch, augmult = 4, 2
        recorded = tf.Variable(tf.zeros((batch * augmult, 8, 8, 1)))

        def augment(x, training=None):
            views = flip_and_shift(x, training=training)
            recorded.assign(views)
            return views

        seen = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda *_, **__: seen.append(recorded.numpy()))
        private = tf_dpadam.make_private(base, augment=augment,
                                         augmult=augmult)
        private.compile(optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=0.5), loss=_LOSS)
        x = _rng(4).random((batch, 8, 8, 1)).astype("float32")
        y = np.arange(batch) % 3
        private.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                    callbacks=[record], verbose=0, sampling="shuffled")
        self.assertEqual(private.clipping_used, "ghost")
        self.assertLen(seen, 2)
        for views in seen:
            views = views.reshape(batch, augmult, -1)
            # Random views: not the example itself, and its views differ.
            for i in range(batch):
                self.assertFalse(np.allclose(views[i, 0], x[i].ravel()))
                self.assertFalse(np.allclose(views[i, 0], views[i, 1]))
        self.assertFalse(np.allclose(seen[0], seen[1]))  # new each step
        # Prediction and evaluation see the inputs unaugmented.
        np.testing.assert_allclose(private.predict(x, verbose=0),
                                   base.predict(x, verbose=0), rtol=1e-6)

    @parameterized.named_parameters(
        ("zero", {"augmult": 0}, "augmult=0 to be an int >= 1"),
        ("float", {"augmult": 2.0, "augment": abs}, "augmult=2.0"),
        ("bool", {"augmult": True}, "augmult=True"),
        ("no_augment", {"augmult": 3}, "augment=None to be a callable with"),
        ("not_callable", {"augment": 3}, "augment=3 to be None or a callable"),
        ("trainable", {"augment": "dense"}, "no trainable weights"),
        ("mixup", {"augment": "mixup"}, "MixUp"),
    )
    def test_invalid_arguments(self, kwargs, message):
        if kwargs.get("augment") == "dense":
            kwargs["augment"] = layers.Dense(2)
            kwargs["augment"].build((None, 5))
        elif kwargs.get("augment") == "mixup":
            kwargs["augment"] = keras.Sequential([layers.MixUp()])
        base, _, _ = _build("mlp")
        with self.assertRaisesRegex(ValueError, message):
            tf_dpadam.make_private(base, **kwargs)

    def test_augment_that_builds_trainable_weights_is_refused(self):
        base, x, y = _build("mlp")
        private = tf_dpadam.make_private(base, augment=layers.Dense(5))
        private.compile(optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=1.0, noise_multiplier=0.5), loss=_LOSS)
        with self.assertRaisesRegex(ValueError, "no trainable weights"):
            private.train_on_batch(x, y)
        self.assertEqual(int(private.optimizer.iterations), 0)

    @pytest.mark.slow
    def test_save_and_load_keras_layer(self):
        keras.utils.set_random_seed(0)
        base = keras.Sequential([keras.Input((4, 4, 1)), layers.Flatten(),
                                 layers.Dense(3)])
        x = _rng(1).random((_B, 4, 4, 1)).astype("float32")
        y = np.arange(_B) % 3
        augment = keras.Sequential([layers.RandomFlip("horizontal"),
                                    layers.RandomTranslation(0.1, 0.1)])
        private = tf_dpadam.make_private(base, augment=augment, augmult=2,
                                         clipping="ghost")
        private.compile(optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=1.0, noise_multiplier=0.5), loss=_LOSS)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        private.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(loaded.augmult, 2)
        self.assertEqual(loaded.clipping, "ghost")
        self.assertEqual(_layer_configs(loaded.augment),
                         _layer_configs(augment))
        np.testing.assert_allclose(loaded.predict(x, verbose=0),
                                   private.predict(x, verbose=0), rtol=1e-6)
        loaded.fit(x, y, batch_size=_B, epochs=1, verbose=0,
                   sampling="shuffled")  # trains
        self.assertEqual(loaded.clipping_used, "ghost")

    def test_save_and_load_registered_function(self):
        base, x, _ = _build("mlp")
        # The function the registry holds now (under xdist,
        # tests/optimizers/disk_test.py can import this module a second
        # time, which registers its own copy of the function in place of
        # this module's).
        registered = keras.saving.get_registered_object(
            "augmult_test>_registered_augment")
        self.assertIsNotNone(registered)
        private = tf_dpadam.make_private(base, augment=registered,
                                         augmult=3)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        private.save(path)
        loaded = keras.models.load_model(path)
        # The registered function (by its registered name: under xdist,
        # tests/optimizers/disk_test.py can import this module a second
        # time, which registers its own copy of the function).
        self.assertIs(loaded.augment, keras.saving.get_registered_object(
            "augmult_test>_registered_augment"))
        self.assertEqual(
            keras.saving.get_registered_name(loaded.augment),
            "augmult_test>_registered_augment")
        np.testing.assert_allclose(loaded.augment(np.ones(2, "float32")),
                                   [1.5, 1.5])
        self.assertEqual(loaded.augmult, 3)

    @parameterized.parameters(
        (lambda x: x,), (functools.partial(_augment, augmult=2),))
    def test_saving_an_unloadable_callable_raises(self, augment):
        base, _, _ = _build("mlp")
        private = tf_dpadam.make_private(base, augment=augment, augmult=2)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        with self.assertRaisesRegex(ValueError,
                                    "register_keras_serializable"):
            private.save(path)


@keras.saving.register_keras_serializable(package="augmult_test")
def _registered_augment(x):
    return x * 1.5


if __name__ == "__main__":
    absltest.main()
