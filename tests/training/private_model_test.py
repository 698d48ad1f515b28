"""Behaviour of make_private and the DP optimizers as Keras objects."""

import math
import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam

import helpers

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _functional(d=6, classes=3, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((d,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(classes)(hidden))


class SubclassedNet(keras.Model):

    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(classes)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def _subclassed(d=6, classes=3, seed=0):
    keras.utils.set_random_seed(seed)
    model = SubclassedNet(classes)
    model(np.zeros((1, d), "float32"))
    return model


_BUILDERS = {
    "sequential": helpers.mlp,
    "functional": _functional,
    "subclassed": _subclassed,
}

_OPTIMIZERS = {
    "dpsgd": lambda **kw: tf_dpadam.DPSGD(learning_rate=0.1, **kw),
    "dpadam": lambda **kw: tf_dpadam.DPAdam(learning_rate=0.01, **kw),
    "dpadam_corrected": lambda **kw: tf_dpadam.DPAdamCorrected(
        learning_rate=0.01, **kw
    ),
}


class MakePrivateTest(parameterized.TestCase):

    @parameterized.named_parameters(
        (f"{m}_{o}", m, o) for m in _BUILDERS for o in _OPTIMIZERS
    )
    @pytest.mark.slow
    def test_trains_and_shares_weights(self, builder, optimizer):
        base = _BUILDERS[builder]()
        model = tf_dpadam.make_private(base, seed=1)
        self.assertEqual(
            [id(v) for v in model.trainable_variables],
            [id(v) for v in base.trainable_variables],
        )
        model.compile(
            optimizer=_OPTIMIZERS[optimizer](
                l2_norm_clip=1.0, noise_multiplier=0.5
            ),
            loss=_LOSS,
            metrics=["accuracy"],
        )
        before = helpers.numpy_values(base.weights)
        x, y = helpers.classification_data(32)
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                            sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertTrue(math.isfinite(history.history["loss"][0]))
        self.assertIn("accuracy", history.history)
        for b, a in zip(before, helpers.numpy_values(base.weights)):
            self.assertFalse(np.allclose(a, b))
        # Inference is the wrapped model's.
        np.testing.assert_allclose(
            model.predict(x, verbose=0), base.predict(x, verbose=0), rtol=1e-6
        )

    @parameterized.parameters("auto", "vectorized")
    @pytest.mark.slow
    def test_model_without_input_builds_on_first_step(self, clipping):
        # No keras.Input: the layers and the optimizer get their weights on
        # the first traced step (this used to fail with "tf.function only
        # supports singleton tf.Variables").
        keras.utils.set_random_seed(0)
        base = keras.Sequential(
            [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
        )
        model = tf_dpadam.make_private(base, seed=0, clipping=clipping)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=1.0, noise_multiplier=0.5
            ),
            loss=_LOSS,
        )
        x = np.random.default_rng(0).random((16, 5)).astype("float32")
        y = np.random.default_rng(1).integers(0, 3, 16)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 2)
        self.assertEqual(model.clipping_used,
                         "ghost" if clipping == "auto" else "vectorized")
        self.assertLen(base.trainable_variables, 4)

    @pytest.mark.slow
    def test_jit_and_eager_graph_agree_without_noise(self):
        results = []
        for jit in (False, True):
            model = tf_dpadam.make_private(_functional(seed=3))
            model.compile(
                optimizer=tf_dpadam.DPAdamCorrected(
                    l2_norm_clip=0.1, noise_multiplier=0.0, phi=1e-4,
                    learning_rate=0.01,
                ),
                loss=_LOSS,
                jit_compile=jit,
            )
            x, y = helpers.classification_data(24)
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      sampling="shuffled")
            results.append(helpers.numpy_values(model.base_model.weights))
        for eager_graph, xla in zip(*results):
            np.testing.assert_allclose(eager_graph, xla, rtol=1e-5, atol=1e-6)

    @pytest.mark.slow
    def test_loss_metric_is_mean_per_example_loss(self):
        base = helpers.mlp()
        model = tf_dpadam.make_private(base)
        # Learning rate 0: the weights stay, so the reported loss must equal
        # Keras' own loss of the batch.
        model.compile(
            optimizer=tf_dpadam.DPSGD(
                l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.0
            ),
            loss=_LOSS,
        )
        x, y = helpers.classification_data(16)
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                            sampling="shuffled")
        expected = float(_LOSS(y, base(x)))
        self.assertAlmostEqual(history.history["loss"][0], expected, places=5)

    @pytest.mark.slow
    def test_multi_output_model(self):
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        a = keras.layers.Dense(3, name="a")(hidden)
        b = keras.layers.Dense(1, name="b")(hidden)
        model = tf_dpadam.make_private(keras.Model(inputs, {"a": a, "b": b}))
        model.compile(
            optimizer=tf_dpadam.DPAdam(l2_norm_clip=1.0, noise_multiplier=0.1),
            loss={"a": _LOSS, "b": "mse"},
        )
        x, y = helpers.classification_data(16)
        history = model.fit(
            x, {"a": y, "b": np.zeros((16, 1), "float32")},
            batch_size=8, verbose=0,
            sampling="shuffled",
        )
        self.assertTrue(math.isfinite(history.history["loss"][0]))
        self.assertIn("a_loss", history.history)


