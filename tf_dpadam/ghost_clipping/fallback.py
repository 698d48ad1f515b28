"""The fallback rule: exact per-example gradients of one layer, vectorized.

For a layer with trainable weights and no ghost rule (RNNs, LoRA embeddings
and convolutions, other convolutions, custom layers, ...), the step records
the layer's call arguments and output; the output gradients come from the
batched backward pass, and each example's weight gradient is the
vector-Jacobian product of the layer alone on that example, by a vectorized
map. Only that layer pays
for per-example backward passes. The replay cannot reproduce the forward
pass's random draws, so a fallback layer that draws random numbers in
training (e.g. contains dropout) is refused.
"""

import tensorflow as tf
from keras import ops

from tf_dpadam import compat
from tf_dpadam.step import clipping
from tf_dpadam import vectorization
from tf_dpadam.ghost_clipping import blocks
from tf_dpadam.ghost_clipping import rule


class FallbackRule(rule.Rule):
    """Any layer: per-example gradients by a vectorized map over the layer.

    Records the layer's call arguments and output; the output gradients `g`
    come from the batched backward pass, and each example's weight gradient is
    the vector-Jacobian product of the layer alone on that example.
    """

    name = "fallback"
    kind = "fallback"

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        args_kwargs = tf.nest.map_structure(
            lambda t: recording.check_batch(t, layer) if tf.is_tensor(t) else t,
            (args, kwargs),
        )
        # The per-example replay could not reproduce the forward's random
        # draws (e.g. dropout): refuse if the layer draws any.
        generators = compat.seed_generators(layer)
        drawn = []
        for generator in generators:
            def next_seed(*a, _original=generator.next, _g=generator, **k):
                drawn.append(_g)
                return _original(*a, **k)
            generator.next = next_seed
        try:
            outputs = original(*args, **kwargs)
        finally:
            for generator in generators:
                del generator.next
        if drawn:
            recording.error(
                f"layer {layer.name!r} has no ghost rule and draws random"
                " numbers in training (e.g. dropout)"
            )
        taps = rule.watch_float(recording.tape, outputs)
        self.records.append({"inputs": args_kwargs, "taps": taps})
        return outputs

    def taps(self):
        return [[t for t in r["taps"] if t is not None] for r in self.records]

    def blocks(self, recording, tap_grads):
        layer, variables = self.layer, self.variables
        total = None
        for record, grads in zip(self.records, tap_grads):
            leaves = tf.nest.flatten(record["inputs"])
            tensor_index = [i for i, t in enumerate(leaves) if tf.is_tensor(t)]
            out_index = [i for i, t in enumerate(record["taps"]) if t is not None]
            used = [(j, g) for j, g in zip(out_index, grads) if g is not None]
            if not used:
                continue

            def one_example(packed, leaves=leaves, record=record,
                            tensor_index=tensor_index, used=used):
                tensors, cotangents = packed
                example = list(leaves)
                for i, t in zip(tensor_index, tensors):
                    example[i] = t[None]
                args, kwargs = tf.nest.pack_sequence_as(
                    record["inputs"], example
                )
                with tf.GradientTape() as tape:
                    outputs = layer(*args, **kwargs)
                flat = tf.nest.flatten(outputs)
                return clipping.gradients_or_zeros(
                    tape, [flat[j] for j, _ in used], variables,
                    output_gradients=[c[None] for c in cotangents],
                )

            per_example = vectorization.vectorized_map(
                one_example,
                ([leaves[i] for i in tensor_index], [g for _, g in used]),
                what=f"the per-example gradients of layer {layer.name!r}",
            )
            per_example = [ops.cast(g, "float32") for g in per_example]
            total = per_example if total is None else [
                t + g for t, g in zip(total, per_example)
            ]
        if total is None:
            return {}
        return {
            id(v): [blocks.MaterializedBlock(g)]
            for v, g in zip(variables, total)
        }
