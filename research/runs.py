"""One run of the experiments: its setting, its folder, reading it back.

A run is one `common.TrainConfig` trained in a folder of its own (the
`model_dir` of `research.training.fit_private`, which writes metrics.json
there). `execute` adds `reproduce.json` beside it (data, wall time, command,
machine, "done") and on a second call reads the finished run back instead of
retraining it; an interrupted run resumes from its checkpoint. A folder that
holds a run of other hyperparameters or other data is refused
(`check_run_dir`) rather than mixed in.

Several processes can work through the same runs (e.g. the same
`research.reproduce` command started twice on a machine with cores to
spare): a process trains a run only while it holds the run's lock (`LOCK`,
an advisory `flock`, released by the system if the process dies), and
`execute_all` trains the runs nobody holds first, then waits for the others
and reads them back.
"""

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import platform
import time

from absl import logging

from research import common
from tf_dpadam.tools import run_dir

METRICS = "metrics.json"
SIDECAR = "reproduce.json"  # What `execute` adds to a run's model_dir.
# The seconds a run has trained over all its sessions and its curve so far,
# rewritten at every checkpoint (`training.RunProgress`), so that a resumed
# run's wall time and curve include the sessions before.
ELAPSED = "elapsed.json"
# Held (flock) by the process that trains the run.
LOCK = "run.lock"
# What `research.training` keeps in a model_dir: the checkpoint and the one
# before it (both whole: written to a temporary file, then renamed; each
# carries the model's privacy ledger), the run's privacy record (the
# settings, the ledger at the last checkpoint and the steps reserved before
# they run, `tf_dpadam.tools.run_ledger.Record`), and the lock of the process that
# trains (flock).
CHECKPOINT = run_dir.CHECKPOINT
PREVIOUS_CHECKPOINT = run_dir.PREVIOUS_CHECKPOINT
LEDGER = run_dir.LEDGER
TRAIN_LOCK = run_dir.TRAIN_LOCK


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of a grid. gamma: None for DP-SGD (it has none) and for
    DP-AdamBC's default 0.04 * Phi."""

    optimizer: str
    learning_rate: float
    gamma: float | None


def format_gamma(setting):
    """How the reports print the setting's gamma ("-": DP-SGD has none)."""
    if setting.optimizer == "dpsgd":
        return "-"
    if setting.gamma is None:
        return "0.04·Φ"
    return f"{setting.gamma:g}"


def format_percent(x):
    """An accuracy fraction as a percentage with 2 decimals, or "n/a"."""
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.2f}"


def format_seconds(x):
    """Seconds without decimals, or "n/a"."""
    return "n/a" if x is None else f"{x:.0f}"


def run_name(setting, seed):
    """The folder of one run, e.g. `dpadam_lr0.001_g1e-08_seed0`."""
    name = f"{setting.optimizer}_lr{setting.learning_rate:g}"
    if setting.optimizer != "dpsgd":
        gamma = "phi" if setting.gamma is None else f"{setting.gamma:g}"
        name += f"_g{gamma}"
    return f"{name}_seed{seed}"


def folder_name(model_dir):
    """The last part of `model_dir` (a run's name in the logs and records),
    with or without a trailing separator."""
    return os.path.basename(os.path.normpath(model_dir))


def run_config(base, setting, seed, model_dir):
    """The `TrainConfig` of one run.

    The run's seed also keys its DP noise and Poisson sampling
    (`noise_seed=seed`), unlike the binaries' secret default: these are
    research reruns on public data, compared across seeds, and each must be
    reproducible (anyone who knows the seed can remove the noise, so their
    models are not private).
    """
    return dataclasses.replace(
        base, optimizer=setting.optimizer,
        learning_rate=setting.learning_rate, epsilon=setting.gamma, seed=seed,
        noise_seed=seed, model_dir=model_dir,
    )


