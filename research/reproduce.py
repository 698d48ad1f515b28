"""Reproduces the paper's DP-SGD / DP-Adam / DP-AdamBC comparison at eps ~ 7.

    python -m research.reproduce --task=fashion_mnist
    python -m research.reproduce --task=sst2 --noise_multiplier=0.5
    python -m research.reproduce --task=sst2_lora --sequence_length=32
    python -m research.reproduce --optimizers=dpadam_stp,dpadam_disk
    python -m research.reproduce --calibration_accountant=rdp

Tang & Lecuyer compare the three optimizers on CIFAR-10 (a CNN) and SNLI
(BERT, last block fine-tuned) at epsilon = 7. This binary runs the same
protocol on the data this project has offline: Fashion-MNIST for the CNN
(`research.train_image`) and SST-2 for the text model (`research.train_text`):

1. `--phase=tune`: for each optimizer, every learning rate x gamma of its
   grid (the paper's coarse granularity: powers of 10) at the first seed;
   then, while the best rate sits at an end of its grid, up to
   `--lr_edge_extensions` (default 1) rates beyond that end, the grid's
   ratio continued (`experiments.extended_plan`).
2. `--phase=seeds`: the best setting of each optimizer (by final test
   accuracy, as the paper reports; runs that held training examples out
   for validation would be compared by their validation accuracy,
   `comparison.selection_accuracies`, the studies' rule) with every seed
   of `--seeds`.
3. `--phase=ceiling` (with `--ceiling_learning_rate`): one non-private
   run (Adam, sigma = 0, no clipping) with the DP runs' steps, the ceiling
   that the private runs are reported against.
4. `--phase=report`: writes `<output_dir>/RESULTS_<task>.md` and its plots
   from the runs on disk, without training. `tune` and `seeds` write it too;
   `--phase=all` does them in turn (the ceiling if its learning rate is
   given).

Every run lives in `<runs_dir>/<name>` (the `model_dir` of
`research.training.fit_private`): a finished run is read back instead of being
retrained, an interrupted one resumes from its checkpoint. A run folder made
with other hyperparameters or other data is refused rather than mixed in.
Each run's seed keys its model, data order, DP noise and Poisson sampling
(`runs.run_config`), so that a run is reproducible; anyone who knows the seed can
remove the noise, which is fine for this comparison on public data only.

`--optimizers` picks which optimizers the plan tunes (default: the paper's
three, `dpsgd,dpadam,dpadam_corrected`; also `dpadam_stp` and `dpadam_disk`,
DP-Adam scale-then-privatize and DiSK, with grids of their own flags); the
report covers those. With a target epsilon the runs calibrate their steps by
PLD (`research.common.ACCOUNTANT`); `--calibration_accountant=rdp` calibrates
them by RDP here and trains them as epochs, the steps of the results recorded
with RDP (719 for Fashion-MNIST, 536 for SST-2 at sigma = 0.5; PLD allows
1,468 and 1,221).

The plan and its runs are `research.experiments` and `research.runs`; the
report is `research.results_report`. C, sigma and B default to
`research.common.PAPER_DEFAULTS` for the dataset.
For SST-2 that is the paper's SNLI setting (sigma = 0.4, B = 256), which on
SST-2's 67k examples reaches epsilon = 7 after only 7 steps (SNLI has 550k
examples); `--noise_multiplier=0.5` gives 536 steps (about 2 epochs).
"""

import os
import shlex
import sys

from absl import app
from absl import flags

# Before the modules that import Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order

from research import common
from research import experiments
from research import results_report
from research import datasets
from research import runs
from research import training
from tf_dpadam.common import validation

# The optimizers with a gamma (a --gammas_* flag): all but DP-SGD.
GAMMA_OPTIMIZERS = tuple(n for n in common.OPTIMIZER_LABELS if n != "dpsgd")


