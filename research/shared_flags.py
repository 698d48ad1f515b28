"""The flags the harness's binaries share, and their parsing.

Every binary defines its flags in its own `define_flags()` (called under
`__main__`, not on import) and takes the DP flags from here, so that C, sigma,
B and the run's length mean the same everywhere:

- `define_dp_flags`: C, sigma, B, the physical batch, the epsilon target or
  epochs, delta, the evaluation interval, a training subset, XLA and the
  bands of correlated noise (all binaries; None: the paper's value for the
  dataset).
- `define_training_flags`: those and the optimizer's own flags (weight
  decay and parameter averaging too) and the validation split
  (--validation_examples), for the binaries that train one run
  (`train_image`, `train_text`, `diagnostics`); `config_from_flags` turns
  them into a `common.TrainConfig`.

Only `config_from_flags` reads absl's FLAGS; the other helpers take values.

The binaries run through `run(main)` (`tf_dpadam.accounting.cli.run`): a bad
flag value or an impossible setting ends with one line naming the flag and
the reason, exit code 2. Importing this module first quiets TensorFlow's
start-up logs (`quiet_tensorflow_start`), and `smoke_test_caps()` reads
$TF_DPADAM_SMOKE_TEST, which caps a run's examples and steps for a quick
check of a command (the README test).
"""

import contextlib
import dataclasses
import functools
import os
import sys
import tempfile

# Before TensorFlow's first import: C++ INFO and WARNING lines off (a user's
# own setting wins).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@contextlib.contextmanager
def _quiet_stderr():
    """Sends file descriptor 2 to a temporary file for the block (C++ code
    writes there directly) and replays it if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def quiet_tensorflow_start():
    """Imports TensorFlow and looks for its devices with stderr silenced.

    TensorFlow 2.21 writes its start-up lines (oneDNN, CUDA drivers, CPU
    instructions) before its log level applies, twice, and a `cuInit` error
    on a machine without a GPU; nothing of it concerns the user. Later logs
    keep `TF_CPP_MIN_LOG_LEVEL` (default here 2: errors only).
    """
    with _quiet_stderr():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.config.list_physical_devices()


quiet_tensorflow_start()

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from research import common
from research import training
from tf_dpadam.accounting import cli as privacy_cli
from tf_dpadam.common import validation

# The environment variable of a smoke test: set (not "" or "0"), the
# binaries cap every run to `SMOKE_TEST_CAPS`.
SMOKE_TEST_VARIABLE = "TF_DPADAM_SMOKE_TEST"


def _at_most(value, limit):
    """`min(value, limit)`, where None means no bound."""
    if limit is None:
        return value
    return limit if value is None else min(value, limit)


@dataclasses.dataclass(frozen=True)
class RunCaps:
    """Upper bounds on a run's size (None: none)."""

    max_examples: int | None = None  # Training examples.
    max_test_examples: int | None = None
    max_steps: int | None = None  # DP steps of a run.

    def examples(self, value):
        """A `--max_examples` value (None: all) within the cap."""
        return _at_most(value, self.max_examples)

    def test_examples(self, value):
        """A `--max_test_examples` value (None: all) within the cap."""
        return _at_most(value, self.max_test_examples)


# Enough to run every line of a binary, in seconds; 4,096 examples keep the
# sampling rate of B = 256 low enough for epsilon = 7 to allow a step.
SMOKE_TEST_CAPS = RunCaps(max_examples=4096, max_test_examples=256,
                          max_steps=2)


def smoke_test_caps():
    """`SMOKE_TEST_CAPS` if $TF_DPADAM_SMOKE_TEST is set (not "" or "0"),
    else `RunCaps()` (no caps).

    A binary honours it by capping its training examples, test examples and
    DP steps to the fields (`caps.examples(FLAGS.max_examples)`, ...); it
    reports the shortened run as it is (its steps and epsilon).
    """
    if os.environ.get(SMOKE_TEST_VARIABLE, "") in ("", "0"):
        return RunCaps()
    return SMOKE_TEST_CAPS


def run(main):
    """Runs a binary's `main` with one-line usage errors, exit code 2."""
    privacy_cli.run(main)


