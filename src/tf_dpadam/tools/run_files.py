"""The files of a run folder (`tf_dpadam.tools.run_dir`): JSON written whole,
the write test, and the one-line errors of a file that cannot be written.

A full disk or a folder made read-only mid-run is a `SettingsError` of one
line naming the file and the cause (`io_error`), not an `OSError`
traceback, and leaves no temporary file behind (`writing`); the write test
removes its file however it ends, and `remove_leftovers` removes what a
killed process left half-written (the space a full disk lacks may be its).
"""

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from typing import Any

from tf_dpadam.tools.run_ledger import SettingsError


def io_error(path: str, error: OSError,
             doing: str = "write") -> SettingsError:
    """The one-line error of a file of a run folder that could not be
    written (or read): the file, the cause and what to do."""
    cause = error.strerror or str(error)
    if error.errno is not None and error.errno in errno.errorcode:
        cause = f"{cause}, {errno.errorcode[error.errno]}"
    return SettingsError(
        f"Cannot {doing} {path} ({cause}): the run folder needs free space"
        " and write permission; fix that and rerun to resume from its last"
        " checkpoint.")


@contextlib.contextmanager
def writing(path: str, *temporaries: str) -> Iterator[None]:
    """Turns an `OSError` (a full disk, a folder made read-only) into
    `io_error(path)`, removing the `temporaries` it leaves half-written."""
    try:
        yield
    except OSError as error:
        for temporary in temporaries:
            with contextlib.suppress(OSError):
                os.remove(temporary)
        raise io_error(path, error) from error


def read_json(path: str) -> Any:
    """The JSON file at `path`, or None if there is none."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as error:
        raise io_error(path, error, "read") from error


def write_json(path: str, value: Any) -> None:
    """Writes `value` to `path` as JSON, whole or not at all (a temporary
    file renamed over it): a reader never sees half a file. `SettingsError`
    (one line, `io_error`) if it cannot, leaving no temporary file."""
    partial = f"{path}.{os.getpid()}.partial"
    with writing(path, partial):
        with open(partial, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(partial, path)


# The file `check_writable` writes (and removes), with the process id.
WRITE_TEST = ".write_test"


def check_writable(model_dir: str) -> None:
    """Raises `SettingsError` if no file can be written in `model_dir`
    (flushed: a full disk fails here), leaving no file behind."""
    probe = os.path.join(model_dir, f"{WRITE_TEST}.{os.getpid()}")
    try:
        try:
            with open(probe, "w") as f:
                f.write("ok")
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(probe)
    except OSError as error:
        raise not_writable(model_dir, error) from error


def remove_leftovers(model_dir: str) -> None:
    """Removes what a killed process left half-written in `model_dir` (its
    temporary checkpoint and JSON files, its write test): they take space
    and are no part of the run."""
    for name in os.listdir(model_dir):
        if ".partial" in name or name.startswith(WRITE_TEST + "."):
            os.remove(os.path.join(model_dir, name))


def not_writable(model_dir: str, error: OSError) -> SettingsError:
    """The error of an unwritable `model_dir`."""
    return SettingsError(f"--model_dir={model_dir} is not writable"
                         f" ({error.strerror}); use another --model_dir.")
