"""The private train step, one module per phase.

Read in this order:

- `train_step`: `PrivateModel.train_step` top to bottom: the checks, the
  rows to clip, phases 1 and 2 (the sum of clipped per-example gradients,
  by ghost clipping or a vectorized map), then phases 3 to 5, then the
  metrics.
- `clipping`: phases 1 and 2 on materialized per-example gradients
  (`per_example_gradients`, `clip_and_sum`) and non-finite examples.
- `update`: phases 3 to 5, noise once, divide by B, apply, with gradient
  accumulation (`tf_dpadam.accumulation` holds its state) and
  `tf.distribute` replicas beside them.
- `noise`: the Gaussian noise and the division by B.
- `replicas`: sums and the single noise draw across replicas.
- `seeds`: secret seeds for the noise (and for sampling).
- `hooks`: `StepHooks`, how audits and diagnostics take part in the step.

`tf_dpadam.privatizer` still exports the functions of `seeds`, `clipping`,
`noise` and `replicas` under their old names.
"""
