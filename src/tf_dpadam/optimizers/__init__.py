"""The DP optimizers: Keras optimizers that carry the DP hyperparameters and
consume the privatizer's output, the private gradient and Phi.

- `paper`: `DPSGD`, `DPAdam` (the paper's "biased" baseline) and
  `DPAdamCorrected` (DP-AdamBC).
- `scale_then_privatize`, `disk`: the 2024-2025 adaptive DP-Adams.
- `base`: the DP part they share (`DPOptimizerMixin`).
- `arguments`: the DP keyword arguments they all take, declared once.
- `registry`: the optimizers by their `--optimizer` name.
- `accumulation`: the state of gradient accumulation.

The names below load on first use (PEP 562), so that `registry` answers
the command lines' `--help` without importing Keras.
"""

import importlib
from typing import TYPE_CHECKING

# Each public name, and the submodule that defines it.
_DEFINED_IN = {
    "DPAdam": "paper",
    "DPAdamCorrected": "paper",
    "DPAdamDiSK": "disk",
    "DPAdamScaleThenPrivatize": "scale_then_privatize",
    "DPOptimizerMixin": "base",
    "DPSGD": "paper",
    "is_dp_optimizer": "base",
}
_SUBMODULES = ("accumulation", "arguments", "base", "disk", "paper",
               "registry", "scale_then_privatize")

__all__ = ["DPAdam", "DPAdamCorrected", "DPAdamDiSK",
           "DPAdamScaleThenPrivatize", "DPOptimizerMixin", "DPSGD",
           "is_dp_optimizer"]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _DEFINED_IN:
        module = importlib.import_module(f"{__name__}.{_DEFINED_IN[name]}")
        value = globals()[name] = getattr(module, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # The same names, for type checkers.
    from tf_dpadam.optimizers.base import DPOptimizerMixin
    from tf_dpadam.optimizers.base import is_dp_optimizer
    from tf_dpadam.optimizers.disk import DPAdamDiSK
    from tf_dpadam.optimizers.paper import DPAdam
    from tf_dpadam.optimizers.paper import DPAdamCorrected
    from tf_dpadam.optimizers.paper import DPSGD
    from tf_dpadam.optimizers.scale_then_privatize import (
        DPAdamScaleThenPrivatize)
