"""A run folder's privacy record (`ledger.json`) and the rules of a resume.

A run's privacy depends on its settings (`privacy_settings`: sigma, C, B,
N, optimizer, physical batch, delta); a resume must keep them
(`check_settings`, one line naming the flags that changed). A private model
owns its privacy ledger (`tf_dpadam.training.model_ledger`) and every checkpoint
carries it; a run folder's `ledger.json` is a `Record` beside the
checkpoints:

* `settings`: the run's privacy settings;
* `ledger`: the model's `tf_dpadam.accounting.ledger.Ledger` when its
  process began (with the steps it found abandoned) or, later, at its last
  checkpoint;
* `checkpoint_steps`: the steps of the run's last checkpoint (None: none
  was ever saved);
* `reserved_steps`: a write-ahead high-water mark. Before steps run, the
  process that trains reserves them (`reservation`: a chunk of at most
  `RESERVE_STEPS`, one write per chunk), so after a kill at any moment the
  record holds at least every step the process took.

A resume checks the checkpoint against the record (`problem`) and adds to
the model the steps the checkpoint lacks (`to_restore`): those of the record
and those reserved after them (its process's steps after its last
checkpoint, lost with it but spent), as a segment of the run's mechanism.
Nothing is ever dropped: the epsilon of the resumed model is at least that
of every step taken. Nothing here reads a file or imports TensorFlow
(`tf_dpadam.tools.run_dir` does).
"""

import dataclasses
import math
from typing import Any

from tf_dpadam.accounting import ledger as ledger_lib
from tf_dpadam.optimizers import registry

FORMAT = 2  # Of `Record.to_json`.
RESERVE_STEPS = 10  # The most steps one reservation holds.
# The binaries' flag that resumes a run whose files disagree, counting all.
COUNT_ALL_FLAG = "--resume_counting_all_steps"
ABANDONED = ("steps of a process that ended after its last checkpoint"
             " (reserved before they ran)")
BEFORE_LEDGER = "steps of a checkpoint saved before the privacy ledger"
ACCOUNTANT = "pld"  # What a ledger records by default: the tighter.

Settings = dict[str, Any]

# The settings a run's privacy (its epsilon) depends on, each with the flag
# that sets it (None: fixed by the loop). A resume must keep them all.
PRIVACY_SETTINGS = {
    "noise_multiplier": "--noise_multiplier", "l2_norm_clip": "--l2_norm_clip",
    "batch_size": "--batch_size", "num_examples": "--max_examples (N)",
    "optimizer": "--optimizer",
    "physical_batch_size": "--physical_batch_size", "sampling": None,
    "delta": "--delta", "noise_bands": "--noise_bands",
}
# Settings that follow from those (compared only if those agree, e.g. with a
# checkpoint from before the ledger, which knows k but not the physical
# batch size).
DERIVED_SETTINGS = {"accumulation_steps": "accumulation steps (--batch_size /"
                                          " --physical_batch_size)"}
# The --optimizer of each built-in DP optimizer class, by class name (a
# checkpoint's optimizer is looked up in the registry itself, which also
# knows the classes registered later).
OPTIMIZER_FLAGS = {class_name: flag for flag, class_name
                   in registry.class_names().items()}


class SettingsError(ValueError):
    """A run that cannot train in this folder (other privacy settings, held
    by another process, not writable, damaged): a usage error."""


def privacy_settings(*, noise_multiplier: float, l2_norm_clip: float,
                     batch_size: int, num_examples: int, optimizer: str,
                     physical_batch_size: int | None, accumulation_steps: int,
                     delta: float, accountant: str = ACCOUNTANT,
                     noise_bands: int = 1) -> Settings:
    """The settings a run's privacy depends on, as JSON values: sigma, C,
    the expected (Poisson) B, N, the optimizer's flag name ("dpsgd", ...:
    `tf_dpadam.optimizers.registry`), the physical batch (None: all of a step),
    k, delta, q = B / N, the accountant (recorded, not compared) and the
    bands of correlated noise (1: independent noise)."""
    return dict(
        noise_multiplier=float(noise_multiplier),
        l2_norm_clip=float(l2_norm_clip), batch_size=int(batch_size),
        num_examples=int(num_examples),
        sampling_rate=batch_size / num_examples, optimizer=optimizer,
        physical_batch_size=physical_batch_size,
        accumulation_steps=int(accumulation_steps), sampling="poisson",
        delta=float(delta), accountant=accountant,
        noise_bands=int(noise_bands))