def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("task", "fashion_mnist", list(experiments.TASKS),
                      "fashion_mnist: the CNN on Fashion-MNIST (the paper's "
                      "CIFAR-10 experiment); sst2: BERT on SST-2 (its SNLI "
                      "experiment: last block and head); sst2_lora,"
                      " sst2_full: the same data, LoRA or full fine-tuning"
                      " of the pretrained BERT; sst2_scratch: a small BERT"
                      " trained from scratch (research.finetune).")
    flags.DEFINE_enum("phase", "all",
                      ["tune", "seeds", "ceiling", "all", "report"],
                      "tune: the grid at the first seed; seeds: the best "
                      "setting with every seed; ceiling: the non-private "
                      "run (--ceiling_learning_rate); report: only write "
                      "the report; all: all of them.")
    flags.DEFINE_float("ceiling_learning_rate", None,
                       "The non-private ceiling: one run of Adam without "
                       "clipping or noise (sigma = 0, C = 1e9), with the DP "
                       "runs' Poisson batches and steps, at this learning "
                       "rate; reported beside them. Also give it to "
                       "--phase=report.")
    flags.DEFINE_string("output_dir", None,
                        "Where RESULTS_<task>.md and its plots go (default: "
                        "research/results/ in the repository).")
    flags.DEFINE_string("runs_dir", None,
                        "Folder of the runs' model_dirs (default: "
                        "runs/<task> in the repository).")
    flags.DEFINE_string("data_dir", None,
                        "fashion_mnist: folder of the IDX files (default: "
                        "Debian's, else tfds); sst2: folder of train.tsv and "
                        "dev.tsv (default: ../shared/data/sst2 from the "
                        "repository).")
    flags.DEFINE_integer("max_test_examples", None,
                         "sst2 only: evaluate on this many dev examples.")
    flags.DEFINE_string("preset", None,
                        "sst2: keras-hub preset (default: the offline "
                        "all-MiniLM-L6-v2).")
    flags.DEFINE_integer("sequence_length", 128, "sst2: tokens per example.")
    flags.DEFINE_bool("cache_frozen", True,
                      "sst2: compute the frozen BERT part once and train the "
                      "top on its outputs (see research.train_text).")
    flags.DEFINE_integer("lora_rank", 8,
                         "sst2_lora: rank of the LoRA factors.")
    flags.DEFINE_enum("pooling", None, ["cls", "mean"],
                      "sst2*: what feeds the head (default: cls for sst2,"
                      " mean for sst2_lora and sst2_full).")
    flags.DEFINE_integer("finetune_blocks", None,
                         "sst2_lora, sst2_full: fine-tune only the top this"
                         " many transformer blocks (default: all); the"
                         " blocks below are frozen and cached.")
    flags.DEFINE_list("seeds", ["0", "1", "2"],
                      "Seeds of the final runs; tuning uses the first. A "
                      "run's seed also keys its DP noise and sampling "
                      "(reproducible, so not private).")
    flags.DEFINE_list("optimizers", list(common.OPTIMIZER_NAMES),
                      "The optimizers to tune and report, in this order: "
                      f"some of {','.join(common.OPTIMIZER_LABELS)} "
                      "(dpadam_stp: DP-Adam scale-then-privatize; "
                      "dpadam_disk: DP-Adam DiSK).")
    flags.DEFINE_enum("calibration_accountant", "pld", ["pld", "rdp"],
                      "With a target epsilon, the accountant that calibrates"
                      " the runs' steps: pld (the binaries', at train time)"
                      " or rdp (calibrated here and trained as epochs: the"
                      " steps of the results recorded with RDP).")
    flags.DEFINE_list("learning_rates_dpsgd", None,
                      "DP-SGD's grid (default: 0.1,1,10).")
    flags.DEFINE_list("learning_rates_dpadam", None,
                      "DP-Adam's grid (default: 1e-4,1e-3,1e-2).")
    flags.DEFINE_list("learning_rates_dpadam_corrected", None,
                      "DP-AdamBC's grid (default: 1e-4,1e-3,1e-2).")
    flags.DEFINE_list("learning_rates_dpadam_stp", None,
                      "DP-Adam STP's grid (default: 1e-4,1e-3,1e-2).")
    flags.DEFINE_list("learning_rates_dpadam_disk", None,
                      "DP-Adam DiSK's grid (default: 1e-4,1e-3,1e-2).")
    shared_flags.define_lr_edge_extensions_flag()
    flags.DEFINE_list("gammas_dpadam", None,
                      "DP-Adam's gamma, outside the root (default: the "
                      "paper's, 1e-8).")
    flags.DEFINE_list("gammas_dpadam_corrected", None,
                      "DP-AdamBC's gamma', inside the root; 'none' = 0.04 * "
                      "Phi (default: the paper's for the dataset).")
    flags.DEFINE_list("gammas_dpadam_stp", None,
                      "DP-Adam STP's gamma, outside the root (default: the "
                      "paper's DP-Adam gamma, 1e-8).")
    flags.DEFINE_list("gammas_dpadam_disk", None,
                      "DP-Adam DiSK's gamma, outside the root (default: the "
                      "paper's DP-Adam gamma, 1e-8).")
    shared_flags.define_dp_flags(eval_every=50)
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    positive = shared_flags.number_in(validation.check_positive)
    shared_flags.check_list_flag("optimizers", check_optimizer)
    for name in common.OPTIMIZER_LABELS:
        shared_flags.check_list_flag(f"learning_rates_{name}", positive)
    shared_flags.check_flag("ceiling_learning_rate",
                            validation.check_positive)
    for name in GAMMA_OPTIMIZERS:
        shared_flags.check_list_flag(f"gammas_{name}",
                                     shared_flags.check_gamma)
    shared_flags.check_list_flag(
        "seeds", shared_flags.number_in(shared_flags.check_seed, kind=int))
    for name in ("sequence_length", "max_test_examples", "lora_rank",
                 "finetune_blocks"):
        shared_flags.check_flag(name, validation.check_positive_int)


FLAGS = flags.FLAGS


def check_optimizer(name, value):
    """An item of --optimizers: a key of `common.OPTIMIZER_LABELS`."""
    validation.check(value in common.OPTIMIZER_LABELS, name, value,
                     f"in {list(common.OPTIMIZER_LABELS)}")


