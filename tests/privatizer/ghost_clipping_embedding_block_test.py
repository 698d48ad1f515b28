"""`EmbeddingBlock`'s squared norms, by pairs of positions or by sorting.

(`ghost_clipping_embedding_test.py` checks the Embedding rule, by pairs, in
lockstep with explicit clipping; here the same with the sort too.)
"""

from unittest import mock

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import helpers
from tf_dpadam.privatizer.ghost_clipping import embedding


def _brute_force_squared_norms(ids, g, vocabulary_size):
    """Each example's squared norm of sum_t e_{id_t} g_t^T, in NumPy."""
    norms = []
    for example_ids, example_g in zip(ids, g.astype("float64")):
        grad = np.zeros((vocabulary_size, g.shape[2]))
        np.add.at(grad, example_ids, example_g)
        norms.append(np.sum(grad ** 2))
    return np.array(norms)


class EmbeddingBlockTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    # The positions of an id are found by comparing pairs of positions
    # (T = 12 <= max(p, PAIRWISE_MAX_LENGTH)) or, with PAIRWISE_MAX_LENGTH
    # = 0 and T > p, by sorting the ids.
    @parameterized.named_parameters(
        ("graph_pairs", False, 128), ("jit_pairs", True, 128),
        ("graph_sorted", False, 0), ("jit_sorted", True, 0),
    )
    @pytest.mark.slow
    def test_lockstep_with_repeated_ids(self, jit, pairwise_max_length):
        model = helpers.sequential(
            (12,), keras.layers.Embedding(5, 4, name="embedding"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3),
            dtype="int32",
        )
        ids = helpers.rng().integers(0, 5, size=(helpers.BATCH, 12))
        ids = ids.astype("int32")
        ids[0] = 2  # one example with a single id
        with mock.patch.object(embedding, "PAIRWISE_MAX_LENGTH",
                               pairwise_max_length):
            self.assert_lockstep(model, ids,
                                 helpers.normal((helpers.BATCH, 3)), jit=jit)

    @parameterized.named_parameters(
        # (T, p, pairwise): pairs while T <= max(p, PAIRWISE_MAX_LENGTH).
        ("short", 12, 4, True),
        ("as_long_as_wide", 200, 200, True),
        ("long_and_narrow", 200, 4, False),
    )
    def test_squared_norms_by_pairs_or_sorting(self, length, p, pairwise):
        ids = helpers.rng().integers(0, 7, size=(3, length)).astype("int32")
        ids[1] = 5  # one id at every position
        ids[2] = np.arange(length) % 7 * 3  # in no particular order
        g = helpers.normal((3, length, p))
        block = embedding.EmbeddingBlock(tf.constant(ids), tf.constant(g), 21)
        self.assertEqual(block._pairwise(), pairwise)
        np.testing.assert_allclose(
            block.squared_norms(), _brute_force_squared_norms(ids, g, 21),
            rtol=1e-5,
        )

    def test_unknown_length_sorts(self):
        pairwise = []

        @tf.function(input_signature=[
            tf.TensorSpec([None, None], tf.int32),
            tf.TensorSpec([None, None, 4], tf.float32),
        ])
        def trace(ids, g):
            block = embedding.EmbeddingBlock(ids, g, 5)
            pairwise.append(block._pairwise())
            return block.squared_norms()

        trace.get_concrete_function()
        self.assertEqual(pairwise, [False])

    def test_no_sort_in_xla_program(self):
        # A sort anywhere in an XLA program on CPU makes XLA inline the
        # dropout masks' random number generators and recompute their key at
        # every element (~100x slower): the norms of short sequences have
        # none.
        ids = tf.constant(helpers.rng().integers(0, 5, size=(2, 12)), tf.int32)
        g = tf.constant(helpers.normal((2, 12, 4)))

        def hlo():
            squared_norms = tf.function(
                lambda ids, g: embedding.EmbeddingBlock(ids, g, 5)
                .squared_norms(),
                jit_compile=True,
            )
            return squared_norms.experimental_get_compiler_ir(ids, g)(
                stage="hlo")

        self.assertNotIn(" sort(", hlo())
        with mock.patch.object(embedding, "PAIRWISE_MAX_LENGTH", 0):
            self.assertIn(" sort(", hlo())  # (the check would see one)


if __name__ == "__main__":
    absltest.main()
