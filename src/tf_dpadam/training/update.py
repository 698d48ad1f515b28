"""Phases 3 to 5 of the DP step: noise once, divide by B, apply.

`apply_clipped_sum` takes a batch's clipped sum (phases 1 and 2,
`train_step`) and runs the rest of the step, in one of three ways:

1. No accumulation (k = 1): the sums and counts are added over the
   `tf.distribute` replicas (if any), then `noise_scale_apply`: the hooks'
   additions (audit canaries), one Gaussian draw of std sigma * C (on the
   first replica only: each replica hands 1/R of the sum to Keras, which
   adds them), division by B, the optimizer.
2. Accumulation over k > 1 physical batches, one replica: the batch is added
   to the optimizer's accumulators (`accumulation.GradientAccumulator`), and
   on every k-th batch `noise_scale_apply` runs on their totals and clears
   them.
3. Accumulation under `tf.distribute`: each replica adds its batch to its
   own copy of the accumulators, without communication; then all replicas
   meet in one `merge_call` (outside any control flow, as Keras' own
   gradient aggregation does), in which, on every k-th batch only, one
   `tf.cond` runs `logical_step_on_replicas`: the noise is added to the copy
   of the replica with global id 0, one all-reduce sums all copies (so the
   noise is drawn once and every worker applies the same gradient), then
   division by the global B and the optimizer, in cross-replica context.
   (The reverse nesting, a `merge_call` inside a `tf.cond` of the replica's
   step, is what `tf.distribute` refuses.)

The noise and the division compute in float32; the optimizer casts the
private gradient to each variable's dtype (`apply_private`).
"""

import dataclasses
from typing import Sequence

import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer import adaptive_clipping
from tf_dpadam.privatizer import noise
from tf_dpadam.privatizer import replicas


@dataclasses.dataclass(frozen=True)
class Update:
    """What phases 3 to 5 need, for one trace of the train step.

    Attributes:
        optimizer: the DP optimizer (its `dp_config` gives C, sigma and B).
        variables: the trainable variables.
        noise_seeds: the model's `seeds.NoiseSeeds`.
        hooks: the model's `hooks.StepHooks`, in order.
        secure_mode: whether each noise value is a sum of several normals.
        ledger: the model's `model_ledger.ModelLedger` (None: steps not
            counted, for tests of this module only).
    """
    optimizer: object
    variables: Sequence
    noise_seeds: object
    hooks: Sequence = ()
    secure_mode: bool = False
    ledger: object = None


def count_step(update: Update) -> None:
    """The ledger counts the logical step whose noise is drawn now."""
    if update.ledger is not None:
        update.ledger.count_step()


def clip_norm(optimizer, hooks):
    """The total C of this step (sqrt(sum_l C_l^2) with per-layer
    clipping; a tensor under adaptive clipping), unless a hook (an audit
    test's deliberate break) changes it."""
    l2_norm_clip = optimizer.total_clip_norm()
    for hook in hooks:
        l2_norm_clip = hook.clip_norm(l2_norm_clip)
    return l2_norm_clip


def clip_for_sum(optimizer, hooks):
    """What phases 1 and 2 clip to: C (flat clipping), or the `[G]` clip
    norms of the groups (per-layer clipping), after the hooks."""
    if optimizer.variable_groups() is None:
        return clip_norm(optimizer, hooks)
    clips = optimizer.clip_norms()
    for hook in hooks:
        clips = hook.clip_norm(clips)
    return clips


def apply_clipped_sum(update: Update, summed: list, count,
                      unclipped=None) -> None:
    """Phases 3 to 5 for a batch's clipped sums and example count (this
    replica's), with accumulation and replicas as the module docstring says.
    With adaptive clipping, `unclipped` holds the batch's shifted counts of
    unclipped examples per group (`adaptive_clipping`), which travel with
    the sums and are noised once per logical step."""
    accumulator = update.optimizer.dp_accumulator  # None unless k > 1
    if accumulator is None:
        if replicas.num_replicas() > 1:
            extra = () if unclipped is None else (unclipped,)
            summed, count, *extra = replicas.sum_over_replicas(
                (summed, count, *extra))
            unclipped = extra[0] if extra else None
        noise_scale_apply(update, summed, count, unclipped)
    elif not tf.distribute.has_strategy():
        accumulator.add(summed, count, unclipped)

        def logical_step():
            noise_scale_apply(update, *accumulator.totals())
            accumulator.clear()
            return ops.zeros(())

        ops.cond(accumulator.advance(), logical_step, lambda: ops.zeros(()))
    else:
        accumulator.add(summed, count, unclipped)

        def merge_fn(strategy):
            def logical_step():
                logical_step_on_replicas(update, strategy, accumulator)
                accumulator.clear_all_copies()
                return tf.zeros(())

            tf.cond(accumulator.advance(), logical_step,
                    lambda: tf.zeros(()))

        replicas.merge(merge_fn)


