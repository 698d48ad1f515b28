"""`vectorization.vectorized_map` against a Python loop over the examples.

Run, like the whole suite, with TensorFlow's default kernels (oneDNN on x86):
TensorFlow 2.21's own vectorizer gives wrong numbers (or corrupts memory) for
the first cases below there.
"""

import contextlib
import importlib
import warnings
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer import vectorization
from tensorflow.python.ops.parallel_for import pfor as tf_pfor

import sensitivity

_N = 12


def _normal(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


# Each case: the per-example operand shapes as stored (with the batch axis of
# one that layers see), which operands are per-example ("stacked"), adj_x,
# adj_y.
_MATMUL_CASES = (
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


def _check_batch_matmul(x_shape, y_shape, stacked, adj_x, adj_y):
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


def _check_lora_einsum_dense(test):
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
    test.assertLen(got, len(variables))
    for k in range(len(variables)):
        want = np.stack([gradients(x[i])[k] for i in range(_N)])
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-5)


class VectorizedMapTest(parameterized.TestCase):

    @parameterized.named_parameters(*_MATMUL_CASES)
    def test_batch_matmul_matches_a_loop(self, x_shape, y_shape, stacked,
                                         adj_x, adj_y):
        _check_batch_matmul(x_shape, y_shape, stacked, adj_x, adj_y)

    def test_lora_einsum_dense_gradients_match_a_loop(self):
        # Keras' LoRA EinsumDense computes einsum(x, lora_a) @ lora_b: under
        # TensorFlow's own vectorizer its per-example gradients were off by
        # tens of percent with oneDNN.
        _check_lora_einsum_dense(self)

    def test_registry_is_restored(self):
        before = dict(tf_pfor._pfor_converter_registry)
        tf.function(lambda x: vectorization.vectorized_map(
            lambda e: tf.matmul(e[None], tf.ones([3, 2])), x
        ))(tf.ones([4, 2, 3]))
        self.assertEqual(tf_pfor._pfor_converter_registry, before)



# --------------------------------------------------------------------------
# The known-answer check, and the loop that replaces the vectorizer when
# TensorFlow's internals moved or the check fails.
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _fresh_check():
    """Forgets the cached check outcome on entry and on exit."""
    saved = list(vectorization._KNOWN_ANSWER)
    vectorization._KNOWN_ANSWER.clear()
    try:
        yield
    finally:
        vectorization._KNOWN_ANSWER[:] = saved


@contextlib.contextmanager
def _internals_moved():
    """TensorFlow without `pfor._pfor_converter_registry` (renamed, say):
    tf_dpadam.privatizer.vectorization is re-imported against it, then restored."""
    registry = tf_pfor._pfor_converter_registry
    del tf_pfor._pfor_converter_registry
    try:
        importlib.reload(vectorization)
    finally:
        tf_pfor._pfor_converter_registry = registry
    try:
        yield
    finally:
        importlib.reload(vectorization)


def _wrong_by_one(pfor_input):
    """A converter whose product is off by 1: what the check must catch."""
    right = vectorization._convert_batch_matmul(pfor_input)
    return tf_pfor.wrap(right.t + 1.0, True)


def _uncounted(pfor_input):
    """The exact conversion, without telling tf_dpadam it ran."""
    x, x_stacked, _ = pfor_input.input(0)
    y, y_stacked, _ = pfor_input.input(1)
    return tf_pfor.wrap(vectorization._explicit_broadcast_matmul(
        x, x_stacked, y, y_stacked, pfor_input.pfor.loop_len_vector), True)


def _recorded_problem():
    """(known_answer_problem(), the warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problem = vectorization.known_answer_problem()
    return problem, [str(w.message) for w in caught]


class KnownAnswerCheckTest(parameterized.TestCase):

    def test_check_runs_once_and_passes_here(self):
        with _fresh_check(), mock.patch.object(
                vectorization, "_check_broadcast_products",
                wraps=vectorization._check_broadcast_products) as check:
            for _ in range(2):
                got = tf.function(lambda x: vectorization.vectorized_map(
                    lambda e: tf.matmul(e[None], tf.ones([3, 2])), x
                ))(tf.ones([4, 2, 3]))
                np.testing.assert_array_equal(got, np.full([4, 1, 2, 2], 3.0))
            self.assertEqual(check.call_count, 1)
            self.assertEqual(vectorization._KNOWN_ANSWER, [None])

    def test_check_detects_a_wrong_product_and_maps_by_a_loop(self):
        with _fresh_check(), mock.patch.dict(
                vectorization._CONVERTERS, {"BatchMatMulV2": _wrong_by_one}):
            problem, messages = _recorded_problem()
            self.assertIn("off by 1.0", problem)
            self.assertLen(messages, 1)
            self.assertIn("tf.map_fn loop", messages[0])
            # The wrong converter is still installed: a vectorized map would
            # be off by one, the loop is exact.
            _check_batch_matmul((1, 5, 6), (6, 4), (True, False), False,
                                False)
            _check_lora_einsum_dense(self)
            # Warned once per process, not per map.
            self.assertEqual(_recorded_problem(), (problem, []))

    def test_check_detects_that_the_converter_was_not_called(self):
        # TensorFlow keeps a registry under the old name but reads another:
        # the products come out right (here, by an exact converter that
        # TensorFlow calls), yet tf_dpadam's converter never ran.
        with _fresh_check(), mock.patch.object(
                vectorization, "_REGISTRY", {}), mock.patch.dict(
                tf_pfor._pfor_converter_registry,
                {"BatchMatMulV2": _uncounted}):
            problem, messages = _recorded_problem()
        self.assertIn("did not call", problem)
        self.assertLen(messages, 1)

    def test_check_that_raises_is_a_problem(self):
        def broken(pfor_input):
            raise RuntimeError("moved")

        with _fresh_check(), mock.patch.dict(
                vectorization._CONVERTERS, {"BatchMatMulV2": broken}):
            problem, _ = _recorded_problem()
        self.assertIn("RuntimeError", problem)


class InternalsMovedTest(parameterized.TestCase):
    """With TensorFlow's converter registry gone, the maps are still exact
    (a loop), and the first one says so."""

    def test_import_failure_is_a_problem(self):
        with _internals_moved():
            self.assertIsNone(vectorization._REGISTRY)
            problem, messages = _recorded_problem()
            self.assertIn("could not be imported", problem)
            self.assertLen(messages, 1)

    @parameterized.named_parameters(*_MATMUL_CASES)
    def test_batch_matmul_matches_a_loop(self, x_shape, y_shape, stacked,
                                         adj_x, adj_y):
        with _internals_moved(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _check_batch_matmul(x_shape, y_shape, stacked, adj_x, adj_y)

    def test_lora_einsum_dense_gradients_match_a_loop(self):
        with _internals_moved(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _check_lora_einsum_dense(self)

    @parameterized.parameters(False, True)
    @pytest.mark.slow
    def test_private_clipped_sum_is_exact_and_bounded(self, jit):
        # A LoRA EinsumDense on sequences through the vectorized path of
        # make_private: its clipped sum against one-example tapes, and the
        # remove-one sensitivity <= C.
        x = _normal((8, 5, 6), 3)
        y = _normal((8, 5, 4), 4)

        def model():
            keras.utils.set_random_seed(0)
            layer = keras.layers.EinsumDense(
                "btd,de->bte", output_shape=(5, 4), activation="tanh")
            m = keras.Sequential([keras.Input((5, 6)), layer])
            layer.enable_lora(2)
            for i, v in enumerate(m.trainable_variables):
                v.assign(_normal(v.shape, 20 + i))
            return m

        reference = model()
        loss = keras.losses.MeanSquaredError()
        grads = []
        for i in range(len(x)):
            with tf.GradientTape() as tape:
                value = loss(y[i:i + 1], reference(x[i:i + 1], training=True))
            grads.append([np.asarray(g, "float64") for g in tape.gradient(
                value, reference.trainable_variables)])
        norms = [np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in grads]
        clip = float(np.median(norms))
        want = [sum(gs[k] * min(1.0, clip / n) for gs, n in zip(grads, norms))
                for k in range(len(grads[0]))]
        with _internals_moved(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            worst, full = sensitivity.remove_one_sensitivity(
                model(), loss, x, y, clip, clipping="vectorized",
                jit_compile=jit)
            self.assertIsNotNone(vectorization._KNOWN_ANSWER[0])
        self.assertLen(full, len(want))
        for got, expected in zip(full, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
        self.assertLessEqual(worst, 1.0 + 1e-5)
        self.assertGreater(worst, 0.5)


if __name__ == "__main__":
    absltest.main()
