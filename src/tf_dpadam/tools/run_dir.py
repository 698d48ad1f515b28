"""A training run's folder: one process at a time, whole checkpoints, a ledger.

A run that trains in a folder (`model_dir`) and resumes there after a kill
must neither lose its checkpoint nor misstate its epsilon:

* `hold(model_dir)` holds the folder for this process (an advisory `flock`
  on `TRAIN_LOCK`, released however the process ends), removes what a
  killed process left half-written and checks that the folder is
  writable, before any step; a second process gets `SettingsError`, as
  does a file that cannot be written (`tf_dpadam.tools.run_files`).
* `save_checkpoint` writes a temporary file and renames it over
  `CHECKPOINT`, keeping the one before as `PREVIOUS_CHECKPOINT`, so a kill
  at any moment leaves one that loads; `load_checkpoint` names a damaged
  one in a warning and uses the earlier one. Every checkpoint carries the
  model's privacy ledger (`tf_dpadam.training.model_ledger`).
* `RunLedger` (`LEDGER`, JSON: a `tf_dpadam.tools.run_ledger.Record`) records the
  run's `privacy_settings` (sigma, C, B, N, optimizer, physical batch,
  delta), the model's ledger at its last checkpoint and the steps reserved
  before they run. `begin_ledger` refuses a resume whose privacy settings
  changed (one line naming the flags, `PRIVACY_SETTINGS`) or whose files
  disagree (`run_ledger.problem`: a ledger of another run, a checkpoint or
  a ledger missing; `count_all_steps` resumes anyway, counting the steps of
  both), and adds to the model the steps its checkpoint lacks (a killed
  process's steps after its last checkpoint). `AtomicCheckpoint` reserves
  steps before they run and checkpoints at every epoch's end, and
  `RunLedger.epsilon` is the model's: the composition of every step taken.
* A resume keeps the checkpoint's optimizer; `resume_learning_rate` gives
  it the learning rate asked for (no privacy setting), and `ProgressBar`
  counts the epochs of the whole run across `fit` calls. `resumed` holds
  the folder and loads its checkpoint with that learning rate.

A typical loop::

    with run_dir.resumed(model_dir, learning_rate) as model:
        model = model or build_and_compile()  # None: no checkpoint yet.
        ledger = run_dir.begin_ledger(model_dir, settings, model)
        model.fit(..., callbacks=[run_dir.AtomicCheckpoint(model_dir, ledger),
                                  run_dir.ProgressBar(epochs)])
        epsilon = ledger.epsilon()
"""

import contextlib
import dataclasses
import fcntl
import os
from collections.abc import Iterator
from typing import Any

from absl import logging
import keras
import numpy as np

from tf_dpadam.tools import run_ledger
from tf_dpadam.tools.run_files import (WRITE_TEST, check_writable, io_error,
                                 not_writable, read_json, remove_leftovers,
                                 write_json, writing)

# What a run folder holds.
CHECKPOINT = "checkpoint.keras"
PREVIOUS_CHECKPOINT = "checkpoint.prev.keras"
LEDGER = "ledger.json"
TRAIN_LOCK = "train.lock"
# The secret state of correlated noise beside each checkpoint (owner only).
NOISE_STATE = "noise_state.npz"
PREVIOUS_NOISE_STATE = "noise_state.prev.npz"

# The run's privacy settings and the usage error of a folder, kept in
# `run_ledger` with the record they go into.
ACCOUNTANT = run_ledger.ACCOUNTANT
PRIVACY_SETTINGS = run_ledger.PRIVACY_SETTINGS
Settings = run_ledger.Settings
SettingsError = run_ledger.SettingsError
privacy_settings = run_ledger.privacy_settings
checkpoint_settings = run_ledger.checkpoint_settings
settings_changes = run_ledger.settings_changes
check_settings = run_ledger.check_settings


