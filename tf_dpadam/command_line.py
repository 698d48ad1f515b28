"""Command lines whose usage errors take one line (absl flags).

`run(main)` is `absl.app.run(main)` for the command lines of tf_dpadam and of
its example and research binaries: a flag that does not parse or fails its
check (`register_check`), and an `app.UsageError` raised by `main`, end with
`<program>: error: <reason>` on stderr and exit code 2, as argparse's.

This module does not import TensorFlow.
"""

import os
import sys

from absl import app
from absl import flags

# The exit code of a usage error (a bad flag value or combination), as
# argparse's.
USAGE_ERROR_EXIT_CODE = 2


def usage_error_line(message):
    """`<program>: error: <message>` on one line (the message's newlines
    become spaces)."""
    program = os.path.basename(sys.argv[0]) if sys.argv else "python"
    return f"{program}: error: {' '.join(str(message).split())}"


def _exit_with_usage_error(message):
    sys.stderr.write(usage_error_line(message) + "\n")
    sys.stderr.flush()
    sys.exit(USAGE_ERROR_EXIT_CODE)


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        _exit_with_usage_error(error)


def run(main, argv=None):
    """`absl.app.run(main)` whose usage errors take one line.

    A flag that does not parse or fails its validator (`register_check`), and
    an `app.UsageError` raised by `main`, print `<program>: error: <reason>`
    on stderr and exit with code 2: no help text, no traceback. Other
    exceptions keep their traceback (they are bugs, not usage errors).
    """

    def main_with_usage_errors(args):
        try:
            return main(args)
        except app.UsageError as error:
            _exit_with_usage_error(error)

    app.run(main_with_usage_errors, argv=argv, flags_parser=_parse_flags)


def register_check(name, check, flag_values=flags.FLAGS):
    """Validates flag `name` at parsing with `check(value)`, a function that
    raises `ValueError` (e.g. of `tf_dpadam.validation`); None passes.

    The error reads `flag --delta=2.0: Expected delta=2.0 in (0, 1).`
    """

    def checker(value):
        if value is not None:
            try:
                check(value)
            except ValueError as error:
                raise flags.ValidationError(str(error)) from None
        return True

    flags.register_validator(name, checker, flag_values=flag_values)
