"""The privatizer's functions under their old names (kept for imports).

The phases of one DP step now live in `tf_dpadam.step`, one module per job:

- `step.seeds`: secret seeds (`secret_seed`, `resolve_seed`, `NoiseSeeds`);
- `step.clipping`: per-example gradients and their clipped sum
  (`per_example_gradients`, `clip_and_sum`, `without_non_finite`, ...);
- `step.noise`: the Gaussian noise and the division by B (`gaussian`,
  `add_noise`, `scale`, `SECURE_MODE_DRAWS`);
- `step.replicas`: sums and noise under `tf.distribute`.

`from tf_dpadam import privatizer` still gives all of them.
"""

from tf_dpadam.step.clipping import all_finite
from tf_dpadam.step.clipping import clip_and_sum
from tf_dpadam.step.clipping import gradients_or_zeros
from tf_dpadam.step.clipping import per_example_gradients
from tf_dpadam.step.clipping import without_non_finite
from tf_dpadam.step.noise import add_noise
from tf_dpadam.step.noise import gaussian
from tf_dpadam.step.noise import scale
from tf_dpadam.step.noise import SECURE_MODE_DRAWS
from tf_dpadam.step.replicas import first_replica_share
from tf_dpadam.step.replicas import num_replicas
from tf_dpadam.step.replicas import replica_share
from tf_dpadam.step.replicas import sum_over_replicas
from tf_dpadam.step.replicas import sum_replica_copies
from tf_dpadam.step.seeds import NoiseSeeds
from tf_dpadam.step.seeds import REPRODUCIBLE_SEED_WARNING
from tf_dpadam.step.seeds import resolve_seed
from tf_dpadam.step.seeds import secret_seed

__all__ = [
    "NoiseSeeds", "REPRODUCIBLE_SEED_WARNING", "SECURE_MODE_DRAWS",
    "add_noise", "all_finite", "clip_and_sum", "first_replica_share",
    "gaussian", "gradients_or_zeros", "num_replicas", "per_example_gradients",
    "replica_share", "resolve_seed", "scale", "secret_seed",
    "sum_over_replicas", "sum_replica_copies", "without_non_finite",
]
