"""The rules for `Embedding` and `ReversibleEmbedding`: rows gathered by ids.

Example i's gradient is `sum_t e_{id_t} g_t^T`: the output gradient of each
position added to the row of its id. Its squared norm sums, over the distinct
ids of the example, the squared norm of the summed output gradients of that
id (`EmbeddingBlock`); the weighted sum scatters the factor-scaled output
gradients into the rows.

`ReversibleEmbedding` (Keras; keras-hub's is a subclass) gathers the same
way, and `reverse=True` computes logits `x K` with the kernel `K = E^T` (tied
weights) or its reverse embeddings `[p, V]`: a Dense kernel at the positions
of x (`blocks.LinearBlock`). A tied table used both ways has one block whose
norm includes the cross term between the two uses (`TiedEmbeddingBlock`).
"""

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import dense
from tf_dpadam.privatizer.ghost_clipping import rule


class EmbeddingRule(rule.Rule):

    name = "Embedding"
    shifted_pass = True  # blocks from the records alone
    weight_names = ("embeddings",)

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        ids = rule.first_input(args, kwargs)
        if ids.dtype != "int32" and ids.dtype != "int64":
            ids = ops.cast(ids, "int32")
        z = ops.take(rule.stopped(layer.embeddings), ids, axis=0)
        z = ops.cast(z, layer.compute_dtype)
        recording.tape.watch(z)
        self.records.append({"ids": recording.check_batch(ids, layer),
                             "taps": [z]})
        return z

    def blocks(self, recording, tap_grads):
        embeddings = self.variable("embeddings")
        if embeddings is None:
            return {}
        return {id(embeddings): [
            self._gathered(recording, self.records, tap_grads)
        ]}

    def _gathered(self, recording, records, tap_grads):
        """The `EmbeddingBlock` of gathers (`records` with "ids")."""
        vocabulary, p = self.layer.embeddings.shape
        batch = recording.batch_size
        ids = ops.concatenate([
            tf.reshape(ops.cast(r["ids"], "int32"), [batch, -1])
            for r in records
        ], axis=1)
        g = ops.concatenate([
            tf.reshape(ops.cast(g, "float32"), [batch, -1, p])
            for (g,) in tap_grads
        ], axis=1)
        return EmbeddingBlock(ids, g, vocabulary)


def _reversible_arguments(inputs, reverse=False):
    """`ReversibleEmbedding.call`'s arguments."""
    return inputs, reverse


