"""Correlated noise: banded Toeplitz matrix factorization (BandMF).

DP-SGD adds independent noise z_t ~ N(0, (sigma C)^2 I) to step t's clipped
sum. A matrix mechanism (Choquette-Choo et al. 2023, arXiv 2306.08153;
McKenna 2024, arXiv 2405.15913) picks a lower-triangular T x T strategy
matrix M (the literature's "C"; C here is the clip norm), privatizes
M G + Z and trains on M^-1 (M G + Z) = G + M^-1 Z: step t adds

    w_t = (M^-1 Z)_t,

noise correlated across steps so that the prefix sums of the gradients,
which SGD and Adam's momentum apply, carry less of it. Here M is banded
Toeplitz: M[t, s] = m[t - s] for 0 <= t - s < b (b "bands"), with
||m||_2 = 1, so every full column has norm 1 and an example that takes part
in steps at least b apart (cyclic Poisson sampling, `tf_dpadam.data`) has
the sensitivity of one DP-SGD step per participation. `bands=1` is m = (1,),
M = I: DP-SGD's noise, exactly.

Since M is lower triangular with b bands, w comes from the last b - 1
noise vectors alone (solving M w = z forward):

    w_t = (z_t - sum_{j=1}^{b-1} m_j w_{t-j}) / m_0.

The same recursion on the impulse z = (1, 0, 0, ...) gives the coefficients
d_k of M^-1 (a lower-triangular Toeplitz matrix, not banded), and step t's
noise has per-coordinate variance (sigma C)^2 sum_{k<=t} d_k^2, a public
number: divided by B^2 it is the exact Phi_t of DP-AdamBC (`correlate`,
`BandedToeplitz.noise_variances`).

`correlate(strategy, iid_noise, state)` is the step's part, value in, value
out: it takes this step's independent draws and the `NoiseState` (the b - 1
past noise vectors, secret like the noise itself, and the public impulse
response) and returns the correlated noise, its variance multiplier and the
next state. The strategies:

* `BandedToeplitz.optimized(bands, steps)`: m minimizing the mean squared
  error of the T prefix sums (`prefix_error`) at sensitivity 1, found once
  per (bands, steps) with L-BFGS from the BISR start and cached;
* `BandedToeplitz.bisr(bands)`: the banded inverse square root (Kalinin &
  Lampert 2024, arXiv 2405.13763): the first b coefficients of
  (1 - x)^(-1/2), normalized; a closed form for any T;
* `BandedToeplitz(coefficients)`: a user's m (normalized here).
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Sequence

import numpy as np
import tensorflow as tf

from tf_dpadam.common import validation

# The most bands a strategy may have (its history costs b - 1 copies of the
# model's gradient, and the published gains flatten well before it).
MAX_BANDS = 64


def _check_bands(bands):
    validation.check(validation.is_int(bands) and 1 <= bands <= MAX_BANDS,
                     "bands", bands, f"to be an int in [1, {MAX_BANDS}]")
    return int(bands)


def _check_steps(steps, bands):
    validation.check(validation.is_int(steps) and steps >= bands, "steps",
                     steps, f"to be an int >= bands={bands}")
    return int(steps)


def bisr_coefficients(bands: int) -> np.ndarray:
    """The first `bands` coefficients of (1 - x)^(-1/2), binom(2k, k) / 4^k,
    normalized to norm 1 (float64)."""
    bands = _check_bands(bands)
    m = np.ones(bands)
    for k in range(1, bands):
        m[k] = m[k - 1] * (2 * k - 1) / (2 * k)
    return m / np.linalg.norm(m)


def inverse_coefficients(coefficients: Sequence[float], n: int) -> np.ndarray:
    """d_0 .. d_{n-1}, the first column of M^-1 (float64): the recursion on
    the impulse, as scipy's IIR filter."""
    from scipy import signal  # pylint: disable=import-outside-toplevel
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return signal.lfilter([1.0], np.asarray(coefficients, np.float64),
                          impulse)


def prefix_error(coefficients: Sequence[float], steps: int) -> float:
    """The mean over t < T of the variance of the noise of the prefix sum
    sum_{s<=t} w_s, per unit of z's variance, with m normalized to norm 1
    (DP-SGD's, m = (1,), is (T + 1) / 2). The noise of prefix t is
    sum_u z_u D_{t-u}, D_j = d_0 + ... + d_j, so the total is
    sum_j (T - j) D_j^2."""
    m = np.asarray(coefficients, np.float64)
    m = m / np.linalg.norm(m)
    partial = np.cumsum(inverse_coefficients(m, steps))
    return float(np.sum((steps - np.arange(steps)) * partial**2) / steps)


def _optimize(bands, steps):
    from scipy import optimize  # pylint: disable=import-outside-toplevel
    start = bisr_coefficients(bands)
    if bands == 1:
        return start

    def loss(m):
        value = prefix_error(m, steps)
        return value if math.isfinite(value) else 1e300

    result = optimize.minimize(
        loss, start, method="L-BFGS-B",
        bounds=[(1e-3, None)] + [(None, None)] * (bands - 1),
        options={"maxiter": 500})
    best = result.x if result.fun <= loss(start) else start
    return best / np.linalg.norm(best)


