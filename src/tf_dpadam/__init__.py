"""tf_dpadam: differentially private Keras 3 training with bias-corrected DP-Adam.

The public API (`__all__`): the DP optimizers (`DPSGD`, `DPAdam`,
`DPAdamCorrected`, and the 2024-2025 adaptive ones `DPAdamScaleThenPrivatize`
and `DPAdamDiSK`, with their hyperparameters in `DPConfig`; the modules
`adaptive_clipping` and `clip_groups` explain their adaptive and per-layer
clipping), `make_private`
and `PrivateModel` (per-example clipping in the train step), `validate`
and `fix` (what `make_private` would refuse in a model, as `Problem`s, and
a copy without BatchNormalization problems), the privacy
accounting (`epsilon_after_steps`, `calibrate_steps`,
`calibrate_noise_multiplier`, `compute_dp_sgd_privacy`,
`compute_dp_sgd_privacy_statement`, and the `accounting` package),
`PrivacyBudget` (epsilon in the logs, a stop at a budget),
`per_example_gradient_norms`, `MomentDiagnostics`, and the modules `data`
(Poisson batches), `sharding` (multi-worker), `layers`, `run_dir`
(resumable runs that never misstate epsilon), `audit` and `diagnostics`;
`StepHooks`, the interface through which the audit and diagnostics observe
the private train step; and `membership` (membership inference attacks on a
trained model: scores, ROC, LiRA).
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

from tf_dpadam.version import __version__

# The public names load on first use (PEP 562, `__getattr__`), so that the
# command lines (`python -m tf_dpadam.accounting.cli`, the example binaries)
# answer without importing TensorFlow. The first use of any of them loads
# them all, and so does importing tf_dpadam after TensorFlow or Keras (the
# usual order): either registers the DP optimizers and layers with Keras
# before a `keras.models.load_model`. (A program that imports tf_dpadam,
# then Keras, then loads a model without using a tf_dpadam name would not
# find them.)

# The subpackages and modules of `__all__`, by where they live:
# `from tf_dpadam import layers` (also inside tf_dpadam, while it loads)
# imports only that one.
_MODULES = {
    "accounting": "tf_dpadam.accounting",
    "adaptive_clipping": "tf_dpadam.privatizer.adaptive_clipping",
    "audit": "tf_dpadam.tools.audit",
    "clip_groups": "tf_dpadam.privatizer.clip_groups",
    "data": "tf_dpadam.data",
    "diagnostics": "tf_dpadam.tools.diagnostics",
    "independence": "tf_dpadam.training.independence",
    "layers": "tf_dpadam.layers",
    "membership": "tf_dpadam.tools.membership",
    "run_dir": "tf_dpadam.tools.run_dir",
    "sharding": "tf_dpadam.data.sharding",
}


def _load_all():
    """Binds every public name of `__all__` in this package."""
    # pylint: disable=g-import-not-at-top,import-outside-toplevel
    from tf_dpadam import accounting
    from tf_dpadam.privatizer import adaptive_clipping
    from tf_dpadam.tools import audit
    from tf_dpadam.privatizer import clip_groups
    from tf_dpadam import data
    from tf_dpadam.tools import diagnostics
    from tf_dpadam.training import independence
    from tf_dpadam import layers
    from tf_dpadam.tools import membership
    from tf_dpadam.tools import run_dir
    from tf_dpadam.data import sharding
    from tf_dpadam.accounting import calibrate_noise_multiplier
    from tf_dpadam.accounting import calibrate_steps
    from tf_dpadam.accounting import compute_dp_sgd_privacy
    from tf_dpadam.accounting import compute_dp_sgd_privacy_statement
    from tf_dpadam.accounting import epsilon_after_steps
    from tf_dpadam.training.callbacks import PrivacyBudget
    from tf_dpadam.tools.diagnostics import MomentDiagnostics
    from tf_dpadam.optimizers.disk import DPAdamDiSK
    from tf_dpadam.tools.gradient_norms import per_example_gradient_norms
    from tf_dpadam.privatizer.ghost_clipping.registry import (
        register_ghost_rule)
    from tf_dpadam.optimizers.arguments import DPConfig
    from tf_dpadam.tools.fixer import fix
    from tf_dpadam.tools.fixer import Problem
    from tf_dpadam.tools.fixer import validate
    from tf_dpadam.optimizers import DPAdam
    from tf_dpadam.optimizers import DPAdamCorrected
    from tf_dpadam.optimizers import DPSGD
    from tf_dpadam.training.private_model import make_private
    from tf_dpadam.training.private_model import PrivateModel
    from tf_dpadam.optimizers.scale_then_privatize import DPAdamScaleThenPrivatize
    from tf_dpadam.training.hooks import StepHooks
    for name, value in locals().items():
        if name in __all__:  # Not over a name set already (a test's patch).
            globals().setdefault(name, value)


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in __all__:
        _load_all()
        return globals()[name]
    raise AttributeError(f"module 'tf_dpadam' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    # Optimizers and their configuration.
    "DPAdam",
    "DPAdamCorrected",
    "DPAdamDiSK",
    "DPAdamScaleThenPrivatize",
    "DPConfig",
    "DPSGD",
    # The private model.
    "PrivateModel",
    "make_private",
    "Problem",
    "fix",
    "validate",
    "per_example_gradient_norms",
    "register_ghost_rule",
    "StepHooks",
    # Accounting.
    "PrivacyBudget",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "compute_dp_sgd_privacy",
    "compute_dp_sgd_privacy_statement",
    "epsilon_after_steps",
    # Diagnostics (not differentially private: a research tool).
    "MomentDiagnostics",
    # Modules.
    "accounting",
    "adaptive_clipping",
    "audit",
    "clip_groups",
    "data",
    "diagnostics",
    "independence",
    "layers",
    "membership",
    "run_dir",
    "sharding",
]

if TYPE_CHECKING:  # The same names, for type checkers (tf_dpadam is typed).
    from tf_dpadam import accounting
    from tf_dpadam.privatizer import adaptive_clipping
    from tf_dpadam.tools import audit
    from tf_dpadam.privatizer import clip_groups
    from tf_dpadam import data
    from tf_dpadam.tools import diagnostics
    from tf_dpadam.training import independence
    from tf_dpadam import layers
    from tf_dpadam.tools import membership
    from tf_dpadam.tools import run_dir
    from tf_dpadam.data import sharding
    from tf_dpadam.accounting import calibrate_noise_multiplier
    from tf_dpadam.accounting import calibrate_steps
    from tf_dpadam.accounting import compute_dp_sgd_privacy
    from tf_dpadam.accounting import compute_dp_sgd_privacy_statement
    from tf_dpadam.accounting import epsilon_after_steps
    from tf_dpadam.training.callbacks import PrivacyBudget
    from tf_dpadam.tools.diagnostics import MomentDiagnostics
    from tf_dpadam.optimizers.disk import DPAdamDiSK
    from tf_dpadam.tools.gradient_norms import per_example_gradient_norms
    from tf_dpadam.privatizer.ghost_clipping.registry import (
        register_ghost_rule)
    from tf_dpadam.optimizers.arguments import DPConfig
    from tf_dpadam.tools.fixer import fix
    from tf_dpadam.tools.fixer import Problem
    from tf_dpadam.tools.fixer import validate
    from tf_dpadam.optimizers import DPAdam
    from tf_dpadam.optimizers import DPAdamCorrected
    from tf_dpadam.optimizers import DPSGD
    from tf_dpadam.training.private_model import make_private
    from tf_dpadam.training.private_model import PrivateModel
    from tf_dpadam.optimizers.scale_then_privatize import DPAdamScaleThenPrivatize
    from tf_dpadam.training.hooks import StepHooks
elif "keras" in sys.modules or "tensorflow" in sys.modules:
    _load_all()  # Costs no more: TensorFlow is loaded already.
else:
    class _LoadWithKeras(importlib.abc.MetaPathFinder):
        """Loads every public name right after Keras is imported, so that
        `import tf_dpadam`, then `import keras`, then
        `keras.models.load_model` finds the classes tf_dpadam registers
        with Keras (a saved private model, its DP optimizer)."""

        def find_spec(self, name, path=None, target=None):
            if name != "keras":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_load(module):
                exec_module(module)
                if not _importing_a_submodule():
                    _load_all()

            spec.loader.exec_module = exec_then_load
            return spec

    def _importing_a_submodule():
        """Whether Keras was imported by a tf_dpadam module that is still
        loading (`import tf_dpadam.training.private_model` first): loading
        every name now would import that module half-made. The names then
        load on first use."""
        return any(getattr(getattr(module, "__spec__", None),
                           "_initializing", False)
                   for name, module in list(sys.modules.items())
                   if name.startswith("tf_dpadam."))

    sys.meta_path.insert(0, _LoadWithKeras())