class ReversibleEmbeddingRule(EmbeddingRule):

    name = "ReversibleEmbedding"
    weight_names = ("embeddings", "reverse_embeddings")

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        inputs, reverse = _reversible_arguments(*args, **kwargs)
        if not reverse:
            z = super().intercept(recording, original, inputs)
            # The layer sets its padding mask in call (its compute_mask
            # returns None).
            mask = keras.layers.Embedding.compute_mask(layer, inputs)
            if mask is not None:
                compat.set_keras_mask(z, mask)
            return z
        if layer.tie_weights:
            kernel = ops.transpose(rule.stopped(layer.embeddings))
        else:
            kernel = rule.stopped(layer.reverse_embeddings)
        x = inputs
        if layer.reverse_dtype is not None:
            x = ops.cast(x, layer.reverse_dtype)
            kernel = ops.cast(kernel, layer.reverse_dtype)
        logits = ops.matmul(x, kernel)
        recording.tape.watch(logits)
        self.records.append({"x": recording.check_batch(x, layer),
                             "taps": [logits]})
        cap = layer.logit_soft_cap
        if cap is not None:
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits

    def blocks(self, recording, tap_grads):
        layer = self.layer
        embeddings = self.variable("embeddings")
        # (None with tied weights: no such attribute.)
        reverse = self.variable("reverse_embeddings")
        gathers = [(r, g) for r, g in zip(self.records, tap_grads)
                   if "ids" in r]
        products = [(r, g) for r, g in zip(self.records, tap_grads)
                    if "x" in r]
        kernel = embeddings if layer.tie_weights else reverse
        gathered = logits = None
        if gathers and embeddings is not None:
            records, grads = zip(*gathers)
            gathered = self._gathered(recording, records, grads)
        if products and kernel is not None:
            logits = self._logits(recording, products)
        # A weight that the layer's calls did not use gets no block (its
        # gradient is 0).
        out = {}
        if embeddings is not None:
            tied = logits if layer.tie_weights else None
            if gathered is not None and tied is not None:
                out[id(embeddings)] = [TiedEmbeddingBlock(gathered, tied)]
            else:
                out[id(embeddings)] = [
                    b for b in (gathered, tied) if b is not None
                ]
        if reverse is not None:
            out[id(reverse)] = [] if logits is None else [logits]
        return out

    def _logits(self, recording, products):
        """The `LinearBlock` of the reverse calls' kernel, in the layout of
        the variable it is (E `[V, p]` tied, else `[p, V]`)."""
        layer = self.layer
        vocabulary, p = layer.input_dim, layer.output_dim
        batch = recording.batch_size
        x = ops.concatenate([
            tf.reshape(ops.cast(r["x"], "float32"), [batch, -1, p])
            for r, _ in products
        ], axis=1)
        g = ops.concatenate([
            tf.reshape(ops.cast(g, "float32"), [batch, -1, vocabulary])
            for _, (g,) in products
        ], axis=1)
        if layer.tie_weights:
            matrix = dense.KernelMatrix("vp", (vocabulary, p),
                                        contracted="p", produced="v")
        else:
            matrix = dense.KernelMatrix.dense(p, vocabulary)
        return blocks.LinearBlock(x, g, to_matrix=matrix.to_matrix,
                                  from_matrix=matrix.from_matrix)


# `EmbeddingBlock` groups the positions of an example by id by comparing all
# pairs of positions (B T^2 integer comparisons: no more than the B T p floats
# of the output gradient while T <= p) when T <= max(p, this), else by
# sorting each example's ids (B T log T). The pairs keep sorts out of XLA
# programs: on CPU (TF 2.21), a sort anywhere in the program makes XLA inline
# its random number generators and recompute the Philox key of every dropout
# mask at each element, ~100x slower (full fine-tuning of MiniLM, seq 128,
# B = 32: the clipped sum took 34 s instead of 4 s).
PAIRWISE_MAX_LENGTH = 128


