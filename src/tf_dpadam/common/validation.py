"""Argument checks shared by every public entry of tf_dpadam.

Each check raises `ValueError` with a message of the form

    Expected {name}={value!r} {expectation}.

for example `Expected noise_multiplier=-0.5 > 0.`: the argument's name, the
value it was given and what it should have been. The messages are part of the
interface (tests match them and users search for them), so each check keeps
its wording; where two checks look alike, their messages differ on purpose.

Three families:

* Hyperparameters of the DP step and the optimizers (`check_positive`,
  `check_non_negative`, `check_beta`): one message naming the whole
  expectation, e.g. "to be a finite number > 0".
* Counts of the data pipeline (`check_count`): "to be an int > 0".
* Accounting quantities (`check_positive_int`, `check_positive_real`,
  `check_sizes`, `check_delta`, `check_steps`, `check_epochs`): first the
  type ("to be an integer", "to be a real number"), then the range ("> 0",
  "in (0, 1)", ...). An accountant's name is checked where the accountants
  are registered (`tf_dpadam.accounting.accountants.get_accountant`).

This module imports neither TensorFlow nor NumPy: NumPy's scalar types are
registered with `numbers`, so `is_int(np.int64(3))` holds.
"""

import math
import numbers
import re
import warnings


def check(condition, name, value, expectation):
    """Raises `ValueError("Expected {name}={value!r} {expectation}.")`.

    Args:
        condition: whether `value` is acceptable; nothing happens if true.
        name: the argument's name, as the caller spells it.
        value: the value given.
        expectation: what it should be, e.g. "> 0" or "to be an integer".
    """
    if not condition:
        raise ValueError(f"Expected {name}={value!r} {expectation}.")


def is_int(value):
    """An integer (Python or NumPy), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value):
    """A real number (Python or NumPy, ints included), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# --------------------------------------------------------------------------
# Hyperparameters of the DP step and the optimizers.


def check_positive(name, value):
    """A finite real number > 0 (e.g. `l2_norm_clip`, Adam's `epsilon`)."""
    check(is_real(value) and math.isfinite(value) and value > 0, name, value,
          "to be a finite number > 0")


def check_non_negative(name, value):
    """A finite real number >= 0 (e.g. `noise_multiplier`, `momentum`)."""
    check(is_real(value) and math.isfinite(value) and value >= 0, name, value,
          "to be a finite number >= 0")


def check_learning_rate(value, name="learning_rate"):
    """A learning rate as Keras takes it: a finite real number >= 0, or
    anything else Keras accepts (a `LearningRateSchedule`, a callable, a
    variable or tensor), which is left to Keras."""
    if is_real(value):
        check(math.isfinite(value) and value >= 0, name, value,
              "to be a finite number >= 0 (or a LearningRateSchedule or a"
              " callable)")


def check_beta(name, value):
    """A real number in [0, 1) (Adam's `beta_1`, `beta_2`)."""
    check(is_real(value) and 0 <= value < 1, name, value, "to be in [0, 1)")


# --------------------------------------------------------------------------
# Counts of the data pipeline.


def check_count(name, value):
    """An int > 0 (a batch size or a number of steps of `tf_dpadam.data`).

    Unlike `check_positive_int` it reports type and range in one message,
    and, as it always has, it lets a bool through (True counts as 1).
    """
    check(isinstance(value, numbers.Integral) and value > 0, name, value,
          "to be an int > 0")


# --------------------------------------------------------------------------
# Accounting quantities: the type first, then the range.


def check_positive_int(name, value):
    """An integer > 0 (e.g. `num_examples`, `max_examples_per_user`)."""
    check(is_int(value), name, value, "to be an integer")
    check(value > 0, name, value, "> 0")


def check_positive_real(name, value):
    """A finite real number > 0 (e.g. `noise_multiplier`, `target_epsilon`)."""
    check(is_real(value), name, value, "to be a real number")
    check(math.isfinite(value) and value > 0, name, value, "> 0")


def check_sizes(n_name, n, batch_size):
    """N > 0 examples (named `n_name`) and 0 < batch_size <= N."""
    check_positive_int(n_name, n)
    check_positive_int("batch_size", batch_size)
    check(
        batch_size <= n,
        "batch_size",
        batch_size,
        f"<= {n_name}={n!r} (the sampling rate batch_size / {n_name} must be"
        " at most 1)",
    )


def check_delta(delta):
    """A real number in (0, 1)."""
    check(is_real(delta), "delta", delta, "to be a real number")
    check(0 < delta < 1, "delta", delta, "in (0, 1)")


def check_steps(steps):
    """An integer >= 0."""
    check(is_int(steps), "steps", steps, "to be an integer")
    check(steps >= 0, "steps", steps, ">= 0")


def check_epochs(epochs, name="epochs"):
    """A finite real number >= 0 (fractional epochs are allowed)."""
    check(is_real(epochs), name, epochs, "to be a real number")
    check(math.isfinite(epochs) and epochs >= 0, name, epochs, ">= 0")


class LargeDeltaWarning(UserWarning):
    """delta >= 1 / N: the (epsilon, delta) guarantee allows releasing an
    example outright (the mechanism that publishes one random example of N
    in the clear is (0, 1/N)-DP)."""


def large_delta_message(delta, num_examples):
    """The text of `LargeDeltaWarning`, or None if delta < 1 / N."""
    if delta * num_examples < 1:
        return None
    return (
        f"delta={delta!r} >= 1/N = {1 / num_examples:.6g}: an (epsilon,"
        " delta) guarantee with delta >= 1/N allows releasing an example"
        " outright; use delta well below 1/N (N = "
        f"{num_examples} examples)."
    )


def warn_large_delta(delta, num_examples, stacklevel=3):
    """Warns (`LargeDeltaWarning`, a `UserWarning`) if delta >= 1 / N.

    Called once by each public function that computes an epsilon with a
    known N, never inside a search. `stacklevel=3` points at the caller of
    the function that calls this one.
    """
    message = large_delta_message(delta, num_examples)
    if message is not None:
        warnings.warn(message, LargeDeltaWarning, stacklevel=stacklevel)


# --------------------------------------------------------------------------
# Messages.

# Terminal colour codes (ANSI SGR), which Keras puts around the message of
# an error raised inside a layer's call.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain_text(error):
    """`error`'s message as one line of plain text. Of a Keras error raised
    inside a call, only the message Keras marks in bold is kept (not the
    call's context: its arguments), without its colour codes."""
    text = str(error)
    bold = re.search(r"\x1b\[1m(.*?)\x1b\[0m", text, re.DOTALL)
    if bold and "Exception encountered when calling" in text:
        text = bold.group(1)
    return " ".join(_ANSI.sub("", text).split())
