"""Issue 18's studies as plans of runs: the regime map and the best recipe.

A study is cells x variants x learning rates x seeds of Fashion-MNIST runs
of the paper's CNN (`research.train_image.run`):

- a `Cell` is one privacy budget and expected batch: (epsilon, B) with
  either a fixed number of epochs, for which sigma is calibrated so that
  the run spends the target epsilon (`calibrate_noise`: within
  `EPSILON_TOLERANCE` below it), or a fixed sigma, for which the steps are
  calibrated (`common.total_steps`); and the settings every run of the cell
  shares (C, delta, augmentation multiplicity, parameter averaging,
  normalization);
- a `Variant` is an optimizer with its own settings (`VARIANTS`: DP-SGD,
  DP-Adam, DP-AdamBC, DP-AdamBC with decoupled weight decay, DP-AdamBC at
  beta_2 = 0.9999, DP-Adam with scale-then-privatize and with DiSK) and the centre of its learning-rate grid at
  `REFERENCE_BATCH`; each cell gets a half-decade grid (x sqrt(10) steps)
  around the centre scaled to its B (`scaled_centre`).

`run_phase` tunes every (cell, variant) over its grid at the first seed and
reruns the best learning rate of each with every seed. The best is the
highest validation accuracy when the cell holds training examples out
(`make_cell`'s `validation_examples`), else, as in the studies recorded
before the split, the highest test accuracy
(`comparison.selection_accuracies`). Each run is one `runs.execute`
folder, `<runs_dir>/<cell>/<variant>_lr<lr>_seed<seed>`: a finished run is
read back, an interrupted one resumes from its checkpoint, and a folder of
other settings or data is refused (`runs.check_run_dir`).
`study_moments.final_moments` measures the optimizer's second moment at the
end of a run (stored in its metrics.json): the median over coordinates of
(v_hat - Phi) / Phi, the "v^c / Phi" of the regime map.
"""

import dataclasses
import math
import os

import tf_dpadam
from research import common
from research import comparison
from research import experiments
from research import runs
from research import study_moments

# The batch size at which `Variant.lr_centre` was measured (the Fashion-MNIST
# comparison and ablations, research/results/RESULTS_fashion_mnist.md).
REFERENCE_BATCH = 256
# `calibrate_noise`'s sigma spends epsilon in [target - this, target].
EPSILON_TOLERANCE = 1e-4
FASHION_MNIST_TRAIN_EXAMPLES = 60_000


@dataclasses.dataclass(frozen=True)
class Variant:
    """An optimizer and its settings, with its learning-rate grid's centre.

    `changes` are `(field, value)` pairs of `common.TrainConfig` set for
    every run of the variant (e.g. `(("beta_2", 0.9999),)`); `gamma` is
    its `epsilon` (DP-Adam's gamma outside the root, DP-AdamBC's gamma'
    inside it, None: 0.04 Phi); the grid is centred on
    `lr_centre * (B / REFERENCE_BATCH) ** lr_exponent`.
    """

    name: str
    label: str
    optimizer: str
    lr_centre: float
    lr_exponent: float
    gamma: float | None = None
    changes: tuple = ()