@dataclasses.dataclass(frozen=True)
class Record:
    """A finished run, as read back from its model_dir."""

    name: str
    setting: Setting
    seed: int
    accuracy: float
    epsilon: float
    steps: int
    num_examples: int
    wall_seconds: float | None
    resumed: bool
    history: tuple  # (step, test accuracy) per evaluation.
    command: str | None
    machine: dict | None
    # The accuracy on the training examples the run held out
    # (`common.TrainConfig.validation_examples`), by which tuning selects
    # (`comparison.selection_accuracies`); None: no validation split (runs
    # recorded before it, or with none).
    validation_accuracy: float | None = None


def comparable_config(config):
    """The config as JSON values, without model_dir (runs may move); as
    the run's records hold it (`common.config_record`: no `noise_bands`
    when it is 1, no `validation_examples` when it is 0)."""
    values = json.loads(json.dumps(common.config_record(config)))
    values.pop("model_dir", None)
    return values


# The run folder's JSON files, read and written whole (`tf_dpadam.run_dir`).
read_json = run_dir.read_json
write_json = run_dir.write_json


def check_run_dir(model_dir, config, data):
    """Raises if `model_dir` holds a run of other hyperparameters or data."""
    wanted = comparable_config(config)
    # The fields a record may leave out (`common.config_record`) at their
    # defaults, on both sides.
    defaults = {field.name: field.default
                for field in dataclasses.fields(config)
                if field.default is not dataclasses.MISSING}
    wanted = {**{k: v for k, v in defaults.items() if k != "model_dir"},
              **wanted}
    for source in (read_json(os.path.join(model_dir, SIDECAR)),
                   read_json(os.path.join(model_dir, METRICS))):
        if source is None:
            continue
        if "config" in source and source["config"] is not None:
            saved = dict(source["config"])
            saved.pop("model_dir", None)
            # Runs from before --noise_seed keyed their noise and sampling
            # with the seed; runs from before a later field (weight_decay,
            # ema, ...) had its default.
            saved.setdefault("noise_seed", saved.get("seed"))
            for name, default in defaults.items():
                if name != "model_dir":
                    saved.setdefault(name, default)
            if saved != wanted:
                diff = sorted(k for k in saved.keys() | wanted.keys()
                              if saved.get(k) != wanted.get(k))
                raise ValueError(
                    f"{model_dir} holds a run with other hyperparameters "
                    f"({', '.join(diff)}); use another --runs_dir.")
        if "data" in source and source["data"] != data:
            raise ValueError(
                f"{model_dir} holds a run on other data ({source['data']} vs"
                f" {data}); use another --runs_dir.")


def load_record(model_dir, config, data):
    """The finished run in `model_dir`, or None if it is not (yet) finished.

    Finished: metrics.json of the same config reports all the planned steps,
    and the sidecar file (`reproduce.json`: data, wall time, command,
    machine) of the same data says "done". The record's setting and seed are
    `config`'s (see `run_config`); its `validation_accuracy` is None when
    metrics.json has none (a run without a validation split).
    """
    check_run_dir(model_dir, config, data)
    metrics = read_json(os.path.join(model_dir, METRICS))
    sidecar = read_json(os.path.join(model_dir, SIDECAR))
    if (metrics is None or sidecar is None or sidecar.get("status") != "done"
            or metrics["steps"] < metrics["planned_steps"]):
        return None
    history = tuple((int(r["step"]), float(r["val_accuracy"]))
                    for r in metrics.get("history", [])
                    if "val_accuracy" in r)
    return Record(
        name=folder_name(model_dir),
        setting=Setting(config.optimizer, config.learning_rate,
                        config.epsilon),
        seed=config.seed,
        accuracy=float(metrics["test_accuracy"]),
        epsilon=float(metrics["epsilon"]),
        steps=int(metrics["steps"]),
        num_examples=int(metrics["num_examples"]),
        wall_seconds=sidecar.get("wall_seconds"),
        resumed=bool(sidecar.get("resumed")),
        history=history,
        command=sidecar.get("command"),
        machine=sidecar.get("machine"),
        validation_accuracy=(
            None if metrics.get("validation_accuracy") is None
            else float(metrics["validation_accuracy"])),
    )


def machine_info():
    """The platform, CPUs and versions this process runs on."""
    import keras
    import tensorflow as tf

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    return info