@contextlib.contextmanager
def usage_errors(*errors, prefix="", hint=""):
    """Turns `errors` (default `ValueError`) into an `app.UsageError`: an
    impossible setting found by the config, the library or the data (e.g. a
    budget below one step, B > N, no network for the data) ends with one
    line, `prefix`, the error's message and `hint`, not a traceback."""
    try:
        yield
    except errors or (ValueError,) as error:
        raise app.UsageError(f"{prefix}{error}{hint}") from error


# The offline alternative, for a dataset that cannot be downloaded.
OFFLINE_IMAGES_HINT = (
    "; offline, use --dataset=fashion_mnist (Debian's dataset-fashion-mnist)"
    " or --data_dir=DIR with the dataset prepared by tensorflow-datasets")


def check_flag(name, check):
    """Validates flag `name` at parsing with `check(name, value)` (e.g. a
    `tf_dpadam.common.validation` check); None passes."""
    privacy_cli.register_check(name, functools.partial(check, name))


def check_list_flag(name, check):
    """Validates each item of the list flag `name` at parsing with
    `check(name, item)`, e.g. `number_in(validation.check_positive)`."""
    privacy_cli.register_check(
        name, lambda values: [check(name, value) for value in values])


def _check_probability(name, value):
    validation.check(0 < value < 1, name, value, "in (0, 1)")


def _to_number(name, text, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"Expected {name}={text!r} to be"
                         f" {'an integer' if kind is int else 'a number'}."
                         ) from None


def number_in(check, kind=float):
    """A check of a flag's text: a number (`kind`) that passes
    `check(name, number)`."""
    return lambda name, text: check(name, _to_number(name, text, kind))


def check_gamma(name, text):
    """A gamma (Adam's epsilon) as text: a number >= 0, or 'none'."""
    if text.strip().lower() != "none":
        validation.check_non_negative(name, _to_number(name, text))


def check_seed(name, value):
    """A seed: an integer >= 0."""
    validation.check(value >= 0, name, value, ">= 0")


def define_dp_flags(*, eval_every):
    """The DP and run-length flags (None: the paper's default)."""
    flags.DEFINE_float("l2_norm_clip", None,
                       "C, the per-example clipping norm (L2 norm of a "
                       "gradient; default: the paper's for the dataset).")
    flags.DEFINE_float("noise_multiplier", None,
                       "sigma, the noise std in units of C (default: the "
                       "paper's for the dataset).")
    flags.DEFINE_integer("batch_size", None,
                         "B, the expected (Poisson) batch size in examples "
                         "(default: the paper's for the dataset).")
    flags.DEFINE_integer("physical_batch_size", None,
                         "Examples per forward/backward pass; the logical "
                         "batch is accumulated over several. Default: all.")
    flags.DEFINE_float("target_epsilon", 7.0,
                       "Train for the most steps with epsilon <= this "
                       "(calibrate_steps); 0 to use --epochs instead.")
    flags.DEFINE_float("delta", 1e-5, "delta of the (epsilon, delta) "
                       "guarantee, in (0, 1).")
    flags.DEFINE_float("epochs", None,
                       "Length in epochs (N / B steps each) when "
                       "--target_epsilon=0.")
    flags.DEFINE_integer("eval_every", eval_every,
                         "DP steps between test-set evaluations (a Keras "
                         "epoch; the points of the curves).")
    flags.DEFINE_integer("max_examples", None,
                         "Use only this many training examples (a subset; "
                         "default: all).")
    flags.DEFINE_bool("jit_compile", False,
                      "XLA (slower than graphs on CPU, faster on GPU/TPU).")
    flags.DEFINE_integer("noise_bands", 1,
                         "b in [1, 64]: correlated noise with b bands"
                         " (banded matrix factorization; the optimizer's"
                         " noise_strategy=b) on cyclic Poisson batches of b"
                         " groups, T steps accounted as ceil(T / b) steps at"
                         " q = b B / N; the steps, --eval_every and a"
                         " resume's start are rounded to multiples of b."
                         " 1: independent noise (DP-SGD's). A resume with"
                         " another b is refused.")
    check_flag("l2_norm_clip", validation.check_positive)
    check_flag("noise_multiplier", validation.check_non_negative)
    check_flag("batch_size", validation.check_positive_int)
    check_flag("physical_batch_size", validation.check_positive_int)
    check_flag("target_epsilon", validation.check_non_negative)
    check_flag("delta", _check_probability)
    check_flag("epochs", validation.check_positive_real)
    check_flag("eval_every", validation.check_positive_int)
    check_flag("max_examples", validation.check_positive_int)
    check_flag("noise_bands", common.check_noise_bands)