class RunLedger:
    """The privacy record of a run folder (`LEDGER`, a
    `run_ledger.Record`), written whole (`write_json`) at a process's
    beginning, at every reservation and checkpoint and at the end of
    training, so it survives any kill.

    Attributes:
        path: the record's file.
        record: the `run_ledger.Record` (None: no file yet).
        settings: the run's `privacy_settings`, fixed by its first process.
        model: the model this process trains (`begin`).
    """

    def __init__(self, model_dir: str):
        """Reads `model_dir`'s record (None if none); `SettingsError` if it
        is damaged."""
        self.path = os.path.join(model_dir, LEDGER)
        self.model = None
        try:
            found = read_json(self.path)
            self.record = (None if found is None
                           else run_ledger.Record.from_json(found))
        except SettingsError:  # Not readable (`io_error`).
            raise
        except ValueError as error:
            raise SettingsError(
                f"{self.path} is damaged ({error}); the run's privacy ledger"
                " is lost: use another --model_dir.") from error
        self.settings = self.record and self.record.settings

    def begin(self, model: keras.Model, settings: Settings,
              restore: Any, checkpoint_steps: int | None) -> None:
        """Adds `restore` (a `Ledger`) to `model`'s ledger and writes the
        record of this process (before its first step)."""
        if restore.segments:
            add_to_ledger(model, restore)
        self.model = model
        self.settings = self.settings or settings
        ledger = model.privacy_ledger
        self.record = run_ledger.Record(self.settings, ledger,
                                        checkpoint_steps, ledger.steps)
        self.write()

    def reserve(self, ahead: int, left: int | None = None) -> None:
        """Reserves the steps of the next call of the train function (at
        most `ahead`; `left` in the epoch) unless they are (`run_ledger.
        reservation`)."""
        reserved = run_ledger.reservation(
            self.steps(), self.record.reserved_steps, ahead, left)
        if reserved is not None:
            self._update(reserved_steps=reserved)

    def checkpointed(self) -> None:
        """The checkpoint now holds the model (and its ledger)."""
        ledger = self.model.privacy_ledger
        self._update(ledger=ledger, checkpoint_steps=ledger.steps,
                     reserved_steps=max(ledger.steps,
                                        self.record.reserved_steps))

    def release(self) -> None:
        """No step runs until the next reservation: the reservation is the
        steps taken."""
        self._update(reserved_steps=self.steps())

    def steps(self) -> int:
        """The model's steps (its ledger's: all of the run's)."""
        return self.model.privacy_ledger.steps

    def epsilon(self) -> float:
        """The model's epsilon at the run's delta (`spent_epsilon`): the
        composition of every step of the run."""
        return self.model.spent_epsilon(self.settings["delta"],
                                        self.settings.get("accountant",
                                                          ACCOUNTANT))

    def _update(self, **changes: Any) -> None:
        record = dataclasses.replace(self.record, **changes)
        if record != self.record:
            self.record = record
            self.write()

    def write(self) -> None:
        """Replaces the record's file whole."""
        write_json(self.path, self.record.to_json())


def add_to_ledger(model: keras.Model, ledger: Any) -> None:
    """Merges `ledger` into `model`'s privacy ledger as loading a weights
    store does (`tf_dpadam.training.model_ledger`: its segments keep their larger
    count, others are composed); the model's own variables are written
    back as they are."""
    model.add_to_privacy_ledger(ledger)


def loaded_checkpoint(model: keras.Model) -> run_ledger.Checkpoint:
    """The `run_ledger.Checkpoint` of a model loaded from a checkpoint: one
    loaded without a ledger (saved before tf_dpadam kept one), or whose
    ledger is empty though its optimizer took steps, has an unknown
    history; its optimizer's steps are the least it took."""
    ledger = model.privacy_ledger
    iterations = int(model.optimizer.iterations.numpy())
    unknown = model.loaded_without_ledger or (iterations and not ledger.steps)
    return run_ledger.Checkpoint(ledger, iterations, not unknown)


def has_checkpoint(model_dir: str) -> bool:
    """Whether `model_dir` holds a checkpoint (`load_checkpoint` loads it)."""
    return any(os.path.exists(os.path.join(model_dir, name))
               for name in (CHECKPOINT, PREVIOUS_CHECKPOINT))


