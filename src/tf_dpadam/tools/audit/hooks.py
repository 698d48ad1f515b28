"""How the audit takes part in a private model's train step.

`AuditHooks` is the audit's `tf_dpadam.training.hooks.StepHooks`, registered on
a `PrivateModel` (`model.add_step_hooks`) at most once: the train step asks
it, while tracing, the clip norm to use, the noise std to use, and what
gradient canaries to add to the clipped sum before the noise, and shows
it the private gradient. Without breaks the first two are the identity,
so a run with gradient canaries is the user's own DP step plus extra
"examples".

The breaks exist to test the auditor: a broken run must be detected. They
make the run NOT private, and `break_privatizer` says so loudly.
"""

import logging
import warnings

from tf_dpadam.training import private_model
from tf_dpadam.training import hooks as step_hooks

# `break_privatizer`'s choices: "none" keeps the real privatizer; "no_noise"
# adds no noise (the optimizer's Phi and the claimed epsilon still assume
# it); "no_clipping" clips nothing (C still sets the noise and Phi).
BREAKS = ("none", "no_noise", "no_clipping")

# No per-example norm reaches this, so min(1, C / norm) is 1. Finite, as
# dp_math.clip_factors computes C / max(norm, C).
_NO_CLIPPING = 1e30

BROKEN_WARNING = (
    "tf_dpadam.tools.audit.break_privatizer({how!r}): this model's privatizer is"
    " DELIBERATELY BROKEN ({what}). Training is NOT differentially private"
    " and no epsilon printed for it holds. This exists only to test that the"
    " privacy audit detects a broken privatizer; never use it on real data."
)
_WHAT = {
    "no_noise": "no noise is added",
    "no_clipping": "per-example gradients are not clipped",
}


class AuditHooks(step_hooks.StepHooks):
    """What a private model's train step asks the audit while tracing."""

    supports_replica_accumulation = False

    def __init__(self):
        self.broken = "none"
        self.canaries = None  # a canaries.GradientCanaries

    @property
    def breaks_privacy(self):
        return self.broken != "none"

    def clip_norm(self, l2_norm_clip):
        return _NO_CLIPPING if self.broken == "no_clipping" else l2_norm_clip

    def noise_stddev(self, stddev):
        return 0.0 if self.broken == "no_noise" else stddev

    def add_to_sum(self, summed, count, variables, l2_norm_clip, step):
        if self.canaries is None:
            return summed, count
        return self.canaries.add_to_step(summed, count, variables,
                                         l2_norm_clip, step)

    def after_noise(self, private_grads, variables):
        if self.canaries is not None:
            self.canaries.observe(private_grads, variables)

    def replica_accumulation_error(self):
        return ("tf_dpadam.tools.audit supports one replica only; it is not"
                " available with gradient accumulation under tf.distribute.")


def hooks_of(model):
    """The model's `AuditHooks`, created on first use.

    Forgets the model's traced train step, so that the next `fit` traces one
    that asks the hooks.

    Raises:
        ValueError: if `model` is not a `tf_dpadam.PrivateModel`.
    """
    if not isinstance(model, private_model.PrivateModel):
        raise ValueError(
            "Expected model to be a tf_dpadam.PrivateModel (from"
            f" make_private), got {type(model).__name__}."
        )
    for hooks in model.step_hooks:
        if isinstance(hooks, AuditHooks):
            model.train_function = None
            return hooks
    hooks = AuditHooks()
    model.add_step_hooks(hooks)
    return hooks


def break_privatizer(model, how):
    """Deliberately breaks a private model's privatizer, to test the audit.

    Args:
        model: a `PrivateModel`.
        how: one of `BREAKS`: "none" (no change), "no_noise" or
            "no_clipping".

    Raises:
        ValueError: on a `how` not in `BREAKS` or a non-private model.
    """
    if how not in BREAKS:
        raise ValueError(f"Expected how={how!r} to be one of {BREAKS}.")
    hooks = hooks_of(model)
    hooks.broken = how
    if how != "none":
        message = BROKEN_WARNING.format(how=how, what=_WHAT[how])
        logging.warning(message)
        warnings.warn(message, stacklevel=2)