def default_variants(*, weight_decay=0.1, beta_2_high=0.9999):
    """name -> `Variant` of the regime map.

    Centres: the best learning rates at B = 256 on Fashion-MNIST (DP-SGD 1-4
    with C = 1, DP-Adam 1e-2, DP-AdamBC 1e-3 at 719 steps and 3e-3 at 235).
    DP-SGD's scales linearly with B (equal epochs: the same lr x steps, and
    the same noise diffusion lr^2 T (sigma / B)^2 when sigma grows as
    sqrt(B)). The Adams' noise-dominated update is lr m / sqrt(Phi) = lr B m
    / (sigma C), already linear in B / sigma: their lr scales as sigma, which
    at a fixed epsilon and epochs grows about as B^0.22 (sigma 0.70, 0.88,
    1.28 for B = 256, 1024, 4096 at epsilon = 3 and 5 epochs), so
    B^0.25. beta_2_high keeps beta_1 = 0.9: only the averaging of v, whose
    noise v_hat - Phi shrinks with it, changes.
    """
    corrected = dict(optimizer="dpadam_corrected", lr_centre=2e-3,
                     lr_exponent=0.25)
    return {v.name: v for v in (
        Variant("dpsgd", "DP-SGD", "dpsgd", 2.0, 1.0),
        Variant("dpadam", "DP-Adam", "dpadam", 1e-2, 0.25, gamma=1e-8),
        Variant("dpadam_corrected", "DP-AdamBC", **corrected),
        Variant("dpadam_corrected_wd",
                f"DP-AdamBC + weight decay {weight_decay:g}",
                changes=(("weight_decay", float(weight_decay)),),
                **corrected),
        Variant("dpadam_corrected_b2",
                f"DP-AdamBC, β₂ = {beta_2_high:g}",
                changes=(("beta_2", float(beta_2_high)),), **corrected),
        # Issue 37: Adam's epsilon outside the root, as DP-Adam; centred
        # on DP-Adam's rate (STP: Adam on the same-size private gradient)
        # and a half-decade below it (DiSK: the filter shrinks the noise in
        # v, so each step is larger).
        Variant("dpadam_stp", "DP-Adam STP", "dpadam_stp", 1e-2, 0.25,
                gamma=1e-8),
        Variant("dpadam_disk", "DP-Adam DiSK", "dpadam_disk", 3e-3, 0.25,
                gamma=1e-8),
    )}


def with_centres(variants, centres):
    """`variants` with the learning-rate centres of `centres` (name -> lr at
    `REFERENCE_BATCH`) replaced."""
    unknown = set(centres) - set(variants)
    if unknown:
        raise ValueError(f"Unknown variants {sorted(unknown)}; expected some"
                         f" of {list(variants)}.")
    return {name: dataclasses.replace(v, lr_centre=float(centres[name]))
            if name in centres else v for name, v in variants.items()}


def scaled_centre(variant, batch_size):
    """The variant's learning-rate centre at expected batch `batch_size`."""
    return variant.lr_centre * (batch_size / REFERENCE_BATCH) ** (
        variant.lr_exponent)


def half_decade_grid(centre, span):
    """`2 span + 1` learning rates 10^(k / 2) (3 significant digits) around
    the one nearest `centre`: e.g. 0.002, 1 -> (0.001, 0.00316, 0.01)."""
    if not centre > 0:
        raise ValueError(f"Expected a learning-rate centre > 0, got {centre}.")
    if span < 0:
        raise ValueError(f"Expected a grid span >= 0, got {span}.")
    middle = comparison.half_decades(centre)
    return tuple(comparison.half_decade(k)
                 for k in range(middle - span, middle + span + 1))


