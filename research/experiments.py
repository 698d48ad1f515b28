"""The optimizer comparison as a plan of runs: tasks, grids, seeds.

`research.reproduce` tunes each optimizer over a grid of `runs.Setting`s at
the first seed and reruns the best setting of each with every seed. A `Plan`
holds all that decides those runs; `execute_runs` trains (or reads back) them,
each in `<runs_dir>/<runs.run_name(setting, seed)>`, `collect` reads back the
finished ones and `best_of_tuning` picks each optimizer's best setting.
`make_train_fn` is the training of one run, by the binary of its task.

A plan tunes any of the optimizers of `common.OPTIMIZER_LABELS` (by default
the paper's three, `common.OPTIMIZER_NAMES`); everything downstream iterates
`plan.grids`. With a target epsilon the runs calibrate their steps at train
time with the binaries' accountant (`common.ACCOUNTANT`, PLD); a plan made
with `calibration_accountant="rdp"` gives them RDP's steps instead, as
epochs (`calibrated_base`), the steps of the results recorded before the
binaries moved to PLD.
"""

import dataclasses
import math
import os

from research import common
from research import comparison
from research import finetune as finetune_lib
from research import runs
from research.runs import Setting
from tf_dpadam import accounting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the reports (RESULTS*.md, ABLATIONS_*, the studies' pages, their
# plots and JSON summaries) go by default.
RESULTS_DIR = os.path.join(ROOT, "research", "results")

# --task -> what it trains and what the paper trained in its place.
TASKS = {
    "fashion_mnist": {
        "kind": "image", "dataset": "fashion_mnist", "name": "Fashion-MNIST",
        "paper_dataset": "CIFAR-10",
        "model": "the paper's 5-layer tanh CNN (research.models.make_cnn)",
    },
    "sst2": {
        "kind": "text", "dataset": "sst2_tsv", "name": "SST-2",
        "paper_dataset": "SNLI",
        "model": "BERT classifier, last block re-initialized and trained "
                 "with a new head (research.models.make_text_classifier)",
    },
    # Fine-tuning the whole pretrained BERT (research.finetune), beside the
    # paper's last-block setting.
    "sst2_lora": {
        "kind": "text", "dataset": "sst2_tsv", "name": "SST-2 (LoRA)",
        "paper_dataset": "SNLI", "finetune": "lora",
        "model": "BERT classifier, pretrained backbone frozen, LoRA factors"
                 " on every attention projection (query, key, value,"
                 " output) of every block trained with a new head on the"
                 " mean of the final token states (research.finetune)",
    },
    "sst2_full": {
        "kind": "text", "dataset": "sst2_tsv",
        "name": "SST-2 (full fine-tuning)",
        "paper_dataset": "SNLI", "finetune": "full",
        "model": "BERT classifier, every pretrained weight and a new head"
                 " on the mean of the final token states trained"
                 " (research.finetune)",
    },
    # Issue 18's text point: a small transformer from scratch.
    "sst2_scratch": {
        "kind": "text", "dataset": "sst2_tsv",
        "name": "SST-2 (transformer from scratch)",
        "paper_dataset": "SNLI", "finetune": "scratch",
        "model": "a 2-block BERT (128 wide, 2 heads, FFN 512) randomly"
                 " initialized on MiniLM's WordPiece vocabulary and trained"
                 " whole, with a head on the mean of the final token states"
                 " (research.finetune)",
    },
}


def finetune_of(task):
    """What the text task trains (`research.finetune` modes)."""
    return TASKS[task].get("finetune", "last_block")


# Default grids (powers of 10 around the paper's picks; DP-Adam STP and
# DiSK, not in the paper, take DP-Adam's). Gammas: None is the paper's value
# for the dataset (`PAPER_DEFAULTS[...]["epsilon"]`).
DEFAULT_LEARNING_RATES = {
    "dpsgd": (0.1, 1.0, 10.0),
    "dpadam": (1e-4, 1e-3, 1e-2),
    "dpadam_corrected": (1e-4, 1e-3, 1e-2),
    "dpadam_stp": (1e-4, 1e-3, 1e-2),
    "dpadam_disk": (1e-4, 1e-3, 1e-2),
}


DEFAULT_SST2_DIR = os.path.join(ROOT, os.pardir, "shared", "data", "sst2")
# The training split of tensorflow-datasets' fashion_mnist (read when
# Debian's IDX files are absent), as Zalando publishes it.
FASHION_MNIST_TRAIN_EXAMPLES = 60_000


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The steps an accountant other than the runs' own allows within a
    target epsilon; the runs train them as epochs (`calibrated_base`)."""

    accountant: str
    target_epsilon: float
    steps: int
    num_examples: int


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
    # The learning rate of the non-private ceiling run (None: no ceiling).
    ceiling_learning_rate: float | None = None
    # Rates tuning may add past each end of a grid (`extended_plan`).
    edge_extensions: int = 0
    # Set when the steps were calibrated by another accountant than the
    # runs' (`calibrated_base`): `base` then carries them as epochs.
    calibration: Calibration | None = None

    @property
    def tune_seed(self):
        return self.seeds[0]

    @property
    def optimizers(self):
        """The plan's optimizers, in the order of its grids."""
        return tuple(self.grids)

    @property
    def target_epsilon(self):
        """The epsilon the runs' steps were calibrated to (None: epochs)."""
        if self.calibration is not None:
            return self.calibration.target_epsilon
        return self.base.target_epsilon


def make_grid(optimizer, learning_rates, gammas=(None,)):
    """The settings learning_rates x gammas (DP-SGD ignores gammas); any
    optimizer of `common.OPTIMIZER_LABELS`."""
    if optimizer not in common.OPTIMIZER_LABELS:
        raise ValueError(f"Unknown optimizer {optimizer!r}; expected one of "
                         f"{list(common.OPTIMIZER_LABELS)}.")
    if not learning_rates:
        raise ValueError(f"Empty learning-rate grid for {optimizer}.")
    if optimizer == "dpsgd":
        gammas = (None,)
    if not gammas:
        raise ValueError(f"Empty gamma grid for {optimizer}.")
    if optimizer in common.KERAS_ADAM_EPSILON and None in gammas:
        raise ValueError(f"{common.OPTIMIZER_LABELS[optimizer]} needs numeric"
                         " gammas ('none' is only DP-AdamBC's 0.04 * Phi).")
    for lr in learning_rates:
        if not lr > 0:
            raise ValueError(f"Expected learning rates > 0, got {lr}.")
    return tuple(Setting(optimizer, float(lr), None if g is None else
                         float(g))
                 for g in gammas for lr in learning_rates)


def calibrated_base(base, num_examples, accountant):
    """`base` whose runs train the steps `accountant` allows within its
    target epsilon, and their `Calibration`.

    The runs calibrate a target's steps at train time with
    `common.ACCOUNTANT` (`common.total_steps`); for another accountant the
    steps T are calibrated here and given as epochs T B / N (target None),
    which the runs turn back into round(epochs N / B) = T steps, as
    `study_plan.make_cell` does. `(base, None)` when base has no target
    (its epochs decide) or `accountant` is the runs' own.
    """
    accounting.get_accountant(accountant)
    if base.target_epsilon is None or accountant == common.ACCOUNTANT:
        return base, None
    steps = common.total_steps(base, num_examples, accountant=accountant)
    calibration = Calibration(accountant, base.target_epsilon, steps,
                              num_examples)
    return dataclasses.replace(
        base, target_epsilon=None,
        epochs=steps * base.batch_size / num_examples), calibration


def make_plan(task, *, base, learning_rates, gammas, seeds, runs_dir, data,
              ceiling_learning_rate=None, edge_extensions=0,
              optimizers=tuple(common.OPTIMIZER_NAMES),
              calibration_accountant=common.ACCOUNTANT, num_examples=None):
    """A `Plan` with a grid for each of `optimizers` (some of
    `common.OPTIMIZER_LABELS`, in that order); learning_rates / gammas:
    optimizer -> values. With a target epsilon in `base` and another
    `calibration_accountant` than the runs' (`calibrated_base`), the steps
    are calibrated for the `num_examples` training examples."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; expected one of "
                         f"{list(TASKS)}.")
    seeds = tuple(int(s) for s in seeds)
    if not seeds:
        raise ValueError("Give at least one seed.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"Repeated seeds in {seeds}.")
    optimizers = tuple(optimizers)
    if not optimizers:
        raise ValueError("Give at least one optimizer.")
    if len(set(optimizers)) != len(optimizers):
        raise ValueError(f"Repeated optimizers in {optimizers}.")
    grids = {
        name: make_grid(name, learning_rates[name],
                        gammas.get(name, (None,)))
        for name in optimizers
    }
    accounting.get_accountant(calibration_accountant)
    calibration = None
    if (base.target_epsilon is not None
            and calibration_accountant != common.ACCOUNTANT):
        if num_examples is None:
            raise ValueError(f"Calibrating the steps by "
                             f"{calibration_accountant} needs num_examples.")
        base, calibration = calibrated_base(base, num_examples,
                                            calibration_accountant)
    if ceiling_learning_rate is not None and not ceiling_learning_rate > 0:
        raise ValueError(f"Expected ceiling_learning_rate="
                         f"{ceiling_learning_rate!r} > 0.")
    if not (isinstance(edge_extensions, int) and edge_extensions >= 0):
        raise ValueError(f"Expected edge_extensions={edge_extensions!r} to"
                         " be an int >= 0.")
    return Plan(task=task, base=base, grids=grids, seeds=seeds,
                runs_dir=runs_dir, data=dict(data),
                ceiling_learning_rate=ceiling_learning_rate,
                edge_extensions=edge_extensions, calibration=calibration)


def planned_config(plan, setting, seed):
    """The `TrainConfig` of the run of (setting, seed), with its model_dir."""
    model_dir = os.path.join(plan.runs_dir, runs.run_name(setting, seed))
    return runs.run_config(plan.base, setting, seed, model_dir)


def execute_runs(plan, pairs, train_fn, command, machine):
    """Reads back the run of each (setting, seed) in `pairs`, or trains (or
    resumes) it, those that other processes are training last
    (`runs.execute_all`)."""
    return runs.execute_all([planned_config(plan, setting, seed)
                             for setting, seed in pairs],
                            data=plan.data, train_fn=train_fn,
                            command=command, machine=machine)


def load_run(plan, setting, seed):
    """The finished run of (setting, seed) (a `runs.Record`), or None."""
    config = planned_config(plan, setting, seed)
    return runs.load_record(config.model_dir, config, plan.data)


def next_rate(rates, direction):
    """The rate one grid step past the end of `rates` in `direction` (+1
    above, -1 below): the grid's ratio at that end continued, to 3
    significant digits, and on the half-decade lattice when it lands within
    1% of it (0.000316, 0.001, 0.00316 -> 0.01, not 0.00999; 1.3, 4 ->
    12.3)."""
    rates = sorted(rates)
    end, neighbour = ((rates[-1], rates[-2]) if direction > 0
                      else (rates[0], rates[1]))
    rate = end * end / neighbour
    lattice = comparison.half_decade(comparison.half_decades(rate))
    if abs(math.log(rate / lattice)) < 0.01:
        return lattice
    return float(f"{rate:.3g}")


def extended_plan(plan):
    """`plan` with the rates that tuning adds past its grids' ends.

    For each optimizer and gamma, once every rate of its grid has a finished
    tuning run (the first seed): while the best of them (`pick_best`) is the
    highest (lowest) rate tried, and fewer than `plan.edge_extensions` rates
    were added above (below) the grid, the next rate past that end
    (`next_rate`) joins the grid. The added settings follow the finished
    runs on disk, so that every phase and the report see the same grids.
    The result has `edge_extensions=0`: extending it again changes nothing.
    """
    if not plan.edge_extensions:
        return plan
    grids = {}
    for name, grid in plan.grids.items():
        settings = list(grid)
        for gamma in dict.fromkeys(s.gamma for s in grid):
            base = [s.learning_rate for s in grid if s.gamma == gamma]
            while True:
                group = [s for s in settings if s.gamma == gamma]
                found = [load_run(plan, s, plan.tune_seed) for s in group]
                if None in found:
                    break
                best, _ = pick_best(zip(group, comparison.selection_accuracies(
                    found, f"{name} (gamma {gamma})")))[name]
                rates = [s.learning_rate for s in group]
                direction = comparison.edge_direction(
                    best.learning_rate, rates, base, plan.edge_extensions)
                if direction is None:
                    break
                settings.append(
                    Setting(name, next_rate(rates, direction), gamma))
        grids[name] = tuple(settings)
    return dataclasses.replace(plan, grids=grids, edge_extensions=0)


def collect(plan):
    """All finished runs of the plan on disk: name -> Record (with the rates
    `extended_plan` adds)."""
    plan = extended_plan(plan)
    records = {}
    for grid in plan.grids.values():
        for setting in grid:
            for seed in plan.seeds:
                record = load_run(plan, setting, seed)
                if record is not None:
                    records[record.name] = record
    return records


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


def best_of_tuning(plan, records):
    """optimizer -> best Setting among the finished tuning runs (with the
    rates `extended_plan` adds), by validation accuracy where the runs
    held examples out, else by test accuracy
    (`comparison.selection_accuracies`: a ValueError if an optimizer's
    runs mix the two)."""
    scored = []
    for name, grid in extended_plan(plan).grids.items():
        found = [(setting, record) for setting in grid
                 if (record := records.get(runs.run_name(
                     setting, plan.tune_seed))) is not None]
        scored += zip((setting for setting, _ in found),
                      comparison.selection_accuracies(
                          (record for _, record in found), name))
    return {name: s for name, (s, _) in pick_best(scored).items()}


# The non-private ceiling: Adam (gamma outside the root) on the DP runs'
# Poisson batches and steps, with no noise and a clip norm no gradient
# reaches, so the per-example clipping changes nothing.
CEILING_GAMMA = 1e-8
CEILING_CLIP = 1e9


def ceiling_config(plan, steps, num_examples):
    """The `TrainConfig` of the non-private ceiling run of `plan`: the DP
    runs' `steps` over `num_examples` (as epochs), the first seed."""
    seed = plan.tune_seed
    lr = plan.ceiling_learning_rate
    return dataclasses.replace(
        plan.base, optimizer="dpadam", learning_rate=lr,
        epsilon=CEILING_GAMMA, l2_norm_clip=CEILING_CLIP,
        noise_multiplier=0.0, target_epsilon=None,
        epochs=steps * plan.base.batch_size / num_examples, seed=seed,
        noise_seed=seed,
        model_dir=os.path.join(plan.runs_dir,
                               f"nonprivate_adam_lr{lr:g}_seed{seed}"))


def _ceiling_steps(records):
    """`(steps, num_examples)` of the finished DP runs (None if none)."""
    sizes = {(r.steps, r.num_examples) for r in records.values()}
    if len(sizes) > 1:
        raise ValueError(f"The runs differ in steps or examples ({sizes}).")
    return sizes.pop() if sizes else None


def collect_ceiling(plan, records):
    """The finished ceiling run (a `runs.Record`), or None."""
    sizes = _ceiling_steps(records)
    if plan.ceiling_learning_rate is None or sizes is None:
        return None
    config = ceiling_config(plan, *sizes)
    return runs.load_record(config.model_dir, config, plan.data)


def run_ceiling(plan, train_fn, *, command, machine):
    """Trains (or reads back) the non-private ceiling run of `plan`, with
    as many steps as its finished DP runs."""
    if plan.ceiling_learning_rate is None:
        raise ValueError("The ceiling needs a learning rate "
                         "(--ceiling_learning_rate).")
    sizes = _ceiling_steps(collect(plan))
    if sizes is None:
        raise ValueError("The ceiling takes the steps of the DP runs: run "
                         "--phase=tune first.")
    config = ceiling_config(plan, *sizes)
    return runs.execute(config.model_dir, config, data=plan.data,
                        train_fn=train_fn, command=command, machine=machine)


def next_round(plan, seeds=False):
    """The (setting, seed) runs that tuning can train now: the unfinished
    runs of the grids (with the rates `extended_plan` adds) and, if `seeds`,
    those of the seeds phase of each optimizer whose tuning is over (every
    rate of its grid finished, so none is left to add). With two processes
    on a study, one trains the seeds of an optimizer while the other
    finishes another's tuning."""
    extended = extended_plan(plan)  # Extending it again changes nothing.
    records = collect(extended)

    def missing(setting, seed):
        return runs.run_name(setting, seed) not in records

    todo = [(setting, plan.tune_seed) for grid in extended.grids.values()
            for setting in grid if missing(setting, plan.tune_seed)]
    if seeds:
        best = best_of_tuning(extended, records)
        todo += [(best[name], seed) for name, grid in extended.grids.items()
                 if not any(missing(s, plan.tune_seed) for s in grid)
                 for seed in plan.seeds if missing(best[name], seed)]
    return todo


def run_phase(plan, train_fn, phase, *, command, machine):
    """Trains (or reads back) the runs of `phase` of the plan.

    Args:
        plan: a `Plan`.
        train_fn: config -> results; only called for unfinished runs.
        phase: "tune" (the grids at the first seed), "seeds" (the best
            setting of each optimizer with every seed), "ceiling" (the
            non-private run, `run_ceiling`), "all" (the three; an
            optimizer's seeds as soon as its tuning is over, the
            ceiling only if the plan has its learning rate) or "report"
            (nothing to train; the run folders are only checked).
        command, machine: saved with each run, for the reports.
    """
    if phase not in ("tune", "seeds", "ceiling", "all", "report"):
        raise ValueError(f"Unknown phase {phase!r}.")
    # Check every run folder first: a mismatch fails before any training.
    collect(plan)
    if phase in ("tune", "all"):
        done = set()
        # Each round may add rates past a grid's end (and seeds, with "all").
        while todo := [pair for pair in next_round(plan, phase == "all")
                       if pair not in done]:
            execute_runs(plan, todo, train_fn, command, machine)
            done.update(todo)
    if phase in ("seeds", "all"):
        # The grids as tuning extended them, read from disk once.
        extended = extended_plan(plan)
        records = collect(extended)
        missing = [runs.run_name(s, plan.tune_seed)
                   for grid in extended.grids.values() for s in grid
                   if runs.run_name(s, plan.tune_seed) not in records]
        if missing:
            raise ValueError(f"Tuning is not finished ({len(missing)} runs "
                             f"missing, e.g. {missing[0]}): run "
                             "--phase=tune first.")
        execute_runs(plan, [(setting, seed) for setting in
                            best_of_tuning(extended, records).values()
                            for seed in plan.seeds],
                     train_fn, command, machine)
    if phase == "ceiling" or (phase == "all"
                              and plan.ceiling_learning_rate is not None):
        run_ceiling(plan, train_fn, command=command, machine=machine)


def data_spec(task, *, max_examples=None, max_test_examples=None,
              preset=None, sequence_length=None, cache_frozen=True,
              lora_rank=None, finetune_blocks=None, pooling=None):
    """What identifies the data of a run (saved with it)."""
    spec = {"task": task, "dataset": TASKS[task]["dataset"],
            "max_examples": max_examples}
    if TASKS[task]["kind"] == "text":
        finetune = finetune_of(task)
        spec.update(max_test_examples=max_test_examples, preset=preset,
                    sequence_length=sequence_length,
                    cache_frozen=cache_frozen and finetune_lib.cacheable(
                        finetune, finetune_blocks))
        if finetune == "lora":
            spec.update(lora_rank=lora_rank)
        if finetune_blocks is not None:
            # Only when set: runs made before the flag keep their spec.
            spec.update(finetune_blocks=finetune_blocks)
        pooling = pooling or finetune_lib.default_pooling(finetune)
        if finetune != "last_block" or pooling != "cls":
            spec.update(pooling=pooling)
    return spec


def num_train_examples(task, *, data_dir=None, max_examples=None):
    """N, the training examples the runs of `task` train on (`data_dir`
    and `max_examples` as for `make_train_fn`), read cheaply: the labels
    of Fashion-MNIST's IDX files (without them, tensorflow-datasets'
    60,000) or the rows of SST-2's train.tsv, not the images or tokens.

    Raises:
        FileNotFoundError: no train.tsv in the text task's folder.
    """
    from research import datasets  # Imports TensorFlow.

    if TASKS[task]["kind"] == "text":
        _, labels = datasets.read_sst2_tsv(
            os.path.join(data_dir or DEFAULT_SST2_DIR, "train.tsv"))
        total = len(labels)
    else:
        files = datasets.fashion_mnist_files(data_dir)
        total = (FASHION_MNIST_TRAIN_EXAMPLES if files is None
                 else len(datasets.read_idx(files["train"][1])))
    return min(total, max_examples) if max_examples else total


def make_train_fn(task, *, data_dir=None, max_examples=None,
                  max_test_examples=None, preset=None, sequence_length=128,
                  cache_frozen=True, lora_rank=None, finetune_blocks=None,
                  pooling=None):
    """config -> results of one run of `task` (imports the binary it uses).

    For sst2 with `cache_frozen`, the frozen features are computed once and
    shared by the runs of this function (they do not depend on the seed
    unless `max_examples` draws a seeded subset).
    """
    if task == "fashion_mnist":
        if max_test_examples:
            raise ValueError("max_test_examples is for sst2 only; "
                             "fashion_mnist evaluates on its 10k test images.")
        from research import train_image

        return lambda config: train_image.run(
            "fashion_mnist", data_dir, config, max_examples=max_examples)
    if TASKS.get(task, {}).get("kind") == "text":
        from research import train_text

        feature_cache = {}
        finetune = {"finetune": finetune_of(task)}
        if lora_rank is not None:
            finetune.update(lora_rank=lora_rank)
        if finetune_blocks is not None:
            finetune.update(finetune_blocks=finetune_blocks)
        if pooling is not None:
            finetune.update(pooling=pooling)
        return lambda config: train_text.run(
            "sst2_tsv", data_dir or DEFAULT_SST2_DIR, preset,
            sequence_length, config, max_examples=max_examples,
            max_test_examples=max_test_examples, cache_frozen=cache_frozen,
            feature_cache=feature_cache, **finetune)
    raise ValueError(f"Unknown task {task!r}.")

