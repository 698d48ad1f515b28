"""Issue 18's studies on Fashion-MNIST: the regime map and the best recipe.

    python -m research.study --study=regime_map --phase=plan
    python -m research.study --study=regime_map
    python -m research.study --study=best_recipe --epsilons=3 --augmult=0 \\
        --epochs=10 --phase=tune --runs_dir=runs/recipe_pilot \\
        --output_dir=runs/recipe_pilot

Regime map (`--study=regime_map`): from scratch at epsilon = 3 (delta =
1e-5), expected batch B in {256, 1024, 4096}, the same epochs for every B
and sigma calibrated per B to spend exactly epsilon = 3 (within 1e-4 below);
DP-SGD, DP-Adam, DP-AdamBC, DP-AdamBC + decoupled weight decay and DP-AdamBC
at beta_2 = 0.9999 (beta_1 = 0.9) on half-decade learning-rate grids scaled
with B (`research.study_plan.default_variants`). Each run records the
median over coordinates of (v_hat - Phi) / Phi after its last step.

Best recipe (`--study=best_recipe`): epsilon = 3 and 7 with De et al.'s
techniques the binaries have, each a flag: a large batch (--batch_sizes),
augmentation multiplicity (--augmult), parameter averaging
(--ema_momentum), group norm with weight standardization (--normalization),
decoupled weight decay (the dpadam_corrected_wd variant, --weight_decay),
and --epochs or --noise_multiplier; pick the optimizers with --variants and
the learning rates with --lr_centres / --lr_span (0: one rate per cell).

Issue 37's studies put DP-Adam with scale-then-privatize and DiSK beside
the others: `--study=class_imbalance` (the B = 256 cell at epsilon = 3 on a
training set cut by `--imbalance_ratio`, reporting the worst class too) and
`--study=paper_cnn` (the paper CNN at epsilon = 7, B = 256); both default to
the five optimizers. `--calibration_accountant=rdp` reproduces the sigma or
steps of the studies recorded before the binaries moved from RDP to PLD.

`--noise_bands=1,4` makes correlated (BandMF) noise a cell dimension: each
b > 1 adds cells `<cell>_bands<b>` whose runs train with the optimizer's
`noise_strategy=b` on cyclic Poisson batches of b groups, sigma (with
--epochs) or the steps (with --noise_multiplier) calibrated for it, each
(cell, variant) tuned on its own grid (default 1: independent noise, the
cells and runs as before).

`--validation_examples=V` holds V of the training images out as a
validation split (`research.datasets.split_validation`: a fixed choice,
the same for every run, seed and learning rate, carved after
--max_examples and the --imbalance_ratio cut): the runs train on the N - V
others, N - V being the N of sigma's or the steps' calibration and of the
runs' accounting, and each (cell, variant) picks its best learning rate
(and the grid's edge extensions) by accuracy on the held-out images; the
report's accuracies stay on the test set. Default 0: no split, the rates
chosen by test accuracy as in the studies recorded so far.

Phases as `research.reproduce`: tune (every grid at the first seed, then,
while a best rate sits at an end of its grid, up to --lr_edge_extensions
half-decade rates beyond that end), seeds
(each best rate with every seed), report (write the page from the runs on
disk), all (the three); and plan (print the runs and the time estimate,
train nothing). Every run is resumable: a finished one is read back, an
interrupted one resumes from its checkpoint, a folder of other settings is
refused. The report is `<output_dir>/<STUDY>_fashion_mnist.md` with PNGs
(`research.study_report`).

Budget (measured on this 2-core machine while it ran another training, graph
mode, the paper CNN, DP-AdamBC; CPU time by `time.process_time`, which is
less inflated by the other load than wall time): one step costs 0.30 s CPU
(0.33 s wall) at B = 256, 1.11 s (1.13 s) at B = 1024, 4.5 s (6.4 s) at B =
4096: about 70 CPU-seconds per epoch of 60k images at every B. DP-SGD: 0.29 s
at B = 256. --augmult=K costs about K times (0.63 s at K = 2, 1.12 s at K =
4, B = 256), --normalization=group 2.8 times with ghost clipping's rules for
WSConv2D and GroupNormalization (0.77 s against 0.28 s in one run; 7.5 times,
2.07 s, through the fallback rule they replaced); one evaluation on the 10k
test images 2.4 s. On the idle machine the comparison of
research/results/RESULTS_fashion_mnist.md took 47 s of wall time per epoch
(2 cores, evaluations included), the estimate's default
`--seconds_per_epoch=50`.

The plan (issue 18, about 8 hours in all):
- the paper CNN's B = 256 cell at 4 epochs (runs/regime_map: 12 runs,
  about 1 h) came first; the regime map itself then moved to the small CNN
  (`--cnn=small`, 7-10 times cheaper per epoch), so that it affords 10
  epochs: `--cnn=small --epochs=10 --eval_every=100
  --lr_centres=dpsgd=0.6,dpadam=0.0019,dpadam_corrected=0.0006,
  dpadam_corrected_wd=0.0006,dpadam_corrected_b2=0.0006
  --lr_edge_extensions=2` (2344 / 586 / 146 steps at B = 256 / 1024 /
  4096, 75 runs and the rates added past grid ends, about 2.5 h);
- best recipe: `--study=best_recipe --cnn=small --epochs=40
  --ema_momentum=0.99 --augmult=0 --variants=dpsgd,dpadam,dpadam_corrected
  --lr_centres=dpsgd=0.5,dpadam=0.0019,dpadam_corrected=0.0006
  --eval_every=100` at epsilon = 3 and 7, B = 2048, 1172 steps (the
  setting of Tramer & Boneh's end-to-end CNN): 3 optimizers x 3 learning
  rates x 2 epsilons at seed 0 and each best with seeds 1 and 2, 30 runs,
  about 3 h (6.5 min per run on the busy machine);
- the SST-2 from-scratch point (`research.reproduce --task=sst2_scratch
  --l2_norm_clip=10 --noise_multiplier=0.5`, epsilon = 7 as the other SST-2
  rows; C = 0.1 collapsed to the majority class): 15 runs, about 2 h.
`--phase=plan` prints the estimate of any setting.
"""

