r"""Command line for the privacy accounting of DP training.

Epsilon of a training run (a statement with RDP and PLD epsilons):

    python -m tf_dpadam.accounting.cli --num_examples=60000 --batch_size=256 \
        --noise_multiplier=1.1 --epochs=60 --delta=1e-5

The number of steps (and epochs) a budget allows:

    python -m tf_dpadam.accounting.cli --num_examples=50000 --batch_size=2048 \
        --noise_multiplier=1.0 --target_epsilon=7 --delta=1e-5

The noise multiplier a budget needs for a given length of training:

    python -m tf_dpadam.accounting.cli --num_examples=50000 --batch_size=2048 \
        --epochs=20 --target_epsilon=7 --delta=1e-5

With --noise_multiplier, --epochs (or --steps) and --target_epsilon it prints
the statement of the run and then the steps the budget allows.

Installed, the same command is `tf_dpadam_privacy` (a console script).

All numbers come from `tf_dpadam.accounting` (add-or-remove-one adjacency).
By default they assume Poisson sampling at rate q = batch_size / num_examples,
which tf_dpadam's Poisson batches give (the default of a private model's
`fit` on in-memory data); every report says so and gives the epsilon of
shuffled fixed batches beside it. `--sampling=shuffled` accounts shuffled
fixed batches of batch_size, without amplification by subsampling (each pass
one Gaussian mechanism per example):

    python -m tf_dpadam.accounting.cli --num_examples=80 --batch_size=8 \
        --noise_multiplier=1 --epochs=3 --delta=1e-5 --sampling=shuffled

This module imports no TensorFlow: the accounting needs only dp-accounting.
The --accountant choices are the names in `accountants.ACCOUNTANTS`.

A bad value or combination ends with one line on stderr that names the flag,
and exit code 2 (`tf_dpadam.common.command_line.run`, which the example binaries
use too).
"""

import functools
import math
import sys
import warnings

from absl import app
from absl import flags

from tf_dpadam.common import validation
from tf_dpadam.accounting import accountants
# The command-line plumbing, also used by the example binaries through
# this module (`privacy_cli.run`, `privacy_cli.register_check`).
from tf_dpadam.common.command_line import USAGE_ERROR_EXIT_CODE
from tf_dpadam.common.command_line import register_check
from tf_dpadam.common.command_line import run
from tf_dpadam.common.command_line import usage_error_line

SAMPLINGS = ("poisson", "shuffled")  # accounting.SAMPLINGS, for a fast --help.

__all__ = [
    "USAGE_ERROR_EXIT_CODE", "define_flags", "main",
    "noise_multiplier_report", "register_check", "report", "run",
    "sampling_report", "steps_report", "usage_error_line",
]


