"""Command lines whose usage errors take one line (absl flags).

`run(main)` is `absl.app.run(main)` for the command lines of tf_dpadam and of
its example and research binaries: a flag that does not parse or fails its
check (`register_check`), and an `app.UsageError` raised by `main`, end with
`<program>: error: <reason>` on stderr and exit code 2, as argparse's.

`unreachable(url)` and `tfds_prepared(name, data_dir)` let the example
binaries refuse, in one line and seconds, a download that cannot happen
(offline), instead of retrying for minutes.

This module does not import TensorFlow.
"""

import glob
import os
import socket
import sys
import threading
import urllib.parse
import urllib.request

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


# (old name, new name) of the deprecated flags of FLAGS
# (`define_deprecated_alias`).
_ALIASES = []


def define_deprecated_alias(old, new):
    """Defines --`old` as a deprecated name of the flag --`new` (defined).

    `run` copies --old's value to --new and writes one line of warning on
    stderr; giving both is a usage error. --old is left out of `--help`
    (`--helpfull` lists it). absl's DEFINE_alias would not warn.
    """
    flag = flags.FLAGS[new]
    flags.DEFINE(flag.parser, old, None, f"Deprecated name of --{new}.",
                 serializer=flag.serializer)
    _ALIASES.append((old, new))


def _apply_aliases():
    for old, new in _ALIASES:
        if not flags.FLAGS[old].present:
            continue
        if flags.FLAGS[new].present:
            _exit_with_usage_error(f"--{old} is the deprecated name of --{new};"
                                   f" give --{new} only.")
        sys.stderr.write(f"warning: --{old} is deprecated and will be removed;"
                         f" use --{new}.\n")
        flags.FLAGS[new].value = flags.FLAGS[old].value


def _parse_flags(argv):
    try:
        args = flags.FLAGS(argv)
    except flags.Error as error:
        _exit_with_usage_error(error)
    _apply_aliases()
    return args


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
    raises `ValueError` (e.g. of `tf_dpadam.common.validation`); None passes.

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


def unreachable(url, timeout=2.0):
    """Why `url`'s host (or the HTTPS proxy's) takes no TCP connection within
    `timeout` seconds, e.g. "no network: [Errno -2] Name or service not
    known"; None if it does. Name resolution counts in the timeout."""
    proxy = urllib.request.getproxies().get(urllib.parse.urlsplit(url).scheme)
    parts = urllib.parse.urlsplit(proxy or url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome = [f"no network: {parts.hostname}:{port} did not answer within"
               f" {timeout:g} s"]

    def connect():
        try:
            socket.create_connection((parts.hostname, port), timeout).close()
            outcome[0] = None
        except OSError as error:
            outcome[0] = f"no network: {error}"

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0]


# Where keras-hub downloads a preset from, by its scheme (a name without
# one: keras-hub's own presets, on Kaggle).
PRESET_HOSTS = {"hf": "https://huggingface.co",
                "modelscope": "https://modelscope.cn",
                "kaggle": "https://api.kaggle.com"}


def preset_unreachable(preset):
    """Why keras-hub cannot download `preset` (a preset name, e.g.
    "bert_tiny_en_uncased" or "hf://owner/name"), as `unreachable` says;
    None if it is a local folder, None, of an unknown scheme, or its host
    answers (without a network keras-hub would retry for minutes)."""
    if not preset or os.path.isdir(preset):
        return None
    scheme = preset.split("://")[0].lower() if "://" in preset else "kaggle"
    url = PRESET_HOSTS.get(scheme)
    return url and unreachable(url)


def tfds_prepared(name, data_dir=None):
    """Whether tensorflow-datasets' `name` (e.g. "glue/sst2") is prepared in
    `data_dir` (default: $TFDS_DATA_DIR or ~/tensorflow_datasets), without
    importing tensorflow-datasets."""
    root = (data_dir or os.environ.get("TFDS_DATA_DIR")
            or os.path.join(os.path.expanduser("~"), "tensorflow_datasets"))
    pattern = os.path.join(root, *name.split("/"), "**", "dataset_info.json")
    return bool(glob.glob(pattern, recursive=True))
