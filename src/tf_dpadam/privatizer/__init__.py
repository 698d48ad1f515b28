"""The privatizer: per-example clipping, the sum, the noise and B.

Value in, value out: it reads no model and no optimizer. Given the
per-example gradients (or what ghost clipping needs to get their norms),
it clips each to C, sums, adds N(0, (sigma C)^2 I) once and divides by the
public denominator B, and returns the private gradient together with
Phi = (sigma C / B)^2, the variance its noise adds to each coordinate
(`noise.add_noise`, then `noise.divide`). The optimizers consume that pair.

- `dp_math`: the paper's formulas (clip factors, Phi, gamma').
- `clipping`: per-example gradients by a vectorized map, clipped and summed.
- `ghost_clipping`: the clipped sum without per-example gradients, one rule
  per layer type (`register_ghost_rule` for a user's layer).
- `vectorized_clipping`, `vectorization`: the vectorized path.
- `clip_groups`, `adaptive_clipping`, `preclip`: per-layer and adaptive
  clip norms, and what an optimizer asks to do to each example's gradient
  before clipping.
- `noise`, `replicas`: the noise, once, and the sums under `tf.distribute`.
- `correlated_noise`: banded Toeplitz matrix factorization (BandMF): the
  noise of each step correlated with the last b - 1, and its exact Phi_t.
"""