def checkpoint_settings(model: Any) -> Settings:
    """What a checkpoint's DP optimizer (and its ledger's last segment,
    for N) say of `privacy_settings`."""
    optimizer = model.optimizer
    name = type(optimizer).__name__
    settings = dict(
        noise_multiplier=float(optimizer.noise_multiplier),
        l2_norm_clip=float(optimizer.dp_config.l2_norm_clip),  # initial C
        batch_size=optimizer.batch_size,
        optimizer=registry.optimizer_name(optimizer) or name,
        accumulation_steps=int(optimizer.dp_accumulation_steps),
        noise_bands=int(getattr(optimizer, "noise_bands", 1)))
    segments = model.privacy_ledger.segments
    if segments and segments[-1].mechanism.num_examples is not None:
        settings["num_examples"] = segments[-1].mechanism.num_examples
    return settings


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


@dataclasses.dataclass(frozen=True)
class Record:
    """What `ledger.json` holds (see the module)."""

    settings: Settings | None
    ledger: ledger_lib.Ledger
    checkpoint_steps: int | None
    reserved_steps: int

    def to_json(self):
        """The record as JSON values."""
        return {"format": FORMAT, "settings": self.settings,
                "ledger": self.ledger.to_json(),
                "checkpoint_steps": self.checkpoint_steps,
                "reserved_steps": int(self.reserved_steps)}

    @classmethod
    def from_json(cls, value):
        """The record of `to_json`'s value, or of a `ledger.json` from before
        the model's ledger (`from_segments`).

        Raises:
            ValueError: if `value` is no such record.
        """
        if not isinstance(value, dict) or (
                value.get("format") != FORMAT and "segments" not in value):
            raise ValueError(f"not a run ledger of format {FORMAT}")
        try:
            if "segments" in value:
                return from_segments(value)
            ledger = ledger_lib.Ledger.from_json(value["ledger"])
            checkpoint = value["checkpoint_steps"]
            reserved = int(value["reserved_steps"])
        except (KeyError, TypeError) as error:
            raise ValueError(f"no {error}") from error
        return cls(value["settings"], ledger,
                   None if checkpoint is None else int(checkpoint),
                   max(reserved, ledger.steps))


def mechanism_of(settings, source=ABANDONED):
    """The `Mechanism` of a step with `settings` (Poisson batches; with
    `noise_bands` b > 1, cyclic Poisson over b groups: a step counted at
    b = 1 would count T steps of the run as T Poisson steps at q = B / N,
    not ceil(T / b) at q = b B / N, and give a smaller epsilon)."""
    return ledger_lib.Mechanism.poisson(
        settings["noise_multiplier"], settings["num_examples"],
        settings["batch_size"], settings.get("accumulation_steps", 1), source,
        bands=settings.get("noise_bands", 1))


def from_segments(value):
    """The `Record` of a `ledger.json` from before the model's ledger: one
    segment of `{first_step, steps, settings}` per process, each counted
    with its settings."""
    segments = tuple(
        ledger_lib.Segment(mechanism_of(s["settings"], BEFORE_LEDGER),
                           int(s["steps"]), f"before-ledger-{i}")
        for i, s in enumerate(value["segments"]) if s["steps"])
    ledger = ledger_lib.Ledger(segments)
    return Record(value.get("settings"), ledger, ledger.steps or None,
                  ledger.steps)


def extends(longer, shorter):
    """Whether ledger `shorter` is an earlier state of `longer`: its
    segments begin `longer`'s (same ids and mechanisms, the same steps but
    for its last, which may have fewer)."""
    head, tail = longer.segments, shorter.segments
    if len(tail) > len(head):
        return False
    for i, (mine, theirs) in enumerate(zip(head, tail)):
        if mine.id != theirs.id or mine.mechanism != theirs.mechanism:
            return False
        last = i == len(tail) - 1
        if mine.steps < theirs.steps or not last and mine.steps > theirs.steps:
            return False
    return True