def define_flags():
    """Defines the command line's flags on absl's global FLAGS.

    Called only when this module runs as a program: importing it defines no
    flag, so it never collides with the flags of a user's own binary.
    """
    flags.DEFINE_integer(
        "num_examples", None, "Number of training examples N (required)."
    )
    flags.DEFINE_integer(
        "batch_size", None,
        "Expected batch size B, in examples (sampling rate q = B / N;"
        " required).",
    )
    flags.DEFINE_float(
        "noise_multiplier",
        None,
        "Noise multiplier sigma (noise std / clipping norm C). Leave it out,"
        " with --target_epsilon and --epochs or --steps, to calibrate it.",
    )
    flags.DEFINE_float(
        "epochs", None, "Length of training in epochs (may be fractional);"
        " steps = ceil(epochs * N / B)."
    )
    flags.DEFINE_integer(
        "steps", None, "Length of training in DP steps (instead of --epochs)."
    )
    flags.DEFINE_float("delta", None, "Target delta, in (0, 1) (required;"
                       " usually below 1 / N).")
    flags.DEFINE_float(
        "target_epsilon",
        None,
        "Privacy budget epsilon. With --noise_multiplier: print the largest"
        " number of steps within it (after the statement if --epochs or"
        " --steps is given too); without: print the smallest noise multiplier"
        " (within 1%) that meets it for --epochs or --steps.",
    )
    flags.DEFINE_enum(
        "accountant", "pld", list(accountants.ACCOUNTANTS),
        "Accountant of the calibrations (the statement reports both); PLD,"
        " the default, is the tighter.")
    flags.DEFINE_enum(
        "sampling", "poisson", list(SAMPLINGS),
        "How the batches are drawn: 'poisson' (tf_dpadam's Poisson batches,"
        " amplification by subsampling) or 'shuffled' (fixed batches, no"
        " amplification).")
    flags.DEFINE_bool(
        "used_microbatching",
        False,
        "Whether gradients were clipped per microbatch of more than one example"
        " (doubles the sensitivity). Statement only.",
    )
    flags.DEFINE_integer(
        "max_examples_per_user",
        None,
        "Bound on the examples of one user, for a user-level epsilon. Statement"
        " only.",
    )
    for name, check in (
        ("num_examples",
         functools.partial(validation.check_positive_int, "num_examples")),
        ("batch_size",
         functools.partial(validation.check_positive_int, "batch_size")),
        ("noise_multiplier",
         functools.partial(validation.check_positive_real,
                           "noise_multiplier")),
        ("epochs", validation.check_epochs),
        ("steps", validation.check_steps),
        ("delta", validation.check_delta),
        ("target_epsilon",
         functools.partial(validation.check_positive_real, "target_epsilon")),
        ("max_examples_per_user",
         functools.partial(validation.check_positive_int,
                           "max_examples_per_user")),
    ):
        register_check(name, check)


def _epochs_of(steps, num_examples, batch_size):
    return steps * batch_size / num_examples


def _sampling_words(sampling, num_examples, batch_size):
    if sampling == "shuffled":
        return (f"shuffled fixed batches of {batch_size} of {num_examples}"
                " examples (no amplification by subsampling)")
    return f"Poisson sampling at q = {batch_size}/{num_examples}"


def _epsilon(*, steps, num_examples, batch_size, noise_multiplier, delta,
             accountant, sampling):
    """Epsilon of T steps under `sampling` (nan: too large for PLD)."""
    from tf_dpadam import accounting  # pylint: disable=g-import-not-at-top
    from tf_dpadam.accounting import pld  # pylint: disable=g-import-not-at-top
    try:
        if sampling == "shuffled":
            return accounting.epsilon_without_amplification(
                steps=steps, noise_multiplier=noise_multiplier, delta=delta,
                batches_per_pass=math.ceil(num_examples / batch_size),
                accountant=accountant)
        return accounting.epsilon_after_steps(
            steps=steps, num_examples=num_examples, batch_size=batch_size,
            noise_multiplier=noise_multiplier, delta=delta,
            accountant=accountant)
    except pld.PLDTooLargeError:  # E.g. --epochs=1e9; RDP's is finite.
        return math.nan


def sampling_report(*, num_examples, batch_size, noise_multiplier, delta,
                    steps, sampling):
    """The epsilons (RDP and PLD) of T steps under `sampling`, and under the
    other sampling for comparison."""
    from tf_dpadam.accounting import pld  # pylint: disable=g-import-not-at-top
    setting = dict(steps=steps, num_examples=num_examples,
                   batch_size=batch_size, noise_multiplier=noise_multiplier,
                   delta=delta)
    other = "shuffled" if sampling == "poisson" else "poisson"
    lines = []
    for which, title in ((sampling, "Assumed sampling"),
                         (other, "For comparison")):
        rdp, by_pld = (_epsilon(accountant=a, sampling=which, **setting)
                       for a in ("rdp", "pld"))
        lines.append(
            f"{title}: {_sampling_words(which, num_examples, batch_size)}:"
            f" after {steps} steps epsilon = {rdp:.4g} (RDP),"
            f" {by_pld:.4g} (PLD) at delta = {delta:g}."
            + (f" PLD: not computed, over {pld.MAX_PLD_POINTS:,} points."
               if math.isnan(by_pld) else ""))
    if sampling == "poisson":
        lines.append(
            "Poisson sampling is what tf_dpadam's Poisson batches (and a"
            " private model's fit on in-memory data) give; with shuffled"
            " fixed batches pass --sampling=shuffled.")
    return "\n".join(lines)


