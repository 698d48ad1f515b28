"""A training run's folder: one process at a time, whole checkpoints, a ledger.

A run that trains in a folder (`model_dir`) and resumes there after a kill
must neither lose its checkpoint nor misstate its epsilon:

* `hold(model_dir)` holds the folder for this process (an advisory `flock`
  on `TRAIN_LOCK`, released however the process ends) and checks that it
  is writable, before any step; a second process gets `SettingsError`.
* `save_checkpoint` writes a temporary file and renames it over
  `CHECKPOINT`, keeping the one before as `PREVIOUS_CHECKPOINT`, so a kill
  at any moment leaves one that loads; `load_checkpoint` names a damaged
  one in a warning and uses the earlier one. `AtomicCheckpoint` saves at
  every Keras epoch's end.
* `RunLedger` (`LEDGER`, JSON) records the run's `privacy_settings` (sigma,
  C, B, N, optimizer, physical batch, delta) and the steps of every process
  that trained it; `begin_ledger` refuses a resume whose privacy settings
  changed (one line naming the flags, `PRIVACY_SETTINGS`), and
  `RunLedger.epsilon` accounts the steps in the checkpoint.

A typical loop::

    with run_dir.hold(model_dir):
        model = run_dir.load_checkpoint(model_dir) or build_and_compile()
        ledger = run_dir.begin_ledger(model_dir, settings, model)
        model.fit(..., callbacks=[run_dir.AtomicCheckpoint(model_dir, ledger)])
        epsilon = ledger.epsilon()
"""

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any

from absl import logging
import keras

from tf_dpadam import accounting

# What a run folder holds.
CHECKPOINT = "checkpoint.keras"
PREVIOUS_CHECKPOINT = "checkpoint.prev.keras"
LEDGER = "ledger.json"
TRAIN_LOCK = "train.lock"

ACCOUNTANT = "pld"  # What a ledger records by default: the tighter.

# The settings a run's privacy (its epsilon) depends on, each with the flag
# that sets it (None: fixed by the loop). A resume must keep them all.
PRIVACY_SETTINGS = {
    "noise_multiplier": "--noise_multiplier", "l2_norm_clip": "--l2_norm_clip",
    "batch_size": "--batch_size", "num_examples": "--max_examples (N)",
    "optimizer": "--optimizer",
    "physical_batch_size": "--physical_batch_size", "sampling": None,
    "delta": "--delta",
}
# Settings that follow from those (compared only if those agree, e.g. with a
# checkpoint from before the ledger, which knows k but not the physical
# batch size).
DERIVED_SETTINGS = {"accumulation_steps": "accumulation steps (--batch_size /"
                                          " --physical_batch_size)"}
# The --optimizer of each tf_dpadam optimizer class.
OPTIMIZER_FLAGS = {
    "DPSGD": "dpsgd", "DPAdam": "dpadam", "DPAdamCorrected": "dpadam_corrected",
    "DPAdamScaleThenPrivatize": "dpadam_stp", "DPAdamDiSK": "dpadam_disk"}

Settings = dict[str, Any]
Segment = dict[str, Any]


class SettingsError(ValueError):
    """A run that cannot train in this folder (other privacy settings, held
    by another process, not writable, damaged): a usage error."""