def calibrate_noise(target_epsilon, *, num_examples, batch_size, steps,
                    delta, tolerance=EPSILON_TOLERANCE,
                    accountant=common.ACCOUNTANT, noise_bands=1):
    """sigma whose `steps` Poisson-sampled steps spend epsilon in
    [target_epsilon - tolerance, target_epsilon] by `accountant`: by
    default the one the runs record their epsilon with (`common.ACCOUNTANT`,
    PLD); "rdp" gives the sigma of the studies recorded before the
    binaries moved from RDP to PLD (RDP's epsilon bounds PLD's, so those
    runs spend at most the target).

    `tf_dpadam.calibrate_noise_multiplier` brackets sigma within 1% (about
    1% of epsilon); this bisects its bracket further. With `noise_bands` =
    b > 1, the epsilon of b-banded correlated noise on cyclic Poisson
    batches (`common.steps_epsilon`: ceil(T / b) steps at q = b B / N).

    Raises:
        ValueError: as `calibrate_noise_multiplier` for impossible targets.
    """
    def epsilon(sigma):
        return common.steps_epsilon(
            steps=steps, num_examples=num_examples, batch_size=batch_size,
            noise_multiplier=sigma, delta=delta, noise_bands=noise_bands,
            accountant=accountant)

    high = tf_dpadam.calibrate_noise_multiplier(
        target_epsilon=target_epsilon, num_examples=num_examples,
        batch_size=batch_size, steps=steps, delta=delta,
        accountant=accountant,
        **({"bands": noise_bands} if noise_bands > 1 else {}))
    low = high / 1.01  # eps(low) > target >= eps(high).
    while epsilon(high) < target_epsilon - tolerance:
        middle = 0.5 * (low + high)
        if epsilon(middle) <= target_epsilon:
            high = middle
        else:
            low = middle
        if high - low < 1e-12 * high:
            break  # A step of epsilon larger than the tolerance.
    return high


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (epsilon, B) of a study: `base` holds every shared setting of its
    runs (optimizer, learning rate, seed and model_dir are replaced per
    run); `steps` and `noise_multiplier` are calibrated for `num_examples`,
    the examples the runs train on (without the
    `base.validation_examples` held out)."""

    name: str
    target_epsilon: float
    base: common.TrainConfig
    steps: int
    num_examples: int
    # The accountant that calibrated sigma (epochs given) or the steps.
    accountant: str = common.ACCOUNTANT


def make_cell(*, target_epsilon, batch_size, num_examples, epochs=None,
              noise_multiplier=None, l2_norm_clip=1.0, delta=1e-5,
              eval_every=50, augmult=0, ema_momentum=None,
              normalization="none", cnn="paper", imbalance_ratio=1.0,
              accountant=common.ACCOUNTANT, noise_bands=1,
              validation_examples=0):
    """A `Cell`: exactly one of `epochs` (sigma calibrated to spend
    `target_epsilon` in round(epochs N / B) steps) and `noise_multiplier`
    (the most steps within `target_epsilon`), by `accountant` ("pld" or
    "rdp", see `calibrate_noise`). ema_momentum: None for no
    parameter averaging. imbalance_ratio < 1: the training set's classes
    cut geometrically (`research.imbalance`); `num_examples` is then the
    size of the cut set. noise_bands = b > 1: correlated noise of b bands
    on cyclic Poisson batches (`common.TrainConfig.noise_bands`), the
    steps a multiple of b (epochs: round(epochs N / B) rounded down), sigma
    or the steps calibrated for it; the cell's name ends in `_bands<b>`.
    validation_examples = V > 0: the runs hold V of the `num_examples`
    out (`common.TrainConfig.validation_examples`) and train on the
    others, so the cell's N (`Cell.num_examples`, the calibration's and
    the runs' accounting's) is `num_examples` - V, and tuning selects by
    the validation accuracy; the cell's name is unchanged (the runs'
    configs differ)."""
    if (epochs is None) == (noise_multiplier is None):
        raise ValueError("Give exactly one of epochs and noise_multiplier.")
    common.check_validation_examples("validation_examples",
                                     validation_examples)
    if validation_examples >= num_examples:
        raise ValueError(
            f"Expected validation_examples={validation_examples} < the"
            f" {num_examples} training examples: at least one must remain"
            " to train on.")
    # N: what the runs train on, and their accounting counts.
    num_examples -= validation_examples
    if batch_size > num_examples:
        raise ValueError(f"Expected batch_size={batch_size} <= the"
                         f" {num_examples} training examples.")
    base = common.base_config(
        "fashion_mnist", l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier or 1.0, batch_size=batch_size,
        target_epsilon=None if epochs else target_epsilon, delta=delta,
        epochs=epochs, eval_every=eval_every, noise_bands=noise_bands,
        validation_examples=validation_examples)
    calibration = None
    if epochs is None:
        # The runs count their steps with the binaries' accountant: with
        # another, they get its steps as epochs.
        base, calibration = experiments.calibrated_base(base, num_examples,
                                                        accountant)
    steps = (calibration.steps if calibration is not None else
             common.total_steps(base, num_examples, accountant=accountant))
    if epochs is not None:
        base = dataclasses.replace(base, noise_multiplier=calibrate_noise(
            target_epsilon, num_examples=num_examples, batch_size=batch_size,
            steps=steps, delta=delta, accountant=accountant,
            noise_bands=noise_bands))
    base = dataclasses.replace(
        base, augmult=augmult, normalization=normalization, cnn=cnn,
        ema=ema_momentum is not None,
        ema_momentum=0.999 if ema_momentum is None else ema_momentum,
        imbalance_ratio=float(imbalance_ratio))
    name = f"eps{target_epsilon:g}_B{batch_size}"
    if imbalance_ratio < 1:
        name += f"_imbalance{imbalance_ratio:g}"
    if noise_bands != 1:
        name += f"_bands{noise_bands}"
    return Cell(name, float(target_epsilon), base, steps, num_examples,
                accountant)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a study (a folder of its runs_dir)."""

    cell: str
    variant: str
    learning_rate: float
    seed: int

    @property
    def folder(self):
        return os.path.join(self.cell, f"{self.variant}_lr"
                            f"{self.learning_rate:g}_seed{self.seed}")


