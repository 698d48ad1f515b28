"""Ghost clipping: the sum of clipped per-example gradients, batched.

The vectorized path (`step.clipping.per_example_gradients`) differentiates every
example on its own. For most layers the per-example gradient of a weight is a
known function of two batched tensors, the layer's input `a` and the gradient
`g` of the loss w.r.t. the layer's output `z` (Goodfellow 2015; Li et al.
2021, "ghost clipping"; Bu et al. 2022, "book-keeping"). One step then costs
one batched forward and backward pass plus small per-layer products, and the
result equals explicit per-example clipping up to float rounding.

Layout (the step knows no layer; a rule knows no clipping):

* `step.py`: the step (`clipped_gradient_sum`): record, backward to the
  taps, norms, clip factors, weighted sum; `block_modes` says which blocks
  took the ghost norm and which were materialized.
* `sums.py`: the per-example norms and the weighted sums from the blocks
  (with `scales`, of the coordinate-wise scaled gradients S * grad_i that
  scale-then-privatize clips: each block's `scale_sq`).
* `plan.py`: which rule owns which trainable variable; `describe(model)`.
* `registry.py`: the table of layer classes -> rules, what is looked into,
  what falls back and what is refused (and why).
* `rule.py`: the rule interface; `blocks.py`: per-example gradient blocks.
* one module per layer family: `dense.py` (Dense, EinsumDense), `lora.py`
  (Dense and EinsumDense with LoRA enabled),
  `convolution.py` (Conv1D, Conv2D), `embedding.py` (Embedding,
  ReversibleEmbedding), `normalization.py` (LayerNormalization,
  GroupNormalization), `standardized.py` (`tf_dpadam.layers.WSConv2D`),
  `keras_hub.py` (keras-hub's PositionEmbedding, once keras_hub is
  imported), `fallback.py` (any other layer with weights: a vectorized map
  over that layer alone).
* `per_example_loss.py`: `[B]` losses from the compiled loss.

Augmentation multiplicity (`clipped_gradient_sum(..., group_size=K)`, see
`tf_dpadam.training.augmentation`): the rules record K rows per example and every
block type groups them (`grouped`): the K views of an example are one
example whose norm includes the cross terms between its views.

Weight regularizers are supported (each example's loss includes the whole
regularization term, as in the vectorized path). Not supported
(`clipped_gradient_sum` raises `GhostClippingUnsupportedError`; use the
vectorized path): activity regularizers and `add_loss` in `call`, a fallback
unit containing random layers, layers called inside control flow
(`tf.while_loop`, `tf.cond`), rematerialization, a trainable variable used
outside its layer's `call` (detected: rules compute with `stop_gradient` of
their weights, so any other differentiable use shows up as a gradient), a
recorded tensor whose leading axis is not the batch axis (detected
statically, and at run time by a reshape to the batch size),
`LayerNormalization` over the batch axis, and a root model that owns
trainable weights directly.

Requirement shared with the vectorized path and checked by `make_private`
for `registry.EXAMPLE_MIXING_LAYERS`: no layer may mix the examples of a
batch in training. Unlike the vectorized path (which runs every example as a
batch of one), ghost clipping runs the batch through the model, so a custom
layer that mixes examples would break the per-example decomposition.
"""

from tf_dpadam.privatizer.ghost_clipping.per_example_loss import compiled_loss_fn
from tf_dpadam.privatizer.ghost_clipping.plan import describe
from tf_dpadam.privatizer.ghost_clipping.plan import supports
from tf_dpadam.privatizer.ghost_clipping.plan import unsupported_layers
from tf_dpadam.privatizer.ghost_clipping.gradient_sum import block_modes
from tf_dpadam.privatizer.ghost_clipping.gradient_sum import clipped_gradient_sum
from tf_dpadam.privatizer.ghost_clipping.gradient_sum import GhostClippingUnsupportedError

__all__ = [
    "block_modes", "clipped_gradient_sum", "compiled_loss_fn", "describe",
    "GhostClippingUnsupportedError", "supports", "unsupported_layers",
]
