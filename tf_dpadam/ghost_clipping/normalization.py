"""The rule for `LayerNormalization`: a per-feature scale and offset.

`z = gamma * normalized(x) + beta` with `normalized(x)` free of weights, so
example i's gradients are `sum normalized(x_i) * g_i` (gamma) and `sum g_i`
(beta) over the axes that are not normalized: small, materialized.
Normalizing over the batch axis would mix examples and is refused.
"""

from keras import ops

from tf_dpadam.ghost_clipping import blocks
from tf_dpadam.ghost_clipping import rule


class LayerNormalizationRule(rule.Rule):

    name = "LayerNormalization"
    weight_names = ("gamma", "beta")

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        x = rule.first_input(args, kwargs)
        rank = len(x.shape)
        axes = sorted(a % rank for a in layer.axis)
        if 0 in axes:
            recording.error(
                f"LayerNormalization {layer.name!r} normalizes over the batch"
                " axis (it mixes examples)"
            )
            return original(*args, **kwargs)
        normalized = ops.layer_normalization(
            x, None, None, axis=axes, epsilon=layer.epsilon,
            rms_scaling=layer.rms_scaling,
        )
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
