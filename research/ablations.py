"""The paper's ablations of DP-AdamBC on Fashion-MNIST with the paper's CNN.

    python -m research.ablations --ablation=all
    python -m research.ablations --max_examples=20000 --noise_multiplier=0.59 \
        --eval_every=40 --spread_seeds=1,2
        # (research/results/ABLATIONS_fashion_mnist.md)

Tang & Lecuyer ablate three choices of DP-AdamBC (Algorithm 1,
theta <- theta - eta * m_hat / sqrt(max(v_hat - Phi', gamma'))). Each
ablation sweeps one hyperparameter with everything else fixed, one run
(`research.train_image`) per setting at `--seed`, which also keys the DP
noise and the Poisson sampling (`runs.run_config`: reproducible research
runs on public data, not private ones):

1. `phi`: the subtracted Phi' = m * Phi for m in `--phi_multiples`
   (default 0.1, 1, 10), Phi = (sigma C / B)^2 the true noise variance.
   gamma' stays at 0.04 * Phi (of the true Phi) so that only Phi' moves.
2. `gamma`: gamma' in `--gammas` (default 1e-9 ... 1e-5 and `none`, the
   default 0.04 * Phi), lr 1e-3. gamma' only means something relative to Phi:
   the report gives gamma' / Phi for each.
3. `beta`: beta_2 in `--beta_2s` (default 0.99, 0.999, 0.9999) with
   (1 - beta_1) = sqrt(1 - beta_2), for DP-AdamBC (lr 1e-3, gamma' = 0.04
   Phi) and DP-Adam (biased; lr 1e-2, gamma = 1e-8, its best on
   Fashion-MNIST), next to Keras' defaults beta = (0.9, 0.999).
4. `lr`: the learning rate at this scale, DP-AdamBC over
   `--lr_sweep_corrected` (default 3e-4, 1e-3, 3e-3, 1e-2) and DP-Adam over
   `--lr_sweep_adam` (default 3e-3, 1e-2, 3e-2), everything else default:
   whether the other ablations' fixed learning rates (the main
   experiment's picks) still suit a shorter run.

`--ablation=all` runs the four (the DP-AdamBC run with the defaults, lr
1e-3, gamma' = 0.04 Phi, true Phi, beta = (0.9, 0.999), is the reference of
all four and trains once; DP-Adam's default run is shared by `beta` and
`lr`). `--spread_seeds` reruns that reference with
other seeds, which measures the seed-to-seed spread the report uses to tell
an effect from noise.

Each run is a model_dir `<runs_dir>/<variant>/<run name>` written by
`research.runs.execute`: a finished run is read back, an interrupted one
resumes, a folder of other hyperparameters or data is refused. Every call
rewrites `<output_dir>/ABLATIONS_fashion_mnist.md` (a table per ablation,
plots, the command, a paragraph from the numbers) with a PNG per ablation,
from all the finished runs on disk; `--notrain` only writes the report.
The sweeps are `research.ablation_sweeps`, the report
`research.ablations_report` with its prose from `research.ablation_findings`.

C, sigma and B default to the main experiment's (C = 1, sigma = 0.52,
B = 256, epsilon = 7: 719 steps on the 60k images). For a cheaper run use a
subset and recalibrate sigma so that epsilon = 7 still takes a few hundred
steps, e.g. `--max_examples=20000 --noise_multiplier=0.59` (235 steps; the
22 runs of the report took 32 minutes on 2 CPU cores shared with other jobs).
The fixed learning rates are the main experiment's picks at every scale;
the `lr` ablation checks them at the scale of the run.
"""

import os
import shlex
import sys

from absl import app
from absl import flags

# Before the modules that import Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order

from research import ablation_sweeps
from research import ablations_report
from research import experiments
from research import datasets
from research import runs
from research import training
from research.ablation_sweeps import ABLATIONS
from research.ablation_sweeps import TASK
from tf_dpadam.common import validation


def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("ablation", "all", list(ABLATIONS) + ["all"],
                      "Which ablation to train (the report shows every "
                      "finished run).")
    flags.DEFINE_integer("seed", 0,
                         "Seed of every ablation run (model, data order, "
                         "DP noise and sampling: reproducible, not private).")
    flags.DEFINE_list("spread_seeds", [],
                      "Extra seeds of the reference DP-AdamBC run, to "
                      "measure the seed-to-seed spread.")
    flags.DEFINE_string("runs_dir", None,
                        "Folder of the runs (default: runs/ablations in the "
                        "repository).")
    flags.DEFINE_string("output_dir", None,
                        "Where ABLATIONS_fashion_mnist.md and its PNGs go "
                        "(default: research/results/ in the repository).")
    flags.DEFINE_string("data_dir", None,
                        "Folder of the Fashion-MNIST IDX files (default: "
                        "Debian's, else tfds).")
    flags.DEFINE_bool("train", True,
                      "Train the missing runs; --notrain only writes the "
                      "report.")
    flags.DEFINE_list("phi_multiples", ["0.1", "1", "10"],
                      "phi ablation: Phi' / Phi.")
    flags.DEFINE_list("gammas", ["1e-9", "1e-8", "1e-7", "1e-6", "1e-5",
                                 "none"],
                      "gamma ablation: DP-AdamBC's gamma'; 'none' = 0.04 * "
                      "Phi.")
    flags.DEFINE_list("beta_2s", ["0.99", "0.999", "0.9999"],
                      "beta ablation: beta_2, with beta_1 = 1 - sqrt(1 - "
                      "beta_2).")
    flags.DEFINE_list("lr_sweep_corrected", ["3e-4", "1e-3", "3e-3", "1e-2"],
                      "lr ablation: DP-AdamBC's learning rates.")
    flags.DEFINE_list("lr_sweep_adam", ["3e-3", "1e-2", "3e-2"],
                      "lr ablation: DP-Adam's learning rates.")
    flags.DEFINE_float("learning_rate_corrected", 1e-3,
                       "DP-AdamBC's learning rate (all ablations).")
    flags.DEFINE_float("learning_rate_adam", 1e-2,
                       "DP-Adam's learning rate (beta ablation).")
    flags.DEFINE_float("gamma_adam", 1e-8,
                       "DP-Adam's gamma, outside the root (beta ablation).")
    shared_flags.define_dp_flags(eval_every=50)
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    positive = shared_flags.number_in(validation.check_positive)
    for name in ("lr_sweep_corrected", "lr_sweep_adam"):
        shared_flags.check_list_flag(name, positive)
    shared_flags.check_list_flag(
        "phi_multiples", shared_flags.number_in(validation.check_non_negative))
    shared_flags.check_list_flag("gammas", shared_flags.check_gamma)
    shared_flags.check_list_flag("beta_2s",
                                 shared_flags.number_in(validation.check_beta))
    shared_flags.check_list_flag(
        "spread_seeds",
        shared_flags.number_in(shared_flags.check_seed, kind=int))
    shared_flags.check_flag("seed", shared_flags.check_seed)
    for name in ("learning_rate_corrected", "learning_rate_adam"):
        shared_flags.check_flag(name, validation.check_positive)
    shared_flags.check_flag("gamma_adam", validation.check_non_negative)


