"""The DP optimizers: Keras optimizers that carry the DP hyperparameters and
consume the privatizer's output, the private gradient and Phi.

- `paper`: `DPSGD`, `DPAdam` (the paper's "biased" baseline) and
  `DPAdamCorrected` (DP-AdamBC).
- `scale_then_privatize`, `disk`: the 2024-2025 adaptive DP-Adams.
- `base`: the DP part they share (`DPOptimizerMixin`).
- `accumulation`: the state of gradient accumulation.
"""

from tf_dpadam.optimizers.base import DPOptimizerMixin
from tf_dpadam.optimizers.base import is_dp_optimizer
from tf_dpadam.optimizers.disk import DPAdamDiSK
from tf_dpadam.optimizers.paper import DPAdam
from tf_dpadam.optimizers.paper import DPAdamCorrected
from tf_dpadam.optimizers.paper import DPSGD
from tf_dpadam.optimizers.scale_then_privatize import DPAdamScaleThenPrivatize

__all__ = ["DPAdam", "DPAdamCorrected", "DPAdamDiSK",
           "DPAdamScaleThenPrivatize", "DPOptimizerMixin", "DPSGD",
           "is_dp_optimizer"]