import os
import shlex
import sys

from absl import app
from absl import flags
import numpy as np

# Before the modules that import Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order

from research import common
from research import datasets
from research import imbalance
from research import models
from research import results_index
from research import runs
from research import study_plan
from research import study_report
from tf_dpadam.common import validation

STUDIES = ("regime_map", "best_recipe", "class_imbalance", "paper_cnn")
# Issue 37's five optimizers (DP-SGD, DP-Adam, DP-AdamBC, scale-then-
# privatize, DiSK).
FIVE_OPTIMIZERS = ("dpsgd", "dpadam", "dpadam_corrected", "dpadam_stp",
                   "dpadam_disk")
# Per study: the flags' values when they are not given.
STUDY_DEFAULTS = {
    "regime_map": dict(batch_sizes=("256", "1024", "4096"), epsilons=("3",),
                       epochs=4.0, variants=tuple(
                           study_plan.default_variants())),
    "best_recipe": dict(batch_sizes=("2048",), epsilons=("3", "7"),
                        epochs=15.0, variants=("dpsgd", "dpadam_corrected")),
    # The regime map's B = 256 cell on a training set whose class sizes
    # fall geometrically (--imbalance_ratio).
    "class_imbalance": dict(batch_sizes=("256",), epsilons=("3",),
                            epochs=10.0, variants=FIVE_OPTIMIZERS),
    # The paper CNN at the comparison's epsilon = 7 and B = 256 (the
    # recorded cell: --noise_multiplier=0.52 --calibration_accountant=rdp).
    "paper_cnn": dict(batch_sizes=("256",), epsilons=("7",), epochs=4.0,
                      variants=FIVE_OPTIMIZERS),
}
# Evaluation on the 10k test images, in wall seconds (see the docstring).
EVALUATION_SECONDS = 2.5
GROUP_NORM_COST = 2.8
# The small CNN's DP step against the paper CNN's (0.26 s against 2.15 s of
# CPU at B = 2048, one run).
SMALL_CNN_COST = 0.12