def noise_scale_apply(update: Update, summed: list, count,
                      unclipped=None) -> None:
    """Noise once, divide by B, apply.

    `summed` is the clipped sum over all examples of the (logical) step
    and all replicas, the same on every replica; `count` their number;
    `unclipped` (adaptive clipping) their shifted counts of unclipped
    examples, noised here too.
    """
    optimizer = update.optimizer
    config = optimizer.dp_config
    hooks = update.hooks
    l2_norm_clip = clip_norm(optimizer, hooks)
    for hook in hooks:
        # Gradient canaries: extra examples, clipped like the others.
        summed, count = hook.add_to_sum(summed, count, update.variables,
                                        l2_norm_clip, optimizer.iterations)
    denominator = config.denominator(count)
    for hook in hooks:
        if hook.observes_clean_sum:
            hook.before_noise(summed, denominator)
    noise_stddev = optimizer.gradient_noise_stddev()
    for hook in hooks:
        noise_stddev = hook.noise_stddev(noise_stddev)
    seed = update.noise_seeds.next(optimizer.iterations)
    count_step(update)
    fraction = None
    if unclipped is not None:
        seed, count_seed = noise.split_seed(seed)
        # Drawn on the first replica and summed over the replicas, so that
        # every replica moves C by the same privatized fraction.
        count_noise = replicas.sum_over_replicas(
            replicas.first_replica_share()
            * _count_noise(update, unclipped, count_seed))
        fraction = adaptive_clipping.unclipped_fraction(
            unclipped + count_noise, denominator)
    noised = noise.add_noise(
        replicas.replica_share(summed),
        noise_stddev,
        seed,
        share=replicas.first_replica_share(),
        secure_mode=update.secure_mode,
    )
    private_grads = noise.scale(noised, denominator)
    for hook in hooks:
        hook.after_noise(private_grads, update.variables)
    optimizer.apply_private(private_grads, update.variables, denominator,
                            fraction)


def logical_step_on_replicas(update: Update, strategy, accumulator) -> None:
    """Noise once, all-reduce once, divide by B, apply (cross-replica).

    The logical step of accumulation under `tf.distribute`: the
    accumulator's sums and count have one copy per replica. The noise is
    added to the copy of the replica with global id 0 before the one
    all-reduce (`replicas.sum_replica_copies`), so it is drawn once in
    total and every worker applies the same gradient.
    """
    optimizer = update.optimizer
    config = optimizer.dp_config
    for hook in update.hooks:
        if not hook.supports_replica_accumulation:
            raise ValueError(hook.replica_accumulation_error())
    seed = update.noise_seeds.next(optimizer.iterations)
    count_step(update)
    num_sums = len(accumulator.sums)
    adaptive = accumulator.unclipped is not None
    if adaptive:
        seed, count_seed = noise.split_seed(seed)

    def add_noise(values):
        noised = noise.add_noise(
            values[:num_sums], optimizer.gradient_noise_stddev(), seed,
            secure_mode=update.secure_mode,
        )
        rest = values[num_sums:]
        if adaptive:  # [count, unclipped counts]: one draw, here only.
            rest[1] = rest[1] + _count_noise(update, rest[1], count_seed)
        return noised + rest

    sums = list(accumulator.sums)
    reduced = replicas.sum_replica_copies(
        strategy, accumulator.state(), first_replica=add_noise
    )
    noised, total = reduced[:num_sums], reduced[num_sums]
    denominator = config.denominator(total)
    fraction = None
    if adaptive:
        fraction = adaptive_clipping.unclipped_fraction(
            reduced[num_sums + 1], denominator)
    observers = [hook for hook in update.hooks if hook.observes_clean_sum]
    if observers:
        # The clean sum needs an all-reduce of its own (research only).
        clean = replicas.sum_replica_copies(strategy, sums)
        for hook in observers:
            hook.before_noise(clean, denominator)
    optimizer.apply_private(
        noise.scale(noised, denominator), update.variables, denominator,
        fraction,
    )


def _count_noise(update: Update, unclipped, seed):
    """The noise of adaptive clipping's unclipped counts (one draw)."""
    return noise.gaussian(
        ops.shape(unclipped), update.optimizer.clipped_count_stddev(),
        "float32", seed, secure_mode=update.secure_mode)