def read_json(path: str) -> Any:
    """The JSON file at `path`, or None if there is none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_json(path: str, value: Any) -> None:
    """Writes `value` to `path` as JSON, whole or not at all (a temporary
    file renamed over it): a reader never sees half a file."""
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(partial, path)


def privacy_settings(*, noise_multiplier: float, l2_norm_clip: float,
                     batch_size: int, num_examples: int, optimizer: str,
                     physical_batch_size: int | None, accumulation_steps: int,
                     delta: float, accountant: str = ACCOUNTANT) -> Settings:
    """The settings a run's privacy depends on, as JSON values: sigma, C,
    the expected (Poisson) B, N, the optimizer's flag name ("dpsgd",
    "dpadam", "dpadam_corrected"), the physical batch (None: all of a step),
    k, delta, q = B / N and the accountant (recorded, not compared)."""
    return dict(
        noise_multiplier=float(noise_multiplier),
        l2_norm_clip=float(l2_norm_clip), batch_size=int(batch_size),
        num_examples=int(num_examples),
        sampling_rate=batch_size / num_examples, optimizer=optimizer,
        physical_batch_size=physical_batch_size,
        accumulation_steps=int(accumulation_steps), sampling="poisson",
        delta=float(delta), accountant=accountant)


def checkpoint_settings(model: keras.Model) -> Settings:
    """What a checkpoint's DP optimizer says of `privacy_settings` (for a
    run folder from before the ledger)."""
    optimizer = model.optimizer
    name = type(optimizer).__name__
    return dict(
        noise_multiplier=float(optimizer.noise_multiplier),
        l2_norm_clip=float(optimizer.dp_config.l2_norm_clip),  # initial C
        batch_size=optimizer.batch_size,
        optimizer=OPTIMIZER_FLAGS.get(name, name),
        accumulation_steps=int(optimizer.dp_accumulation_steps))


def settings_changes(model_dir: str, saved: Settings,
                     wanted: Settings) -> list[str]:
    """One `<flag>: the run in DIR was trained with X, got Y` per flag whose
    setting differs between `saved` and `wanted` (keys in both)."""
    changes = []
    for names in (PRIVACY_SETTINGS, DERIVED_SETTINGS):
        for key, flag in names.items():
            if key in saved and saved[key] != wanted[key]:
                changes.append(f"{flag or key}: the run in {model_dir} was"
                               f" trained with {saved[key]}, got"
                               f" {wanted[key]}")
        if changes:
            break
    return changes


def check_settings(model_dir: str, saved: Settings, wanted: Settings) -> None:
    """Raises `SettingsError` (one line naming the flags) if a resume would
    change a privacy setting."""
    changes = settings_changes(model_dir, saved, wanted)
    if changes:
        raise SettingsError(
            "; ".join(changes) + " (a resume keeps the settings its epsilon"
            " is accounted with; train new ones in another --model_dir).")


def resumed_segments(segments: list[Segment], done: int) -> list[Segment]:
    """The ledger's segments of the `done` steps of the checkpoint resumed.

    Segment i took the steps `first_step + 1 ... first_step + steps`. The
    steps past `done` are not in the model (a kill after the last
    checkpoint, or a damaged one): they are cut, and segments left with no
    step dropped. The last segment kept ends at `done` (its checkpoint can
    be newer than its record: a kill between the two writes).
    """
    kept = []
    for segment in segments:
        if segment["first_step"] >= done:
            break
        kept.append(dict(segment))
    if kept:
        kept[-1]["steps"] = done - kept[-1]["first_step"]
    return kept


def ledger_epsilon(segments: list[Segment]) -> float:
    """Epsilon of the steps in `segments` with their settings (0 for none;
    infinite without noise), with the last segment's accountant; a
    ValueError if the segments' settings differ (`check_settings`)."""
    if not segments:
        return 0.0

    def accounted(segment):
        return {k: v for k, v in segment["settings"].items()
                if k != "accountant"}

    if any(accounted(s) != accounted(segments[0]) for s in segments):
        raise ValueError("The ledger's segments have other settings.")
    settings = segments[-1]["settings"]
    if settings["noise_multiplier"] == 0:
        return math.inf
    return accounting.epsilon_after_steps(
        steps=sum(s["steps"] for s in segments),
        num_examples=settings["num_examples"],
        batch_size=settings["batch_size"],
        noise_multiplier=settings["noise_multiplier"],
        delta=settings["delta"], accountant=settings["accountant"])


