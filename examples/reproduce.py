"""Reproduces the paper's DP-SGD / DP-Adam / DP-AdamBC comparison at eps ~ 7.

    python -m examples.reproduce --task=fashion_mnist
    python -m examples.reproduce --task=sst2 --noise_multiplier=0.5

Tang & Lecuyer compare the three optimizers on CIFAR-10 (a CNN) and SNLI
(BERT, last block fine-tuned) at epsilon = 7. This binary runs the same
protocol on the data this project has offline: Fashion-MNIST for the CNN
(`examples.train_image`) and SST-2 for the text model (`examples.train_text`):

1. `--phase=tune`: for each optimizer, every learning rate x gamma of its
   grid (the paper's coarse granularity: powers of 10) at the first seed.
2. `--phase=seeds`: the best setting of each optimizer (by final test
   accuracy, as the paper reports) with every seed of `--seeds`.
3. `--phase=report`: writes `<output_dir>/RESULTS_<task>.md` and its plots
   from the runs on disk, without training. `tune` and `seeds` write it too;
   `--phase=all` does the three in turn.

Every run lives in `<runs_dir>/<name>` (the `model_dir` of
`examples.common.fit_private`): a finished run is read back instead of being
retrained, an interrupted one resumes from its checkpoint. A run folder made
with other hyperparameters or other data is refused rather than mixed in.
Each run's seed keys its model, data order, DP noise and Poisson sampling
(`run_config`), so that a run is reproducible; anyone who knows the seed can
remove the noise, which is fine for this comparison on public data only.

C, sigma and B default to `examples.common.PAPER_DEFAULTS` for the dataset.
For SST-2 that is the paper's SNLI setting (sigma = 0.4, B = 256), which on
SST-2's 67k examples reaches epsilon = 7 after only 7 steps (SNLI has 550k
examples); `--noise_multiplier=0.5` gives 536 steps (about 2 epochs).
"""

import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np

from examples import common

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPTIMIZER_NAMES = {
    "dpsgd": "DP-SGD",
    "dpadam": "DP-Adam",
    "dpadam_corrected": "DP-AdamBC",
}

# --task -> what it trains and what the paper trained in its place.
TASKS = {
    "fashion_mnist": {
        "kind": "image", "dataset": "fashion_mnist", "name": "Fashion-MNIST",
        "paper_dataset": "CIFAR-10",
        "model": "the paper's 5-layer tanh CNN (examples.models.make_cnn)",
    },
    "sst2": {
        "kind": "text", "dataset": "sst2_tsv", "name": "SST-2",
        "paper_dataset": "SNLI",
        "model": "BERT classifier, last block re-initialized and trained "
                 "with a new head (examples.models.make_text_classifier)",
    },
}

# Test accuracy (%) at epsilon = 7 of the paper's Table (Tang & Lecuyer).
PAPER_RESULTS = {
    "CIFAR-10": {"dpsgd": 61.94, "dpadam": 56.35, "dpadam_corrected": 60.27},
    "SNLI": {"dpsgd": 41.31, "dpadam": 53.04, "dpadam_corrected": 56.62},
}

# Default grids (powers of 10 around the paper's picks). Gammas: None is the
# paper's value for the dataset (`PAPER_DEFAULTS[...]["epsilon"]`).
DEFAULT_LEARNING_RATES = {
    "dpsgd": (0.1, 1.0, 10.0),
    "dpadam": (1e-4, 1e-3, 1e-2),
    "dpadam_corrected": (1e-4, 1e-3, 1e-2),
}

DEFAULT_SST2_DIR = os.path.join(_ROOT, os.pardir, "shared", "data", "sst2")

_METRICS = "metrics.json"
_SIDECAR = "reproduce.json"  # What this binary adds to a run's model_dir.


