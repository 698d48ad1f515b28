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
* **warned** (`DATA_ADAPTED_LAYERS`): preprocessing layers whose state
  comes from `adapt`, outside the private steps; `make_private` warns once.

Adding a layer: a rule module, one line in `GHOST_RULES` (a keras-hub layer:
in `keras_hub.RULES`, by name, registered once keras_hub is imported), one
test; the table of docs/guides/layers_and_clipping.md (`markdown_table`) is
checked against this module by tests/privatizer/ghost_clipping_registry_test.py.

A user's own layer: `register_ghost_rule(layer_class, rule)`
(`tf_dpadam.register_ghost_rule`) adds a rule at run time, looked up with
the built-in ones (the nearest registered class of a layer wins); the
latest registration of a class wins, over a built-in rule too, and
`unregister_ghost_rule` takes it back.
"""

import warnings

import keras

from tf_dpadam.common import compat
from tf_dpadam import layers
from tf_dpadam.privatizer.ghost_clipping import convolution
from tf_dpadam.privatizer.ghost_clipping import dense
from tf_dpadam.privatizer.ghost_clipping import embedding
from tf_dpadam.privatizer.ghost_clipping import keras_hub
from tf_dpadam.privatizer.ghost_clipping import lora
from tf_dpadam.privatizer.ghost_clipping import normalization
from tf_dpadam.privatizer.ghost_clipping import rule as rule_lib
from tf_dpadam.privatizer.ghost_clipping import standardized

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

# Layer class -> rule, registered at run time (`register_ghost_rule`):
# looked up with `GHOST_RULES` and the keras-hub rules, and over them.
USER_RULES = {}

# Never looked into: with trainable weights, they are fallback units.
OPAQUE_LAYERS = (keras.layers.RNN, keras.layers.Wrapper)

# Layers that mix the examples of a batch while training (when trainable):
# one example's gradient then depends on the others, so per-example
# clipping does not bound one example's influence. Refused everywhere.
EXAMPLE_MIXING_LAYERS = (keras.layers.BatchNormalization,)

# Layers whose state comes from `adapt(data)`, not from the private steps:
# the model is only private if they were adapted on public data. Class ->
# whether an instance was given its state explicitly in the constructor
# (then it needs no `adapt` and gets no warning). Keras 3.15 records no
# "adapted" flag, so the test is the constructor's: a layer built to be
# adapted (no vocabulary / mean / bin_boundaries) is warned about whether
# `adapt` ran before `make_private` or runs after it; the same holds for a
# loaded model (these constructor arguments are in the saved config, the
# adapted state is not). Any other layer with an `adapt` method (e.g.
# keras.utils.FeatureSpace) always counts as data-adapted.
DATA_ADAPTED_LAYERS = {
    keras.layers.Normalization: lambda layer: layer.input_mean is not None,
    keras.layers.Discretization: lambda layer: layer.num_bins is None,
    keras.layers.StringLookup: (
        lambda layer: layer.input_vocabulary is not None),
    keras.layers.IntegerLookup: (
        lambda layer: layer.input_vocabulary is not None),
    keras.layers.TextVectorization: (
        lambda layer: layer.get_config()["vocabulary"] is not None),
}

ADAPTED_LAYERS_WARNING = (
    "The layers {names} take their state (vocabulary, mean and variance, bins)"
    " from `adapt(data)`, not from the private training steps: no noise"
    " protects it and no epsilon accounts for it. The model is only"
    " differentially private if they were adapted on public data, or given"
    " their vocabulary / mean and variance / bin_boundaries explicitly from"
    " public knowledge (then this warning does not appear)."
)


def takes_state_from_adapt(layer):
    """Whether `layer`'s state comes (or will come) from `adapt`."""
    for cls in type(layer).__mro__:
        if cls in DATA_ADAPTED_LAYERS:
            return not DATA_ADAPTED_LAYERS[cls](layer)
    return callable(getattr(layer, "adapt", None))


def data_adapted_layers(model):
    """The layers of `model` whose state comes from `adapt` (outermost only:
    the StringLookup inside a TextVectorization is not listed again)."""
    found, inside = [], set()
    for layer in compat.all_layers(model):
        if id(layer) in inside or not takes_state_from_adapt(layer):
            continue
        found.append(layer)
        inside.update(id(sub) for sub in compat.all_layers(layer))
    return found


def warn_data_adapted_layers(model, stacklevel=2):
    """One `UserWarning` naming every data-adapted layer of `model`, if any.

    Returns:
        The layers named (maybe []).
    """
    found = data_adapted_layers(model)
    if found:
        names = ", ".join(f"{layer.name!r} ({type(layer).__name__})"
                          for layer in found)
        warnings.warn(ADAPTED_LAYERS_WARNING.format(names=names),
                      stacklevel=stacklevel + 1)
    return found


