"""Secret seeds: the noise key and sampling seeds no script can replay.

The DP noise (and Poisson sampling, `tf_dpadam.data.sampling`) is seeded from the
operating system's CSPRNG unless the user gives a seed, which is then used
with a warning that points at the user's line. `NoiseSeeds` turns the key
into one fresh seed per noise draw; its state is never saved.
"""

import os
import secrets
import sys
import warnings

import numpy as np
import tensorflow as tf
from keras import random as keras_random

# Shown when a user passes an explicit seed for the DP noise or sampling.
REPRODUCIBLE_SEED_WARNING = (
    "{what} uses the explicit seed={seed!r}: anyone who knows it can"
    " regenerate {drawn} and remove {effect}, so {consequence}. Use explicit"
    " seeds for reproducible research only; leave seed=None (the default) to"
    " draw the seed from the operating system's entropy."
)

# The tf_dpadam package: frames in it are not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def secret_seed() -> int:
    """A 63-bit seed from the operating system's CSPRNG (`secrets`).

    Independent of `keras.utils.set_random_seed`, `tf.random.set_seed`,
    `random.seed` and `np.random.seed`: a script's seed cannot regenerate it.
    """
    return secrets.randbits(63)


def _user_stacklevel():
    """The `stacklevel` of the first caller outside tf_dpadam and Keras."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_PACKAGE_DIR)
                or f"{os.sep}keras{os.sep}" in path):
            return level
        frame = frame.f_back
        level += 1
    return 1


def resolve_seed(seed, what: str, drawn: str, effect: str,
                 consequence: str = "the result is NOT differentially private"
                 " against them") -> int:
    """`seed` if given (with a warning), else a `secret_seed()`.

    Args:
        seed: None or an int in [0, 2**63).
        what, drawn, effect, consequence: the parts of the warning
            (`REPRODUCIBLE_SEED_WARNING`), which points at the user's line.

    Raises:
        ValueError: if `seed` is neither None nor an int in [0, 2**63).
    """
    if seed is None:
        return secret_seed()
    if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
            or not 0 <= seed < 2**63):
        raise ValueError(
            f"Expected seed={seed!r} to be None or an int in [0, 2**63)."
        )
    seed = int(seed)
    warnings.warn(
        REPRODUCIBLE_SEED_WARNING.format(
            what=what, seed=seed, drawn=drawn, effect=effect,
            consequence=consequence,
        ),
        stacklevel=_user_stacklevel(),
    )
    return seed


class NoiseSeeds:
    """The seeds of the DP noise: a key and a count of draws, never saved.

    Each draw's seed is a Philox hash of `(key, draws so far)` paired with
    the optimizer's step, so no two draws of one process share a seed (not
    after a recompile that resets the step either), and a run resumed from a
    checkpoint with an explicit key does not replay the noise of the steps
    before the checkpoint. The key is `secret_seed()` unless the user gave a
    seed. The state lives in a variable that the owner keeps out of Keras'
    and TensorFlow's tracking, so it is not in `model.weights`, a `.keras`
    file or a checkpoint.
    """

    def __init__(self, key: int):
        self._generator = keras_random.SeedGenerator(
            key, name="dp_noise_seed"
        )

    def next(self, step) -> tf.Tensor:
        """A fresh `[2]` int64 seed for the noise of optimizer step `step`."""
        state = tf.cast(self._generator.next(), tf.int64)
        mixed = tf.random.stateless_uniform(
            [], seed=state, minval=None, maxval=None, dtype=tf.int64,
            alg="philox",
        )
        return tf.stack([mixed, tf.cast(step, tf.int64)])