class RunLedger:
    """The privacy ledger of a run folder (`LEDGER`, JSON).

    Attributes:
        path: the ledger's file.
        settings: the run's `privacy_settings`, fixed by its first process.
        segments: one per process that trained, in order: `first_step`,
            `steps` (the steps of this process in the checkpoint),
            `settings`, `started` (a time). Every write replaces the file
            whole (`write_json`), so it survives any kill.
    """

    def __init__(self, model_dir: str):
        """Reads `model_dir`'s ledger (empty if none); `SettingsError` if
        it is damaged."""
        self.path = os.path.join(model_dir, LEDGER)
        try:
            found = read_json(self.path) or {}
        except ValueError as error:
            raise SettingsError(
                f"{self.path} is damaged ({error}); the run's privacy ledger"
                " is lost: use another --model_dir.") from error
        self.settings: Settings | None = found.get("settings")
        self.segments: list[Segment] = found.get("segments", [])

    def begin(self, settings: Settings, done: int) -> None:
        """Starts this process's segment at the checkpoint's `done` steps
        (written before its first step)."""
        segments = resumed_segments(self.segments, done)
        if done and not segments:  # A run from before the ledger.
            segments = [{"first_step": 0, "steps": done, "settings": settings,
                         "started": None}]
        self.settings = self.settings or settings
        self.segments = segments + [{
            "first_step": done, "steps": 0, "settings": settings,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
        self.write()

    def record(self, steps: int) -> None:
        """The checkpoint now holds `steps` steps."""
        self.segments[-1]["steps"] = steps - self.segments[-1]["first_step"]
        self.write()

    def steps(self) -> int:
        """The steps of all segments."""
        return sum(s["steps"] for s in self.segments)

    def epsilon(self) -> float:
        """`ledger_epsilon` of the segments."""
        return ledger_epsilon(self.segments)

    def write(self) -> None:
        """Replaces the ledger's file whole."""
        write_json(self.path, {"settings": self.settings,
                               "segments": self.segments})


def begin_ledger(model_dir: str, settings: Settings,
                 model: keras.Model | None = None) -> RunLedger:
    """The ledger of `model_dir`, with this process's segment begun.

    Call it before any step, with the model (resumed from the checkpoint,
    or new). Raises `SettingsError`, writing nothing, if `settings`
    (`privacy_settings`) differ from the run's (the ledger's, or for a run
    from before the ledger, the checkpoint optimizer's).
    """
    ledger = RunLedger(model_dir)
    if model is not None and not ledger.settings:
        check_settings(model_dir, checkpoint_settings(model), settings)
    if ledger.settings:
        check_settings(model_dir, ledger.settings, settings)
    done = 0 if model is None else int(model.optimizer.iterations.numpy())
    ledger.begin(settings, done)
    return ledger


def check_writable(model_dir: str) -> None:
    """Raises `SettingsError` if no file can be written in `model_dir`."""
    probe = os.path.join(model_dir, f".write_test.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise not_writable(model_dir, error) from error


def not_writable(model_dir: str, error: OSError) -> SettingsError:
    """The error of an unwritable `model_dir`."""
    return SettingsError(f"--model_dir={model_dir} is not writable"
                         f" ({error.strerror}); use another --model_dir.")


@contextlib.contextmanager
def hold(model_dir: str) -> Iterator[None]:
    """Holds `model_dir` for this process (created if need be).

    Raises `SettingsError` before any step if another process holds it (an
    advisory `flock` on `TRAIN_LOCK`, released when this process ends,
    however it ends) or if the folder is not writable. Removes what a
    killed process left half-written.
    """
    try:
        os.makedirs(model_dir, exist_ok=True)
        lock = open(os.path.join(model_dir, TRAIN_LOCK), "a")
    except OSError as error:
        raise not_writable(model_dir, error) from error
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SettingsError(
                f"--model_dir={model_dir}: another process is training this"
                f" run (it holds {TRAIN_LOCK}); wait for it to end or"
                " use another --model_dir.") from None
        try:
            check_writable(model_dir)
            for name in os.listdir(model_dir):
                if name.startswith("checkpoint.") and ".partial" in name:
                    os.remove(os.path.join(model_dir, name))
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_model(model: keras.Model, path: str) -> None:
    """`model.save(path)`, on disk when it returns."""
    model.save(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(model: keras.Model, model_dir: str) -> None:
    """Saves `model` as the checkpoint of `model_dir`, whole or not at all.

    The model goes to a temporary file (`write_model`); the checkpoint
    becomes `PREVIOUS_CHECKPOINT` (a hard link: it stays in place too) and
    the new file replaces it (`os.replace`, atomic). A kill at any moment
    leaves a whole checkpoint.
    """
    checkpoint = os.path.join(model_dir, CHECKPOINT)
    partial = os.path.join(model_dir, f"checkpoint.{os.getpid()}.partial.keras")
    write_model(model, partial)
    if os.path.exists(checkpoint):
        link = os.path.join(model_dir,
                            f"checkpoint.prev.{os.getpid()}.partial")
        if os.path.lexists(link):
            os.remove(link)
        os.link(checkpoint, link)
        os.replace(link, os.path.join(model_dir, PREVIOUS_CHECKPOINT))
    os.replace(partial, checkpoint)


def one_line(error: BaseException) -> str:
    """`Type: message` of `error` on one line of at most 200 characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 200 else text[:197] + "..."


def load_checkpoint(model_dir: str) -> keras.Model | None:
    """The model of `model_dir`'s checkpoint, None if there is none yet.

    A checkpoint that does not load is damaged: one warning line says so
    and which earlier checkpoint (`PREVIOUS_CHECKPOINT`) is used instead.

    Raises:
        SettingsError: if there are checkpoints but none loads.
    """
    damaged = None
    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT):
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            continue
        try:
            model = keras.models.load_model(path)
        except Exception as error:  # pylint: disable=broad-except
            damaged = damaged or (name, one_line(error))
            continue
        if damaged:
            logging.warning(
                "%s in %s is damaged (%s); resuming from the earlier %s"
                " (step %d).", damaged[0], model_dir, damaged[1], name,
                int(model.optimizer.iterations.numpy()))
        return model
    if damaged:
        raise SettingsError(
            f"{damaged[0]} in {model_dir} is damaged ({damaged[1]}) and no"
            " earlier checkpoint loads; remove it to start the run over, or"
            " use another --model_dir.")
    return None


class AtomicCheckpoint(keras.callbacks.Callback):
    """At every epoch's end saves the model whole (`save_checkpoint`), then
    records its steps in the run's `RunLedger`."""

    def __init__(self, model_dir: str, ledger: RunLedger):
        super().__init__()
        self.model_dir = model_dir
        self.ledger = ledger

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        save_checkpoint(self.model, self.model_dir)
        self.ledger.record(int(self.model.optimizer.iterations.numpy()))
