"""The private Keras/TensorFlow APIs tf_dpadam uses (`tf_dpadam.common.compat`)."""

from unittest import mock

import keras
import numpy as np
from absl.testing import absltest
import pytest

import tf_dpadam
from tf_dpadam.common import compat


class CompatTest(absltest.TestCase):

    def test_rebuildable_is_sequential_or_functional(self):
        inputs = keras.Input((3,))
        functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        sequential = keras.Sequential([keras.Input((3,)),
                                       keras.layers.Dense(2)])

        class Subclassed(keras.Model):
            def call(self, x):
                return x

        self.assertTrue(compat.rebuildable(functional))
        self.assertTrue(compat.rebuildable(sequential))
        self.assertFalse(compat.rebuildable(Subclassed()))

    def test_the_vectorizer_registry_is_found(self):
        registry, wrap = compat.pfor_converter_registry()
        self.assertIn("BatchMatMulV2", registry)
        self.assertTrue(callable(wrap))

    def test_a_tracked_variable_is_optimizer_state(self):
        optimizer = keras.optimizers.SGD()
        optimizer.build([keras.Variable(np.zeros(2, "float32"))])
        extra = keras.Variable(np.zeros(3, "float32"), trainable=False)
        compat.track_optimizer_variable(optimizer, extra)
        self.assertTrue(any(v is extra for v in optimizer.variables))

    def test_lora_frozen_kernel_is_w_without_a_b(self):
        layer = keras.layers.Dense(3)
        layer.build((None, 2))
        layer.enable_lora(1)
        self.assertEqual(tuple(compat.lora_frozen_kernel(layer).shape),
                         (2, 3))
        self.assertFalse(layer.trainable_weights[0] is
                         compat.lora_frozen_kernel(layer))

    def test_clipping_after_construction_is_checked(self):
        optimizer = tf_dpadam.DPAdamCorrected(l2_norm_clip=1.0,
                                              noise_multiplier=1.0)
        optimizer.clipnorm = 1.0
        with self.assertRaisesRegex(ValueError, "clipnorm=None"):
            optimizer.check_gradient_clipping()
        with self.assertRaisesRegex(ValueError, "clipnorm=None"):
            optimizer._clip_gradients([np.zeros(2, "float32")])


def _traces_of_first_step(fail_symbolic_build=False):
    """How often the private step is traced by a first `train_on_batch`
    of a model compiled with metrics (`LocalBatchSymbolicBuild`)."""
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model = tf_dpadam.make_private(base, check_independence=False)
    model.compile(optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0,
                                            noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"])
    traces = []
    step = type(model).train_step

    def counted(self, data):
        traces.append(1)
        return step(self, data)

    x = np.ones((8, 4), "float32")
    y = np.zeros(8, "int32")
    with mock.patch.object(type(model), "train_step", counted):
        if fail_symbolic_build:
            with mock.patch.object(keras.Model, "_symbolic_build",
                                   side_effect=TypeError("no specs")):
                model.train_on_batch(x, y)
        else:
            model.train_on_batch(x, y)
    return len(traces)


class SymbolicBuildTest(absltest.TestCase):

    @pytest.mark.slow
    def test_metrics_do_not_trace_the_first_step_twice(self):
        self.assertEqual(_traces_of_first_step(), 1)

    @pytest.mark.slow
    def test_a_model_that_cannot_build_symbolically_trains_and_says_why(self):
        with self.assertLogs(level="INFO") as logs:
            traces = _traces_of_first_step(fail_symbolic_build=True)
        self.assertEqual(traces, 2)  # Built in the trace, as Keras does.
        self.assertTrue(any("TypeError: no specs" in line
                            for line in logs.output))


if __name__ == "__main__":
    absltest.main()