def begin_ledger(model_dir: str, settings: Settings, model: keras.Model, *,
                 count_all_steps: bool = False) -> RunLedger:
    """The ledger of `model_dir`, begun for this process.

    Call it before any step with the model: `load_checkpoint`'s, or a new
    one if the folder holds no checkpoint. The model gets the steps its
    checkpoint lacks (`run_ledger.to_restore`).

    Args:
        model_dir: the run folder.
        settings: this process's `privacy_settings`.
        model: the model to train.
        count_all_steps: resume even if the checkpoint and the ledger
            disagree or one is missing (`run_ledger.problem`), counting
            the steps of both (`run_ledger.COUNT_ALL_FLAG`).

    Raises:
        SettingsError: writing nothing, if the files disagree (and not
            `count_all_steps`), or if `settings` differ from the run's (the
            record's, and the checkpoint's `checkpoint_settings`).
    """
    ledger = RunLedger(model_dir)
    record = ledger.record
    checkpoint = (loaded_checkpoint(model) if has_checkpoint(model_dir)
                  else None)
    problem = run_ledger.problem(os.path.join(model_dir, CHECKPOINT),
                                 ledger.path, checkpoint, record)
    if problem and not count_all_steps:
        raise SettingsError(problem)
    if ledger.settings:
        check_settings(model_dir, ledger.settings, settings)
    if checkpoint is not None:
        check_settings(model_dir, checkpoint_settings(model), settings)
    restore = run_ledger.to_restore(checkpoint, record,
                                    run_ledger.mechanism_of(settings))
    ledger.begin(model, settings, restore,
                 None if checkpoint is None else checkpoint.ledger.steps)
    return ledger


def resume_learning_rate(model: keras.Model,
                         learning_rate: float | None) -> None:
    """Gives the optimizer of a resumed `model` (restored whole, learning
    rate included) the `learning_rate` asked for (None: keeps the
    checkpoint's), logging one line if it changes. The learning rate is no
    privacy setting, so a resume may change it; `SettingsError` if the
    checkpoint's is a schedule (or callable), which cannot be set."""
    if learning_rate is None:
        return
    optimizer = model.optimizer
    old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    try:
        optimizer.learning_rate = learning_rate
    except (TypeError, AttributeError) as error:  # A schedule, a callable.
        raise SettingsError(
            f"--learning_rate={learning_rate:g}: the checkpoint's optimizer"
            " has a learning-rate schedule (or callable), which a resume"
            " keeps; train with another learning rate in another"
            " --model_dir.") from error
    new = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    if new != old:
        logging.info("Resuming with learning_rate %g (the checkpoint's"
                     " was %g).", learning_rate, old)


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
            try:  # The leftovers first: they may be what fills the disk.
                remove_leftovers(model_dir)
            except OSError as error:
                raise not_writable(model_dir, error) from error
            check_writable(model_dir)
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
    link = os.path.join(model_dir, f"checkpoint.prev.{os.getpid()}.partial")
    with writing(checkpoint, partial, link):
        write_model(model, partial)
        if os.path.exists(checkpoint):
            if os.path.lexists(link):
                os.remove(link)
            os.link(checkpoint, link)
            os.replace(link, os.path.join(model_dir, PREVIOUS_CHECKPOINT))
        os.replace(partial, checkpoint)
    save_noise_state(model, model_dir)


def _noise_history(model):
    """The model's `NoiseHistory`, or None (not a private model)."""
    return getattr(model, "noise_history", None)


def save_noise_state(model: keras.Model, model_dir: str) -> None:
    """Writes the model's correlated-noise state (the past noise: SECRET,
    readable by the owner only) as `NOISE_STATE`, tagged with the
    optimizer's step, keeping the one before as `PREVIOUS_NOISE_STATE`
    (beside `PREVIOUS_CHECKPOINT`). Nothing without correlated noise."""
    history = _noise_history(model)
    values = None if history is None else history.to_numpy()
    if values is None:
        return
    values["optimizer_step"] = np.asarray(
        int(model.optimizer.iterations.numpy()))
    path = os.path.join(model_dir, NOISE_STATE)
    partial = os.path.join(model_dir, f"noise_state.{os.getpid()}.partial")
    with writing(path, partial):
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             0o600)
        with os.fdopen(descriptor, "wb") as f:
            np.savez(f, **values)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.replace(path, os.path.join(model_dir, PREVIOUS_NOISE_STATE))
        os.replace(partial, path)