@functools.lru_cache(maxsize=64)
def _optimized_coefficients(bands, steps):
    return tuple(float(c) for c in _optimize(bands, steps))


@dataclasses.dataclass(frozen=True)
class BandedToeplitz:
    """A banded Toeplitz strategy M, by its first column m (normalized to
    norm 1 on construction; `bands = len(m)`).

    Attributes:
        coefficients: m_0 .. m_{b-1}, m_0 > 0, finite.
        name: how it was made ("optimized", "bisr" or "given"), for people
            and checkpoints.
    """

    coefficients: tuple
    name: str = "given"

    def __post_init__(self):
        m = np.asarray(self.coefficients, np.float64).reshape(-1)
        if (m.size == 0 or m.size > MAX_BANDS or not np.all(np.isfinite(m))
                or m[0] <= 0):
            raise ValueError(
                f"Expected coefficients={self.coefficients!r} to be 1 to"
                f" {MAX_BANDS} finite numbers, the first one > 0.")
        object.__setattr__(
            self, "coefficients",
            tuple(float(c) for c in m / np.linalg.norm(m)))

    @classmethod
    def bisr(cls, bands: int):
        """The banded inverse square root (module docstring)."""
        return cls(tuple(bisr_coefficients(bands)), "bisr")

    @classmethod
    def optimized(cls, bands: int, steps: int):
        """m minimizing `prefix_error` over `steps` steps (cached)."""
        bands = _check_bands(bands)
        steps = _check_steps(steps, bands)
        return cls(_optimized_coefficients(bands, steps), "optimized")

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def matrix(self, steps: int) -> np.ndarray:
        """M itself, `steps` x `steps` (float64; for tests and plots)."""
        out = np.zeros((steps, steps))
        for k, c in enumerate(self.coefficients[:steps]):
            out += c * np.eye(steps, k=-k)
        return out

    def noise_variances(self, steps: int) -> np.ndarray:
        """sum_{k<=t} d_k^2 for t < steps: the variance of step t's noise per
        unit of z's (float64)."""
        return np.cumsum(inverse_coefficients(self.coefficients, steps)**2)

    def to_config(self) -> dict:
        return {"coefficients": list(self.coefficients), "name": self.name}


class NoiseState(NamedTuple):
    """What the recursion carries from step to step (tensors; a named
    tuple, so that it passes through `tf.function` and `tf.nest`).

    Attributes:
        history: per noise tensor, `[b - 1, *shape]` float32: w_{t-1} ..
            w_{t-b+1}, the past correlated noise (SECRET, as the noise).
        impulse: `[b - 1]` float64: d_{t-1} .. d_{t-b+1} (public).
        variance: float64 scalar, sum_{k<t} d_k^2 (public).
        draws: int64 scalar, t: the draws so far.
    """

    history: tuple
    impulse: Any
    variance: Any
    draws: Any


def initial_state(strategy: BandedToeplitz, shapes) -> NoiseState:
    """The state before the first draw, for noise tensors of `shapes`."""
    past = strategy.bands - 1
    return NoiseState(
        tuple(tf.zeros([past, *shape], tf.float32) for shape in shapes),
        tf.zeros([past], tf.float64), tf.zeros([], tf.float64),
        tf.zeros([], tf.int64))


def _step(m, current, past):
    """(current - sum_j m_j past_{j-1}) / m_0, past stacked on axis 0."""
    if past.shape[0] == 0:
        return current / m[0]
    tail = tf.tensordot(tf.cast(m[1:], past.dtype), past, axes=1)
    return (current - tail) / tf.cast(m[0], past.dtype)


def _shifted(value, past):
    return tf.concat([value[None], past[:-1]], axis=0)


def correlate(strategy: BandedToeplitz, iid_noise: Sequence,
              state: NoiseState) -> tuple:
    """Step t's correlated noise from its independent draws.

    Args:
        strategy: the `BandedToeplitz` M.
        iid_noise: z_t, one float32 tensor per noise tensor (each entry
            N(0, (sigma C)^2)).
        state: the `NoiseState` after t draws.

    Returns:
        `(noise, variance, state)`: w_t (one tensor per entry of
        `iid_noise`); sum_{k<=t} d_k^2 (float32), the variance of w_t per
        unit of z's, so that Phi_t is (sigma C / B)^2 times it; the state
        after t + 1 draws. With one band, `noise` is `iid_noise` itself
        and `variance` is 1.
    """
    m = np.asarray(strategy.coefficients)
    impulse = tf.where(tf.equal(state.draws, 0), tf.constant(1.0, tf.float64),
                       tf.constant(0.0, tf.float64))
    d = _step(tf.constant(m, tf.float64), impulse, state.impulse)
    variance = state.variance + tf.square(d)
    if strategy.bands == 1:
        noise = list(iid_noise)
        history = state.history
        impulse_history = state.impulse
    else:
        m32 = tf.constant(m, tf.float32)
        noise = [_step(m32, tf.cast(z, tf.float32), past)
                 for z, past in zip(iid_noise, state.history)]
        history = tuple(_shifted(w, past)
                        for w, past in zip(noise, state.history))
        impulse_history = _shifted(d, state.impulse)
    return (noise, tf.cast(variance, tf.float32),
            NoiseState(history, impulse_history, variance, state.draws + 1))