class RefusalTest(parameterized.TestCase):

    @parameterized.named_parameters((o, o) for o in _OPTIMIZERS)
    def test_dp_optimizer_on_non_private_model_raises(self, optimizer):
        model = helpers.mlp()
        model.compile(
            optimizer=_OPTIMIZERS[optimizer](
                l2_norm_clip=1.0, noise_multiplier=1.0
            ),
            loss=_LOSS,
        )
        before = helpers.numpy_values(model.weights)
        x, y = helpers.classification_data(32)
        with self.assertRaisesRegex(ValueError, "make_private"):
            model.fit(x, y, batch_size=8, verbose=0)
        for b, a in zip(before, helpers.numpy_values(model.weights)):
            np.testing.assert_array_equal(a, b)

    def test_non_dp_optimizer_on_private_model_raises(self):
        model = tf_dpadam.make_private(helpers.mlp())
        with self.assertRaisesRegex(ValueError, "tf_dpadam optimizer"):
            model.compile(optimizer="adam", loss=_LOSS)

    def test_batch_normalization_raises_and_names_layer(self):
        base = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(name="my_bn"),
            keras.layers.Dense(3),
        ])
        with self.assertRaisesRegex(ValueError, "my_bn.*BatchNormalization"):
            tf_dpadam.make_private(base)

    def test_nested_batch_normalization_raises(self):
        inner = keras.Sequential(
            [keras.Input((6,)), keras.layers.BatchNormalization(name="deep_bn")]
        )
        outer = keras.Sequential([inner, keras.layers.Dense(3)])
        with self.assertRaisesRegex(ValueError, "deep_bn"):
            tf_dpadam.make_private(outer)

    @pytest.mark.slow
    def test_frozen_batch_normalization_is_allowed_until_unfrozen(self):
        bn = keras.layers.BatchNormalization(name="frozen_bn")
        base = keras.Sequential([keras.Input((6,)), bn, keras.layers.Dense(3)])
        bn.trainable = False
        model = tf_dpadam.make_private(base)
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=_LOSS,
        )
        x, y = helpers.classification_data(32)
        model.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")
        bn.trainable = True
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=_LOSS,
        )
        with self.assertRaisesRegex(ValueError, "frozen_bn"):
            model.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")

    @parameterized.named_parameters(
        ("clip_zero", "l2_norm_clip", 0.0),
        ("clip_negative", "l2_norm_clip", -1.0),
        ("clip_inf", "l2_norm_clip", math.inf),
        ("clip_nan", "l2_norm_clip", math.nan),
        ("noise_negative", "noise_multiplier", -0.5),
        ("noise_inf", "noise_multiplier", math.inf),
        ("batch_zero", "batch_size", 0),
        ("batch_negative", "batch_size", -4),
        ("batch_float", "batch_size", 2.5),
        ("beta_1_one", "beta_1", 1.0),
        ("beta_1_negative", "beta_1", -0.1),
        ("beta_2_one", "beta_2", 1.0),
        ("epsilon_zero", "epsilon", 0.0),
        ("epsilon_negative", "epsilon", -1e-8),
        ("phi_negative", "phi", -1e-6),
    )
    def test_bad_hyperparameters_name_the_argument(self, name, value):
        args = {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, name: value}
        classes = [tf_dpadam.DPAdamCorrected]
        if name != "phi":
            classes.append(tf_dpadam.DPAdam)
        if name not in ("beta_1", "beta_2", "epsilon", "phi"):
            classes.append(tf_dpadam.DPSGD)
        for cls in classes:
            with self.assertRaisesRegex(ValueError, f"{name}={value!r}"):
                cls(**args)

    def test_dp_arguments_are_keyword_only(self):
        with self.assertRaises(TypeError):
            tf_dpadam.DPAdamCorrected(1.0, 1.0)

    @parameterized.named_parameters(("zero", 0), ("negative", -2), ("float", 2.0))
    def test_bad_accumulation_steps_name_the_argument(self, value):
        for cls in (tf_dpadam.DPSGD, tf_dpadam.DPAdam, tf_dpadam.DPAdamCorrected):
            with self.assertRaisesRegex(
                ValueError, f"gradient_accumulation_steps={value!r}"
            ):
                cls(l2_norm_clip=1.0, noise_multiplier=1.0,
                    gradient_accumulation_steps=value)

    def test_loss_scaling_is_refused(self):
        with self.assertRaisesRegex(ValueError, "loss_scale_factor"):
            tf_dpadam.DPAdam(
                l2_norm_clip=1.0, noise_multiplier=1.0, loss_scale_factor=128.0
            )


class SerializationTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("dpsgd", tf_dpadam.DPSGD, {"momentum": 0.9}),
        ("dpadam", tf_dpadam.DPAdam, {"beta_1": 0.8, "epsilon": 1e-5}),
        ("corrected_default", tf_dpadam.DPAdamCorrected, {"beta_2": 0.99}),
        ("corrected_set", tf_dpadam.DPAdamCorrected,
         {"epsilon": 1e-9, "phi": 2.5e-7, "beta_1": 0.5}),
        ("corrected_accumulation", tf_dpadam.DPAdamCorrected,
         {"gradient_accumulation_steps": 4}),
    )
    def test_config_round_trip(self, cls, extra):
        optimizer = cls(
            l2_norm_clip=0.7, noise_multiplier=1.3, batch_size=128,
            learning_rate=0.003, **extra
        )
        config = optimizer.get_config()
        for key, value in extra.items():
            self.assertEqual(config[key], value)
        restored = cls.from_config(config)
        self.assertEqual(restored.get_config(), config)
        self.assertEqual(restored.dp_config, optimizer.dp_config)
        # Through Keras' registry, as `load_model` does it.
        revived = keras.optimizers.deserialize(
            keras.optimizers.serialize(optimizer)
        )
        self.assertIsInstance(revived, cls)
        self.assertEqual(revived.get_config(), config)

    def test_corrected_defaults_serialize_as_none(self):
        config = tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0
        ).get_config()
        self.assertIsNone(config["epsilon"])
        self.assertIsNone(config["phi"])
        self.assertIsNone(config["batch_size"])
        self.assertNotIn("amsgrad", config)

    @parameterized.named_parameters((o, o) for o in _OPTIMIZERS)
    @pytest.mark.slow
    def test_save_mid_training_and_resume(self, optimizer):
        # Noise off so that the continued runs must agree exactly (the noise
        # seed is never saved: tests/noise_secrecy_test.py).
        def build():
            model = tf_dpadam.make_private(_functional(seed=5), seed=7)
            model.compile(
                optimizer=_OPTIMIZERS[optimizer](
                    l2_norm_clip=0.2, noise_multiplier=0.0, batch_size=8
                ),
                loss=_LOSS,
                metrics=["accuracy"],
            )
            return model

        x, y = helpers.classification_data(16)
        model = build()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  sampling="shuffled")
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)

        self.assertIsInstance(loaded, tf_dpadam.PrivateModel)
        self.assertIsInstance(loaded.optimizer, type(model.optimizer))
        self.assertEqual(int(loaded.optimizer.iterations), 2)
        self.assertEqual(
            loaded.optimizer.get_config(), model.optimizer.get_config()
        )
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
            np.testing.assert_array_equal(np.array(a), np.array(b))

        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  sampling="shuffled")
        loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                   sampling="shuffled")
        self.assertEqual(int(loaded.optimizer.iterations), 4)
        for a, b in zip(helpers.numpy_values(model.weights), helpers.numpy_values(loaded.weights)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    @pytest.mark.slow
    def test_compile_builds_the_optimizer_of_a_built_model(self):
        # Creating the optimizer's variables in the first train step would
        # make tf.function trace that step twice.
        model = tf_dpadam.make_private(_functional())
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=_LOSS,
        )
        self.assertTrue(model.optimizer.built)
        x, y = helpers.classification_data(32)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 4)

    @pytest.mark.slow
    def test_loaded_base_model_is_still_refused_without_wrapper(self):
        model = tf_dpadam.make_private(helpers.mlp())
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=1.0, noise_multiplier=1.0
            ),
            loss=_LOSS,
        )
        x, y = helpers.classification_data(32)
        model.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        base = loaded.base_model
        base.compile(optimizer=loaded.optimizer, loss=_LOSS)
        with self.assertRaisesRegex(ValueError, "not privatized"):
            base.fit(x, y, batch_size=8, verbose=0)


if __name__ == "__main__":
    absltest.main()
