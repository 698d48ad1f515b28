"""`StepHooks`: how audits and diagnostics plug into the private train step.

A `PrivateModel` calls each registered `StepHooks` (`model.add_step_hooks`)
at fixed points of its train step, while tracing it. The base class does
nothing (every method is the identity or a no-op), so a subclass overrides
only what it needs:

    step                                   hook
    ------------------------------------   ---------------------------------
    model and optimizer built              build(variables)
    C for the clipped sum                  clip_norm(l2_norm_clip) -> C'
    phases 1-2: clipped sum of a batch     after_clipping(norms, losses,
                                                          present)
    the logical step's clipped sum         add_to_sum(summed, count,
                                             variables, l2_norm_clip, step)
                                             -> (summed, count)
    denominator B known, before noise      before_noise(summed, denominator)
                                             (only if `observes_clean_sum`)
    phase 3: the noise's std               noise_stddev(stddev) -> stddev'
    phase 4 done: the private gradient     after_noise(private_grads,
                                                       variables)

`tf_dpadam.tools.audit` adds gradient canaries with `add_to_sum` and reads the
private gradients with `after_noise`; `make_private(diagnostics=True)`
records the clean gradient with `before_noise` (NOT private). A hook that
changes C, the sum or the noise changes the privacy guarantee: only the
audit's deliberate breaks do that, to test the auditor.
"""

from typing import Sequence


class StepHooks:
    """The base hook: changes nothing. Subclass it and override methods.

    Attributes:
        observes_clean_sum: whether `before_noise` needs the un-noised sum.
            Under `tf.distribute` with gradient accumulation that sum costs
            an all-reduce of its own, made only when a hook asks for it.
        supports_replica_accumulation: False if the hook cannot run in the
            logical step of accumulation under `tf.distribute` (the step
            then raises `replica_accumulation_error()`).
        breaks_privacy: True while the hook changes C or the noise (the
            audit's deliberate breaks): the model's privacy ledger then
            records its steps without noise (epsilon infinite).
    """

    observes_clean_sum = False
    supports_replica_accumulation = True
    breaks_privacy = False

    def build(self, variables: Sequence) -> None:
        """Creates state for the model's trainable `variables` (eager)."""

    def clip_norm(self, l2_norm_clip):
        """The C the examples are clipped to (default: `l2_norm_clip`)."""
        return l2_norm_clip

    def after_clipping(self, norms, losses, present) -> None:
        """Sees a batch's per-example norms, losses and `present` mask
        (this replica's), after phases 1 and 2."""

    def add_to_sum(self, summed: list, count, variables: Sequence,
                   l2_norm_clip, step) -> tuple:
        """`(summed, count)` of the logical step, before its noise
        (default: unchanged). `step` is the optimizer's iteration."""
        return summed, count

    def before_noise(self, summed: list, denominator) -> None:
        """Sees the clipped sum over all examples and replicas and B (NOT
        private); called only if `observes_clean_sum`."""

    def noise_stddev(self, stddev):
        """The noise's std sigma * C (default: unchanged)."""
        return stddev

    def after_noise(self, private_grads: list, variables: Sequence) -> None:
        """Sees the privatized gradient (noised sum / B) before the update."""

    def replica_accumulation_error(self) -> str:
        """The message of the error when `supports_replica_accumulation` is
        False."""
        return (f"{type(self).__name__} does not support gradient"
                " accumulation under tf.distribute.")