class EmbeddingBlock:
    """Embedding rows gathered at ids `[B, T]`: grad_i = sum_t e_{id_t} g_t^T.

    Squared norm: sum over distinct ids of ||sum of g_t with that id||^2: the
    output gradients of each id's positions are summed into one segment per
    id (O(B T p)). The segments are the first position of the id in the
    example, found by comparing all pairs of positions (O(B T^2), while T <=
    max(p, `PAIRWISE_MAX_LENGTH`)), or runs of the example's sorted ids.
    """

    def __init__(self, ids, g, vocabulary_size):
        self.ids, self.g = ids, g
        self.vocabulary_size = vocabulary_size

    def _pairwise(self):
        length = self.ids.shape[1]  # None if unknown while tracing
        return (length is not None
                and length <= max(self.g.shape[2], PAIRWISE_MAX_LENGTH))

    def _segments(self):
        """`(segments, g, ids)`: each position's segment `[B, T]` (in
        [0, T); the positions of one id share one), and the output gradients
        `[B, T, p]` and ids `[B, T]` in the order of `segments`."""
        ids, g = self.ids, self.g
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        if self._pairwise():
            # The first position of each position's id in its example.
            positions = tf.range(length)
            same = ids[:, :, None] == ids[:, None, :]  # [B, T, T]
            first = tf.reduce_min(
                tf.where(same, positions[None, None, :], length), axis=2
            )
            return first, g, ids
        order = tf.argsort(ids, axis=1, stable=True)
        sorted_ids = tf.gather(ids, order, batch_dims=1)
        new_run = tf.concat(
            [tf.ones([batch, 1], tf.int32),
             tf.cast(sorted_ids[:, 1:] != sorted_ids[:, :-1], tf.int32)],
            axis=1,
        )
        return (tf.cumsum(new_run, axis=1) - 1,
                tf.gather(g, order, batch_dims=1), sorted_ids)

    def squared_norms(self, reg_grad=None, scale_sq=None):
        ids, g = self.ids, self.g
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        segments, ordered_g, ordered_ids = self._segments()
        segments = tf.reshape(segments + tf.range(batch)[:, None] * length,
                              [-1])
        sums = tf.math.unsorted_segment_sum(
            tf.reshape(ordered_g, [batch * length, -1]), segments,
            batch * length,
        )
        squares = ops.square(sums)
        if scale_sq is not None:
            # Each segment is one id's row: its S^2 row (an empty segment's
            # sum is 0, whatever row).
            rows = tf.math.unsorted_segment_max(
                tf.reshape(ordered_ids, [-1]), segments, batch * length)
            squares = squares * tf.gather(ops.cast(scale_sq, squares.dtype),
                                          tf.maximum(rows, 0))
        sq = ops.sum(
            tf.reshape(ops.sum(squares, axis=1), [batch, length]),
            axis=1,
        )
        if reg_grad is not None:
            rows = tf.gather(ops.cast(reg_grad, g.dtype), ids)
            sq = sq + 2.0 * ops.sum(rows * g, axis=(1, 2))
        return sq

    def weighted_sum(self, factors):
        g = self.g * factors[:, None, None]
        return tf.math.unsorted_segment_sum(
            tf.reshape(g, [-1, tf.shape(g)[2]]),
            tf.reshape(self.ids, [-1]),
            self.vocabulary_size,
        )

    def grouped(self, size):
        # A group's rows are its positions: an id shared by two rows of the
        # group is one row of the group's gradient.
        return EmbeddingBlock(blocks.group_rows(self.ids, size),
                              blocks.group_rows(self.g, size),
                              self.vocabulary_size)


class TiedEmbeddingBlock:
    """A table used both ways (`ReversibleEmbedding` with tied weights).

    Rows gathered at ids (`gathered`, an `EmbeddingBlock`: example i's
    gradient G_i) and the kernel E^T of logits `x E^T` (`logits`, a
    `blocks.LinearBlock` of x and the logits' gradient h: H_i in E's layout).
    Example i's gradient is G_i + H_i; its squared norm adds to the two
    blocks' the cross term

        2 <G_i, H_i> = 2 sum_{s,t} h_{i,t}[id_s] (x_{i,t} . g_{i,s}),

    s over the gathered positions, t over the logits' (O(T T' p)).
    """

    def __init__(self, gathered, logits):
        self.gathered, self.logits = gathered, logits

    def squared_norms(self, reg_grad=None, scale_sq=None):
        g, ids = self.gathered.g, self.gathered.ids
        x, h = self.logits.a, self.logits.g
        at_ids = tf.gather(h, ids, axis=2, batch_dims=1)  # [B, T', T]
        if scale_sq is not None:
            # <S^2 G_i, H_i>: each gathered gradient times its row's S^2.
            g = g * tf.gather(ops.cast(scale_sq, g.dtype), ids)
        cross = ops.sum(at_ids * tf.einsum("btp,bsp->bts", x, g),
                        axis=(1, 2))
        return (self.gathered.squared_norms(reg_grad, scale_sq)
                + self.logits.squared_norms(reg_grad, scale_sq) + 2.0 * cross)

    def weighted_sum(self, factors):
        return (self.gathered.weighted_sum(factors)
                + self.logits.weighted_sum(factors))

    def grouped(self, size):
        return TiedEmbeddingBlock(self.gathered.grouped(size),
                                  self.logits.grouped(size))
