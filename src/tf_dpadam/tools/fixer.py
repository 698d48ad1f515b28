"""`validate(model)` and `fix(model)`: what `make_private` would refuse, and
a model it accepts (as Opacus' `ModuleValidator`).

`validate` runs, without training, the checks of `make_private` and of the
first private step, with the predicates they use (`ghost_clipping.registry`,
`ghost_clipping.unsupported_layers`, the `independence` guard's model
check). `fix` returns a new Sequential or functional model in which every
trainable BatchNormalization is replaced by a GroupNormalization ("group")
or frozen with its statistics ("freeze"); all other layers are clones
holding copies of the original weights.
"""

import dataclasses
from typing import Any, List, Optional

import keras
import tensorflow as tf

from tf_dpadam.common import compat
from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.training import private_model
from tf_dpadam.common import validation
from tf_dpadam.privatizer.ghost_clipping import registry
from tf_dpadam.training.independence import composite_types
from tf_dpadam.training.independence import model_check
from tf_dpadam.training.independence import rows

# `fix`'s `batch_norm`: how a trainable BatchNormalization is repaired.
BATCH_NORM_FIXES = ("group", "freeze")

# The most groups `fix(batch_norm="group")` gives a GroupNormalization by
# default (the usual 32 of Wu & He 2018, "Group Normalization").
MAX_GROUPS = 32

SEVERITIES = ("error", "warning")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One reason why `make_private` would refuse (or warn about) a model.

    Attributes:
        layer: the name of the layer (or of the model) concerned.
        reason: what is wrong, and why it matters for privacy.
        fix: how to repair it (maybe by `tf_dpadam.fix`), or None.
        severity: "error": `make_private` or the first private step raises;
            "warning": `make_private` warns and trains.
    """

    layer: str
    reason: str
    fix: Optional[str] = None
    severity: str = "error"

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"Expected severity={self.severity!r} to be one"
                             f" of {SEVERITIES}.")

    def __str__(self) -> str:
        text = f"{self.severity}: {self.layer!r}: {self.reason}"
        if self.fix:
            text += f" Fix: {self.fix}"
        return text


# --------------------------------------------------------------------------
# validate


def _mixing_problems(model):
    return [
        Problem(
            layer.name,
            f"{type(layer).__name__} mixes the examples of a batch in"
            " training (batch statistics): per-example clipping would not"
            " bound one example's influence, and make_private raises.",
            "tf_dpadam.fix(model, batch_norm='group') replaces it by"
            " GroupNormalization, batch_norm='freeze' freezes it with its"
            " statistics (for fine-tuning a pretrained model).")
        for layer in compat.all_layers(model)
        if registry.mixes_examples(layer)
    ]


def _ghost_problems(model, skipped):
    return [
        Problem(name, f"clipping='ghost' is refused: {reason}.",
                "clipping='auto' takes the vectorized path for this model.")
        for name, reason in ghost_clipping.unsupported_layers(model)
        if name not in skipped
    ]


def _xla_problems(model, clipping):
    """Recurrent loops that the step would run inside a vectorized map."""
    vectorized = clipping == "vectorized" or (
        clipping == "auto" and not ghost_clipping.supports(model))
    return [
        Problem(
            layer.name,
            f"{type(layer).__name__} runs its loop (a tf.while_loop) inside"
            " a vectorized map of per-example gradients, which XLA does not"
            " compile (the first step under jit_compile=True raises).",
            "unroll=True (short sequences), or jit_compile=False.")
        for layer in compat.all_layers(model)
        if isinstance(layer, keras.layers.RNN) and not layer.unroll
        and (vectorized or layer.trainable_weights)
    ]


def _warnings(model):
    found = [
        Problem(
            layer.name,
            f"{type(layer).__name__} takes its state from adapt(data), not"
            " from the private steps: the model is only private if it was"
            " adapted on public data (make_private warns).",
            "adapt it on public data, or give its vocabulary / mean and"
            " variance / bin boundaries in the constructor.", "warning")
        for layer in registry.data_adapted_layers(model)
    ]
    built = all(layer.built for layer in compat.all_layers(model))
    if built and not model.trainable_variables:
        found.append(Problem(
            model.name, "the model has no trainable weights: the private"
            " step trains nothing (it warns).", None, "warning"))
    return found


def _independence_problems(model, x, mixing_layers):
    """The model part of the first step's independence check on `x`, with
    the layers already reported as mixing frozen meanwhile (restored)."""
    x = tf.nest.map_structure(
        lambda t: t if t is None or isinstance(t, composite_types)
        else tf.convert_to_tensor(t), x)
    checked = [i for i in range(rows.num_rows(x))
               if rows.has_distinct_row(x, i)][:2]
    if not checked:
        raise ValueError(
            "Expected x to hold at least two distinct examples (the"
            " independence check replaces the others by copies of one).")
    flags = [(layer, layer.trainable,
              [(v, v.trainable) for v in layer.variables])
             for layer in mixing_layers]
    try:
        for layer in mixing_layers:
            layer.trainable = False
        model_check.check_outputs(model, x, checked)
    except ValueError as error:
        # Keras' (an x that does not fit) has colour codes, several lines.
        return [Problem(model.name, validation.plain_text(error), None)]
    finally:
        for layer, trainable, variables in flags:
            layer.trainable = trainable
            for v, flag in variables:
                v.trainable = flag
    return []


def validate(model: keras.Model, *, clipping: str = "auto",
             jit_compile: bool = False, x: Any = None) -> List[Problem]:
    """Every problem that `make_private(model, clipping=clipping)` and its
    first step (compiled with `jit_compile`) would raise on, without
    training (the same predicates), errors first, then warnings:

    * a trainable layer that mixes the examples of a batch
      (BatchNormalization): `make_private` raises, whatever the clipping
      (`tf_dpadam.fix` repairs it);
    * with `clipping="ghost"`, what ghost clipping refuses statically (e.g.
      an activity regularizer): the first step raises ("auto" takes the
      vectorized path instead);
    * with `jit_compile=True`, a recurrent layer whose loop (`unroll=False`)
      would run inside a vectorized map of per-example gradients (a
      trainable RNN, or any RNN on the vectorized path): XLA does not
      compile it and the first step raises;
    * given a batch `x`, the outputs part of the independence check that
      training runs (`tf_dpadam.training.independence`): an example's training-mode
      outputs must not change when every other example is replaced by a
      copy of it; this finds custom layers that mix examples, which no list
      of classes can;
    * warnings (`severity="warning"`), as `make_private` and the step give
      them: layers whose state comes from `adapt` (not private unless
      adapted on public data), and a model without trainable weights.

    Not checked (they need the loss and labels; the first step checks
    them): that the loss is a per-example loss, and that it has a gradient
    path to the weights.

    Args:
        model: a Keras model (Sequential, functional or subclassed; a layer
            that is not built yet is checked as far as its configuration
            goes).
        clipping: "auto", "ghost" or "vectorized", as `make_private`'s.
        jit_compile: whether the private model will be compiled with XLA.
        x: None, or a batch of inputs (at least two distinct examples) on
            which to run the outputs part of the independence check that
            training runs: this finds custom layers that mix examples. Random layers are replayed and every state restored.

    Returns:
        A list of `Problem`s, empty if `make_private` accepts the model.

    Raises:
        ValueError: for an invalid argument (named).
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected model to be a keras.Model, got {model!r}.")
    if clipping not in private_model.CLIPPING_METHODS:
        raise ValueError(f"Expected clipping={clipping!r} to be one of"
                         f" {private_model.CLIPPING_METHODS}.")
    if not isinstance(jit_compile, bool):
        raise ValueError(
            f"Expected jit_compile={jit_compile!r} to be True or False.")
    if isinstance(model, private_model.PrivateModel):
        return [Problem(model.name, "the model is private already.",
                        "pass its base_model.")]
    problems = _mixing_problems(model)
    mixing = {p.layer for p in problems}
    if clipping == "ghost":
        problems += _ghost_problems(model, mixing)
    if jit_compile:
        problems += _xla_problems(model, clipping)
    if x is not None:
        mixing_layers = [layer for layer in compat.all_layers(model)
                         if layer.name in mixing]
        problems += _independence_problems(model, x, mixing_layers)
    return problems + _warnings(model)


