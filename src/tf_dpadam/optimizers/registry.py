"""The DP optimizers by their command-line name (`--optimizer`).

`OPTIMIZERS` maps each name, in the order the command lines offer them, to
its class; `optimizer_class` looks one up and `register_optimizer` adds
one, so a new DP optimizer is its module plus one line here (or one
`register_optimizer` call). The names are known without importing Keras
(a binary's `--help` lists them); a built-in class loads on first use.

A name is also what a run folder records of its optimizer
(`tf_dpadam.tools.run_ledger`): `optimizer_name` gives it back from an
optimizer.
"""

import importlib
from typing import Any, Iterator, Mapping, Optional, Union

__all__ = ["OPTIMIZERS", "class_names", "optimizer_class",
           "optimizer_name", "register_optimizer"]

# Name -> class, or (module, class name) of a class loaded on first use.
_ENTRIES: dict[str, Union[type, tuple[str, str]]] = {
    "dpsgd": ("tf_dpadam.optimizers.paper", "DPSGD"),
    "dpadam": ("tf_dpadam.optimizers.paper", "DPAdam"),
    "dpadam_corrected": ("tf_dpadam.optimizers.paper", "DPAdamCorrected"),
    "dpadam_stp": ("tf_dpadam.optimizers.scale_then_privatize",
                   "DPAdamScaleThenPrivatize"),
    "dpadam_disk": ("tf_dpadam.optimizers.disk", "DPAdamDiSK"),
}


def _location(entry) -> tuple[str, str]:
    """(module, class name) of a registry entry, without importing it."""
    if isinstance(entry, tuple):
        return entry
    return entry.__module__, entry.__qualname__


def optimizer_class(name: str) -> type:
    """The DP optimizer class registered as `name`.

    Raises:
        ValueError: no optimizer has that name.
    """
    if not isinstance(name, str) or name not in _ENTRIES:
        raise ValueError(f"Expected optimizer={name!r} to be one of"
                         f" {', '.join(_ENTRIES)}.")
    entry = _ENTRIES[name]
    if isinstance(entry, tuple):
        module, class_name = entry
        entry = getattr(importlib.import_module(module), class_name)
        _ENTRIES[name] = entry
    return entry


def register_optimizer(name: str, cls: type) -> type:
    """Registers the DP optimizer class `cls` as `name` (the
    `--optimizer` of the binaries that take their names from here).

    Args:
        name: a new name (registering the same class again is allowed).
        cls: a subclass of `tf_dpadam.optimizers.base.DPOptimizerMixin`.

    Returns:
        `cls`.

    Raises:
        ValueError: `name` is taken by another class, or `cls` is no DP
            optimizer class.
    """
    # pylint: disable-next=g-import-not-at-top
    from tf_dpadam.optimizers import base  # Given a class: Keras is loaded.
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Expected name={name!r} to be an identifier.")
    if not (isinstance(cls, type) and issubclass(cls, base.DPOptimizerMixin)):
        raise ValueError(f"Expected cls={cls!r} to be a DP optimizer class"
                         " (a subclass of DPOptimizerMixin).")
    if name in _ENTRIES and _location(_ENTRIES[name]) != _location(cls):
        raise ValueError(f"Expected a new name, got name={name!r}, which"
                         f" is {_location(_ENTRIES[name])[1]}'s.")
    _ENTRIES[name] = cls
    return cls


def class_names() -> dict[str, str]:
    """Name -> class name of every registered optimizer, in order, without
    importing any class (for a `--help`)."""
    return {name: _location(entry)[1] for name, entry in _ENTRIES.items()}


def optimizer_name(optimizer: Any) -> Optional[str]:
    """The registered name of `optimizer`'s class (or of the class
    `optimizer`), None if it has none."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for name, entry in _ENTRIES.items():
        if _location(entry) == (cls.__module__, cls.__qualname__):
            return name
    return None


class _Optimizers(Mapping):
    """The registry as a read-only mapping name -> class (a live view)."""

    def __getitem__(self, name: str) -> type:
        if name not in _ENTRIES:
            raise KeyError(name)
        return optimizer_class(name)

    def __iter__(self) -> Iterator[str]:
        return iter(list(_ENTRIES))

    def __len__(self) -> int:
        return len(_ENTRIES)

    def __contains__(self, name: object) -> bool:
        return name in _ENTRIES

    def __repr__(self) -> str:
        return f"OPTIMIZERS({class_names()!r})"


# Name -> DP optimizer class, in the order of registration.
OPTIMIZERS = _Optimizers()
