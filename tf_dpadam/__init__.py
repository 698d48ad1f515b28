"""tf_dpadam: differentially private Keras 3 training with bias-corrected DP-Adam."""

from tf_dpadam import audit
from tf_dpadam import data
from tf_dpadam import diagnostics
from tf_dpadam import layers
from tf_dpadam import sharding
from tf_dpadam.accounting import calibrate_noise_multiplier
from tf_dpadam.accounting import calibrate_steps
from tf_dpadam.accounting import compute_dp_sgd_privacy
from tf_dpadam.accounting import compute_dp_sgd_privacy_statement
from tf_dpadam.accounting import epsilon_after_steps
from tf_dpadam.callbacks import PrivacyBudget
from tf_dpadam.diagnostics import MomentDiagnostics
from tf_dpadam.gradient_norms import per_example_gradient_norms
from tf_dpadam.dp_math import DPConfig
from tf_dpadam.optimizers import DPAdam
from tf_dpadam.optimizers import DPAdamCorrected
from tf_dpadam.optimizers import DPSGD
from tf_dpadam.private_model import make_private
from tf_dpadam.private_model import PrivateModel

__version__ = "0.1.0"
