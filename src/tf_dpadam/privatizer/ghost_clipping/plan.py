"""Planning: which rule owns which trainable variable of a model.

Walks the layer tree from the model: a layer with a ghost rule
(`registry.ghost_rule`) that knows all its trainable weights gets that rule;
a layer without trainable weights of its own is looked into; any other layer
with trainable weights becomes a fallback unit for its whole subtree.
Problems that make the model unsupported (`registry.refusals`, shared
variables, a root model with weights of its own) are collected, not raised.
"""

from tf_dpadam.common import compat
from tf_dpadam.privatizer.ghost_clipping import fallback
from tf_dpadam.privatizer.ghost_clipping import registry


class Plan:
    """The rules of a model.

    Attributes:
        rules: the rule objects, in the order the layers were visited.
        owner: `{id(variable): rule}` for every trainable variable.
        problems: `[(layer or variable name, reason)]`; non-empty means the
            model cannot use ghost clipping.
        fallback_reasons: `{layer name: why it has no ghost rule}`.
    """

    def __init__(self, model):
        self.rules = []
        self.problems = []
        self.fallback_reasons = {}
        self.owner = {}
        self._trainable = {id(v) for v in model.trainable_variables}
        self._visited = set()
        for layer in compat.all_layers(model):
            for reason in registry.refusals(layer):
                self.problems.append((layer.name, reason))
        self._visit(model, is_root=True)
        for v in model.trainable_variables:
            if id(v) not in self.owner:
                self.problems.append(
                    (v.path, "trainable variable not owned by a supported layer")
                )

    def _claim(self, rule, variables):
        for v in variables:
            if id(v) in self.owner and self.owner[id(v)] is not rule:
                self.problems.append(
                    (rule.layer.name,
                     f"variable {v.path!r} is shared with layer"
                     f" {self.owner[id(v)].layer.name!r}")
                )
            self.owner[id(v)] = rule

    def _visit(self, layer, is_root):
        if id(layer) in self._visited:
            return
        self._visited.add(id(layer))
        variables = [v for v in layer.variables if id(v) in self._trainable]
        if not variables:
            return
        own = [v for v in compat.own_variables(layer)
               if id(v) in self._trainable]
        rule_class, reason = registry.ghost_rule(layer)
        if rule_class is not None:
            own_ids = {id(v) for v in own}
            known = {id(getattr(layer, n, None))
                     for n in rule_class.weight_names}
            if any(id(v) not in own_ids for v in variables):
                reason = "sublayers with trainable weights"
            elif any(id(v) not in known for v in own):
                # E.g. a subclass with weights of its own, or a kernel
                # computed from other weights: the fallback is exact.
                reason = "weights that its ghost rule does not know"
            else:
                self._add(rule_class(layer, own), own)
                return
        if not own and not isinstance(layer, registry.OPAQUE_LAYERS):
            for sublayer in compat.direct_sublayers(layer):
                self._visit(sublayer, False)
            return
        if is_root:
            self.problems.append(
                (layer.name, "the model itself owns trainable weights")
            )
            return
        self.fallback_reasons[layer.name] = reason
        self._add(fallback.FallbackRule(layer, variables), variables)

    def _add(self, rule, variables):
        self.rules.append(rule)
        self._claim(rule, variables)


def unsupported_layers(model):
    """`[(name, reason), ...]` that prevent ghost clipping (empty if none)."""
    return list(Plan(model).problems)


def supports(model):
    """Whether ghost clipping can handle `model` (static check).

    A few problems only show while tracing (a layer called inside control
    flow, `add_loss` in `call`, a variable used outside its layer); then
    `clipped_gradient_sum` raises `GhostClippingUnsupportedError`.
    """
    return not unsupported_layers(model)


def describe(model):
    """`{layer name: "ghost (<rule>)" | "fallback: <reason>"}` for the layers
    that own trainable weights: the rule that will run for each."""
    plan = Plan(model)
    out = {}
    for rule in plan.rules:
        name = rule.layer.name
        if rule.kind == "ghost":
            out[name] = f"ghost ({rule.name})"
        else:
            out[name] = f"fallback: {plan.fallback_reasons.get(name)}"
    return out