def agrees(checkpoint, record):
    """Whether a checkpoint's ledger and a `Record` are of one history: one
    is an earlier state of the other, and a newer checkpoint holds no step
    beyond the record's reservation."""
    if extends(record.ledger, checkpoint):
        return True
    return (extends(checkpoint, record.ledger)
            and checkpoint.steps <= record.reserved_steps)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a resume knows of the checkpoint it loaded.

    Attributes:
        ledger: the loaded model's `privacy_ledger`.
        iterations: its optimizer's steps.
        carries_ledger: False if the file had no ledger (saved before it:
            its ledger is empty, its optimizer took steps).
    """

    ledger: ledger_lib.Ledger
    iterations: int
    carries_ledger: bool = True


def describe(ledger):
    """`N steps in S segments` of a ledger, for messages."""
    steps, segments = ledger.steps, len(ledger.segments)
    return (f"{steps} step{'s' * (steps != 1)} in {segments}"
            f" segment{'s' * (segments != 1)}")


def problem(checkpoint_file, ledger_file, checkpoint, record):
    """Why a resume is refused (one line naming both files and
    `COUNT_ALL_FLAG`), or None.

    Args:
        checkpoint_file, ledger_file: the files' paths, for the message.
        checkpoint: the `Checkpoint` loaded (None: there is none).
        record: the `Record` read (None: there is none).
    """
    also = f"pass {COUNT_ALL_FLAG} to"
    instead = "or use another --model_dir."
    if checkpoint is None:
        if record is None or record.checkpoint_steps is None:
            return None  # A new run, or none of its processes saved one.
        return (f"{ledger_file} records a checkpoint of"
                f" {record.checkpoint_steps} steps but {checkpoint_file} is"
                f" missing; {also} start over counting its"
                f" {record.reserved_steps} steps, {instead}")
    if not checkpoint.carries_ledger:
        return (f"{checkpoint_file} carries no privacy ledger (saved before"
                f" tf_dpadam kept one): its {checkpoint.iterations} steps"
                f" cannot be checked against {ledger_file}; {also} count the"
                f" steps of both, {instead}")
    if record is None:
        return (f"{checkpoint_file} holds {checkpoint.ledger.steps} steps but"
                f" {ledger_file} is missing, so the steps after that"
                f" checkpoint are unknown; {also} resume counting the"
                f" checkpoint's steps only, {instead}")
    if not agrees(checkpoint.ledger, record):
        return (f"{checkpoint_file} and {ledger_file} disagree: the"
                f" checkpoint's privacy ledger ({describe(checkpoint.ledger)})"
                f" is not the one the ledger records"
                f" ({describe(record.ledger)}), e.g. a ledger.json of another"
                f" run; {also} resume counting the steps of both, {instead}")
    return None


def to_restore(checkpoint, record, mechanism):
    """The `Ledger` to merge into the resumed model (`ModelLedger.restore`:
    segments it has keep their larger count, others are composed).

    It holds the record's ledger and, as a segment of `mechanism`, the
    record's reserved steps beyond everything known of its process (for
    records that disagree with the checkpoint, beyond its own ledger);
    for a checkpoint without a ledger, its optimizer's steps beyond those.
    """
    known = ledger_lib.Ledger() if checkpoint is None else checkpoint.ledger
    restore = ledger_lib.Ledger()
    if record is not None:
        union = known.merged(record.ledger)
        same_history = checkpoint is None or agrees(known, record)
        seen = union.steps if same_history else record.ledger.steps
        restore = plus(record.ledger, mechanism,
                       record.reserved_steps - seen)
        known = union.merged(restore)
    if checkpoint is not None and not checkpoint.carries_ledger:
        restore = plus(restore,
                       dataclasses.replace(mechanism, source=BEFORE_LEDGER),
                       checkpoint.iterations - known.steps)
    return restore


def plus(ledger, mechanism, steps):
    """`ledger` and a new segment of `steps` steps of `mechanism` (none if
    `steps` <= 0)."""
    if steps <= 0:
        return ledger
    return ledger.appended(ledger_lib.Segment(mechanism, int(steps)))


def steps_within(batches, accumulation_steps):
    """The most logical steps `batches` physical batches can complete (k
    of them a step; any window of b batches ends at most ceil(b / k))."""
    return max(1, math.ceil(batches / accumulation_steps))


def reservation(done, reserved, ahead, left=None):
    """The reservation to write before a call of the train function, or None
    if `reserved` covers it.

    Args:
        done: the model's steps now (its ledger's).
        reserved: the steps reserved so far.
        ahead: the most steps the call can take.
        left: the most steps left in the epoch, if known (a reservation
            stops there: the checkpoint follows).

    Returns:
        `done + max(ahead, min(RESERVE_STEPS, left))`, or None.
    """
    if done + ahead <= reserved:
        return None
    chunk = RESERVE_STEPS if left is None else min(RESERVE_STEPS, left)
    return done + max(ahead, chunk)
