"""Per-example losses from the compiled loss, for the batched pass."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.common import compat
from tf_dpadam.privatizer.ghost_clipping import per_example_loss

import helpers


class PerExampleLossTest(parameterized.TestCase):
    """compiled_loss_fn's direct path (no vectorized map) against the
    compiled loss applied to one example at a time."""

    def one_at_a_time(self, model, y, y_pred, sample_weight):
        losses = []
        for i in range(y.shape[0]):
            w = None if sample_weight is None else sample_weight[i:i + 1]
            losses.append(float(compat.compile_loss(model)(
                y[i:i + 1], y_pred[i:i + 1], w)))
        return np.array(losses)

    @parameterized.named_parameters(
        ("mse_3d", keras.losses.MeanSquaredError(), (3, 2), False, None),
        ("mse_weighted", keras.losses.MeanSquaredError(), (3,), True, 0.5),
        ("sparse_ce", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), (4,), False, None),
        ("sparse_ce_weighted", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), (4,), True, 2.0),
        ("binary_ce", keras.losses.BinaryCrossentropy(from_logits=True),
         (1,), True, None),
    )
    def test_direct_path_matches_the_compiled_loss(self, loss, shape, weighted,
                                                   loss_weight):
        model = helpers.sequential((5,), keras.layers.Dense(int(np.prod(shape))),
                            keras.layers.Reshape(shape))
        model.compile(loss=loss, loss_weights=loss_weight)
        rng = helpers.rng(3)
        y_pred = tf.constant(rng.normal(size=(6, *shape)), "float32")
        if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
            y = tf.constant(rng.integers(0, shape[-1], size=6))
        elif isinstance(loss, keras.losses.BinaryCrossentropy):
            y = tf.constant(rng.integers(0, 2, size=(6, 1)), "float32")
        else:
            y = tf.constant(rng.normal(size=(6, *shape)), "float32")
        w = tf.constant(rng.uniform(0.1, 2.0, size=6), "float32") \
            if weighted else None
        direct = per_example_loss.direct_per_example_loss(
            compat.compile_loss(model), y, y_pred, w)
        self.assertIsNotNone(direct)
        np.testing.assert_allclose(
            direct, self.one_at_a_time(model, y, y_pred, w), rtol=1e-5,
            atol=1e-6)

    def test_other_cases_take_the_mapped_path(self):
        model = helpers.sequential((5,), keras.layers.Dense(3))
        y = tf.zeros((4, 3))
        y_pred = tf.ones((4, 3))
        model.compile(loss=keras.losses.MeanSquaredError(reduction="sum"))
        self.assertIsNone(per_example_loss.direct_per_example_loss(
            compat.compile_loss(model), y, y_pred, None))
        model.compile(loss="mse")  # Per-element sample weights next.
        compat.compile_loss(model).build(y, y_pred)
        per_element = tf.ones((4, 3))
        self.assertIsNone(per_example_loss.direct_per_example_loss(
            compat.compile_loss(model), y, y_pred, per_element))


if __name__ == "__main__":
    absltest.main()
