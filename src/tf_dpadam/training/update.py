"""Phases 3 to 5 of the DP step: noise once, divide by B, apply.

`apply_clipped_sum` takes a batch's clipped sum (phases 1 and 2,
`train_step`) and decides when a logical step ends:

1. No accumulation (k = 1): the sums and counts are added over the
   `tf.distribute` replicas (if any); every batch is a logical step.
2. Accumulation over k > 1 physical batches, one replica: the batch is added
   to the optimizer's accumulators (`accumulation.GradientAccumulator`);
   every k-th batch is a logical step on their totals, which it clears.
3. Accumulation under `tf.distribute`: each replica adds its batch to its
   own copy of the accumulators, without communication; then all replicas
   meet in one `merge_call` (outside any control flow, as Keras' own
   gradient aggregation does), in which, on every k-th batch only, one
   `tf.cond` runs the logical step in cross-replica context. (The reverse
   nesting, a `merge_call` inside a `tf.cond` of the replica's step, is
   what `tf.distribute` refuses.)

Every logical step then takes the one path of `logical_step`: the hooks'
additions (audit canaries), B, the noise of std sigma * C drawn once, the
privatizer's `noise.add_noise` and `noise.divide` (private gradient and
Phi, value in, value out), the optimizer's `apply_private`. Only where the sums live differs,
in two small classes: `WholeSums` (every replica holds the whole sums; the
first replica adds the noise and each hands 1/R to Keras, which adds them)
and `ReplicaCopies` (case 3: the noise is added to the copy of the replica
with global id 0 and one all-reduce sums all copies, so it is drawn once and
every worker applies the same gradient).

The noise and the division compute in float32; the optimizer casts the
private gradient to each variable's dtype (`apply_private`).
"""

import dataclasses
from typing import Sequence

import tensorflow as tf
from keras import ops