def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("task", "fashion_mnist", list(TASKS),
                      "fashion_mnist: the CNN on Fashion-MNIST (the paper's "
                      "CIFAR-10 experiment); sst2: BERT on SST-2 (its SNLI "
                      "experiment).")
    flags.DEFINE_enum("phase", "all", ["tune", "seeds", "all", "report"],
                      "tune: the grid at the first seed; seeds: the best "
                      "setting with every seed; report: only write the "
                      "report; all: the three.")
    flags.DEFINE_string("output_dir", None,
                        "Where RESULTS_<task>.md and its plots go (default: "
                        "docs/ in the repository).")
    flags.DEFINE_string("runs_dir", None,
                        "Folder of the runs' model_dirs (default: "
                        "runs/<task> in the repository).")
    flags.DEFINE_string("data_dir", None,
                        "fashion_mnist: folder of the IDX files (default: "
                        "Debian's, else tfds); sst2: folder of train.tsv and "
                        "dev.tsv (default: ../shared/data/sst2 from the "
                        "repository).")
    flags.DEFINE_integer("max_examples", None,
                         "Use only this many training examples.")
    flags.DEFINE_integer("max_test_examples", None,
                         "sst2 only: evaluate on this many dev examples.")
    flags.DEFINE_string("preset", None,
                        "sst2: keras-hub preset (default: the offline "
                        "all-MiniLM-L6-v2).")
    flags.DEFINE_integer("sequence_length", 128, "sst2: tokens per example.")
    flags.DEFINE_bool("cache_frozen", True,
                      "sst2: compute the frozen BERT part once and train the "
                      "top on its outputs (see examples.train_text).")
    flags.DEFINE_list("seeds", ["0", "1", "2"],
                      "Seeds of the final runs; tuning uses the first. A "
                      "run's seed also keys its DP noise and sampling "
                      "(reproducible, so not private).")
    flags.DEFINE_list("learning_rates_dpsgd", None,
                      "DP-SGD's grid (default: 0.1,1,10).")
    flags.DEFINE_list("learning_rates_dpadam", None,
                      "DP-Adam's grid (default: 1e-4,1e-3,1e-2).")
    flags.DEFINE_list("learning_rates_dpadam_corrected", None,
                      "DP-AdamBC's grid (default: 1e-4,1e-3,1e-2).")
    flags.DEFINE_list("gammas_dpadam", None,
                      "DP-Adam's gamma, outside the root (default: the "
                      "paper's, 1e-8).")
    flags.DEFINE_list("gammas_dpadam_corrected", None,
                      "DP-AdamBC's gamma', inside the root; 'none' = 0.04 * "
                      "Phi (default: the paper's for the dataset).")
    flags.DEFINE_float("l2_norm_clip", None, "C (default: the paper's).")
    flags.DEFINE_float("noise_multiplier", None,
                       "sigma (default: the paper's).")
    flags.DEFINE_integer("batch_size", None,
                         "B, the expected batch size (default: the paper's).")
    flags.DEFINE_integer("physical_batch_size", None,
                         "Examples per forward/backward pass (default: all).")
    flags.DEFINE_float("target_epsilon", 7.0,
                       "Train for the most steps with epsilon <= this; 0 to "
                       "use --epochs instead.")
    flags.DEFINE_float("delta", 1e-5, "delta.")
    flags.DEFINE_float("epochs", None, "Epochs when --target_epsilon=0.")
    flags.DEFINE_integer("eval_every", 50,
                         "Steps between test-set evaluations (the curves).")
    flags.DEFINE_bool("jit_compile", False, "XLA (faster on GPU/TPU).")


FLAGS = flags.FLAGS


