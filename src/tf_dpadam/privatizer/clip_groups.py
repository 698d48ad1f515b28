"""Per-layer (group-wise) clipping: which clip norm each weight is under.

With flat clipping every example's whole gradient is clipped to global L2
norm C. With groups, the trainable variables are split into G groups and
each example's gradient is clipped group by group, group l to norm C_l:

    clip(g_i)_l = g_i,l * min(1, C_l / ||g_i,l||).

One example then moves the clipped sum by at most sqrt(sum_l C_l^2), the
sensitivity that the noise (std sigma * sqrt(sum_l C_l^2)) and Phi use
(`total_clip_norm`). The groups' norms come from the same per-variable
blocks (ghost clipping) or per-example gradients (vectorized) as the
global norm.

`l2_norm_clip` of a DP optimizer chooses the grouping:

* a number, `per_layer_clipping=False`: one group (flat clipping);
* a number C, `per_layer_clipping=True`: one group per layer that owns
  trainable weights (the variable's path without its last component), each
  with C / sqrt(G), so that the total stays C (the equal split; adaptive
  clipping then moves each group to its own quantile);
* a mapping `{key: C_l}`: one group per key. A key is a layer's name or
  path ("dense_1", "encoder/block_0"), matched against the leading
  components of a variable's path (with or without the model's name in
  front); a variable belongs to the key whose match ends deepest in its
  path (the most specific one).

Functions here are pure Python on variable paths.
"""

import math
from typing import Mapping, Sequence

from tf_dpadam.common import validation

FLAT_GROUP = "all"


def check_spec(l2_norm_clip, per_layer_clipping) -> None:
    """Checks `l2_norm_clip` (a number or a mapping) and `per_layer_clipping`.

    Raises:
        ValueError: naming the argument.
    """
    validation.check(isinstance(per_layer_clipping, bool),
                     "per_layer_clipping", per_layer_clipping,
                     "to be True or False")
    if isinstance(l2_norm_clip, Mapping):
        validation.check(len(l2_norm_clip) > 0, "l2_norm_clip", l2_norm_clip,
                         "to be a number or a non-empty mapping")
        for key, value in l2_norm_clip.items():
            validation.check(isinstance(key, str) and key.strip("/"),
                             "l2_norm_clip", l2_norm_clip,
                             "to have layer names or paths as keys")
            validation.check_positive(f"l2_norm_clip[{key!r}]", value)
    else:
        validation.check_positive("l2_norm_clip", l2_norm_clip)


def total_clip_norm(clip_norms: Sequence[float]) -> float:
    """sqrt(sum_l C_l^2): one example's bound on the clipped sum."""
    return math.sqrt(sum(float(c) ** 2 for c in clip_norms))


def is_grouped(l2_norm_clip, per_layer_clipping: bool) -> bool:
    """Whether this spec clips by groups (else flat, one global norm)."""
    return per_layer_clipping or isinstance(l2_norm_clip, Mapping)


def _components(path: str) -> list:
    return [part for part in path.split("/") if part]


def _matches(key: str, path: str) -> int:
    """How deep in `path` the key's match ends (in components), else 0."""
    key_parts = _components(key)
    parts = _components(path)[:-1]  # the variable's own name is not a key
    for start in (1, 0):
        if parts[start:start + len(key_parts)] == key_parts:
            return start + len(key_parts)
    return 0


def assign(paths: Sequence[str], l2_norm_clip, per_layer_clipping: bool):
    """`(names, clip_norms, group_of)`: the groups of a model's variables.

    Args:
        paths: the trainable variables' paths, in order.
        l2_norm_clip: a number or a mapping (see the module docstring).
        per_layer_clipping: with a number, one group per layer.

    Returns:
        The group names, their initial clip norms (floats) and, for each
        variable, the index of its group.

    Raises:
        ValueError: if a variable matches no key, two keys equally, or a key
            matches no variable.
    """
    if not is_grouped(l2_norm_clip, per_layer_clipping):
        return [FLAT_GROUP], [float(l2_norm_clip)], [0] * len(paths)
    if not isinstance(l2_norm_clip, Mapping):
        layers = []
        for path in paths:
            layer = "/".join(_components(path)[:-1]) or path
            if layer not in layers:
                layers.append(layer)
        share = float(l2_norm_clip) / math.sqrt(len(layers))
        group_of = [layers.index("/".join(_components(p)[:-1]) or p)
                    for p in paths]
        return layers, [share] * len(layers), group_of
    names = list(l2_norm_clip)
    group_of, unmatched = [], []
    for path in paths:
        lengths = [_matches(key, path) for key in names]
        best = max(lengths)
        if best == 0:
            unmatched.append(path)
            group_of.append(-1)
            continue
        winners = [k for k, n in zip(names, lengths) if n == best]
        if len(winners) > 1:
            raise ValueError(
                f"Expected each variable to match one l2_norm_clip key;"
                f" {path!r} matches {winners} equally."
            )
        group_of.append(names.index(winners[0]))
    if unmatched:
        raise ValueError(
            f"Expected l2_norm_clip to have a key for every trainable"
            f" variable; no key matches {unmatched} (keys: {names}). Add"
            " their layers' names, or a key for a model that contains them."
        )
    unused = [k for i, k in enumerate(names) if i not in group_of]
    if unused:
        raise ValueError(
            f"Expected every l2_norm_clip key to match a trainable variable;"
            f" {unused} match none (variables: {list(paths)})."
        )
    return names, [float(l2_norm_clip[k]) for k in names], group_of