from tf_dpadam.data import sharding
from tf_dpadam.privatizer import adaptive_clipping
from tf_dpadam.privatizer import correlated_noise
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
        noise_history: the model's `noise_history.NoiseHistory`, which
            correlated noise (an optimizer's `noise_strategy` of b > 1
            bands) needs.
        xla: whether the step is compiled with XLA (the noise's Philox key
            is then derived as XLA derives it: `noise.gaussian`).
    """
    optimizer: object
    variables: Sequence
    noise_seeds: object
    hooks: Sequence = ()
    secure_mode: bool = False
    ledger: object = None
    noise_history: object = None
    xla: bool = False


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
        logical_step(update, WholeSums(summed, count, unclipped))
    elif not tf.distribute.has_strategy():
        accumulator.add(summed, count, unclipped)

        def step():
            logical_step(update, WholeSums(*accumulator.totals()))
            accumulator.clear()
            return ops.zeros(())

        ops.cond(accumulator.advance(), step, lambda: ops.zeros(()))
    else:
        accumulator.add(summed, count, unclipped)

        def merge_fn(strategy):
            def step():
                logical_step(update, ReplicaCopies(strategy, accumulator))
                accumulator.clear_all_copies()
                return tf.zeros(())

            tf.cond(accumulator.advance(), step, lambda: tf.zeros(()))

        replicas.merge(merge_fn)


def logical_step(update: Update, sums) -> None:
    """Phases 3 to 5 of one logical step, wherever its sums live (`sums`:
    `WholeSums` or `ReplicaCopies`): the hooks' additions, B, one noise
    draw, division by B (the privatizer returns the private gradient and
    Phi), the optimizer."""
    optimizer = update.optimizer
    hooks = update.hooks
    sums.check_hooks(hooks)
    sums.add_from_hooks(hooks, update.variables,
                        clip_norm(optimizer, hooks), optimizer.iterations)
    observers = [hook for hook in hooks if hook.observes_clean_sum]
    if observers:
        clean, count = sums.clean()
        for hook in observers:
            hook.before_noise(clean, optimizer.dp_config.denominator(count))
    noise_stddev = optimizer.gradient_noise_stddev()
    for hook in hooks:
        noise_stddev = hook.noise_stddev(noise_stddev)
    seed = update.noise_seeds.next(optimizer.iterations)
    count_step(update)
    count_seed = None
    if sums.unclipped is not None:
        seed, count_seed = noise.split_seed(seed, update.xla)

    correlated = CorrelatedNoise.of(update)
    noised, count, unclipped = sums.noised(
        lambda summed, share=1.0: correlated.add_noise(
            summed, noise_stddev, seed, share),
        lambda unclipped: _count_noise(update, unclipped, count_seed))
    denominator = optimizer.dp_config.denominator(count)
    private_grads, phi = noise.divide(noised, noise_stddev, denominator)
    phi = correlated.phi(phi)
    fraction = None
    if unclipped is not None:
        fraction = adaptive_clipping.unclipped_fraction(unclipped,
                                                        denominator)
    for hook in hooks:
        hook.after_noise(private_grads, update.variables)
    optimizer.apply_private(private_grads, update.variables, phi, fraction)


class WholeSums:
    """The sums of a logical step, whole on every replica (or one replica):
    the first replica adds the noise, and each hands 1/R of the private
    gradient to Keras, which adds them."""

    def __init__(self, summed, count, unclipped=None):
        self.summed, self.count, self.unclipped = summed, count, unclipped

    def check_hooks(self, hooks):
        del hooks  # Every hook runs here.

    def add_from_hooks(self, hooks, variables, l2_norm_clip, step):
        for hook in hooks:
            # Gradient canaries: extra examples, clipped like the others.
            self.summed, self.count = hook.add_to_sum(
                self.summed, self.count, variables, l2_norm_clip, step)

    def clean(self):
        """`(sums, count)` without noise (NOT private: for observers)."""
        return self.summed, self.count

    def noised(self, add_noise, count_noise):
        """`(noised sums (this replica's share), count, noised unclipped
        counts)`."""
        unclipped = self.unclipped
        if unclipped is not None:
            # Drawn on the first replica and summed over the replicas, so
            # that every replica moves C by the same privatized fraction.
            unclipped = unclipped + replicas.sum_over_replicas(
                replicas.first_replica_share() * count_noise(unclipped))
        noised = add_noise(replicas.replica_share(self.summed),
                           replicas.first_replica_share())
        return noised, self.count, unclipped


class ReplicaCopies:
    """The sums of a logical step of accumulation under `tf.distribute`:
    one copy per replica of the accumulators, in cross-replica context. The
    noise is added to the copy of the replica with global id 0 before the
    one all-reduce (`replicas.sum_replica_copies`), so it is drawn once in
    total and every worker applies the same gradient."""

    def __init__(self, strategy, accumulator):
        self.strategy, self.accumulator = strategy, accumulator
        self.unclipped = accumulator.unclipped

    def check_hooks(self, hooks):
        for hook in hooks:
            if not hook.supports_replica_accumulation:
                raise ValueError(hook.replica_accumulation_error())

    def add_from_hooks(self, hooks, variables, l2_norm_clip, step):
        # The hooks that support replica accumulation add nothing.
        del hooks, variables, l2_norm_clip, step

    def clean(self):
        """`(sums, count)` without noise, all-reduced (NOT private: for
        observers; an all-reduce of its own, research only)."""
        *sums, count = replicas.sum_replica_copies(
            self.strategy, self.accumulator.sums + [self.accumulator.count])
        return sums, count

    def noised(self, add_noise, count_noise):
        """`(noised sums, count, noised unclipped counts)`, all-reduced."""
        accumulator = self.accumulator
        num_sums = len(accumulator.sums)
        adaptive = accumulator.unclipped is not None

        def first_replica(values):
            noised = add_noise(values[:num_sums])
            rest = values[num_sums:]
            if adaptive:  # [count, unclipped counts]: one draw, here only.
                rest[1] = rest[1] + count_noise(rest[1])
            return noised + rest

        reduced = replicas.sum_replica_copies(
            self.strategy, accumulator.state(), first_replica=first_replica)
        count = reduced[num_sums]
        unclipped = reduced[num_sums + 1] if adaptive else None
        return reduced[:num_sums], count, unclipped


class CorrelatedNoise:
    """The noise of one logical step: independent (`noise.add_noise`), or
    correlated by the optimizer's banded `noise_strategy` of b > 1 bands:
    the same independent draws z_t, turned into w_t by
    `correlated_noise.correlate` with the model's secret `NoiseHistory`,
    and Phi_t = Phi times w_t's variance per unit of z_t's."""

    def __init__(self, update, strategy):
        self.update, self.strategy = update, strategy
        self.variance = None

    @classmethod
    def of(cls, update):
        """The step's noise; refuses correlated noise under `tf.distribute`
        or without a noise history."""
        strategy = update.optimizer.noise_strategy
        if strategy is None or strategy.bands == 1:
            return cls(update, None)
        if tf.distribute.has_strategy() and sharding.workers_and_local_replicas(
                tf.distribute.get_strategy())[0] > 1:
            raise ValueError(
                f"Expected noise_strategy with 1 band with several"
                f" tf.distribute workers, got {strategy.bands} bands:"
                " correlated noise runs on the replicas of one worker"
                " (e.g. MirroredStrategy) for now.")
        if update.noise_history is None:
            raise ValueError("Expected a private model's noise history for"
                             " correlated noise (noise_strategy).")
        return cls(update, strategy)

    def add_noise(self, summed, stddev, seed, share=1.0):
        """`summed` plus `share` times this step's noise (float32)."""
        update = self.update
        if self.strategy is None:
            return noise.add_noise(summed, stddev, seed, share=share,
                                   secure_mode=update.secure_mode,
                                   xla=update.xla)
        summed = [ops.cast(g, "float32") for g in summed]
        history = update.noise_history
        state = history.state(self.strategy,
                              [tuple(g.shape) for g in summed])
        drawn = noise.draw(summed, stddev, seed, update.secure_mode,
                           update.xla)
        correlated, self.variance, state = correlated_noise.correlate(
            self.strategy, drawn, state)
        history.assign(state)
        return [g + ops.cast(share, "float32") * w
                for g, w in zip(summed, correlated)]

    def phi(self, phi):
        """Phi_t of this step, from the privatizer's Phi."""
        if self.variance is None:
            return phi
        return ops.cast(phi, "float32") * self.variance


def _count_noise(update: Update, unclipped, seed):
    """The noise of adaptive clipping's unclipped counts (one draw)."""
    return noise.gaussian(
        ops.shape(unclipped), update.optimizer.clipped_count_stddev(),
        "float32", seed, secure_mode=update.secure_mode, xla=update.xla)