# --------------------------------------------------------------------------
# fix


def default_groups(channels: int) -> int:
    """The largest divisor of `channels` that is at most `MAX_GROUPS`."""
    return max(g for g in range(1, min(channels, MAX_GROUPS) + 1)
               if channels % g == 0)


def _channels(layer):
    if not layer.built:
        raise ValueError(
            f"Cannot replace BatchNormalization {layer.name!r}: it is not"
            " built, so its channels are unknown (build the model first,"
            " e.g. with keras.Input).")
    return int(layer.moving_mean.shape[0])


def _group_norm(layer, groups):
    channels = _channels(layer)
    count = default_groups(channels) if groups is None else groups
    if channels % count:
        raise ValueError(
            f"Expected groups={groups!r} to divide the {channels} channels"
            f" of BatchNormalization {layer.name!r}.")
    return keras.layers.GroupNormalization(
        groups=count, axis=layer.axis, epsilon=layer.epsilon,
        center=layer.center, scale=layer.scale,
        beta_initializer=layer.beta_initializer,
        gamma_initializer=layer.gamma_initializer,
        beta_regularizer=layer.beta_regularizer,
        gamma_regularizer=layer.gamma_regularizer,
        beta_constraint=layer.beta_constraint,
        gamma_constraint=layer.gamma_constraint,
        name=layer.name, dtype=layer.dtype_policy)


def _copy_group_norm_weights(batch_norm, group_norm):
    for name in ("gamma", "beta"):
        source = getattr(batch_norm, name, None)
        if source is not None:
            getattr(group_norm, name).assign(source)