def _lora(layer):
    return getattr(layer, "lora_enabled", False)


def _table(layer):
    """`LORA_RULES` for a layer with LoRA enabled, else `GHOST_RULES`, the
    keras-hub rules (once keras_hub is imported) and `USER_RULES`."""
    if _lora(layer):
        return LORA_RULES
    return {**GHOST_RULES, **keras_hub.ghost_rules(), **USER_RULES}


def register_ghost_rule(layer_class: type, rule: type) -> None:
    """Registers a ghost clipping rule for a layer class of your own.

    Ghost clipping gets each example's gradient norm of a layer's weights
    from the layer's recorded input and output gradient, one rule per
    layer type. A layer with trainable weights and no rule takes the
    fallback (exact per-example gradients by a vectorized map over that
    layer alone), which costs more, and which a layer that draws random
    numbers in training (its own dropout) cannot take: `clipping="ghost"`
    then raises and `clipping="auto"` takes the vectorized path for the
    whole model. A registered rule makes the layer ghost: `make_private`
    steps traced after the registration use it, for `layer_class` and its
    subclasses that neither override `call` (or the rule's `overridable`
    methods) nor add trainable weights outside the rule's `weight_names`.
    A layer with LoRA enabled keeps the LoRA rules.

    The rule is trusted: privacy rests on its norms being the per-example
    gradients' norms. Test it against one-example gradient tapes
    (docs/guides/layers_and_clipping.md, "Your own layer: a ghost rule").

    Registering a class again replaces its rule: the latest registration
    wins, over a built-in rule too (`keras.layers.Dense`, ...).
    `unregister_ghost_rule` takes a registration back.

    Args:
        layer_class: a subclass of `keras.layers.Layer` (not `Layer`
            itself).
        rule: a subclass of
            `tf_dpadam.privatizer.ghost_clipping.rule.Rule` (the class, not
            an instance) of kind "ghost" that overrides `intercept` and
            `blocks` and names the layer's weights in `weight_names`.

    Raises:
        ValueError: if `layer_class` or `rule` is not such a class (the
            message names the argument).
    """
    if not (isinstance(layer_class, type)
            and issubclass(layer_class, keras.layers.Layer)):
        raise ValueError(
            "register_ghost_rule: layer_class must be a subclass of"
            f" keras.layers.Layer, got {layer_class!r}")
    if layer_class is keras.layers.Layer:
        raise ValueError(
            "register_ghost_rule: layer_class must be a subclass of"
            " keras.layers.Layer, not keras.layers.Layer itself (its rule"
            " would be every layer's)")
    _check_rule(rule)
    USER_RULES[layer_class] = rule


def unregister_ghost_rule(layer_class: type) -> None:
    """Takes back `register_ghost_rule(layer_class, ...)`: the class gets
    its built-in rule again, or that of its nearest registered base class,
    or none.

    Raises:
        ValueError: if no rule is registered for `layer_class` by
            `register_ghost_rule` (the built-in rules stay).
    """
    if layer_class not in USER_RULES:
        raise ValueError(
            "unregister_ghost_rule: layer_class"
            f" {getattr(layer_class, '__name__', layer_class)!r} has no rule"
            " registered by register_ghost_rule")
    del USER_RULES[layer_class]


def _check_rule(rule):
    """Raises a ValueError naming `rule` unless it is a ghost rule class."""
    def refuse(what):
        raise ValueError(f"register_ghost_rule: rule must be {what}, got"
                         f" {rule!r}")

    if isinstance(rule, rule_lib.Rule):
        refuse("a rule class, not an instance")
    if not (isinstance(rule, type) and issubclass(rule, rule_lib.Rule)):
        refuse("a subclass of tf_dpadam.privatizer.ghost_clipping.rule.Rule")
    if rule.kind != "ghost":
        refuse(f'of kind "ghost" (its kind is {rule.kind!r})')
    for method in ("intercept", "blocks"):
        if getattr(rule, method) is getattr(rule_lib.Rule, method):
            refuse(f"a Rule that overrides {method}")
    names = rule.weight_names
    if (isinstance(names, str) or not names
            or not all(isinstance(n, str) for n in names)):
        refuse("a Rule whose weight_names is a non-empty tuple of the"
               " layer's weight attributes")


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
    if compat.rematerialized(layer):
        reasons.append("rematerialization")
    return reasons


def _qualified(cls):
    """A Keras layer's class name; this package's with its module."""
    if cls.__module__.startswith("tf_dpadam"):
        return f"{cls.__module__}.{cls.__name__}"
    return cls.__name__


def markdown_table():
    """The docs' table of ghost rules, generated from `GHOST_RULES`,
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
