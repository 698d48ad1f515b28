"""tf_dpadam: differentially private Keras 3 training with bias-corrected DP-Adam."""

from tf_dpadam.dp_math import DPConfig
from tf_dpadam.optimizers import DPAdam
from tf_dpadam.optimizers import DPAdamCorrected
from tf_dpadam.optimizers import DPSGD
from tf_dpadam.private_model import make_private
from tf_dpadam.private_model import PrivateModel

__version__ = "0.1.0"