def steps_report(
    *,
    num_examples,
    batch_size,
    noise_multiplier,
    target_epsilon,
    delta,
    accountant="pld",
    sampling="poisson",
):
    """Text giving the largest number of steps (and epochs) within a budget."""
    from tf_dpadam import accounting  # pylint: disable=g-import-not-at-top
    setting = dict(num_examples=num_examples, batch_size=batch_size,
                   noise_multiplier=noise_multiplier, delta=delta,
                   accountant=accountant)
    steps = accounting.calibrate_steps(target_epsilon=target_epsilon,
                                       sampling=sampling, **setting)
    eps = functools.partial(_epsilon, sampling=sampling, **setting)
    words = _sampling_words(sampling, num_examples, batch_size)
    return "\n".join([
        f"Budget epsilon = {target_epsilon:g} at delta = {delta:g}"
        f" ({accountant.upper()} accountant), noise multiplier"
        f" {noise_multiplier:g}, {words}:",
        f"  steps = {steps}",
        f"  epochs = {_epochs_of(steps, num_examples, batch_size):.6g}"
        " (steps * batch_size / num_examples)",
        f"  epsilon after {steps} steps = {eps(steps=steps):.6g};"
        f" after {steps + 1} steps = {eps(steps=steps + 1):.6g}",
    ])


def noise_multiplier_report(
    *,
    num_examples,
    batch_size,
    target_epsilon,
    delta,
    epochs=None,
    steps=None,
    accountant="pld",
):
    """Text giving the smallest noise multiplier (within 1%) for a budget."""
    from tf_dpadam import accounting  # pylint: disable=g-import-not-at-top
    setting = dict(num_examples=num_examples, batch_size=batch_size,
                   delta=delta, accountant=accountant)
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=target_epsilon, epochs=epochs, steps=steps, **setting
    )
    steps = accounting.training_steps(num_examples=num_examples,
                                      batch_size=batch_size, epochs=epochs,
                                      steps=steps)
    epsilon = accounting.epsilon_after_steps(steps=steps,
                                             noise_multiplier=sigma, **setting)
    return "\n".join([
        f"Budget epsilon = {target_epsilon:g} at delta = {delta:g}"
        f" ({accountant.upper()} accountant), q = {batch_size}/{num_examples},"
        f" {steps} steps"
        f" ({_epochs_of(steps, num_examples, batch_size):.6g} epochs):",
        f"  noise_multiplier = {sigma:.6g} (smallest within 1%)",
        f"  epsilon with it = {epsilon:.6g}",
    ])


def report(*, num_examples=None, batch_size=None, delta=None, **kwargs):
    """The text the command line prints (see `_report`).

    Warns once (`validation.LargeDeltaWarning`, a `UserWarning`) if
    delta >= 1 / num_examples, not once per epsilon in the text.
    """
    if (num_examples is not None and delta is not None
            and validation.is_int(num_examples) and num_examples > 0
            and validation.is_real(delta) and 0 < delta < 1):
        validation.warn_large_delta(delta, num_examples)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", validation.LargeDeltaWarning)
        return _report(num_examples=num_examples, batch_size=batch_size,
                       delta=delta, **kwargs)


