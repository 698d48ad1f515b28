"""The optimizers by `--optimizer` name (`tf_dpadam.optimizers.registry`).

A new DP optimizer is one class and one `register_optimizer` line: the toy
`DPRMSprop` below (Keras RMSprop on the privatized gradient) takes the DP
arguments with their shared defaults, trains a private model, round-trips
its config and refuses gradients that were not privatized. Every
registered optimizer shows the full signature, and the built-in ones keep
the `get_config` keys they had before the DP arguments were declared once.
"""

import pytest
import inspect
import os
import subprocess
import sys
from unittest import mock

import keras
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.optimizers import registry
from tf_dpadam.optimizers.base import DPOptimizerMixin
from tf_dpadam.tools import run_ledger

REQUIRED = inspect.Parameter.empty
# The DP arguments and their defaults, as the constructors declared them.
DP_DEFAULTS = {
    "l2_norm_clip": REQUIRED, "noise_multiplier": REQUIRED,
    "batch_size": None, "target_unclipped_quantile": None,
    "clip_learning_rate": 0.2, "clipped_count_stddev": None,
    "per_layer_clipping": False,
}
# The DP keys of `get_config`, and their values for the required arguments
# (1.0, 1.0) and defaults otherwise.
DP_CONFIG = {
    "l2_norm_clip": 1.0, "noise_multiplier": 1.0, "batch_size": None,
    "target_unclipped_quantile": None, "clip_learning_rate": 0.2,
    "clipped_count_stddev": None, "per_layer_clipping": False,
    "gradient_accumulation_steps": None, "noise_strategy": None,
}
# Each built-in name, its class and the update rule's own `get_config`
# keys (beyond Keras' and the DP ones), as before the declaration.
BUILT_IN = {
    "dpsgd": ("DPSGD", {"momentum", "nesterov"}),
    "dpadam": ("DPAdam", {"beta_1", "beta_2", "epsilon", "amsgrad"}),
    "dpadam_corrected": ("DPAdamCorrected",
                         {"beta_1", "beta_2", "epsilon", "phi"}),
    "dpadam_stp": ("DPAdamScaleThenPrivatize",
                   {"beta_1", "beta_2", "epsilon", "amsgrad",
                    "scale_epsilon", "normalize_scale"}),
    "dpadam_disk": ("DPAdamDiSK", {"beta_1", "beta_2", "epsilon", "amsgrad",
                                   "kappa", "gamma"}),
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


@keras.saving.register_keras_serializable(package="tf_dpadam_test")
class DPRMSprop(DPOptimizerMixin, keras.optimizers.RMSprop):
    """DP-RMSprop: Keras RMSprop on the privatized gradient (a toy)."""


def _keras_keys():
    """The keys of every Keras optimizer's `get_config`."""
    return set(keras.optimizers.SGD().get_config()) - {"momentum",
                                                       "nesterov"}


class RegistryTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        # Each test registers the toy; the registry is restored after it.
        self.enter_context(mock.patch.dict(
            registry._ENTRIES))  # pylint: disable=protected-access
        registry.register_optimizer("dprmsprop", DPRMSprop)

    def test_the_built_in_names_in_order(self):
        self.assertEqual(list(registry.OPTIMIZERS),
                         [*BUILT_IN, "dprmsprop"])
        for name, (class_name, _) in BUILT_IN.items():
            cls = registry.optimizer_class(name)
            self.assertIs(cls, getattr(tf_dpadam, class_name))
            self.assertIs(registry.OPTIMIZERS[name], cls)
            self.assertEqual(registry.optimizer_name(cls), name)
        self.assertEqual(registry.class_names(),
                         {**{n: c for n, (c, _) in BUILT_IN.items()},
                          "dprmsprop": "DPRMSprop"})
        self.assertEqual(run_ledger.OPTIMIZER_FLAGS,
                         {c: n for n, (c, _) in BUILT_IN.items()})

    def test_unknown_names_and_bad_registrations(self):
        with self.assertRaisesWithLiteralMatch(
                ValueError, "Expected optimizer='adam' to be one of dpsgd,"
                " dpadam, dpadam_corrected, dpadam_stp, dpadam_disk,"
                " dprmsprop."):
            registry.optimizer_class("adam")
        self.assertNotIn("adam", registry.OPTIMIZERS)
        with self.assertRaises(KeyError):
            registry.OPTIMIZERS["adam"]  # pylint: disable=pointless-statement
        with self.assertRaisesRegex(ValueError, "name='dpsgd'.*DPSGD's"):
            registry.register_optimizer("dpsgd", DPRMSprop)
        with self.assertRaisesRegex(ValueError, "cls=.*DP optimizer class"):
            registry.register_optimizer("rmsprop", keras.optimizers.RMSprop)
        with self.assertRaisesRegex(ValueError, "name='a b'"):
            registry.register_optimizer("a b", DPRMSprop)
        registry.register_optimizer("dprmsprop", DPRMSprop)  # Again: fine.
        self.assertIsNone(registry.optimizer_name(keras.optimizers.Adam()))

    def test_the_toy_takes_the_dp_arguments_with_their_defaults(self):
        optimizer = registry.optimizer_class("dprmsprop")(
            l2_norm_clip=1.0, noise_multiplier=1.0, rho=0.8)
        self.assertTrue(tf_dpadam.optimizers.is_dp_optimizer(optimizer))
        self.assertEqual(optimizer.rho, 0.8)
        config = optimizer.get_config()
        self.assertEqual({k: config[k] for k in DP_CONFIG}, DP_CONFIG)
        optimizer = DPRMSprop(l2_norm_clip=2.0, noise_multiplier=0.5,
                              batch_size=8, gradient_accumulation_steps=2)
        self.assertEqual((optimizer.l2_norm_clip, optimizer.noise_multiplier,
                          optimizer.batch_size,
                          optimizer.dp_accumulation_steps), (2.0, 0.5, 8, 2))
        with self.assertRaisesWithLiteralMatch(
                TypeError, "DPRMSprop.__init__() missing 1 required"
                " keyword-only argument: 'l2_norm_clip'"):
            DPRMSprop(noise_multiplier=1.0)

    def test_the_toy_round_trips_its_config(self):
        optimizer = DPRMSprop(l2_norm_clip={"dense": 1.0}, rho=0.7,
                              noise_multiplier=0.5, batch_size=8,
                              target_unclipped_quantile=0.5)
        config = optimizer.get_config()
        self.assertEqual(set(config),
                         set(keras.optimizers.RMSprop().get_config())
                         | set(DP_CONFIG))
        restored = DPRMSprop.from_config(config)
        self.assertEqual(restored.get_config(), config)
        self.assertEqual(type(keras.optimizers.deserialize(
            keras.optimizers.serialize(optimizer))), DPRMSprop)

    def test_the_toy_trains_a_private_model(self):
        keras.utils.set_random_seed(0)
        model = tf_dpadam.make_private(keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
            keras.layers.Dense(2)]))
        model.compile(optimizer=DPRMSprop(l2_norm_clip=1.0,
                                          noise_multiplier=0.5, batch_size=8,
                                          learning_rate=0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 4)).astype("float32")
        y = rng.integers(0, 2, size=32)
        before = [np.array(w) for w in model.get_weights()]
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                            sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertTrue(np.all(np.isfinite(history.history["loss"])))
        for old, new in zip(before, model.get_weights()):
            self.assertFalse(np.allclose(old, new))

    def test_the_toy_refuses_gradients_that_were_not_privatized(self):
        optimizer = DPRMSprop(l2_norm_clip=1.0, noise_multiplier=1.0)
        variable = keras.Variable(np.zeros(3, "float32"))
        with self.assertRaisesRegex(
                ValueError, "DPRMSprop was asked to apply gradients that were"
                " not privatized"):
            optimizer.apply([np.ones(3, "float32")], [variable])
        np.testing.assert_array_equal(np.array(variable), np.zeros(3))

    @parameterized.parameters(*BUILT_IN, "dprmsprop")
    def test_every_signature_has_the_dp_arguments(self, name):
        cls = registry.optimizer_class(name)
        for function, first in ((cls, []), (cls.__init__, ["self"])):
            parameters = inspect.signature(function).parameters
            self.assertEqual(list(parameters)[:len(first)], first)
            for dp_name, default in DP_DEFAULTS.items():
                self.assertEqual(parameters[dp_name].default, default,
                                 dp_name)
                self.assertEqual(parameters[dp_name].kind,
                                 inspect.Parameter.KEYWORD_ONLY, dp_name)
            self.assertEqual(list(parameters)[-1], "kwargs")
        parameters = inspect.signature(cls).parameters
        own = BUILT_IN[name][1] if name in BUILT_IN else {"rho"}
        self.assertContainsSubset(own, set(parameters))
        self.assertEqual(parameters["learning_rate"].kind,
                         inspect.Parameter.KEYWORD_ONLY)

    @parameterized.parameters(*BUILT_IN)
    def test_the_config_keys_of_before(self, name):
        class_name, own = BUILT_IN[name]
        optimizer = registry.optimizer_class(name)(l2_norm_clip=1.0,
                                                   noise_multiplier=1.0)
        config = optimizer.get_config()
        self.assertEqual(set(config), _keras_keys() | set(DP_CONFIG) | own)
        self.assertEqual({k: config[k] for k in DP_CONFIG}, DP_CONFIG)
        self.assertEqual(config["name"], class_name)
        restored = type(optimizer).from_config(config)
        self.assertEqual(restored.get_config(), config)


class WithoutKerasTest(absltest.TestCase):

    @pytest.mark.slow
    def test_the_names_load_without_keras(self):
        # What a binary's --help does: no Keras, no TensorFlow.
        code = ("import sys\n"
                "from tf_dpadam.optimizers import registry\n"
                "from tf_dpadam.tools import run_ledger\n"
                "print(list(registry.OPTIMIZERS), registry.class_names())\n"
                "assert 'keras' not in sys.modules, 'keras'\n"
                "assert 'tensorflow' not in sys.modules, 'tensorflow'\n")
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True,
            check=False, timeout=120,
            env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        self.assertIn("'dpadam_corrected'", done.stdout)


if __name__ == "__main__":
    absltest.main()
