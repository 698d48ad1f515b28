"""Rules for keras-hub layers: `PositionEmbedding`.

keras-hub is optional: `ghost_rules()` registers these rules only once
`keras_hub` is imported (a model holding one of its layers has imported it),
and nothing here imports it.

`PositionEmbedding` adds rows `start_index .. start_index + T - 1` of its
`[max_length, p]` table to every example (broadcast over the batch and any
axis before the sequence axis). Example i's gradient is its output gradient
g_i (`[T, p]`, summed over those other axes) in those rows: its norm is
`||g_i||` and the clipped sum `sum_i c_i g_i` in those rows, no per-example
table (`PositionBlock`). With `positions=` (rows chosen per position, maybe
repeated) the layer is an embedding lookup of those ids
(`embedding.EmbeddingBlock`), as is a layer called more than once.
"""

import sys

import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import embedding
from tf_dpadam.privatizer.ghost_clipping import rule


def _position_arguments(inputs, start_index=0, positions=None):
    """`PositionEmbedding.call`'s arguments."""
    return inputs, start_index, positions


def _serving_positions(layer):
    """The positions the layer's call uses when given none: vLLM's while it
    serves (keras-hub's `_vllm_serving_positions`), else None."""
    serving = type(layer).call.__globals__.get("_vllm_serving_positions")
    return None if serving is None else serving()


class PositionEmbeddingRule(rule.Rule):

    name = "PositionEmbedding"
    shifted_pass = True  # blocks from the records alone
    weight_names = ("position_embeddings",)

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        inputs, start_index, positions = _position_arguments(*args, **kwargs)
        shape = ops.shape(recording.check_batch(inputs, layer))
        table = rule.stopped(layer.position_embeddings)
        if positions is None:
            positions = _serving_positions(layer)
        shared = positions is None  # the same rows for every example
        if shared:
            length = shape[-2]
            rows = ops.slice(table, (start_index, 0), (length, shape[-1]))
            ids = tf.range(length) + ops.cast(start_index, "int32")
        else:
            if len(ops.shape(positions)) == 1:
                positions = ops.expand_dims(positions, axis=0)
            rows = ops.take(table, positions, axis=0)
            # Broadcasting the rows to `shape` broadcasts their ids to its
            # positions.
            ids = ops.broadcast_to(ops.cast(positions, "int32"), shape[:-1])
        z = ops.broadcast_to(rows, shape)
        recording.tape.watch(z)
        self.records.append({"ids": ids, "shared": shared, "taps": [z]})
        return z

    def blocks(self, recording, tap_grads):
        table = self.variable("position_embeddings")
        if table is None:
            return {}
        size, p = table.shape
        batch = recording.batch_size
        if len(self.records) == 1 and self.records[0]["shared"]:
            ids = self.records[0]["ids"]
            (g,), = tap_grads
            g = tf.reshape(ops.cast(g, "float32"),
                           [batch, -1, tf.shape(ids)[0], p])
            return {id(table): [PositionBlock(ids, ops.sum(g, axis=1), size)]}
        # Rows that may repeat within an example: an embedding lookup.
        ids, grads = [], []
        for record, (g,) in zip(self.records, tap_grads):
            ids.append(tf.reshape(
                tf.broadcast_to(record["ids"], tf.shape(g)[:-1]), [batch, -1]
            ))
            grads.append(tf.reshape(ops.cast(g, "float32"), [batch, -1, p]))
        return {id(table): [embedding.EmbeddingBlock(
            ops.concatenate(ids, axis=1), ops.concatenate(grads, axis=1),
            size,
        )]}


class PositionBlock:
    """Rows `ids` (`[T]`, distinct, the same for every example) of a table
    added to each example: example i's gradient is g_i (`[B, T, p]`) in
    those rows."""

    def __init__(self, ids, g, table_size):
        self.ids, self.g = ids, g
        self.table_size = table_size

    def squared_norms(self, reg_grad=None, scale_sq=None):
        if scale_sq is None:
            sq = ops.sum(ops.square(self.g), axis=(1, 2))
        else:  # The rows are distinct.
            sq = tf.einsum("btp,tp->b", ops.square(self.g), tf.gather(
                ops.cast(scale_sq, self.g.dtype), self.ids))
        if reg_grad is not None:
            rows = tf.gather(ops.cast(reg_grad, self.g.dtype), self.ids)
            sq = sq + 2.0 * tf.einsum("btp,tp->b", self.g, rows)
        return sq

    def weighted_sum(self, factors):
        return tf.math.unsorted_segment_sum(
            tf.tensordot(factors, self.g, axes=[[0], [0]]), self.ids,
            self.table_size,
        )

    def grouped(self, size):
        # The views of an example use the same rows: their gradients add up.
        return PositionBlock(self.ids, blocks.sum_groups(self.g, size),
                             self.table_size)


# keras-hub layer name (in `keras_hub.layers`) -> rule.
RULES = {"PositionEmbedding": PositionEmbeddingRule}


def ghost_rules():
    """`{layer class: rule}` of `RULES`, or `{}` until keras_hub is imported."""
    keras_hub = sys.modules.get("keras_hub")
    layers = getattr(keras_hub, "layers", None)
    if layers is None:
        return {}
    return {getattr(layers, name): rule_class
            for name, rule_class in RULES.items() if hasattr(layers, name)}
