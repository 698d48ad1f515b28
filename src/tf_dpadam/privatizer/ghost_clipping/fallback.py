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

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import preclip
from tf_dpadam.privatizer import clipping
from tf_dpadam.privatizer import vectorization
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import rule


class FallbackRule(rule.Rule):
    """Any layer: per-example gradients by a vectorized map over the layer.

    Records the layer's call arguments and output; the output gradients `g`
    come from the batched backward pass, and each example's weight gradient is
    the vector-Jacobian product of the layer alone on that example.
    """

    name = "fallback"
    kind = "fallback"
    shifted_pass = True  # replays at the record's weights

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
        # A pass at shifted weights (DiSK) replays at those weights.
        self.records.append({"inputs": args_kwargs, "taps": taps,
                             "offsets": recording.offsets})
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
                return _replay_gradients(
                    layer, variables, args, kwargs, record["offsets"],
                    [j for j, _ in used], [c[None] for c in cotangents])

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


def _replay_gradients(layer, variables, args, kwargs, offsets, outputs,
                      cotangents):
    """The vector-Jacobian product of `layer` on one example: the
    gradients of its `outputs` (indices into its flattened outputs) with
    `cotangents`, w.r.t. `variables`, at the weights plus `offsets`
    (id -> shift) if given (a record of a pass at shifted weights)."""
    if offsets is None:
        with tf.GradientTape() as tape:
            flat = tf.nest.flatten(layer(*args, **kwargs))
        return clipping.gradients_or_zeros(
            tape, [flat[j] for j in outputs], variables,
            output_gradients=cotangents)
    points = [preclip.shifted_value(v, offsets[id(v)]) for v in variables]
    with tf.GradientTape() as tape:
        tape.watch(points)
        with keras.StatelessScope(state_mapping=list(zip(variables, points))):
            flat = tf.nest.flatten(layer(*args, **kwargs))
    grads = tape.gradient([flat[j] for j in outputs], points,
                          output_gradients=cotangents)
    return [ops.zeros_like(p) if g is None else g
            for p, g in zip(points, grads)]