def load_noise_state(model: keras.Model, model_dir: str,
                     checkpoint: str = CHECKPOINT) -> bool:
    """Gives a model loaded from `checkpoint` its correlated-noise state,
    if the folder holds the one saved with it (the same optimizer step).

    Returns:
        Whether a state was restored. Without one the noise history starts
        again at zero, which is as private (`noise_history`): a log line
        says so when the folder has a state of another step.
    """
    history = _noise_history(model)
    name = (NOISE_STATE if checkpoint == CHECKPOINT
            else PREVIOUS_NOISE_STATE)
    path = os.path.join(model_dir, name)
    if history is None or not os.path.exists(path):
        return False
    with np.load(path) as saved:
        values = {key: saved[key] for key in saved.files}
    step = int(model.optimizer.iterations.numpy())
    if int(values.pop("optimizer_step")) != step:
        logging.warning(
            "%s in %s was not saved with the checkpoint (step %d); the"
            " correlated noise starts a new history.", name, model_dir, step)
        return False
    history.restore(values)
    return True


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
        load_noise_state(model, model_dir, name)
        return model
    if damaged:
        raise SettingsError(
            f"{damaged[0]} in {model_dir} is damaged ({damaged[1]}) and no"
            " earlier checkpoint loads; remove it to start the run over, or"
            " use another --model_dir.")
    return None


@contextlib.contextmanager
def resumed(model_dir: str | None,
            learning_rate: float | None = None
            ) -> Iterator[keras.Model | None]:
    """Holds `model_dir` (`hold`) and yields the model of its checkpoint
    (`load_checkpoint`) with the `learning_rate` asked for
    (`resume_learning_rate`; None: the checkpoint's), or None if it holds
    no checkpoint yet. A `model_dir` of None (no run folder) holds nothing
    and yields None.

    Raises:
        SettingsError: as `hold`, `load_checkpoint` and
            `resume_learning_rate` do, before any step.
    """
    if not model_dir:
        yield None
        return
    with hold(model_dir):
        model = load_checkpoint(model_dir)
        if model is not None:
            resume_learning_rate(model, learning_rate)
        yield model


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, counting up to the run's last epoch `epochs`.

    Keras counts up to each `fit` call's `epochs`: a run split into calls (a
    resume, a last epoch of another length) logs `Epoch 14/14` then `Epoch
    15/15`. Given to every call (it replaces Keras' bar) this one logs
    `Epoch 14/15` then `Epoch 15/15`."""

    def __init__(self, epochs: int):
        super().__init__()
        self.run_epochs = epochs

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        self.epochs = max(self.run_epochs, params["epochs"])


class AtomicCheckpoint(keras.callbacks.Callback):
    """Keeps a run folder while Keras trains in it.

    Before each call of the train function, reserves its steps in the run's
    `RunLedger` (`RunLedger.reserve`: at most one write per
    `run_ledger.RESERVE_STEPS` steps, none past the epoch's end), so a kill
    at any moment leaves a record of every step taken; at every epoch's end
    saves the model whole (`save_checkpoint`) and records its ledger; when
    training ends, releases the reservation to the steps taken.
    """

    def __init__(self, model_dir: str, ledger: RunLedger):
        super().__init__()
        self.model_dir = model_dir
        self.ledger = ledger

    def on_train_batch_begin(self, batch: int, logs: dict | None = None
                             ) -> None:
        k = self.model.optimizer.dp_accumulation_steps
        batches = self.params.get("steps")
        self.ledger.reserve(
            run_ledger.steps_within(self.model.steps_per_execution, k),
            None if not batches else run_ledger.steps_within(
                batches - batch, k))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        save_checkpoint(self.model, self.model_dir)
        self.ledger.checkpointed()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.ledger.release()
