"""The rules for `LayerNormalization` and `GroupNormalization`: a per-feature
scale and offset.

`z = gamma * normalized(x) + beta` with `normalized(x)` free of weights, so
example i's gradients are `sum normalized(x_i) * g_i` (gamma) and `sum g_i`
(beta) over the axes that gamma and beta do not span: small, materialized.
Normalizing over the batch axis would mix examples and is refused.
GroupNormalization normalizes each example over its positions and the
channels of a group, with gamma and beta per channel.
"""

from keras import ops

from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import rule


class LayerNormalizationRule(rule.Rule):

    name = "LayerNormalization"
    shifted_pass = True  # blocks from the records alone
    weight_names = ("gamma", "beta")

    def normalize(self, x):
        """`(normalized x, the axes gamma and beta span)`; None for the axes
        when the layer would mix examples."""
        layer = self.layer
        axes = sorted(a % len(x.shape) for a in layer.axis)
        if 0 in axes:
            return x, None
        return ops.layer_normalization(
            x, None, None, axis=axes, epsilon=layer.epsilon,
            rms_scaling=layer.rms_scaling,
        ), axes

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        x = rule.first_input(args, kwargs)
        rank = len(x.shape)
        normalized, axes = self.normalize(x)
        if axes is None:
            recording.error(
                f"{self.name} {layer.name!r} normalizes over the batch"
                " axis (it mixes examples)"
            )
            return original(*args, **kwargs)
        broadcast = [1] * rank
        for a in axes:
            broadcast[a] = x.shape[a]
        z = normalized
        if layer.gamma is not None:
            z = z * ops.reshape(ops.cast(rule.stopped(layer.gamma), z.dtype),
                                broadcast)
        if layer.beta is not None:
            z = z + ops.reshape(ops.cast(rule.stopped(layer.beta), z.dtype),
                                broadcast)
        recording.tape.watch(z)
        self.records.append({
            "normalized": recording.check_batch(normalized, layer),
            "axes": axes, "taps": [z],
        })
        return ops.cast(z, layer.compute_dtype)

    def blocks(self, recording, tap_grads):
        gamma, beta = self.variable("gamma"), self.variable("beta")
        gamma_grads, beta_grads = [], []
        for record, (g,) in zip(self.records, tap_grads):
            g = ops.cast(g, "float32")
            normalized = ops.cast(record["normalized"], "float32")
            rank = len(g.shape)
            other = [i for i in range(1, rank) if i not in record["axes"]]
            gamma_grads.append(ops.sum(normalized * g, axis=other))
            beta_grads.append(ops.sum(g, axis=other))
        out = {}
        if gamma is not None:
            out[id(gamma)] = [blocks.MaterializedBlock(ops.sum(gamma_grads, axis=0))]
        if beta is not None:
            out[id(beta)] = [blocks.MaterializedBlock(ops.sum(beta_grads, axis=0))]
        return out


class GroupNormalizationRule(LayerNormalizationRule):

    name = "GroupNormalization"

    def normalize(self, x):
        layer = self.layer
        rank = len(x.shape)
        axis = layer.axis % rank
        if axis == 0:
            return x, None
        x = ops.cast(x, "float32")
        dims = [d if d is not None else ops.shape(x)[i]
                for i, d in enumerate(x.shape)]
        # The channel axis as (groups, channels per group); every other axis
        # but the batch and the groups is normalized over.
        grouped = ops.reshape(x, [*dims[:axis], layer.groups,
                                  dims[axis] // layer.groups,
                                  *dims[axis + 1:]])
        reduce = [i for i in range(1, rank + 1) if i != axis]
        mean, variance = ops.moments(grouped, axes=reduce, keepdims=True)
        normalized = (grouped - mean) * ops.rsqrt(variance + layer.epsilon)
        return ops.reshape(normalized, dims), [axis]