def grids_of_flags(dataset, optimizers, rate_flags, gamma_flags):
    """`(learning_rates, gammas)` of `experiments.make_plan` for
    `optimizers`.

    Args:
        dataset: the task's dataset (the paper's gammas are its).
        optimizers: the names of --optimizers.
        rate_flags, gamma_flags: optimizer -> the value of its
            --learning_rates_* / --gammas_* flag (None: not given, then
            `experiments.DEFAULT_LEARNING_RATES` and the paper's gamma).

    Raises:
        ValueError: a value that is not a number, or a grid given to an
            optimizer that is not in `optimizers`.
    """
    for kind, given in (("learning_rates", rate_flags),
                        ("gammas", gamma_flags)):
        for name, values in given.items():
            if values is not None and name not in optimizers:
                raise ValueError(f"--{kind}_{name} is given but --optimizers"
                                 f" lacks {name}.")
    paper_gamma = common.PAPER_DEFAULTS[dataset]["epsilon"]
    learning_rates, gammas = {}, {}
    for name in optimizers:
        rates = rate_flags.get(name)
        learning_rates[name] = (experiments.DEFAULT_LEARNING_RATES[name]
                                if rates is None
                                else shared_flags.parse_floats(rates))
        if name in paper_gamma:  # DP-SGD has none.
            values = gamma_flags.get(name)
            gammas[name] = ((paper_gamma[name],) if values is None
                            else shared_flags.parse_gammas(values))
    return learning_rates, gammas


def reproduce(plan, train_fn, *, phase, output_dir, command, machine=None):
    """Runs `phase` of the plan and writes the report; returns its path.

    Args:
        plan: an `experiments.Plan`.
        train_fn: config -> results (e.g. `experiments.make_train_fn(...)`);
            only called for runs that are not finished.
        phase: "tune", "seeds", "all" or "report" (no training).
        output_dir: folder of the report.
        command: the command line, for the report.
        machine: `runs.machine_info()` (computed if None).
    """
    machine = machine or runs.machine_info()
    experiments.run_phase(plan, train_fn, phase, command=command,
                          machine=machine)
    return results_report.write_report(plan, output_dir, command, machine)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    task = FLAGS.task
    dataset = experiments.TASKS[task]["dataset"]
    lora_rank = (FLAGS.lora_rank
                 if experiments.finetune_of(task) == "lora" else None)
    finetune_blocks = FLAGS.finetune_blocks
    if (finetune_blocks is not None
            and experiments.finetune_of(task) in ("last_block", "scratch")):
        raise app.UsageError(
            "--finetune_blocks is for --task=sst2_lora or sst2_full.")
    try:
        base = shared_flags.base_config_from_flags(dataset)
        optimizers = tuple(FLAGS.optimizers)
        learning_rates, gammas = grids_of_flags(
            dataset, optimizers,
            {name: FLAGS[f"learning_rates_{name}"].value
             for name in common.OPTIMIZER_LABELS},
            {name: FLAGS[f"gammas_{name}"].value
             for name in GAMMA_OPTIMIZERS})
        num_examples = None
        if (base.target_epsilon is not None
                and FLAGS.calibration_accountant != common.ACCOUNTANT):
            # N of the calibration (the runs learn it from their data).
            with shared_flags.usage_errors(FileNotFoundError,
                                           prefix="--data_dir: "):
                num_examples = experiments.num_train_examples(
                    task, data_dir=FLAGS.data_dir,
                    max_examples=FLAGS.max_examples)
        spec = experiments.data_spec(
            task, max_examples=FLAGS.max_examples,
            max_test_examples=FLAGS.max_test_examples, preset=FLAGS.preset,
            sequence_length=FLAGS.sequence_length,
            cache_frozen=FLAGS.cache_frozen, lora_rank=lora_rank,
            finetune_blocks=finetune_blocks, pooling=FLAGS.pooling)
        plan = experiments.make_plan(
            task, base=base, learning_rates=learning_rates, gammas=gammas,
            seeds=FLAGS.seeds,
            runs_dir=(FLAGS.runs_dir
                      or os.path.join(experiments.ROOT, "runs", task)),
            data=spec, ceiling_learning_rate=FLAGS.ceiling_learning_rate,
            edge_extensions=FLAGS.lr_edge_extensions, optimizers=optimizers,
            calibration_accountant=FLAGS.calibration_accountant,
            num_examples=num_examples)
        train_fn = experiments.make_train_fn(
            task, data_dir=FLAGS.data_dir, max_examples=FLAGS.max_examples,
            max_test_examples=FLAGS.max_test_examples, preset=FLAGS.preset,
            sequence_length=FLAGS.sequence_length,
            cache_frozen=FLAGS.cache_frozen, lora_rank=lora_rank,
            finetune_blocks=finetune_blocks, pooling=FLAGS.pooling)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    output_dir = FLAGS.output_dir or experiments.RESULTS_DIR
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT), \
            shared_flags.usage_errors(training.SettingsError):
        path = reproduce(plan, train_fn, phase=FLAGS.phase,
                         output_dir=output_dir,
                         command=shlex.join(sys.orig_argv))
    print(f"Wrote {path}")


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
