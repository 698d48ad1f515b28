"""Reproduces the paper's DP-SGD / DP-Adam / DP-AdamBC comparison at eps ~ 7.

    python -m research.reproduce --task=fashion_mnist
    python -m research.reproduce --task=sst2 --noise_multiplier=0.5
    python -m research.reproduce --task=sst2_lora --sequence_length=32

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
   accuracy, as the paper reports) with every seed of `--seeds`.
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
from tf_dpadam import validation


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
    flags.DEFINE_list("learning_rates_dpsgd", None,
                      "DP-SGD's grid (default: 0.1,1,10).")
    flags.DEFINE_list("learning_rates_dpadam", None,
                      "DP-Adam's grid (default: 1e-4,1e-3,1e-2).")
    flags.DEFINE_list("learning_rates_dpadam_corrected", None,
                      "DP-AdamBC's grid (default: 1e-4,1e-3,1e-2).")
    shared_flags.define_lr_edge_extensions_flag()
    flags.DEFINE_list("gammas_dpadam", None,
                      "DP-Adam's gamma, outside the root (default: the "
                      "paper's, 1e-8).")
    flags.DEFINE_list("gammas_dpadam_corrected", None,
                      "DP-AdamBC's gamma', inside the root; 'none' = 0.04 * "
                      "Phi (default: the paper's for the dataset).")
    shared_flags.define_dp_flags(eval_every=50)
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    positive = shared_flags.number_in(validation.check_positive)
    for name in ("learning_rates_dpsgd", "learning_rates_dpadam",
                 "learning_rates_dpadam_corrected"):
        shared_flags.check_list_flag(name, positive)
    shared_flags.check_flag("ceiling_learning_rate",
                            validation.check_positive)
    for name in ("gammas_dpadam", "gammas_dpadam_corrected"):
        shared_flags.check_list_flag(name, shared_flags.check_gamma)
    shared_flags.check_list_flag(
        "seeds", shared_flags.number_in(shared_flags.check_seed, kind=int))
    for name in ("sequence_length", "max_test_examples", "lora_rank",
                 "finetune_blocks"):
        shared_flags.check_flag(name, validation.check_positive_int)


FLAGS = flags.FLAGS


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
    paper_gamma = common.PAPER_DEFAULTS[dataset]["epsilon"]
    lora_rank = (FLAGS.lora_rank
                 if experiments.finetune_of(task) == "lora" else None)
    finetune_blocks = FLAGS.finetune_blocks
    if (finetune_blocks is not None
            and experiments.finetune_of(task) in ("last_block", "scratch")):
        raise app.UsageError(
            "--finetune_blocks is for --task=sst2_lora or sst2_full.")
    try:
        base = shared_flags.base_config_from_flags(dataset)
        learning_rates = {
            name: shared_flags.parse_floats(values) if values is not None
            else experiments.DEFAULT_LEARNING_RATES[name]
            for name, values in (
                ("dpsgd", FLAGS.learning_rates_dpsgd),
                ("dpadam", FLAGS.learning_rates_dpadam),
                ("dpadam_corrected", FLAGS.learning_rates_dpadam_corrected),
            )
        }
        gammas = {
            name: shared_flags.parse_gammas(values) if values is not None
            else (paper_gamma[name],)
            for name, values in (
                ("dpadam", FLAGS.gammas_dpadam),
                ("dpadam_corrected", FLAGS.gammas_dpadam_corrected),
            )
        }
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
            edge_extensions=FLAGS.lr_edge_extensions)
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