def progress_before(model_dir):
    """`(seconds, rows)`: the wall time and the evaluations of the run in
    `model_dir` up to its checkpoint (`ELAPSED`; else, for a run that
    predates the curve there, its finished sessions' `METRICS`)."""
    found = read_json(os.path.join(model_dir, ELAPSED)) or {}
    rows = found.get("history")
    if rows is None:
        rows = (read_json(os.path.join(model_dir, METRICS)) or {}).get(
            "history", [])
    return float(found.get("wall_seconds", 0.0)), rows


def seconds_spent(model_dir):
    """The seconds the run in `model_dir` trained before (`ELAPSED`; 0 if
    it never reached a checkpoint)."""
    return progress_before(model_dir)[0]


@contextlib.contextmanager
def _run_lock(model_dir, wait):
    """Holds `model_dir`'s lock; yields False (at once) if another process
    holds it and not `wait`, else True once this process holds it."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, LOCK), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            logging.info("%s: another process is training it; waiting",
                         folder_name(model_dir))
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def execute(model_dir, config, *, data, train_fn, command, machine,
            wait=True):
    """Reads back the run in `model_dir`, or trains (or resumes) it.

    Args:
        model_dir: the run's folder (`config.model_dir`).
        config: its `common.TrainConfig`.
        data: what identifies its data (saved with it; a folder of other
            data is refused).
        train_fn: config -> results; called only if the run is not finished.
        command, machine: saved with the run, for the reports.
        wait: while another process trains the run (holds its `LOCK`):
            True: wait for it, then read the run back (or resume it, if
            that process died first); False: return None at once.

    Returns:
        The finished `Record` (None only if not `wait` and the run is
        another process's).
    """
    record = load_record(model_dir, config, data)
    if record is not None:
        logging.info("%s: finished before, accuracy %.4f", record.name,
                     record.accuracy)
        return record
    with _run_lock(model_dir, wait) as held:
        if not held:
            logging.info("%s: another process is training it; later",
                         folder_name(model_dir))
            return None
        return load_record(model_dir, config, data) or _train(
            model_dir, config, data=data, train_fn=train_fn,
            command=command, machine=machine)


def execute_all(configs, *, data, train_fn, command, machine):
    """`execute` of every config in `configs` (each in its `model_dir`),
    the runs other processes hold last (waiting for them); their `Record`s,
    in order."""
    records = [execute(c.model_dir, c, data=data, train_fn=train_fn,
                       command=command, machine=machine, wait=False)
               for c in configs]
    return [record or execute(c.model_dir, c, data=data, train_fn=train_fn,
                              command=command, machine=machine)
            for record, c in zip(records, configs)]


def _train(model_dir, config, *, data, train_fn, command, machine):
    """Trains (or resumes) the run in `model_dir`; its `Record`."""
    sidecar = os.path.join(model_dir, SIDECAR)
    resumed = os.path.exists(os.path.join(model_dir, CHECKPOINT))
    state = {"config": comparable_config(config), "data": data,
             "status": "running", "resumed": resumed}
    write_json(sidecar, state)
    logging.info("%s: training%s", folder_name(model_dir),
                 " (resuming)" if resumed else "")
    # This session's time, and the training time of the sessions before.
    start = time.time() - (seconds_spent(model_dir) if resumed else 0.0)
    train_fn(config)
    state.update(status="done", wall_seconds=time.time() - start,
                 command=command, machine=machine)
    write_json(sidecar, state)
    import keras  # Frees the finished run's graphs before the next one.

    # Its garbage collection (free_memory=True) also frees what reference
    # cycles keep of the run (its model, optimizer and pipeline).
    keras.backend.clear_session()
    record = load_record(model_dir, config, data)
    if record is None:
        metrics = read_json(os.path.join(model_dir, METRICS)) or {}
        raise RuntimeError(
            f"{model_dir}: training returned, but its {METRICS} reports"
            f" {metrics.get('steps')} of {metrics.get('planned_steps')}"
            " planned steps (or is missing): the run is not finished and"
            " has no record; look at its log, or delete the folder to"
            " train it again.")
    return record