@dataclasses.dataclass(frozen=True)
class StudyPlan:
    """Everything that decides a study's runs. grids: (cell name, variant
    name) -> learning rates; data: saved with every run (a folder of other
    data is refused); edge_extensions: how many half-decade rates tuning
    may add beyond each end of a grid while the best sits at that end
    (`next_edge_rate`)."""

    study: str
    cells: tuple
    variants: tuple
    grids: dict
    seeds: tuple
    runs_dir: str
    data: dict
    edge_extensions: int = 0

    @property
    def tune_seed(self):
        return self.seeds[0]

    def cell(self, name):
        return next(c for c in self.cells if c.name == name)

    def variant(self, name):
        return next(v for v in self.variants if v.name == name)


def make_plan(study, *, cells, variants, seeds, runs_dir, data, lr_span=1,
              edge_extensions=0):
    """A `StudyPlan`; each (cell, variant) gets `half_decade_grid(
    scaled_centre(variant, B), lr_span)`."""
    if edge_extensions < 0:
        raise ValueError(f"Expected edge_extensions >= 0, got"
                         f" {edge_extensions}.")
    seeds = tuple(int(s) for s in seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"Expected distinct seeds, got {seeds}.")
    if not cells or not variants:
        raise ValueError("Give at least one cell and one variant.")
    grids = {}
    for cell in cells:
        for variant in variants:
            grid = half_decade_grid(
                scaled_centre(variant, cell.base.batch_size), lr_span)
            decay = dict(variant.changes).get("weight_decay",
                                              cell.base.weight_decay)
            if max(grid) * decay >= 1:
                raise ValueError(
                    f"{variant.name}: weight decay {decay:g} times the"
                    f" learning rate {max(grid):g} must be < 1.")
            grids[(cell.name, variant.name)] = grid
    return StudyPlan(study, tuple(cells), tuple(variants), grids, seeds,
                     runs_dir, dict(data), int(edge_extensions))


def planned_config(plan, run):
    """The `TrainConfig` of `run`, with its model_dir."""
    variant = plan.variant(run.variant)
    setting = runs.Setting(variant.optimizer, run.learning_rate,
                           variant.gamma)
    config = runs.run_config(plan.cell(run.cell).base, setting, run.seed,
                             os.path.join(plan.runs_dir, run.folder))
    return dataclasses.replace(config, **dict(variant.changes))


