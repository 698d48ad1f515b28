"""src/tf_dpadam/privatizer/ghost_clipping/sums.py and the blocks' scaled norms, against
NumPy: each example's norm of S * (grad_i + R') from the blocks of several
variables (a materialized block, a kernel at one position, a kernel at T
positions in the ghost mode, embedding rows with repeated ids), and the
weighted sums."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import embedding
from tf_dpadam.privatizer.ghost_clipping import sums


class _Var:
    """A stand-in for a variable: only its shape is read."""

    def __init__(self, shape):
        self.shape = shape


def _setup(rng, batch=5):
    """Per-example gradients in NumPy and the blocks that stand for them."""
    d, p, t, vocab = 4, 3, 6, 7
    bias = rng.normal(size=(batch, p))
    a1, g1 = rng.normal(size=(batch, 1, d)), rng.normal(size=(batch, 1, p))
    # Large enough for the ghost mode: d p = 160 > T^2 = 36.
    a2, g2 = rng.normal(size=(batch, t, 16)), rng.normal(size=(batch, t, 10))
    ids = rng.integers(0, 3, size=(batch, t))  # Repeated ids.
    ge = rng.normal(size=(batch, t, p))
    grads = [bias, np.einsum("btd,btp->bdp", a1, g1),
             np.einsum("btd,btp->bdp", a2, g2), np.zeros((batch, vocab, p))]
    for i in range(batch):
        for j in range(t):
            grads[3][i, ids[i, j]] += ge[i, j]
    f32 = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    identity = lambda w: tf.cast(w, tf.float32)  # noqa: E731
    block_list = [
        blocks.MaterializedBlock(f32(bias)),
        blocks.LinearBlock(f32(a1), f32(g1), identity, identity),
        blocks.LinearBlock(f32(a2), f32(g2), identity, identity),
        embedding.EmbeddingBlock(tf.constant(ids, tf.int32), f32(ge), vocab),
    ]
    return grads, block_list


class ScaledNormsTest(absltest.TestCase):

    def test_norms_of_scaled_gradients_with_regularization(self):
        rng = np.random.default_rng(0)
        grads, block_list = _setup(rng)
        self.assertEqual(block_list[1].mode, "outer")
        self.assertEqual(block_list[2].mode, "ghost")
        variables = [_Var(g.shape[1:]) for g in grads]
        scales = [rng.uniform(0.1, 3.0, size=g.shape[1:]) for g in grads]
        regs = {id(variables[1]): rng.normal(size=grads[1].shape[1:]),
                id(variables[3]): rng.normal(size=grads[3].shape[1:])}
        block_map = {id(v): [b] for v, b in zip(variables, block_list)}
        for scaled in (False, True):
            got = sums.norms(
                variables, block_map,
                {k: tf.constant(r, tf.float32) for k, r in regs.items()},
                5, {id(v): tf.constant(s, tf.float32)
                    for v, s in zip(variables, scales)} if scaled else None)
            want = np.sqrt(sum(
                np.sum(((g + regs.get(id(v), 0.0)) * (s if scaled else 1.0)
                        ).reshape(5, -1) ** 2, axis=1)
                for g, v, s in zip(grads, variables, scales)))
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)

    def test_weighted_sums(self):
        rng = np.random.default_rng(1)
        grads, block_list = _setup(rng)
        variables = [_Var(g.shape[1:]) for g in grads]
        factors = rng.uniform(0, 1, size=5)
        got = sums.weighted_sums(
            variables, {id(v): [b] for v, b in zip(variables, block_list)},
            {}, [tf.constant(factors, tf.float32)] * len(variables))
        for g, s in zip(grads, got):
            np.testing.assert_allclose(np.asarray(s),
                                       np.tensordot(factors, g, axes=1),
                                       rtol=1e-5, atol=1e-5)

    def test_a_block_without_a_scaled_norm_raises(self):
        class NoScale:
            def squared_norms(self, reg_grad=None, scale_sq=None):
                raise blocks.ScaledNormUnsupportedError("no scaled norm")

        variable = _Var((2,))
        with self.assertRaisesRegex(blocks.ScaledNormUnsupportedError,
                                    "no scaled norm"):
            sums.norms([variable], {id(variable): [NoScale()]}, {}, 3,
                       {id(variable): tf.ones((2,))})


class ConcatenatedTest(absltest.TestCase):

    def test_blocks_side_by_side_stand_for_the_sum(self):
        # Two passes' records of one kernel: each example's gradient is the
        # sum of the two blocks' (the cross term in its norm).
        rng = np.random.default_rng(2)
        parts = [(rng.normal(size=(5, t, 16)), rng.normal(size=(5, t, 10)))
                 for t in (3, 4)]
        identity = lambda w: tf.cast(w, tf.float32)  # noqa: E731
        block = blocks.concatenated([
            blocks.LinearBlock(tf.constant(a, tf.float32),
                               tf.constant(g, tf.float32), identity, identity)
            for a, g in parts])
        self.assertEqual(block.mode, "ghost")  # d p = 160 > T^2 = 49
        want = sum(np.einsum("btd,btp->bdp", a, g) for a, g in parts)
        np.testing.assert_allclose(
            np.asarray(block.squared_norms()),
            np.sum(want.reshape(5, -1) ** 2, axis=1), rtol=1e-5)
        factors = rng.uniform(0, 1, size=5)
        np.testing.assert_allclose(
            np.asarray(block.weighted_sum(tf.constant(factors, tf.float32))),
            np.tensordot(factors, want, axes=1), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    absltest.main()
