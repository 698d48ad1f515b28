"""The rule for `Embedding`: rows gathered by integer ids.

Example i's gradient is `sum_t e_{id_t} g_t^T`: the output gradient of each
position added to the row of its id. Its squared norm sums, over the distinct
ids of the example, the squared norm of the summed output gradients of that
id (`EmbeddingBlock`); the weighted sum scatters the factor-scaled output
gradients into the rows.
"""

import tensorflow as tf
from keras import ops

from tf_dpadam.ghost_clipping import blocks
from tf_dpadam.ghost_clipping import rule


class EmbeddingRule(rule.Rule):

    name = "Embedding"
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
        layer = self.layer
        embeddings = self.variable("embeddings")
        if embeddings is None:
            return {}
        vocabulary, p = layer.embeddings.shape
        batch = recording.batch_size
        ids = ops.concatenate([
            tf.reshape(ops.cast(r["ids"], "int32"), [batch, -1])
            for r in self.records
        ], axis=1)
        g = ops.concatenate([
            tf.reshape(ops.cast(g, "float32"), [batch, -1, p])
            for (g,) in tap_grads
        ], axis=1)
        return {id(embeddings): [EmbeddingBlock(ids, g, vocabulary)]}


class EmbeddingBlock:
    """Embedding rows gathered at ids `[B, T]`: grad_i = sum_t e_{id_t} g_t^T.

    Squared norm: sum over distinct ids of ||sum of g_t with that id||^2,
    computed by sorting each example's ids and summing runs (O(B T p)).
    """

    def __init__(self, ids, g, vocabulary_size):
        self.ids, self.g = ids, g
        self.vocabulary_size = vocabulary_size

    def squared_norms(self, reg_grad=None):
        ids, g = self.ids, self.g
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        order = tf.argsort(ids, axis=1, stable=True)
        sorted_ids = tf.gather(ids, order, batch_dims=1)
        sorted_g = tf.gather(g, order, batch_dims=1)
        new_run = tf.concat(
            [tf.ones([batch, 1], tf.int32),
             tf.cast(sorted_ids[:, 1:] != sorted_ids[:, :-1], tf.int32)],
            axis=1,
        )
        runs = tf.cumsum(new_run, axis=1) - 1
        segments = runs + tf.range(batch)[:, None] * length
        sums = tf.math.unsorted_segment_sum(
            tf.reshape(sorted_g, [batch * length, -1]),
            tf.reshape(segments, [-1]),
            batch * length,
        )
        sq = ops.sum(
            tf.reshape(ops.sum(ops.square(sums), axis=1), [batch, length]),
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