@dataclasses.dataclass(frozen=True)
class StudyRecord:
    """A finished run: its `runs.Record` and its `final_moments` (empty for
    DP-SGD)."""

    run: Run
    record: runs.Record
    moments: dict
    # The lowest test accuracy of a class (runs on imbalanced data only).
    worst_class_accuracy: float | None = None
    # Which class it was (its label).
    worst_class: int | None = None

    @property
    def accuracy(self):
        """The test accuracy (the reports')."""
        return self.record.accuracy

    @property
    def validation_accuracy(self):
        """The accuracy on the examples the run held out (None: none),
        which tuning selects by (`comparison.selection_accuracies`)."""
        return self.record.validation_accuracy


def load(plan, run):
    """The finished `run` as a `StudyRecord`, or None."""
    config = planned_config(plan, run)
    record = runs.load_record(config.model_dir, config, plan.data)
    if record is None:
        return None
    metrics = runs.read_json(os.path.join(config.model_dir, runs.METRICS))
    classes = metrics.get("class_accuracies")
    return StudyRecord(run, record, metrics.get("final_moments") or {},
                       metrics.get("worst_class_accuracy"),
                       int(min(range(len(classes)), key=classes.__getitem__))
                       if classes else None)


def tuning_runs(plan):
    """Every (cell, variant, learning rate) of the grids at the tuning
    seed (the rates `next_edge_rate` adds are not among them)."""
    return [Run(cell.name, variant.name, lr, plan.tune_seed)
            for cell in plan.cells for variant in plan.variants
            for lr in plan.grids[(cell.name, variant.name)]]


def half_decade_step(lr, steps):
    """The rate `steps` half-decades from `lr` on the grid of
    `half_decade_grid` (3 significant digits): 0.01, 1 -> 0.0316."""
    return comparison.half_decade(comparison.half_decades(lr) + steps)


def candidate_rates(plan, key):
    """The grid of `key` with `plan.edge_extensions` rates beyond each
    end: every rate its tuning may train."""
    grid = plan.grids[key]
    below = [half_decade_step(min(grid), -k)
             for k in range(plan.edge_extensions, 0, -1)]
    above = [half_decade_step(max(grid), k)
             for k in range(1, plan.edge_extensions + 1)]
    return tuple(below) + tuple(grid) + tuple(above)


def _scores(found, key):
    """{learning rate: what tuning ranks it by} of {learning rate:
    `StudyRecord`} of `key` = (cell, variant): the validation accuracy, or
    for runs without a validation split the test accuracy
    (`comparison.selection_accuracies`, a ValueError if they mix); a NaN
    loses."""
    rates = sorted(found)
    accuracies = comparison.selection_accuracies(
        (found[lr] for lr in rates), " / ".join(key))
    return {lr: -math.inf if math.isnan(a) else a
            for lr, a in zip(rates, accuracies)}


def tuned_rates(plan, records):
    """(cell name, variant name) -> {learning rate: `StudyRecord`} of the
    finished runs at the tuning seed (grid and added rates)."""
    tuned = {}
    for run, record in records.items():
        if run.seed == plan.tune_seed:
            tuned.setdefault((run.cell, run.variant), {})[
                run.learning_rate] = record
    return tuned


def _best_rate(found, key):
    """The best rate of {learning rate: `StudyRecord`} of `key` = (cell,
    variant), by `_scores` (a NaN accuracy loses; ties: the smaller
    rate)."""
    scores = _scores(found, key)
    return max(sorted(found), key=scores.__getitem__)


def best_learning_rates(plan, records):
    """(cell name, variant name) -> the learning rate of the best finished
    tuning run, the rates added beyond the grid included: by validation
    accuracy where the runs held examples out, else by test accuracy (a
    NaN accuracy loses; ties: the smaller rate).

    Raises:
        ValueError: the tuning runs of a (cell, variant) mix runs with and
            without a validation accuracy.
    """
    return {key: _best_rate(found, key)
            for key, found in tuned_rates(plan, records).items()}