def define_lr_edge_extensions_flag():
    """--lr_edge_extensions, of the tuning programs (reproduce and study)."""
    flags.DEFINE_integer("lr_edge_extensions", 1,
                         "Tuning adds up to this many rates beyond an end of"
                         " a learning-rate grid, one grid step at a time"
                         " (snapped to the half-decade lattice), while the"
                         " best rate sits at that end (0: the grid only).")
    check_flag("lr_edge_extensions", validation.check_non_negative)


def define_training_flags():
    """The flags of a binary that trains one run (None: the paper's)."""
    flags.DEFINE_enum("optimizer", "dpadam_corrected", list(common.OPTIMIZERS),
                      "Update rule on the privatized gradient.")
    flags.DEFINE_float("learning_rate", None,
                       "eta, the learning rate (default: the paper's for the "
                       "dataset and optimizer).")
    flags.DEFINE_string("epsilon", None,
                        "gamma (DP-Adam, outside the root) or gamma' "
                        "(DP-AdamBC, inside it), in squared gradient units "
                        "for gamma'; 'none' = 0.04 * Phi (default: the "
                        "paper's for the dataset).")
    flags.DEFINE_float("phi", None, "Override of Phi, in squared gradient "
                       "units (DP-AdamBC ablation; default: (sigma C / B)^2).")
    flags.DEFINE_float("beta_1", 0.9, "Adam's beta_1, in [0, 1).")
    flags.DEFINE_float("beta_2", 0.999, "Adam's beta_2, in [0, 1).")
    flags.DEFINE_float("momentum", 0.0, "DP-SGD momentum, >= 0.")
    flags.DEFINE_float("weight_decay", 0.0,
                       "Decoupled weight decay, >= 0 (0: none), applied by "
                       "the optimizer as in Keras / AdamW: each step first "
                       "multiplies every trainable weight by 1 - "
                       "learning_rate * weight_decay (so it scales with the "
                       "learning rate). Uses no data: free in privacy.")
    flags.DEFINE_bool("ema", False,
                      "Keep an exponential moving average of the weights "
                      "(Keras' use_ema): train on the raw weights, evaluate "
                      "(curve and final test accuracy) and return the "
                      "average; model_dir/checkpoint.keras keeps both. "
                      "Post-processing of the private weights: free in "
                      "privacy.")
    flags.DEFINE_float("ema_momentum", 0.999,
                       "The average's momentum m, in (0, 1): average = m * "
                       "average + (1 - m) * weights after each step, starting "
                       "from the first step's weights, which still weigh "
                       "m^(T-1) after T steps (0.999: 49% after 719 steps; "
                       "pick 1 / (1 - m) well below the steps).")
    define_dp_flags(eval_every=100)
    flags.DEFINE_string("model_dir", None,
                        "Checkpoints and metrics.json; a rerun resumes.")
    flags.DEFINE_bool("resume_counting_all_steps", False,
                      "Resume a --model_dir whose checkpoint and ledger.json"
                      " disagree (or one is missing), counting the steps of"
                      " both (tf_dpadam.run_dir.begin_ledger).")
    flags.DEFINE_string("tensorboard_dir", None,
                        "Write TensorBoard logs here: loss, accuracy and "
                        "epsilon per step (batch_*) and per evaluation "
                        "(epoch_*, validation).")
    flags.DEFINE_integer("seed", 0,
                         "Seed of the model's initialization and the data "
                         "order (e.g. --max_examples subsets); not of the DP "
                         "noise or the Poisson sampling (--noise_seed).")
    flags.DEFINE_integer("noise_seed", None,
                         "Seed of the DP noise and Poisson sampling, for "
                         "reproducible research only: anyone who knows it "
                         "can remove the noise. Default: drawn from the OS "
                         "entropy (secret).")
    flags.DEFINE_integer("validation_examples", 0,
                         "V >= 0: hold out V training examples (a fixed"
                         " choice, the same for every --seed; after"
                         " --max_examples and --imbalance_ratio) as a"
                         " validation split, train on the others (N - V,"
                         " the N of the accounting) and report the"
                         " validation accuracy beside the test accuracy."
                         " 0: none. In-memory data only (not"
                         " --data_source).")
    check_flag("learning_rate", validation.check_positive)
    check_flag("epsilon", check_gamma)
    check_flag("phi", validation.check_non_negative)
    check_flag("beta_1", validation.check_beta)
    check_flag("beta_2", validation.check_beta)
    check_flag("momentum", validation.check_non_negative)
    check_flag("weight_decay", validation.check_non_negative)
    check_flag("ema_momentum", _check_probability)
    check_flag("seed", check_seed)
    check_flag("noise_seed", check_seed)
    check_flag("validation_examples", common.check_validation_examples)