def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("study", "regime_map", list(STUDIES),
                      "regime_map: the optimizers across B at epsilon = 3;"
                      " best_recipe: De et al.'s techniques at epsilon = 3"
                      " and 7; class_imbalance: B = 256 at epsilon = 3 on"
                      " a cut training set (with --imbalance_ratio) and"
                      " paper_cnn: the paper CNN at epsilon = 7, B = 256,"
                      " both with the five optimizers (issue 37).")
    flags.DEFINE_enum("phase", "all",
                      ["tune", "seeds", "all", "report", "plan"],
                      "tune: the grids at the first seed; seeds: each best"
                      " rate with every seed; report: only write the report;"
                      " all: the three; plan: print the runs and the time"
                      " estimate.")
    flags.DEFINE_string("output_dir", None,
                        "Where the report and its PNGs go (default:"
                        " research/results/).")
    flags.DEFINE_string("runs_dir", None,
                        "Folder of the runs (default: runs/<study>).")
    flags.DEFINE_string("data_dir", None,
                        "Folder of the Fashion-MNIST IDX files (default:"
                        " Debian's, else tfds).")
    flags.DEFINE_integer("max_examples", None,
                         "Use only this many training images.")
    flags.DEFINE_list("seeds", ["0", "1", "2"],
                      "Seeds of the final runs; tuning uses the first.")
    flags.DEFINE_list("variants", None,
                      "Variants of study_plan.default_variants (default:"
                      " all seven for regime_map; dpsgd,dpadam_corrected for"
                      " best_recipe).")
    flags.DEFINE_list("lr_centres", [],
                      "name=lr: a variant's learning-rate centre at B = 256"
                      " (scaled with B as its default).")
    flags.DEFINE_integer("lr_span", 1,
                         "Grid points on each side of the centre, x sqrt(10)"
                         " apart (0: the centre only).")
    shared_flags.define_lr_edge_extensions_flag()
    flags.DEFINE_float("imbalance_ratio", 1.0,
                       "Heavy-tailed class imbalance (research.imbalance):"
                       " class c keeps this^(c / 9) of its training images;"
                       " the runs then record each class's test accuracy.")
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    flags.DEFINE_list("batch_sizes", None,
                      "Expected batch sizes B (default: 256,1024,4096 for"
                      " regime_map, 2048 for best_recipe).")
    flags.DEFINE_list("epsilons", None,
                      "Target epsilons (default: 3 for regime_map; 3,7 for"
                      " best_recipe).")
    flags.DEFINE_float("epochs", None,
                       "Epochs of every run; sigma is calibrated per cell"
                       " (default: 4 for regime_map, 15 for best_recipe).")
    flags.DEFINE_float("noise_multiplier", None,
                       "A fixed sigma instead of --epochs: the steps are"
                       " calibrated per cell.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "C.")
    flags.DEFINE_float("delta", 1e-5, "delta.")
    flags.DEFINE_enum("calibration_accountant", "pld", ["pld", "rdp"],
                      "The accountant that calibrates sigma to the epsilons"
                      " (--epochs) or the steps (--noise_multiplier): rdp"
                      " for the studies recorded before the binaries moved"
                      " to PLD (regime_map_small, recipe_small), whose runs"
                      " it reads back.")
    flags.DEFINE_integer("eval_every", 50, "DP steps between evaluations.")
    flags.DEFINE_list("noise_bands", ["1"],
                      "Bands b of correlated noise, a cell dimension (each"
                      " b in [1, 64] its own cells, named ..._bands<b>):"
                      " the optimizer's noise_strategy=b on cyclic Poisson"
                      " batches of b groups, sigma or the steps calibrated"
                      " for it (T steps count as ceil(T / b) at q = bB/N),"
                      " the steps and --eval_every multiples of b. 1:"
                      " independent noise.")
    flags.DEFINE_integer("validation_examples", 0,
                         "V >= 0: hold out V training images (a fixed"
                         " choice, after --max_examples and"
                         " --imbalance_ratio) as a validation split; the"
                         " runs train on the others (the N of the"
                         " calibration and accounting) and tuning picks"
                         " each learning rate by validation accuracy. 0:"
                         " none (by test accuracy, as before).")
    flags.DEFINE_integer("augmult", 0, "Augmentation multiplicity K (0:"
                         " none).")
    flags.DEFINE_float("ema_momentum", None,
                       "Parameter averaging with this momentum (default:"
                       " none).")
    flags.DEFINE_enum("normalization", "none", list(models.NORMALIZATIONS),
                      "As for research.train_image.")
    flags.DEFINE_enum("cnn", "paper", list(models.CNNS),
                      "As for research.train_image.")
    flags.DEFINE_float("weight_decay", 0.1,
                       "The decoupled weight decay of dpadam_corrected_wd.")
    flags.DEFINE_float("beta_2_high", 0.9999,
                       "beta_2 of dpadam_corrected_b2.")
    flags.DEFINE_float("seconds_per_epoch", 50.0,
                       "--phase=plan: wall seconds of an epoch of the plain"
                       " CNN (B-independent).")
    positive = shared_flags.number_in(validation.check_positive)
    for name in ("batch_sizes", "epsilons"):
        shared_flags.check_list_flag(name, positive)
    shared_flags.check_list_flag(
        "seeds", shared_flags.number_in(shared_flags.check_seed, kind=int))
    shared_flags.check_list_flag(
        "noise_bands", shared_flags.number_in(common.check_noise_bands,
                                              kind=int))
    for name in ("max_examples", "eval_every"):
        shared_flags.check_flag(name, validation.check_positive_int)
    for name in ("epochs", "noise_multiplier", "l2_norm_clip",
                 "seconds_per_epoch"):
        shared_flags.check_flag(name, validation.check_positive)
    for name in ("augmult", "lr_span", "weight_decay"):
        shared_flags.check_flag(name, validation.check_non_negative)
    shared_flags.check_flag("imbalance_ratio", imbalance.check_ratio_flag)
    shared_flags.check_flag("validation_examples",
                            common.check_validation_examples)


FLAGS = flags.FLAGS


def parse_centres(items):
    """["dpsgd=3", ...] -> {"dpsgd": 3.0}."""
    centres = {}
    for item in items:
        name, _, value = item.partition("=")
        centres[name.strip()] = shared_flags.parse_floats([value])[0]
    return centres


def planned_runs(plan):
    """Every run the plan may train: the grids at the first seed and, for
    the seeds phase, one rate per (cell, variant) with the other seeds."""
    return study_plan.tuning_runs(plan) + [
        study_plan.Run(cell.name, variant.name, 0.0, seed)
        for cell in plan.cells for variant in plan.variants
        for seed in plan.seeds[1:]]


def estimate_seconds(plan, seconds_per_epoch):
    """Wall seconds of every planned run: epochs x `seconds_per_epoch` x
    the cost of augmult and group norm, plus the evaluations."""
    total = 0.0
    for run in planned_runs(plan):
        cell = plan.cell(run.cell)
        c = cell.base
        cost = max(c.augmult, 1) * (
            GROUP_NORM_COST if c.normalization == "group" else 1.0) * (
            SMALL_CNN_COST if c.cnn == "small" else 1.0)
        epochs = cell.steps * c.batch_size / cell.num_examples
        total += (epochs * seconds_per_epoch * cost
                  + -(-cell.steps // c.eval_every) * EVALUATION_SECONDS)
    return total


def describe(plan, seconds_per_epoch):
    """The plan as text: its cells, its grids and the time estimate."""
    lines = []
    for cell in plan.cells:
        c = cell.base
        lines.append(f"{cell.name}: B={c.batch_size} sigma="
                     f"{c.noise_multiplier:.5g} steps={cell.steps} epochs="
                     f"{cell.steps * c.batch_size / cell.num_examples:.3g}"
                     f" N={cell.num_examples}"
                     + (f" (validation: {c.validation_examples} held out)"
                        if c.validation_examples else ""))
        for variant in plan.variants:
            grid = plan.grids[(cell.name, variant.name)]
            lines.append(f"  {variant.name}: lr "
                         + ", ".join(f"{lr:g}" for lr in grid))
    seconds = estimate_seconds(plan, seconds_per_epoch)
    lines.append(f"{len(planned_runs(plan))} runs, about {seconds / 3600:.1f}"
                 f" h at {seconds_per_epoch:g} s per epoch, plus up to"
                 f" {plan.edge_extensions} more per (cell, variant) and"
                 " grid end where the best rate sits at the end")
    return "\n".join(lines)


def make_study_plan(name, *, num_examples, runs_dir, data,
                    batch_sizes=None, epsilons=None, epochs=None,
                    noise_multiplier=None, variants=None, lr_centres=None,
                    lr_span=1, lr_edge_extensions=0, seeds=(0, 1, 2),
                    l2_norm_clip=1.0,
                    delta=1e-5, eval_every=50, augmult=0, ema_momentum=None,
                    normalization="none", cnn="paper", weight_decay=0.1,
                    beta_2_high=0.9999, imbalance_ratio=1.0,
                    calibration_accountant="pld", noise_bands=(1,),
                    validation_examples=0):
    """The `StudyPlan` of study `name` for `num_examples` training images
    (after --max_examples and the imbalance cut, before the
    `validation_examples` held out: each cell trains on the others,
    `study_plan.make_cell`); None: the study's default (`STUDY_DEFAULTS`);
    the arguments are the flags'."""
    defaults = STUDY_DEFAULTS[name]
    table = study_plan.with_centres(
        study_plan.default_variants(weight_decay=weight_decay,
                                    beta_2_high=beta_2_high),
        lr_centres or {})
    names = variants or defaults["variants"]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"Unknown variants {unknown}; expected some of"
                         f" {list(table)}.")
    if noise_multiplier is None:
        epochs = epochs or defaults["epochs"]
    elif epochs is not None:
        raise ValueError("Give --epochs or --noise_multiplier, not both.")
    cells = [
        study_plan.make_cell(
            target_epsilon=float(eps), batch_size=int(b),
            num_examples=num_examples, epochs=epochs,
            noise_multiplier=noise_multiplier, l2_norm_clip=l2_norm_clip,
            delta=delta, eval_every=eval_every, augmult=augmult,
            ema_momentum=ema_momentum, normalization=normalization,
            cnn=cnn, imbalance_ratio=imbalance_ratio,
            accountant=calibration_accountant, noise_bands=int(bands),
            validation_examples=validation_examples)
        for eps in epsilons or defaults["epsilons"]
        for b in batch_sizes or defaults["batch_sizes"]
        for bands in noise_bands]
    return study_plan.make_plan(
        name, cells=cells, variants=[table[n] for n in names], seeds=seeds,
        runs_dir=runs_dir, data=data, lr_span=lr_span,
        edge_extensions=lr_edge_extensions)


def study(plan, train_fn, *, phase, output_dir, command, machine=None):
    """Runs `phase` of the plan and writes the report; returns its path."""
    machine = machine or runs.machine_info()
    records = study_plan.run_phase(plan, train_fn, phase, command=command,
                                   machine=machine)
    path = study_report.write_report(plan, records, output_dir, command,
                                     machine)
    results_index.write_index(output_dir)
    return path


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    caps = shared_flags.smoke_test_caps()
    max_examples = caps.examples(FLAGS.max_examples)
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT):
        (_, y_train), _ = datasets.load_image_dataset("fashion_mnist",
                                                      FLAGS.data_dir)
    # The images the runs split into training and validation ones (in
    # `train_image.run`'s order: the cap, the imbalance cut, the split);
    # each cell's N leaves the validation images out (`make_cell`).
    num_examples = min(len(y_train), max_examples or len(y_train))
    if FLAGS.imbalance_ratio < 1:
        num_examples = sum(imbalance.geometric_class_sizes(
            np.bincount(y_train[:num_examples]), FLAGS.imbalance_ratio))
    with shared_flags.usage_errors():
        plan = make_study_plan(
            FLAGS.study, num_examples=num_examples,
            runs_dir=(FLAGS.runs_dir or os.path.join(
                study_plan.experiments.ROOT, "runs", FLAGS.study)),
            data=study_plan.data_spec(max_examples, caps.max_steps),
            batch_sizes=FLAGS.batch_sizes, epsilons=FLAGS.epsilons,
            epochs=FLAGS.epochs, noise_multiplier=FLAGS.noise_multiplier,
            variants=FLAGS.variants,
            lr_centres=parse_centres(FLAGS.lr_centres),
            lr_span=FLAGS.lr_span,
            lr_edge_extensions=FLAGS.lr_edge_extensions, seeds=FLAGS.seeds,
            l2_norm_clip=FLAGS.l2_norm_clip, delta=FLAGS.delta,
            eval_every=FLAGS.eval_every, augmult=FLAGS.augmult,
            ema_momentum=FLAGS.ema_momentum,
            normalization=FLAGS.normalization, cnn=FLAGS.cnn,
            weight_decay=FLAGS.weight_decay, beta_2_high=FLAGS.beta_2_high,
            imbalance_ratio=FLAGS.imbalance_ratio,
            calibration_accountant=FLAGS.calibration_accountant,
            noise_bands=[int(b) for b in FLAGS.noise_bands],
            validation_examples=FLAGS.validation_examples)
    if FLAGS.phase == "plan":
        print(describe(plan, FLAGS.seconds_per_epoch))
        return
    train_fn = study_plan.make_train_fn(
        FLAGS.data_dir, max_examples=max_examples, max_steps=caps.max_steps)
    output_dir = FLAGS.output_dir or study_plan.experiments.RESULTS_DIR
    # ValueError: a run folder of other settings, tuning not finished, or
    # settings that cannot train (training.SettingsError).
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT), \
            shared_flags.usage_errors():
        path = study(plan, train_fn, phase=FLAGS.phase,
                     output_dir=output_dir,
                     command=shlex.join(sys.orig_argv))
    print(f"Wrote {path}")


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
