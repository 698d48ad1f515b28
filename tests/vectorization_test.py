"""`vectorization.vectorized_map` against a Python loop over the examples.

Run, like the whole suite, with TensorFlow's default kernels (oneDNN on x86):
TensorFlow 2.21's own vectorizer gives wrong numbers (or corrupts memory) for
the first cases below there.
"""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam import vectorization
from tensorflow.python.ops.parallel_for import pfor as tf_pfor

_N = 12


def _normal(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


class VectorizedMapTest(parameterized.TestCase):

    # Each case: the per-example operand shapes as stored (with the batch
    # axis of one that layers see), which operands are per-example
    # ("stacked"), adj_x, adj_y.
    @parameterized.named_parameters(
        # The product of a per-example [1, M, K] with a shared weight: the
        # shape that oneDNN's broadcasting batch matmul gets wrong.
        ("shared_right", (1, 5, 6), (6, 4), (True, False), False, False),
        ("shared_right_3d", (1, 5, 6), (1, 6, 4), (True, False), False,
         False),
        ("shared_right_adjoint", (1, 6, 5), (4, 6), (True, False), True,
         True),
        ("shared_right_higher_rank", (5, 6), (1, 1, 6, 4), (True, False),
         False, False),
        ("shared_left", (5, 6), (1, 6, 4), (False, True), False, False),
        ("shared_left_adjoint", (6, 5), (1, 6, 4), (False, True), True,
         False),
        ("both", (1, 5, 6), (1, 6, 4), (True, True), False, False),
        ("both_broadcast", (1, 5, 6), (3, 6, 4), (True, True), False, False),
        ("shared_batched_weight", (1, 5, 6), (3, 6, 4), (True, False), False,
         False),
        ("broadcast_inside", (2, 1, 6, 5), (3, 6, 4), (True, False), True,
         False),
    )
    def test_batch_matmul_matches_a_loop(self, x_shape, y_shape, stacked,
                                         adj_x, adj_y):
        x = _normal(((_N,) if stacked[0] else ()) + x_shape, 0)
        y = _normal(((_N,) if stacked[1] else ()) + y_shape, 1)

        def one(example):
            xi = example[0] if stacked[0] else x
            yi = example[1] if stacked[1] else y
            return tf.matmul(xi, yi, adjoint_a=adj_x, adjoint_b=adj_y)

        elems = (x if stacked[0] else np.zeros(_N, "float32"),
                 y if stacked[1] else np.zeros(_N, "float32"))
        want = np.stack([
            np.matmul(
                np.swapaxes(x[i] if stacked[0] else x, -1, -2)
                if adj_x else (x[i] if stacked[0] else x),
                np.swapaxes(y[i] if stacked[1] else y, -1, -2)
                if adj_y else (y[i] if stacked[1] else y),
            )
            for i in range(_N)
        ])
        for jit in (False, True):
            got = tf.function(
                lambda e: vectorization.vectorized_map(one, e),
                jit_compile=jit,
            )(elems)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"jit={jit}")

    def test_lora_einsum_dense_gradients_match_a_loop(self):
        # Keras' LoRA EinsumDense computes einsum(x, lora_a) @ lora_b: under
        # TensorFlow's own vectorizer its per-example gradients were off by
        # tens of percent with oneDNN.
        layer = keras.layers.EinsumDense(
            "btd,de->bte", output_shape=(5, 4), activation="tanh"
        )
        layer.build((None, 5, 6))
        layer.enable_lora(2)
        for i, v in enumerate(layer.trainable_variables):
            v.assign(_normal(v.shape, 10 + i))
        x = _normal((_N, 5, 6), 2)
        variables = layer.trainable_variables

        def gradients(example):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(layer(example[None])))
            return tape.gradient(loss, variables)

        got = tf.function(
            lambda x: vectorization.vectorized_map(gradients, x)
        )(x)
        for k in range(len(variables)):
            want = np.stack([gradients(x[i])[k] for i in range(_N)])
            np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-5)

    def test_registry_is_restored(self):
        before = dict(tf_pfor._pfor_converter_registry)
        tf.function(lambda x: vectorization.vectorized_map(
            lambda e: tf.matmul(e[None], tf.ones([3, 2])), x
        ))(tf.ones([4, 2, 3]))
        self.assertEqual(tf_pfor._pfor_converter_registry, before)


if __name__ == "__main__":
    absltest.main()