def _copy_state(old, new):
    """Copies every variable of `old`'s layer tree into `new`'s (a clone
    of the same configuration), with each variable's trainable flag."""
    old_layers, new_layers = compat.all_layers(old), compat.all_layers(new)
    if len(old_layers) != len(new_layers):
        raise ValueError(
            f"Cannot copy the weights of layer {old.name!r}: its clone has"
            " other sublayers.")
    for a, b in zip(old_layers, new_layers):
        sources, targets = compat.own_variables(a), compat.own_variables(b)
        if [tuple(v.shape) for v in sources] != [tuple(v.shape)
                                                 for v in targets]:
            raise ValueError(
                f"Cannot copy the weights of layer {a.name!r}: its clone's"
                " weights have other shapes.")
        for source, target in zip(sources, targets):
            target.assign(source)
            if b.trainable:  # A frozen layer's variables stay frozen.
                target.trainable = source.trainable
        if b.built and callable(getattr(b, "finalize_state", None)):
            b.finalize_state()  # e.g. Normalization's mean from its weights


def fix(model: keras.Model, *, batch_norm: str = "group",
        groups: Optional[int] = None) -> keras.Model:
    """A copy of `model` that `make_private` accepts (`validate` is empty).

    Every trainable BatchNormalization (the layers that `validate` reports
    as mixing examples) is repaired:

    * `batch_norm="group"`: replaced by a GroupNormalization over the same
      axis, with the same epsilon, center, scale, initializers,
      regularizers and constraints, and BatchNormalization's gamma and beta.
      For each example x it computes, over each group of C / G channels (and
      all other non-batch axes), `gamma * (x - mean) / sqrt(var + epsilon)
      + beta`: statistics of the example alone, where BatchNormalization
      used the batch's. The moving statistics are dropped, so the model
      computes another function: train (or fine-tune) it.
    * `batch_norm="freeze"`: cloned with its moving statistics, gamma and
      beta, and `trainable=False`: Keras 3 then runs it in inference mode,
      `gamma * (x - moving_mean) / sqrt(moving_variance + epsilon) +
      beta`, in training too, and the private step does not update it. The
      model computes the same function as `model` in inference; the usual
      choice for DP fine-tuning of a pretrained backbone.

    Every other layer is a clone (`keras.models.clone_model`, nested
    Sequential and functional models included) holding a copy of its
    weights and their trainable flags; `model` itself is not changed.

    Args:
        model: a Sequential or functional model (a subclassed model cannot
            be rebuilt layer by layer: replace its layers in its code).
        batch_norm: "group" (default) or "freeze".
        groups: for "group" only: the number of groups G of every
            GroupNormalization, which must divide each layer's channels.
            None (default): per layer, the largest divisor of its channels
            C that is at most `MAX_GROUPS` (32), e.g. 32 for C = 64 and 24
            for C = 144.

    Returns:
        The new model (built as `model` is).

    Raises:
        ValueError: for an invalid argument (named), or if the copy still
            has problems that `validate` reports as errors and that `fix`
            cannot repair (listed).
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected model to be a keras.Model, got {model!r}.")
    if batch_norm not in BATCH_NORM_FIXES:
        raise ValueError(f"Expected batch_norm={batch_norm!r} to be one of"
                         f" {BATCH_NORM_FIXES}.")
    if groups is not None and (batch_norm != "group"
                               or not isinstance(groups, int)
                               or isinstance(groups, bool) or groups < 1):
        raise ValueError(
            f"Expected groups={groups!r} to be None, or a positive int with"
            " batch_norm='group'.")
    if not compat.rebuildable(model):
        raise ValueError(
            f"Expected model {model.name!r} to be a Sequential or functional"
            f" model; a {type(model).__name__} (subclassed) cannot be rebuilt"
            " layer by layer: replace its BatchNormalization layers in its"
            " code (GroupNormalization, or trainable=False).")
    kept = []

    def clone(layer):
        if registry.mixes_examples(layer) and batch_norm == "group":
            new = _group_norm(layer, groups)
            replaced.add(id(new))
            return new, lambda n=new: _copy_group_norm_weights(layer, n)
        config = layer.get_config()
        if registry.mixes_examples(layer):
            config["trainable"] = False
        new = type(layer).from_config(config)
        return new, lambda n=new: _copy_state(layer, n)

    def clone_function(layer):
        new, copy = clone(layer)
        kept.append(copy)
        return new

    replaced = set()

    def call_function(layer, *args, **kwargs):
        # BatchNormalization takes the mask that Keras passes on;
        # GroupNormalization's call has no such argument.
        if id(layer) in replaced:
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    fixed = keras.models.clone_model(
        model, clone_function=clone_function, recursive=True,
        call_function=(None if isinstance(model, keras.Sequential)
                       else call_function))
    for copy in kept:
        copy()
    remaining = [p for p in validate(fixed) if p.severity == "error"]
    if remaining:
        raise ValueError(
            f"fix(model, batch_norm={batch_norm!r}) cannot repair: "
            + "; ".join(str(p) for p in remaining))
    return fixed
