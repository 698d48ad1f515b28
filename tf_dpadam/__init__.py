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

from tf_dpadam import accounting
from tf_dpadam import adaptive_clipping
from tf_dpadam import audit
from tf_dpadam import clip_groups
from tf_dpadam import data
from tf_dpadam import diagnostics
from tf_dpadam import layers
from tf_dpadam import membership
from tf_dpadam import run_dir
from tf_dpadam import sharding
from tf_dpadam.accounting import calibrate_noise_multiplier
from tf_dpadam.accounting import calibrate_steps
from tf_dpadam.accounting import compute_dp_sgd_privacy
from tf_dpadam.accounting import compute_dp_sgd_privacy_statement
from tf_dpadam.accounting import epsilon_after_steps
from tf_dpadam.callbacks import PrivacyBudget
from tf_dpadam.diagnostics import MomentDiagnostics
from tf_dpadam.disk import DPAdamDiSK
from tf_dpadam.gradient_norms import per_example_gradient_norms
from tf_dpadam.dp_math import DPConfig
from tf_dpadam.fixer import fix
from tf_dpadam.fixer import Problem
from tf_dpadam.fixer import validate
from tf_dpadam.optimizers import DPAdam
from tf_dpadam.optimizers import DPAdamCorrected
from tf_dpadam.optimizers import DPSGD
from tf_dpadam.private_model import make_private
from tf_dpadam.private_model import PrivateModel
from tf_dpadam.scale_then_privatize import DPAdamScaleThenPrivatize
from tf_dpadam.step.hooks import StepHooks
from tf_dpadam.version import __version__

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
    "layers",
    "membership",
    "run_dir",
    "sharding",
]
