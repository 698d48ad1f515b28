"""The rule interface: what a per-layer rule does, and its shared helpers.

A rule owns some trainable variables of one layer. While the step's batched
forward pass runs, it intercepts the layer's `call` and records what the
per-example gradients need (the layer's input, and "taps": tensors whose
gradients the backward pass will provide, usually the layer's output before
its activation). After the backward pass it turns each record and its tap
gradients into blocks (`blocks.py`): per-example squared norms and weighted
sums. A rule knows nothing of clipping; the step knows nothing of layers.

A new layer family is one module with a `Rule` subclass, one line in
`registry.py` and one test (see docs/guides/layers_and_clipping.md, "Adding a layer").
"""

import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import preclip


class Rule:
    """A per-layer rule; subclasses set the class attributes and override
    `intercept` and `blocks`.

    Attributes:
        name: shown by `describe` ("ghost (<name>)").
        kind: "ghost" (norms from recorded tensors) or "fallback".
        weight_names: the layer attributes holding the weights it knows.
        overridable: methods a subclass of the layer must not override
            (the rule reimplements them).
        shifted_pass: whether its blocks come from the records and tap
            gradients alone (they read no weight after the forward pass),
            so that a second pass at other weights can add records that
            stand for the gradients there (DiSK's two points, see the step).
            Opt-in: a rule that reads a weight in `blocks` (a replay, a
            kernel's standardization, LoRA's other factor) would compute
            those records' gradients at the wrong weights unless it reads
            it at the record's `offsets` (the fallback, LoRA and WSConv2D
            rules do).
    """

    name = None
    kind = "ghost"
    weight_names = ()
    overridable = ("call",)
    shifted_pass = False

    @classmethod
    def refusal(cls, layer):
        """Why this rule cannot handle `layer` (a string), or None."""
        del layer
        return None

    def __init__(self, layer, variables):
        self.layer = layer
        self.variables = variables
        self.records = []
        self._saved_call = None

    def reset(self):
        self.records = []

    def install(self, recording):
        """Intercepts `layer.call` while `recording` records."""
        layer = self.layer
        original = type(layer).call.__get__(layer)
        saved = layer.__dict__.get("call")
        if saved is not None:
            original = saved
        self._saved_call = saved

        def call(*args, **kwargs):
            if (compat.any_symbolic_tensors(args, kwargs)
                    or not recording.active):
                return original(*args, **kwargs)
            if not recording.same_graph():
                recording.error(
                    f"layer {layer.name!r} is called inside control flow"
                    " (tf.while_loop, tf.cond, tf.map_fn, ...)"
                )
                return original(*args, **kwargs)
            return self.intercept(recording, original, *args, **kwargs)

        object.__setattr__(layer, "call", call)

    def uninstall(self):
        layer = self.layer
        if self._saved_call is not None:
            object.__setattr__(layer, "call", self._saved_call)
        else:
            object.__delattr__(layer, "call")

    def taps(self):
        """The tensors whose gradients `blocks` needs, one list per record."""
        return [record["taps"] for record in self.records]

    def intercept(self, recording, original, *args, **kwargs):
        """Computes the layer's output in place of `original` and records."""
        raise NotImplementedError

    def blocks(self, recording, tap_grads):
        """`{id(variable): [block, ...]}` from the records and tap gradients."""
        raise NotImplementedError

    def variable(self, name):
        """The layer's weight `name` if this rule owns it (trainable), or None."""
        v = getattr(self.layer, name, None)
        if v is None or id(v) not in {id(w) for w in self.variables}:
            return None
        return v

    def value_at(self, name, offsets):
        """The layer's weight `name` (stopped) where a record's pass read it:
        shifted by `offsets` (DiSK's second pass) if the rule owns it and
        they are set."""
        variable = self.variable(name)
        if offsets is None or variable is None:
            return stopped(getattr(self.layer, name))
        return preclip.shifted_value(variable, offsets[id(variable)])


def first_input(args, kwargs):
    """The first positional argument of a layer call (or `inputs=`)."""
    if args:
        return args[0]
    return kwargs["inputs"]


def stopped(variable):
    """The variable's value with its gradient stopped.

    Rules compute with stopped weights, so that any other differentiable use
    of a weight shows up as a gradient (the step refuses it).
    """
    return tf.stop_gradient(ops.convert_to_tensor(variable.value))


def watch_float(tape, structure):
    """Watches the float tensors of `structure`; None for the other leaves."""
    taps = []
    for t in tf.nest.flatten(structure):
        if tf.is_tensor(t) and t.dtype.is_floating:
            tape.watch(t)
            taps.append(t)
        else:
            taps.append(None)
    return taps