# --------------------------------------------------------------------------
# The plan: which runs, with which hyperparameters.


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of a grid. gamma: None for DP-SGD (it has none) and for
    DP-AdamBC's default 0.04 * Phi."""

    optimizer: str
    learning_rate: float
    gamma: float | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that decides the runs; `base` holds the shared
    hyperparameters (its optimizer, learning rate, epsilon, seed and
    model_dir are replaced per run); `data` describes the data, and is saved
    with every run so that runs on other data are not mixed in."""

    task: str
    base: common.TrainConfig
    grids: dict  # optimizer -> tuple of Setting.
    seeds: tuple
    runs_dir: str
    data: dict

    @property
    def tune_seed(self):
        return self.seeds[0]


def parse_floats(values):
    """Floats of a list flag; a ValueError names the bad value."""
    result = []
    for value in values:
        try:
            result.append(float(value))
        except ValueError:
            raise ValueError(f"Expected a number, got {value!r}.") from None
    return tuple(result)


def parse_gammas(values):
    """Like `parse_floats`, with "none" (any case) -> None."""
    return tuple(
        None if str(v).strip().lower() == "none" else parse_floats([v])[0]
        for v in values
    )


def make_grid(optimizer, learning_rates, gammas=(None,)):
    """The settings learning_rates x gammas (DP-SGD ignores gammas)."""
    if optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"Unknown optimizer {optimizer!r}.")
    if not learning_rates:
        raise ValueError(f"Empty learning-rate grid for {optimizer}.")
    if optimizer == "dpsgd":
        gammas = (None,)
    if not gammas:
        raise ValueError(f"Empty gamma grid for {optimizer}.")
    if optimizer == "dpadam" and None in gammas:
        raise ValueError("DP-Adam needs numeric gammas ('none' is only "
                         "DP-AdamBC's 0.04 * Phi).")
    for lr in learning_rates:
        if not lr > 0:
            raise ValueError(f"Expected learning rates > 0, got {lr}.")
    return tuple(Setting(optimizer, float(lr), None if g is None else
                         float(g))
                 for g in gammas for lr in learning_rates)


def base_config(dataset, *, l2_norm_clip=None, noise_multiplier=None,
                batch_size=None, physical_batch_size=None,
                target_epsilon=7.0, delta=1e-5, epochs=None, eval_every=50,
                jit_compile=False):
    """The hyperparameters all runs share; None: PAPER_DEFAULTS[dataset]."""
    defaults = common.PAPER_DEFAULTS[dataset]
    target_epsilon = target_epsilon or None
    if target_epsilon is None and epochs is None:
        raise ValueError("Give target_epsilon > 0 or epochs.")

    def pick(value, key):
        return defaults[key] if value is None else value

    return common.TrainConfig(
        optimizer="dpsgd",  # Placeholders, replaced by `run_config`.
        learning_rate=defaults["learning_rate"]["dpsgd"],
        epsilon=None,
        seed=0,
        model_dir=None,
        l2_norm_clip=pick(l2_norm_clip, "l2_norm_clip"),
        noise_multiplier=pick(noise_multiplier, "noise_multiplier"),
        batch_size=pick(batch_size, "batch_size"),
        physical_batch_size=physical_batch_size,
        phi=None,
        beta_1=0.9,
        beta_2=0.999,
        momentum=0.0,
        target_epsilon=target_epsilon,
        delta=delta,
        epochs=epochs,
        eval_every=eval_every,
        jit_compile=jit_compile,
    )


def make_plan(task, *, base, learning_rates, gammas, seeds, runs_dir, data):
    """A `Plan`; learning_rates / gammas: optimizer -> values."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; expected one of "
                         f"{list(TASKS)}.")
    seeds = tuple(int(s) for s in seeds)
    if not seeds:
        raise ValueError("Give at least one seed.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"Repeated seeds in {seeds}.")
    grids = {
        name: make_grid(name, learning_rates[name],
                        gammas.get(name, (None,)))
        for name in OPTIMIZER_NAMES
    }
    return Plan(task=task, base=base, grids=grids, seeds=seeds,
                runs_dir=runs_dir, data=dict(data))


def format_gamma(setting):
    if setting.optimizer == "dpsgd":
        return "-"
    if setting.gamma is None:
        return "0.04·Φ"
    return f"{setting.gamma:g}"


def run_name(setting, seed):
    """The folder of one run, e.g. `dpadam_lr0.001_g1e-08_seed0`."""
    name = f"{setting.optimizer}_lr{setting.learning_rate:g}"
    if setting.optimizer != "dpsgd":
        gamma = "phi" if setting.gamma is None else f"{setting.gamma:g}"
        name += f"_g{gamma}"
    return f"{name}_seed{seed}"


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


# --------------------------------------------------------------------------
# Pure helpers: choosing, aggregating, judging.


def pick_best(scored):
    """The best setting of each optimizer.

    Args:
        scored: `(Setting, accuracy)` pairs; a NaN or None accuracy (a
            diverged or missing run) loses to any number.

    Returns:
        optimizer -> `(Setting, accuracy)`, the highest accuracy; ties go to
        the pair listed first.
    """
    best = {}
    for setting, accuracy in scored:
        score = -math.inf if accuracy is None or math.isnan(accuracy) else (
            accuracy)
        current = best.get(setting.optimizer)
        if current is None or score > current[2]:
            best[setting.optimizer] = (setting, accuracy, score)
    return {name: (s, a) for name, (s, a, _) in best.items()}


def aggregate_seeds(values):
    """`(mean, std, n)`; std is the sample standard deviation (ddof=1), 0.0
    for a single value. NaN if `values` is empty."""
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan, 0
    std = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return float(values.mean()), std, int(values.size)


def aggregate_curves(histories):
    """Mean and std over seeds of accuracy-vs-step curves.

    Args:
        histories: one list of `(step, accuracy)` per seed.

    Returns:
        `(steps, mean, std)` arrays over the steps all seeds evaluated at
        (std with ddof=1; 0 for one seed).
    """
    if not histories:
        return np.array([]), np.array([]), np.array([])
    maps = [dict(h) for h in histories]
    steps = sorted(set.intersection(*(set(m) for m in maps)))
    values = np.array([[m[s] for s in steps] for m in maps], np.float64)
    mean = values.mean(axis=0) if steps else np.array([])
    std = (values.std(axis=0, ddof=1) if len(maps) > 1
           else np.zeros(len(steps)))
    return np.array(steps), mean, std


def at_grid_edge(setting, grid):
    """Whether `setting`'s learning rate is the lowest or highest of its
    grid (with more than one), i.e. the optimum may lie outside it."""
    rates = sorted({s.learning_rate for s in grid})
    return len(rates) > 1 and setting.learning_rate in (rates[0], rates[-1])


def compare(a, b):
    """How summary a = (mean, std, n) compares to b, in accuracy points.

    Returns:
        `(gap, spread, verdict)`: gap = mean_a - mean_b, spread = std_a +
        std_b, and verdict "better" / "worse" if |gap| > spread (the mean +-
        std intervals do not overlap), "within" if not, "unknown" with fewer
        than 2 seeds on either side.
    """
    gap = a[0] - b[0]
    spread = a[1] + b[1]
    if a[2] < 2 or b[2] < 2 or math.isnan(gap):
        return gap, spread, "unknown"
    if abs(gap) <= spread:
        return gap, spread, "within"
    return gap, spread, "better" if gap > 0 else "worse"


def verdict_paragraph(summary, paper, paper_dataset, dataset):
    """A short honest paragraph from the numbers.

    Args:
        summary: optimizer -> `(mean, std, n)` of test accuracy (fractions).
        paper: optimizer -> the paper's accuracy (%).
        paper_dataset, dataset: names for the text.
    """
    names = OPTIMIZER_NAMES
    if "dpadam_corrected" not in summary or "dpadam" not in summary:
        return ("Not enough finished runs to compare DP-AdamBC with DP-Adam "
                "yet.")

    def pct(x):
        return 100.0 * x

    def sentence(a, b):
        gap, spread, verdict = compare(summary[a], summary[b])
        head = (f"{names[a]} scores {pct(summary[a][0]):.2f}% against "
                f"{pct(summary[b][0]):.2f}% for {names[b]} "
                f"(a gap of {pct(gap):+.2f} points")
        if verdict == "unknown":
            return (head + "); with fewer than two seeds on a side the seed "
                    "spread is unknown, so this says little.")
        tail = (f", seed spread {pct(spread):.2f} points = the sum of the two "
                f"standard deviations)")
        if verdict == "within":
            return head + tail + (": the difference is within the seed "
                                  "spread, not a clear win either way.")
        word = "beats" if verdict == "better" else "loses to"
        return head + tail + (f": {names[a]} {word} {names[b]} by more than "
                              "the seed spread.")

    text = [sentence("dpadam_corrected", "dpadam")]
    if "dpsgd" in summary:
        text.append(sentence("dpadam_corrected", "dpsgd"))
    paper_gap = paper["dpadam_corrected"] - paper["dpadam"]
    text.append(
        f"In the paper ({paper_dataset}) DP-AdamBC beats DP-Adam by "
        f"{paper_gap:.2f} points and DP-SGD scores "
        f"{paper['dpsgd']:.2f}%; {dataset} is a different (and easier) "
        "task with a different model, so compare the ordering and the gaps, "
        "not the accuracies themselves."
    )
    return " ".join(text)


# --------------------------------------------------------------------------
# Runs on disk.


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


def _comparable(config):
    """The config as JSON values, without model_dir (runs may move)."""
    values = json.loads(json.dumps(dataclasses.asdict(config)))
    values.pop("model_dir", None)
    return values


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_run_dir(model_dir, config, data):
    """Raises if `model_dir` holds a run of other hyperparameters or data."""
    for source in (_read_json(os.path.join(model_dir, _SIDECAR)),
                   _read_json(os.path.join(model_dir, _METRICS))):
        if source is None:
            continue
        if "config" in source and source["config"] is not None:
            saved = dict(source["config"])
            saved.pop("model_dir", None)
            # Runs from before --noise_seed keyed their noise and sampling
            # with the seed.
            saved.setdefault("noise_seed", saved.get("seed"))
            if saved != _comparable(config):
                diff = sorted(k for k in saved
                              if saved.get(k) != _comparable(config).get(k))
                raise ValueError(
                    f"{model_dir} holds a run with other hyperparameters "
                    f"({', '.join(diff)}); use another --runs_dir.")
        if "data" in source and source["data"] != data:
            raise ValueError(
                f"{model_dir} holds a run on other data ({source['data']} vs"
                f" {data}); use another --runs_dir.")


def load_record(model_dir, setting, seed, config, data):
    """The finished run in `model_dir`, or None if it is not (yet) finished.

    Finished: metrics.json of the same config reports all the planned steps,
    and this binary's sidecar file (`reproduce.json`: data, wall time,
    command, machine) of the same data says "done".
    """
    check_run_dir(model_dir, config, data)
    metrics = _read_json(os.path.join(model_dir, _METRICS))
    sidecar = _read_json(os.path.join(model_dir, _SIDECAR))
    if (metrics is None or sidecar is None or sidecar.get("status") != "done"
            or metrics["steps"] < metrics["planned_steps"]):
        return None
    history = tuple((int(r["step"]), float(r["val_accuracy"]))
                    for r in metrics.get("history", [])
                    if "val_accuracy" in r)
    return Record(
        name=os.path.basename(os.path.normpath(model_dir)),
        setting=setting, seed=seed,
        accuracy=float(metrics["test_accuracy"]),
        epsilon=float(metrics["epsilon"]),
        steps=int(metrics["steps"]),
        num_examples=int(metrics["num_examples"]),
        wall_seconds=sidecar.get("wall_seconds"),
        resumed=bool(sidecar.get("resumed")),
        history=history,
        command=sidecar.get("command"),
        machine=sidecar.get("machine"),
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


def execute(plan, setting, seed, train_fn, command, machine):
    """Reads back the run of (setting, seed), or trains (or resumes) it."""
    model_dir = os.path.join(plan.runs_dir, run_name(setting, seed))
    config = run_config(plan.base, setting, seed, model_dir)
    record = load_record(model_dir, setting, seed, config, plan.data)
    if record is not None:
        logging.info("%s: finished before, accuracy %.4f", record.name,
                     record.accuracy)
        return record
    os.makedirs(model_dir, exist_ok=True)
    sidecar = os.path.join(model_dir, _SIDECAR)
    resumed = os.path.exists(os.path.join(model_dir, "checkpoint.keras"))
    state = {"config": _comparable(config), "data": plan.data,
             "status": "running", "resumed": resumed}
    with open(sidecar, "w") as f:
        json.dump(state, f, indent=1)
    logging.info("%s: training%s", os.path.basename(model_dir),
                 " (resuming)" if resumed else "")
    start = time.time()
    train_fn(config)
    state.update(status="done", wall_seconds=time.time() - start,
                 command=command, machine=machine)
    with open(sidecar, "w") as f:
        json.dump(state, f, indent=1)
    import keras  # Frees the finished run's graphs before the next one.

    keras.backend.clear_session()
    return load_record(model_dir, setting, seed, config, plan.data)


def collect(plan):
    """All finished runs of the plan on disk: name -> Record."""
    records = {}
    for grid in plan.grids.values():
        for setting in grid:
            for seed in plan.seeds:
                model_dir = os.path.join(plan.runs_dir,
                                         run_name(setting, seed))
                config = run_config(plan.base, setting, seed, model_dir)
                record = load_record(model_dir, setting, seed, config,
                                     plan.data)
                if record is not None:
                    records[record.name] = record
    return records


def best_of_tuning(plan, records):
    """optimizer -> best Setting among the finished tuning runs."""
    scored = []
    for grid in plan.grids.values():
        for setting in grid:
            record = records.get(run_name(setting, plan.tune_seed))
            if record is not None:
                scored.append((setting, record.accuracy))
    return {name: s for name, (s, _) in pick_best(scored).items()}


# --------------------------------------------------------------------------
# The report.


def format_percent(x):
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.2f}"


def format_seconds(x):
    return "n/a" if x is None else f"{x:.0f}"


def describe_data(data, records):
    """One sentence on the data of the runs (`data` as of `data_spec`)."""
    task = TASKS[data["task"]]
    sizes = sorted({r.num_examples for r in records.values()})
    train = (f"{' / '.join(map(str, sizes))} training examples" if sizes
             else "training examples")
    if data.get("max_examples"):
        train += f" (subset: --max_examples={data['max_examples']})"
    text = f"{task['name']} (dataset `{data['dataset']}`), {train}"
    if task["kind"] == "text":
        backbone = data.get("preset") or "all-MiniLM-L6-v2 (offline)"
        text += (f"; {data.get('sequence_length')} tokens per example; "
                 f"backbone {backbone}")
        if data.get("cache_frozen"):
            text += ("; the frozen embeddings and lower blocks ran once "
                     "(inference mode, so without their dropout) and the "
                     "runs trained the last block and head on their cached "
                     "outputs (same per-example gradients and privacy)")
        if data.get("max_test_examples"):
            text += (f"; evaluated on {data['max_test_examples']} dev "
                     "examples drawn with each run's seed (so the test "
                     "subset differs between seeds)")
        else:
            text += "; evaluated on the whole dev set"
    else:
        text += "; evaluated on the whole test set"
    return text + "."


def describe_steps(records, few=100):
    """The step counts of the runs, with a warning when they are few."""
    steps = sorted({r.steps for r in records.values()})
    if not steps:
        return ""
    text = f" Steps per run: {' / '.join(map(str, steps))}."
    if steps[-1] < few:
        text += (f" Under {few} steps the optimizers have little room to "
                 "differ: raise σ (more steps for the same ε) for a "
                 "meaningful comparison.")
    return text


def render_markdown(*, plan, records, best, command, machine, plots):
    """The report as markdown text.

    Args:
        plan: the `Plan`.
        records: name -> `Record` of the finished runs.
        best: optimizer -> best `Setting` (tuning).
        command: the command line that writes this report.
        machine: `machine_info()` of this process.
        plots: `{"curves": file, "tuning": file}` relative to the report.
    """
    task = TASKS[plan.task]
    paper = PAPER_RESULTS[task["paper_dataset"]]
    base = plan.base
    phi = (base.noise_multiplier * base.l2_norm_clip / base.batch_size) ** 2
    budget = (f"target ε = {base.target_epsilon:g}" if base.target_epsilon
              else f"{base.epochs:g} epoch(s), no ε target")
    lines = [
        f"# DP-SGD vs DP-Adam vs DP-AdamBC on {task['name']} "
        f"(the paper's {task['paper_dataset']} experiment)",
        "",
        "Written by `examples/reproduce.py` from the runs in "
        f"`{plan.runs_dir}`.",
        "",
        "## Setup",
        "",
        f"- Machine (this report): `{machine.get('platform')}`, "
        f"{machine.get('cpu_count')} CPUs"
        + (f" ({machine['usable_cpus']} usable)" if "usable_cpus" in machine
           else "")
        + f", processor `{machine.get('processor')}`, Python "
        f"{machine.get('python')}, TensorFlow {machine.get('tensorflow')}, "
        f"Keras {machine.get('keras')}.",
        f"- Command (this report): `{command}`",
    ]
    train_commands = sorted({r.command for r in records.values()
                             if r.command})
    other_machines = sorted({json.dumps(r.machine, sort_keys=True)
                             for r in records.values() if r.machine}
                            - {json.dumps(machine, sort_keys=True)})
    if train_commands == [command]:
        lines.append("- The runs were trained by this same command.")
    elif train_commands:
        lines.append("- Commands that trained the runs: "
                     + "; ".join(f"`{c}`" for c in train_commands))
    for other in other_machines:
        lines.append(f"- Some runs were trained on another machine: "
                     f"`{other}`")
    lines += [
        f"- Data: {describe_data(plan.data, records)}",
        f"- Model: {task['model']}.",
        f"- Privacy: C = {base.l2_norm_clip:g}, σ = "
        f"{base.noise_multiplier:g}, expected batch B = {base.batch_size} "
        f"(Poisson sampling), δ = {base.delta:g}, {budget}; Φ = (σC/B)² = "
        f"{phi:.3g}, so DP-AdamBC's 0.04·Φ = {0.04 * phi:.3g}."
        + describe_steps(records),
        f"- Tuning: each optimizer's learning rate × γ grid at seed "
        f"{plan.tune_seed}; the best setting (final test accuracy) is rerun "
        f"with seeds {', '.join(map(str, plan.seeds))}. DP-Adam's γ is "
        "outside the square root, DP-AdamBC's γ' inside it.",
        "- Caveat: hyperparameters are selected on the test set, as the "
        "paper reports them; that selection is not itself private and "
        "flatters the best numbers a little (equally for all optimizers).",
        "",
    ]

    # Final comparison.
    rows = best_rows(plan, records, best)
    lines += [
        "## Best setting of each optimizer, mean ± std over seeds",
        "",
        f"| optimizer | lr | γ | seeds | {task['name']} test accuracy (%) "
        f"| ε | paper, {task['paper_dataset']} (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in OPTIMIZER_NAMES.items():
        row = rows.get(name)
        if row:
            acc = (f"{format_percent(row['mean'])} ± "
                   f"{format_percent(row['std'])}")
            eps, n = f"{row['epsilon']:.3f}", row["seeds"]
            lr, gamma = f"{row['learning_rate']:g}", row["gamma"]
        else:
            acc, eps, n, lr, gamma = "not run", "n/a", 0, "n/a", "n/a"
        lines.append(f"| {label} | {lr} | {gamma} | {n} | {acc} | {eps} | "
                     f"{paper[name]:.2f} |")
    lines += ["", verdict(plan, rows), ""]
    edges = [OPTIMIZER_NAMES[n] for n, s in best.items()
             if at_grid_edge(s, plan.grids[n])]
    if edges:
        lines += [
            f"The best learning rate of {', '.join(edges)} is at the edge of "
            "its grid: a wider grid might do better.",
            "",
        ]
    lines += [
        f"![Test accuracy vs step]({plots['curves']})",
        "",
        "Test accuracy against the step for the best setting of each "
        "optimizer: mean over seeds, band ± one standard deviation.",
        "",
        f"## Tuning at seed {plan.tune_seed}",
        "",
        "| optimizer | lr | γ | final test accuracy (%) | ε | steps | "
        "wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, grid in plan.grids.items():
        for setting in grid:
            record = records.get(run_name(setting, plan.tune_seed))
            mark = " **(best)**" if best.get(name) == setting else ""
            if record is None:
                lines.append(f"| {OPTIMIZER_NAMES[name]} | "
                             f"{setting.learning_rate:g} | "
                             f"{format_gamma(setting)} | not run | | | |")
                continue
            lines.append(
                f"| {OPTIMIZER_NAMES[name]} | {setting.learning_rate:g} | "
                f"{format_gamma(setting)} | {format_percent(record.accuracy)}{mark} | "
                f"{record.epsilon:.3f} | {record.steps} | "
                f"{format_seconds(record.wall_seconds)} |")
    lines += [
        "",
        f"![Tuning grid]({plots['tuning']})",
        "",
        "## Every run",
        "",
        "Wall time: the session that finished the run, data loading "
        "included (a resumed run counts only its last session).",
        "",
        "| run | seed | test accuracy (%) | ε | steps | wall (s) | resumed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(records):
        r = records[name]
        lines.append(f"| `{name}` | {r.seed} | {format_percent(r.accuracy)} | "
                     f"{r.epsilon:.3f} | {r.steps} | "
                     f"{format_seconds(r.wall_seconds)} | "
                     f"{'yes' if r.resumed else 'no'} |")
    total = sum(r.wall_seconds or 0.0 for r in records.values())
    lines += ["", f"Total wall time: {total:.0f} s ({total / 3600:.2f} h) "
              f"over {len(records)} runs.", ""]
    return "\n".join(lines)


def best_rows(plan, records, best):
    """optimizer -> the seed runs of its best setting, summarized.

    Each row: `learning_rate`, `gamma` (as printed), `mean`, `std`, `seeds`
    (test accuracy as fractions, over the finished seeds) and `epsilon` (the
    largest spent). Optimizers without a finished run are left out.
    """
    rows = {}
    for name in OPTIMIZER_NAMES:
        setting = best.get(name)
        runs = [] if setting is None else [
            records[run_name(setting, s)] for s in plan.seeds
            if run_name(setting, s) in records
        ]
        if runs:
            mean, std, n = aggregate_seeds(r.accuracy for r in runs)
            rows[name] = {
                "learning_rate": setting.learning_rate,
                "gamma": format_gamma(setting),
                "mean": mean, "std": std, "seeds": n,
                "epsilon": max(r.epsilon for r in runs),
            }
    return rows


def verdict(plan, rows):
    task = TASKS[plan.task]
    summary = {name: (row["mean"], row["std"], row["seeds"])
               for name, row in rows.items()}
    return verdict_paragraph(summary, PAPER_RESULTS[task["paper_dataset"]],
                             task["paper_dataset"], task["name"])


def summary_record(plan, records, best, command, machine, files):
    """What RESULTS.md shows of one task (saved as RESULTS_<task>.json)."""
    task = TASKS[plan.task]
    base = plan.base
    rows = best_rows(plan, records, best)
    return {
        "task": plan.task,
        "name": task["name"],
        "paper_dataset": task["paper_dataset"],
        "optimizers": rows,
        "verdict": verdict(plan, rows),
        "privacy": {
            "l2_norm_clip": base.l2_norm_clip,
            "noise_multiplier": base.noise_multiplier,
            "batch_size": base.batch_size, "delta": base.delta,
            "target_epsilon": base.target_epsilon,
            "steps": sorted({r.steps for r in records.values()}),
        },
        "data": describe_data(plan.data, records),
        # The commands that trained the runs (this one if none is known).
        "commands": sorted({r.command for r in records.values()
                            if r.command}) or [command],
        "machine": machine,
        "runs": len(records),
        "wall_seconds": sum(r.wall_seconds or 0.0 for r in records.values()),
        "files": files,
    }


def render_index(summaries):
    """RESULTS.md: every task's best settings beside the paper's numbers."""
    papers = []
    for summary in summaries:
        if summary["paper_dataset"] not in papers:
            papers.append(summary["paper_dataset"])
    lines = [
        "# DP-SGD vs DP-Adam vs DP-AdamBC: results",
        "",
        "Written by `examples/reproduce.py` (it rewrites this page whenever it "
        "writes a task's report) from the `RESULTS_<task>.json` beside it. "
        "Each cell: test accuracy (%) of the optimizer's best tuned setting, "
        "mean ± standard deviation over seeds, at ε ≈ 7 (δ = 1e-5). The "
        "paper's numbers (Tang & Lécuyer) are on other datasets and models: "
        "compare orderings and gaps, not accuracies.",
        "",
        "| optimizer | " + " | ".join(
            f"{s['name']} (ours)" for s in summaries)
        + " | " + " | ".join(f"{p} (paper)" for p in papers) + " |",
        "|---" * (1 + len(summaries) + len(papers)) + "|",
    ]
    for name, label in OPTIMIZER_NAMES.items():
        cells = []
        for summary in summaries:
            row = summary["optimizers"].get(name)
            cells.append(
                "not run" if row is None else
                f"{format_percent(row['mean'])} ± {format_percent(row['std'])}"
                f" ({row['seeds']} seeds, lr {row['learning_rate']:g})")
        cells += [f"{PAPER_RESULTS[p][name]:.2f}" for p in papers]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for summary in summaries:
        privacy = summary["privacy"]
        machine = summary["machine"] or {}
        files = summary["files"]
        lines += [
            "",
            f"## {summary['name']} (in place of the paper's "
            f"{summary['paper_dataset']})",
            "",
            summary["verdict"],
            "",
            f"- Data: {summary['data']}",
            f"- Privacy: C = {privacy['l2_norm_clip']:g}, σ = "
            f"{privacy['noise_multiplier']:g}, expected batch "
            f"{privacy['batch_size']} (Poisson), target ε = "
            f"{privacy['target_epsilon']}, δ = {privacy['delta']:g}; steps "
            f"per run: {' / '.join(map(str, privacy['steps']))}.",
            "- Command: " + "; ".join(f"`{c}`" for c in summary["commands"]),
            f"- Machine: `{machine.get('platform')}`, "
            f"{machine.get('cpu_count')} CPUs, TensorFlow "
            f"{machine.get('tensorflow')}; wall time "
            f"{summary['wall_seconds'] / 3600:.2f} h over {summary['runs']} "
            "runs (tuning and seeds).",
            f"- Details (tuning grid, every run): [{files['report']}]"
            f"({files['report']}).",
            "",
            f"![{summary['name']}: test accuracy vs step]({files['curves']})",
        ]
    return "\n".join(lines) + "\n"


def write_index(output_dir):
    """Rewrites output_dir/RESULTS.md from its RESULTS_<task>.json files."""
    summaries = []
    for task in TASKS:
        path = os.path.join(output_dir, f"RESULTS_{task}.json")
        if os.path.exists(path):
            summaries.append(_read_json(path))
    path = os.path.join(output_dir, "RESULTS.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_index(summaries))
    return path


def new_figure(width, height):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)  # The Agg backend, without pyplot's state.
    return figure


def plot_curves(path, plan, records, best):
    """Test accuracy vs step of each best setting, mean ± std over seeds."""
    figure = new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    for name, setting in best.items():
        histories = [records[run_name(setting, s)].history
                     for s in plan.seeds if run_name(setting, s) in records]
        steps, mean, std = aggregate_curves(histories)
        if not len(steps):
            continue
        label = (f"{OPTIMIZER_NAMES[name]} (lr {setting.learning_rate:g}, "
                 f"{len(histories)} seeds)")
        (line,) = axes.plot(steps, 100 * mean, marker=".", label=label)
        axes.fill_between(steps, 100 * (mean - std), 100 * (mean + std),
                          color=line.get_color(), alpha=0.2)
    axes.set_xlabel("step")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(f"{TASKS[plan.task]['name']}: best setting per optimizer")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def plot_tuning(path, plan, records):
    """Final accuracy vs learning rate, one panel per optimizer, one line
    per gamma."""
    figure = new_figure(4.0 * len(plan.grids), 3.6)
    for i, (name, grid) in enumerate(plan.grids.items()):
        axes = figure.add_subplot(1, len(plan.grids), i + 1)
        gammas = list(dict.fromkeys(s.gamma for s in grid))
        for gamma in gammas:
            points = sorted(
                (s.learning_rate,
                 records[run_name(s, plan.tune_seed)].accuracy)
                for s in grid if s.gamma == gamma
                and run_name(s, plan.tune_seed) in records
            )
            if not points:
                continue
            lrs, accs = zip(*points)
            label = ("" if name == "dpsgd" else
                     f"γ = {format_gamma(Setting(name, 1.0, gamma))}")
            axes.plot(lrs, [100 * a for a in accs], marker="o",
                      label=label or None)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("final test accuracy (%)")
        axes.set_title(OPTIMIZER_NAMES[name])
        axes.grid(alpha=0.3)
        if name != "dpsgd" and axes.lines:
            axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def write_report(plan, output_dir, command, machine):
    """Writes RESULTS_<task>.md, its two PNGs and its summary JSON, then
    RESULTS.md (all tasks); returns the task's .md path."""
    os.makedirs(output_dir, exist_ok=True)
    records = collect(plan)
    best = best_of_tuning(plan, records)
    stem = f"RESULTS_{plan.task}"
    plots = {"curves": f"{stem}_curves.png", "tuning": f"{stem}_tuning.png"}
    plot_curves(os.path.join(output_dir, plots["curves"]), plan, records,
                best)
    plot_tuning(os.path.join(output_dir, plots["tuning"]), plan, records)
    path = os.path.join(output_dir, f"{stem}.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_markdown(plan=plan, records=records, best=best,
                                command=command, machine=machine,
                                plots=plots))
    summary = summary_record(plan, records, best, command, machine,
                             {"report": f"{stem}.md", **plots})
    with open(os.path.join(output_dir, f"{stem}.json"), "w",
              encoding="utf-8") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    write_index(output_dir)
    return path


# --------------------------------------------------------------------------
# The pipeline.


def make_train_fn(task, *, data_dir=None, max_examples=None,
                  max_test_examples=None, preset=None, sequence_length=128,
                  cache_frozen=True):
    """config -> results of one run of `task` (imports the binary it uses).

    For sst2 with `cache_frozen`, the frozen features are computed once and
    shared by the runs of this function (they do not depend on the seed
    unless `max_examples` draws a seeded subset).
    """
    if task == "fashion_mnist":
        if max_test_examples:
            raise ValueError("max_test_examples is for sst2 only; "
                             "fashion_mnist evaluates on its 10k test images.")
        from examples import train_image

        return lambda config: train_image.run(
            "fashion_mnist", data_dir, config, max_examples=max_examples)
    if task == "sst2":
        from examples import train_text

        feature_cache = {}
        return lambda config: train_text.run(
            "sst2_tsv", data_dir or DEFAULT_SST2_DIR, preset,
            sequence_length, config, max_examples=max_examples,
            max_test_examples=max_test_examples, cache_frozen=cache_frozen,
            feature_cache=feature_cache)
    raise ValueError(f"Unknown task {task!r}.")


def data_spec(task, *, max_examples=None, max_test_examples=None,
              preset=None, sequence_length=None, cache_frozen=True):
    """What identifies the data of a run (saved with it)."""
    spec = {"task": task, "dataset": TASKS[task]["dataset"],
            "max_examples": max_examples}
    if TASKS[task]["kind"] == "text":
        spec.update(max_test_examples=max_test_examples, preset=preset,
                    sequence_length=sequence_length,
                    cache_frozen=cache_frozen)
    return spec


def reproduce(plan, train_fn, *, phase, output_dir, command, machine=None):
    """Runs `phase` of the plan and writes the report; returns its path.

    Args:
        plan: a `Plan`.
        train_fn: config -> results (e.g. `make_train_fn(...)`); only
            called for runs that are not finished.
        phase: "tune", "seeds", "all" or "report" (no training).
        output_dir: folder of the report.
        command: the command line, for the report.
        machine: `machine_info()` (computed if None).
    """
    machine = machine or machine_info()
    if phase not in ("tune", "seeds", "all", "report"):
        raise ValueError(f"Unknown phase {phase!r}.")
    # Check every run folder first: a mismatch fails before any training.
    collect(plan)
    if phase in ("tune", "all"):
        for grid in plan.grids.values():
            for setting in grid:
                execute(plan, setting, plan.tune_seed, train_fn, command,
                        machine)
    if phase in ("seeds", "all"):
        records = collect(plan)
        missing = [run_name(s, plan.tune_seed)
                   for grid in plan.grids.values() for s in grid
                   if run_name(s, plan.tune_seed) not in records]
        if missing:
            raise ValueError(f"Tuning is not finished ({len(missing)} runs "
                             f"missing, e.g. {missing[0]}): run "
                             "--phase=tune first.")
        for setting in best_of_tuning(plan, records).values():
            for seed in plan.seeds:
                execute(plan, setting, seed, train_fn, command, machine)
    return write_report(plan, output_dir, command, machine)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    task = FLAGS.task
    dataset = TASKS[task]["dataset"]
    paper_gamma = common.PAPER_DEFAULTS[dataset]["epsilon"]
    try:
        base = base_config(
            dataset, l2_norm_clip=FLAGS.l2_norm_clip,
            noise_multiplier=FLAGS.noise_multiplier,
            batch_size=FLAGS.batch_size,
            physical_batch_size=FLAGS.physical_batch_size,
            target_epsilon=FLAGS.target_epsilon, delta=FLAGS.delta,
            epochs=FLAGS.epochs, eval_every=FLAGS.eval_every,
            jit_compile=FLAGS.jit_compile)
        learning_rates = {
            name: parse_floats(values) if values is not None
            else DEFAULT_LEARNING_RATES[name]
            for name, values in (
                ("dpsgd", FLAGS.learning_rates_dpsgd),
                ("dpadam", FLAGS.learning_rates_dpadam),
                ("dpadam_corrected", FLAGS.learning_rates_dpadam_corrected),
            )
        }
        gammas = {
            name: parse_gammas(values) if values is not None
            else (paper_gamma[name],)
            for name, values in (
                ("dpadam", FLAGS.gammas_dpadam),
                ("dpadam_corrected", FLAGS.gammas_dpadam_corrected),
            )
        }
        spec = data_spec(task, max_examples=FLAGS.max_examples,
                         max_test_examples=FLAGS.max_test_examples,
                         preset=FLAGS.preset,
                         sequence_length=FLAGS.sequence_length,
                         cache_frozen=FLAGS.cache_frozen)
        plan = make_plan(
            task, base=base, learning_rates=learning_rates, gammas=gammas,
            seeds=FLAGS.seeds,
            runs_dir=FLAGS.runs_dir or os.path.join(_ROOT, "runs", task),
            data=spec)
        train_fn = make_train_fn(
            task, data_dir=FLAGS.data_dir, max_examples=FLAGS.max_examples,
            max_test_examples=FLAGS.max_test_examples, preset=FLAGS.preset,
            sequence_length=FLAGS.sequence_length,
            cache_frozen=FLAGS.cache_frozen)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    path = reproduce(plan, train_fn, phase=FLAGS.phase,
                     output_dir=FLAGS.output_dir or os.path.join(_ROOT,
                                                                 "docs"),
                     command=shlex.join(sys.orig_argv))
    print(f"Wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
