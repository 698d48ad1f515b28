"""Which layers take which path: the one table of ghost clipping.

* **ghost**: a layer whose class (or nearest registered base class) is in
  `GHOST_RULES` gets that rule, unless the rule refuses it (`Rule.refusal`)
  or it is changed in a way the rule cannot see (below): its per-example
  norms come from the recorded input and output gradient.
* **looked into**: a layer without trainable weights of its own (a
  `Sequential`, functional or subclassed model, `MultiHeadAttention`, a
  custom block) is not a unit: its sublayers are handled one by one. Except
  the `OPAQUE_LAYERS`, whose sublayers run inside control flow or on
  reshaped batches.
* **fallback**: any other layer with trainable weights (`fallback.py`):
  exact per-example gradients by a vectorized map over that layer alone.
* **refused** (`refusals`): what no path can make exact; `make_private`
  raises for `EXAMPLE_MIXING_LAYERS` in every clipping mode, the rest make
  ghost clipping fall back to the vectorized path (or raise with
  `clipping="ghost"`).

Adding a layer: a rule module, one line in `GHOST_RULES` (a keras-hub layer:
in `keras_hub.RULES`, by name, registered once keras_hub is imported), one
test; the README's table (`markdown_table`) is checked against this module
by tests/ghost_clipping_registry_test.py.
"""

import keras

from tf_dpadam import keras_internals
from tf_dpadam import layers
from tf_dpadam.ghost_clipping import convolution
from tf_dpadam.ghost_clipping import dense
from tf_dpadam.ghost_clipping import embedding
from tf_dpadam.ghost_clipping import keras_hub
from tf_dpadam.ghost_clipping import lora
from tf_dpadam.ghost_clipping import normalization
from tf_dpadam.ghost_clipping import standardized

# Layer class -> rule; a subclass gets its nearest registered base's rule.
GHOST_RULES = {
    keras.layers.Dense: dense.DenseRule,
    keras.layers.EinsumDense: dense.EinsumDenseRule,
    keras.layers.Embedding: embedding.EmbeddingRule,
    keras.layers.LayerNormalization: normalization.LayerNormalizationRule,
    keras.layers.GroupNormalization: normalization.GroupNormalizationRule,
    keras.layers.Conv1D: convolution.ConvolutionRule,
    keras.layers.Conv2D: convolution.ConvolutionRule,
    layers.WSConv2D: standardized.StandardizedConvolutionRule,
}
# Where this Keras has it (3.15 does); keras-hub's ReversibleEmbedding is a
# subclass.
if hasattr(keras.layers, "ReversibleEmbedding"):
    GHOST_RULES[keras.layers.ReversibleEmbedding] = (
        embedding.ReversibleEmbeddingRule)

# The same for a layer with LoRA enabled (`enable_lora` or `lora_rank=`).
LORA_RULES = {
    keras.layers.Dense: lora.LoraDenseRule,
    keras.layers.EinsumDense: lora.LoraEinsumDenseRule,
}

# Never looked into: with trainable weights, they are fallback units.
OPAQUE_LAYERS = (keras.layers.RNN, keras.layers.Wrapper)

# Layers that mix the examples of a batch while training (when trainable):
# one example's gradient then depends on the others, so per-example
# clipping does not bound one example's influence. Refused everywhere.
EXAMPLE_MIXING_LAYERS = (keras.layers.BatchNormalization,)


def _lora(layer):
    return getattr(layer, "lora_enabled", False)


def _table(layer):
    """`LORA_RULES` for a layer with LoRA enabled, else `GHOST_RULES` and
    the keras-hub rules (once keras_hub is imported)."""
    if _lora(layer):
        return LORA_RULES
    return {**GHOST_RULES, **keras_hub.ghost_rules()}


def registered_class(layer):
    """The nearest class of `layer` (its own or a base) in its table."""
    table = _table(layer)
    for cls in type(layer).__mro__:
        if cls in table:
            return cls
    return None


def ghost_rule(layer):
    """`(rule class, None)` for `layer`, or `(None, why there is none)`."""
    if "call" in layer.__dict__:
        return None, "call is replaced on the instance"
    if getattr(layer, "quantization_mode", None) is not None:
        return None, "the layer is quantized"
    base = registered_class(layer)
    if base is None:
        with_lora = " with LoRA" if _lora(layer) else ""
        return None, f"no ghost rule for {type(layer).__name__}{with_lora}"
    rule = _table(layer)[base]
    for name in rule.overridable:
        if getattr(type(layer), name) is not getattr(base, name):
            return None, f"{name} is overridden"
    reason = rule.refusal(layer)
    if reason is not None:
        return None, reason
    return rule, None


def mixes_examples(layer):
    """Whether `layer` mixes the examples of a batch in training."""
    return isinstance(layer, EXAMPLE_MIXING_LAYERS) and layer.trainable


def refusals(layer):
    """The reasons ghost clipping cannot handle `layer` at all (maybe [])."""
    reasons = []
    if getattr(layer, "activity_regularizer", None) is not None:
        reasons.append("activity regularizer")
    if mixes_examples(layer):
        reasons.append("mixes examples in training")
    if keras_internals.rematerialized(layer):
        reasons.append("rematerialization")
    return reasons


def _qualified(cls):
    """A Keras layer's class name; this package's with its module."""
    if cls.__module__.startswith("tf_dpadam"):
        return f"{cls.__module__}.{cls.__name__}"
    return cls.__name__


def markdown_table():
    """The README's table of ghost rules, generated from `GHOST_RULES`,
    `keras_hub.RULES` and `LORA_RULES`."""
    rows = ["| layer | ghost rule | module |", "|---|---|---|"]
    for table, prefix, note in (
        ({_qualified(c): r for c, r in GHOST_RULES.items()}, "", ""),
        (keras_hub.RULES, "keras_hub.layers.", ""),
        ({c.__name__: r for c, r in LORA_RULES.items()}, "", " with LoRA"),
    ):
        for name, rule in table.items():
            module = rule.__module__.rsplit(".", 1)[-1]
            rows.append(f"| `{prefix}{name}`{note} | `{rule.__name__}` |"
                        f" `{module}.py` |")
    return "\n".join(rows)