FLAGS = flags.FLAGS


def run_ablations(names, *, base, sweeps, seed, spread_seeds, runs_dir, data,
                  train_fn, output_dir, command, machine=None, train=True):
    """Trains the missing runs of the ablations `names`, writes the report.

    Args:
        names: ablations to train (a subset of `ABLATIONS`); the report
            shows all of them.
        base: the shared `TrainConfig` (e.g. `common.base_config`).
        sweeps: the `ablation_sweeps.Sweeps`.
        seed: seed of the ablation runs.
        spread_seeds: extra seeds of the reference arm (trained last).
        runs_dir: folder of the runs.
        data: `experiments.data_spec(...)`, saved with every run.
        train_fn: config -> results (e.g. `experiments.make_train_fn`); only
            called for runs that are not finished.
        output_dir: folder of the report.
        command: the command line, for the report.
        machine: `runs.machine_info()` (computed if None).
        train: False only writes the report.

    Returns:
        The path of the report.
    """
    for name in names:
        if name not in ABLATIONS:
            raise ValueError(f"Unknown ablation {name!r}; expected one of "
                             f"{ABLATIONS}.")
    machine = machine or runs.machine_info()
    phi = ablation_sweeps.true_phi(base.l2_norm_clip, base.noise_multiplier,
                                   base.batch_size)
    ablations = ablation_sweeps.make_ablations(phi, sweeps)
    where = dict(base=base, runs_dir=runs_dir, data=data)
    todo = [(arm, seed) for arm in
            ablation_sweeps.unique_arms(ablations[n] for n in names)]
    todo += [(ablation_sweeps.reference_arm(sweeps), s) for s in spread_seeds]
    # Check every run folder first: a mismatch fails before any training.
    for arm, s in todo:
        ablation_sweeps.load_arm(arm, seed=s, **where)
    if train:
        configs = [ablation_sweeps.arm_config(arm, seed=s, base=base,
                                              runs_dir=runs_dir)
                   for arm, s in todo]
        runs.execute_all(configs, data=data,
                         train_fn=train_fn, command=command, machine=machine)
    return ablations_report.write_report(
        ablations=ablations, base=base, sweeps=sweeps, seed=seed,
        spread_seeds=spread_seeds, runs_dir=runs_dir, data=data,
        output_dir=output_dir, command=command, machine=machine)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    try:
        base = shared_flags.base_config_from_flags(
            experiments.TASKS[TASK]["dataset"])
        sweeps = ablation_sweeps.Sweeps(
            phi_multiples=shared_flags.parse_floats(FLAGS.phi_multiples),
            gammas=shared_flags.parse_gammas(FLAGS.gammas),
            beta_2s=shared_flags.parse_floats(FLAGS.beta_2s),
            lr_sweep_corrected=shared_flags.parse_floats(
                FLAGS.lr_sweep_corrected),
            lr_sweep_adam=shared_flags.parse_floats(FLAGS.lr_sweep_adam),
            learning_rate_corrected=FLAGS.learning_rate_corrected,
            learning_rate_adam=FLAGS.learning_rate_adam,
            gamma_adam=FLAGS.gamma_adam)
        spread_seeds = tuple(int(s) for s in FLAGS.spread_seeds)
        if FLAGS.seed in spread_seeds:
            raise ValueError(f"--spread_seeds repeats --seed={FLAGS.seed}.")
        names = ABLATIONS if FLAGS.ablation == "all" else (FLAGS.ablation,)
        data = experiments.data_spec(TASK, max_examples=FLAGS.max_examples)
        train_fn = experiments.make_train_fn(
            TASK, data_dir=FLAGS.data_dir, max_examples=FLAGS.max_examples)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT), \
            shared_flags.usage_errors(training.SettingsError):
        path = run_ablations(
            names, base=base, sweeps=sweeps, seed=FLAGS.seed,
            spread_seeds=spread_seeds,
            runs_dir=(FLAGS.runs_dir
                      or os.path.join(experiments.ROOT, "runs", "ablations")),
            data=data, train_fn=train_fn,
            output_dir=FLAGS.output_dir or experiments.RESULTS_DIR,
            command=shlex.join(sys.orig_argv), train=FLAGS.train)
    print(f"Wrote {path}")


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
