"""Phases 3 and 4 of the DP step: Gaussian noise, once, then division by B.

The privatizer's output, value in, value out: `add_noise` adds
z ~ N(0, (sigma C)^2 I) once to the clipped sum, drawn from TensorFlow's
Philox generator keyed by a `seeds.NoiseSeeds` draw (before the all-reduce
of the replicas' sums, where there is one); `divide` returns the private
gradient g_tilde = (sum + z) / B with Phi = (sigma C / B)^2. Phi comes
from the very std and B used here, so the optimizers never compute it
themselves. Everything is float32: only the private
gradient is cast to each variable's dtype, by the optimizer
(post-processing).
"""

from typing import Sequence

import tensorflow as tf
from keras import ops


# Secure mode draws each noise value as the sum of this many normals of std
# stddev / sqrt(count) (the same variance; Holohan & Braghin 2021: a sum of
# several floating-point normals is far harder to invert than one).
SECURE_MODE_DRAWS = 4


# TensorFlow's Philox algorithm (`tf.random.Algorithm.PHILOX`).
_PHILOX = 1


def _philox_key_counter(seed):
    """The Philox key and counter of a `[2]` seed, by one kernel.

    `tf.random.stateless_*(alg="philox")` derives them with some thirty
    small ops written in Python (so that XLA derives the same ones): about
    40 ms of tracing per call and as many ops in every step, for each
    noise tensor. Outside XLA the `StatelessRandomGetKeyCounter` kernel
    derives the very same key and counter (bit for bit, int32 or int64
    seeds; `noise_test`); under XLA its compilation derives others, so
    the callers pass `xla` and the XLA step keeps TensorFlow's own path.
    """
    return tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)


def split(seed, num, xla=False):
    """`tf.random.experimental.stateless_split(seed, num, alg="philox")`,
    the same `[num, 2]` seeds (of seed's dtype), by one kernel outside XLA
    (`_philox_key_counter`)."""
    seed = tf.convert_to_tensor(seed)
    if xla:
        return tf.random.experimental.stateless_split(seed, num, alg="philox")
    key, counter = _philox_key_counter(seed)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[num, 2], key=key, counter=counter, alg=_PHILOX,
        dtype=seed.dtype)


def _normal(shape, stddev, dtype, seed, xla):
    if xla:
        return tf.random.stateless_normal(
            shape, seed=seed, stddev=stddev, dtype=dtype, alg="philox")
    key, counter = _philox_key_counter(seed)
    return tf.raw_ops.StatelessRandomNormalV2(
        shape=shape, key=key, counter=counter, alg=_PHILOX,
        dtype=dtype) * ops.cast(stddev, dtype)


def gaussian(shape, stddev, dtype, seed,
             secure_mode: bool = False, xla: bool = False) -> tf.Tensor:
    """N(0, stddev^2) samples from TensorFlow's Philox generator.

    `seed` is a `[2]` integer seed (int32 or int64; all 64 bits of int64
    words are used). The algorithm is named: TensorFlow's default ("auto_select")
    compiles under XLA on CPU to a generator 50x slower than Philox (1.8M
    normals: 620 vs 12 ms; graphs: 18 ms either way), which made the noise
    alone cost a third of an XLA step of the text model. The values are
    `tf.random.stateless_normal(..., alg="philox")`'s, bit for bit; `xla`:
    the draw is compiled with XLA (True where it may be: the values are then
    XLA's, which differ; see `_philox_key_counter`). With
    `secure_mode`, each value is the sum of `SECURE_MODE_DRAWS` independent
    normals of std `stddev / sqrt(SECURE_MODE_DRAWS)`.
    """
    seed = tf.convert_to_tensor(seed)
    if not secure_mode:
        return _normal(shape, stddev, dtype, seed, xla)
    draws = split(seed, SECURE_MODE_DRAWS, xla)
    part = stddev / SECURE_MODE_DRAWS ** 0.5
    return tf.add_n([_normal(shape, part, dtype, s, xla)
                     for s in tf.unstack(draws)])


def add_noise(grads: Sequence, stddev, seed, share=1.0,
              secure_mode: bool = False, xla: bool = False) -> list:
    """Adds N(0, stddev^2) noise to every coordinate, once.

    Args:
        grads: list of tensors.
        stddev: sigma * C (a Python number, or a scalar tensor when C
            moves under adaptive clipping).
        seed: a `[2]` integer seed, split into one independent seed per
            tensor (`NoiseSeeds.next` gives one per step).
        share: multiplies the noise; under `tf.distribute` it is 1 on one
            replica and 0 on the others, so that the noise is added once.
        secure_mode: each value the sum of several normals (`gaussian`).
        xla: whether the step is compiled with XLA (`gaussian`).

    Returns:
        The noised tensors, float32 whatever the dtype of `grads` (the noise
        is drawn in float32: a Gaussian drawn in bfloat16 or float16 is
        coarsely quantized). With `stddev == 0` they are returned unchanged,
        cast to float32.
    """
    grads = [ops.cast(g, "float32") for g in grads]
    if not tf.is_tensor(stddev) and stddev == 0:
        return grads
    return [g + ops.cast(share, "float32") * z
            for g, z in zip(grads, draw(grads, stddev, seed, secure_mode,
                                        xla))]


def draw(grads: Sequence, stddev, seed, secure_mode: bool = False,
         xla: bool = False) -> list:
    """The noise that `add_noise` adds (before `share`): one float32
    N(0, stddev^2) tensor per tensor of `grads` (their shapes), each from
    its own seed split from `seed`."""
    # Never the same seed twice: equal-shaped tensors would get equal noise.
    seeds = tf.unstack(split(tf.cast(seed, tf.int64), len(grads), xla))
    return [gaussian(ops.shape(g), stddev, "float32", s,
                     secure_mode=secure_mode, xla=xla)
            for g, s in zip(grads, seeds)]


def split_seed(seed, xla: bool = False) -> tuple:
    """Two independent `[2]` seeds from one (Philox): the gradient noise's
    and, under adaptive clipping, the count's."""
    first, second = tf.unstack(split(tf.cast(seed, tf.int64), 2, xla))
    return first, second


def scale(grads: Sequence, denominator) -> list:
    """Divides by the public denominator B, in float32.

    The result stays float32: it is cast to each variable's dtype only when
    the optimizer applies it (`DPOptimizerMixin.apply_private`).
    """
    return [
        ops.cast(g, "float32") / ops.cast(denominator, "float32")
        for g in grads
    ]



def noise_variance_phi(noise_stddev, denominator):
    """Phi = (sigma C / B)^2, the variance that noise of std `noise_stddev`
    (sigma C) adds to each coordinate of the sum divided by B, and so the
    noise's bias in E[v_hat]: the one formula of Phi, which `divide`
    returns with each private gradient. A number, or a float32 tensor if
    either argument is a tensor."""
    if ops.is_tensor(noise_stddev) or ops.is_tensor(denominator):
        return ops.square(ops.cast(noise_stddev, "float32")
                          / ops.cast(denominator, "float32"))
    return (noise_stddev / denominator) ** 2


def divide(noised: Sequence, noise_stddev, denominator) -> tuple:
    """`(g_tilde, Phi)`: the noised sum divided by B, and
    Phi = (noise_stddev / B)^2, the variance the noise adds to each
    coordinate of g_tilde (`noise_variance_phi`)."""
    return (scale(noised, denominator),
            noise_variance_phi(noise_stddev, denominator))