def _report(*, num_examples, batch_size, delta, noise_multiplier=None,
            epochs=None, steps=None, target_epsilon=None, accountant="pld",
            used_microbatching=False, max_examples_per_user=None,
            sampling="poisson"):
    """The text the command line prints, chosen by which values are given.

    `sampling` ("poisson" or "shuffled") is the sampling the numbers assume;
    the statement of a run gives the other's epsilon beside it.

    * noise_multiplier and one of epochs / steps: the privacy statement
      (`accounting.compute_dp_sgd_privacy_statement`);
    * noise_multiplier and target_epsilon: the calibrated steps and epochs;
    * the three: the statement, then the calibrated steps and epochs;
    * target_epsilon and one of epochs / steps: the calibrated noise
      multiplier.

    Raises:
        ValueError: for another combination, or a value out of range.
    """
    from tf_dpadam import accounting  # pylint: disable=g-import-not-at-top
    for name, value in (
        ("num_examples", num_examples),
        ("batch_size", batch_size),
        ("delta", delta),
    ):
        if value is None:
            raise ValueError(f"--{name} is required.")
    validation.check_sizes("num_examples", num_examples, batch_size)
    accounting.check_sampling(sampling)
    if (epochs is not None) and (steps is not None):
        raise ValueError("Give at most one of --epochs and --steps.")
    length_given = epochs is not None or steps is not None
    setting = dict(num_examples=num_examples, batch_size=batch_size,
                   delta=delta, accountant=accountant)
    if noise_multiplier is not None and target_epsilon is not None:
        budget = steps_report(noise_multiplier=noise_multiplier,
                              target_epsilon=target_epsilon,
                              sampling=sampling, **setting)
        if not length_given:
            return budget
        statement = _report(
            num_examples=num_examples, batch_size=batch_size, delta=delta,
            noise_multiplier=noise_multiplier, epochs=epochs, steps=steps,
            used_microbatching=used_microbatching,
            max_examples_per_user=max_examples_per_user, sampling=sampling)
        return statement + "\n\n" + budget
    if not length_given:
        raise ValueError(
            "Give --epochs or --steps (with --noise_multiplier for the"
            " statement, or with --target_epsilon to calibrate the noise"
            " multiplier), or --noise_multiplier and --target_epsilon to"
            " calibrate the steps."
        )
    if target_epsilon is not None:
        if sampling != "poisson":
            raise ValueError(
                "The noise multiplier is calibrated for Poisson sampling"
                " only; with --sampling=shuffled give --noise_multiplier"
                " (with --epochs or --steps for epsilon, or with"
                " --target_epsilon for the steps).")
        return noise_multiplier_report(target_epsilon=target_epsilon,
                                       epochs=epochs, steps=steps, **setting)
    if noise_multiplier is None:
        raise ValueError("Give --noise_multiplier or --target_epsilon.")
    if epochs is None:
        validation.check_steps(steps)
        epochs = _epochs_of(steps, num_examples, batch_size)
    else:
        steps = accounting.steps_for_epochs(epochs, num_examples, batch_size)
    comparison = sampling_report(
        num_examples=num_examples, batch_size=batch_size,
        noise_multiplier=noise_multiplier, delta=delta, steps=steps,
        sampling=sampling)
    if sampling == "shuffled":
        return comparison
    return accounting.compute_dp_sgd_privacy_statement(
        num_examples,
        batch_size,
        epochs,
        noise_multiplier,
        delta,
        used_microbatching=used_microbatching,
        max_examples_per_user=max_examples_per_user,
    ) + "\n\n" + comparison


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    try:
        f = flags.FLAGS
        text = report(
            num_examples=f.num_examples,
            batch_size=f.batch_size,
            delta=f.delta,
            noise_multiplier=f.noise_multiplier,
            epochs=f.epochs,
            steps=f.steps,
            target_epsilon=f.target_epsilon,
            accountant=f.accountant,
            used_microbatching=f.used_microbatching,
            max_examples_per_user=f.max_examples_per_user,
            sampling=f.sampling,
        )
    except (ValueError, OverflowError) as error:  # Overflow: --steps=1e400.
        raise app.UsageError(str(error)) from error
    print(text)


def console_main():
    """The `tf_dpadam_privacy` console script (pyproject.toml): its --help
    shows this module's docstring and flags, as `python -m` does (absl
    reads both from the main module, here the script)."""
    sys.modules["__main__"].__doc__ = __doc__
    define_flags()
    for flag in flags.FLAGS.get_key_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    run(main)


if __name__ == "__main__":
    console_main()