def tensorboard_callbacks(flag_values=None):
    """`training.tensorboard_callbacks(--tensorboard_dir)`, or [] without
    the flag."""
    f = flag_values or flags.FLAGS
    if not f.tensorboard_dir:
        return []
    return training.tensorboard_callbacks(f.tensorboard_dir)


def config_from_flags(task, flag_values=None):
    """Fills the unset flags with the paper's defaults for `task`."""
    f = flag_values or flags.FLAGS
    defaults = common.PAPER_DEFAULTS[task]
    name = f.optimizer

    def pick(flag, default):
        return default if flag is None else flag

    if f.epsilon is None:
        epsilon = defaults["epsilon"].get(name)
    elif f.epsilon.lower() == "none":
        epsilon = None
    else:
        epsilon = float(f.epsilon)
    if name in common.KERAS_ADAM_EPSILON and epsilon is None:
        epsilon = 1e-8
    target = f.target_epsilon or None
    if target is None and f.epochs is None:
        raise ValueError("Give --target_epsilon > 0 or --epochs.")
    learning_rate = pick(f.learning_rate, defaults["learning_rate"][name])
    if learning_rate * f.weight_decay >= 1:
        raise ValueError(
            f"Expected --weight_decay={f.weight_decay:g} times the learning"
            f" rate {learning_rate:g} < 1 (each step multiplies the weights"
            " by 1 - their product).")
    return common.TrainConfig(
        optimizer=name,
        l2_norm_clip=pick(f.l2_norm_clip, defaults["l2_norm_clip"]),
        noise_multiplier=pick(f.noise_multiplier,
                              defaults["noise_multiplier"]),
        batch_size=pick(f.batch_size, defaults["batch_size"]),
        physical_batch_size=f.physical_batch_size,
        learning_rate=learning_rate,
        epsilon=epsilon,
        phi=f.phi,
        beta_1=f.beta_1,
        beta_2=f.beta_2,
        momentum=f.momentum,
        target_epsilon=target,
        delta=f.delta,
        epochs=f.epochs,
        eval_every=f.eval_every,
        model_dir=f.model_dir,
        seed=f.seed,
        jit_compile=f.jit_compile,
        noise_seed=f.noise_seed,
        weight_decay=f.weight_decay,
        ema=f.ema,
        ema_momentum=f.ema_momentum,
        noise_bands=f.noise_bands,
        validation_examples=f.validation_examples,
    )


def base_config_from_flags(dataset, flag_values=None):
    """`common.base_config` of the DP flags (`define_dp_flags`): the
    hyperparameters that the runs of an experiment share."""
    f = flag_values or flags.FLAGS
    return common.base_config(
        dataset, l2_norm_clip=f.l2_norm_clip,
        noise_multiplier=f.noise_multiplier, batch_size=f.batch_size,
        physical_batch_size=f.physical_batch_size,
        target_epsilon=f.target_epsilon, delta=f.delta, epochs=f.epochs,
        eval_every=f.eval_every, jit_compile=f.jit_compile,
        noise_bands=f.noise_bands)


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