def next_edge_rate(plan, records, key):
    """The next rate that tuning `key` should try, or None: once its grid is
    finished, while the best rate is the highest (lowest) tried and fewer
    than `plan.edge_extensions` rates were added above (below) the grid,
    the half-decade beyond it. Needs two rates or more; a rate whose
    decoupled weight decay would reach 1 is not tried."""
    found = tuned_rates(plan, records).get(key, {})
    grid = plan.grids[key]
    if any(lr not in found for lr in grid):
        return None
    best = _best_rate(found, key)
    step = comparison.edge_direction(best, found, grid,
                                     plan.edge_extensions)
    if step is None:
        return None
    lr = half_decade_step(best, step)
    config = planned_config(plan, Run(*key, lr, plan.tune_seed))
    return None if lr * config.weight_decay >= 1 else lr


def tuning_round(plan, records):
    """The tuning runs not in `records`: the grids' and the next edge rate
    of each finished grid (`next_edge_rate`). A grid's edge does not wait
    for the other grids: a second process trains it while the first
    finishes them."""
    todo = [run for run in tuning_runs(plan) if run not in records]
    return todo + [Run(*key, lr, plan.tune_seed) for key in plan.grids
                   if (lr := next_edge_rate(plan, records, key)) is not None]


def seed_runs(plan, records):
    """The runs of the seeds phase: each best learning rate, every seed."""
    return [Run(cell, variant, lr, seed)
            for (cell, variant), lr in best_learning_rates(
                plan, records).items() for seed in plan.seeds]


def collect(plan):
    """All finished runs of the plan on disk: `Run` -> `StudyRecord`.
    Checks every folder (a folder of other settings raises)."""
    records = {}
    for key in plan.grids:
        for lr in candidate_rates(plan, key):
            for seed in plan.seeds:
                run = Run(*key, lr, seed)
                record = load(plan, run)
                if record is not None:
                    records[run] = record
    return records


def execute(plan, run_list, train_fn, *, command, machine):
    """Reads back each of `run_list`, or trains (or resumes) it, those that
    other processes are training last (`runs.execute_all`); run ->
    `StudyRecord`."""
    runs.execute_all([planned_config(plan, run) for run in run_list],
                     data=plan.data, train_fn=train_fn, command=command,
                     machine=machine)
    return {run: load(plan, run) for run in run_list}


def run_phase(plan, train_fn, phase, *, command, machine):
    """Trains (or reads back) the runs of `phase`: "tune" (every grid at
    the first seed, then the rates `next_edge_rate` adds), "seeds" (each
    best learning rate with every seed), "all" (both) or "report"
    (nothing; the folders are only checked)."""
    if phase not in ("tune", "seeds", "all", "report"):
        raise ValueError(f"Unknown phase {phase!r}.")
    records = collect(plan)  # A mismatched folder fails before training.
    if phase in ("tune", "all"):
        while todo := tuning_round(plan, records):
            records.update(execute(plan, todo, train_fn, command=command,
                                   machine=machine))
    if phase in ("seeds", "all"):
        missing = [r.folder for r in tuning_runs(plan) if r not in records]
        if missing:
            raise ValueError(f"Tuning is not finished ({len(missing)} runs"
                             f" missing, e.g. {missing[0]}): run"
                             " --phase=tune first.")
        records.update(execute(plan, seed_runs(plan, records), train_fn,
                               command=command, machine=machine))
    return records


def data_spec(max_examples=None, max_steps=None):
    """What identifies a study run's data (saved with it); `max_steps`
    (smoke tests' cap) only when set."""
    spec = experiments.data_spec("fashion_mnist", max_examples=max_examples)
    if max_steps is not None:
        spec.update(max_steps=max_steps)
    return spec


def make_train_fn(data_dir=None, *, max_examples=None, max_steps=None):
    """config -> results of one Fashion-MNIST run, with `final_moments`."""
    from research import train_image

    return lambda config: train_image.run(
        "fashion_mnist", data_dir, config, max_examples=max_examples,
        max_steps=max_steps, measure=study_moments.final_moments)
