"""What the example binaries share: flags, the paper's defaults, the DP fit.

Helpers take values as parameters; only `define_flags` and `config_from_flags`
touch absl's FLAGS.
"""

import dataclasses
import json
import math
import os
import time

import keras
import numpy as np
from absl import flags

import tf_dpadam

OPTIMIZERS = ("dpsgd", "dpadam", "dpadam_corrected")

# The paper's hyperparameters (Tang & Lecuyer, Appendix), per task and
# optimizer: learning rate and gamma (DP-Adam, outside the root) or gamma'
# (DP-AdamBC, inside it). Fashion-MNIST is ours: the CIFAR-10 setting with
# B = 256 and sigma = 0.52, which reaches epsilon = 7 in about 3 epochs
# (a CPU-sized run); gamma' None means 0.04 * Phi.
PAPER_DEFAULTS = {
    "cifar10": {
        "l2_norm_clip": 1.0, "noise_multiplier": 1.0, "batch_size": 2048,
        "learning_rate": {"dpsgd": 4.0, "dpadam": 1e-3,
                          "dpadam_corrected": 1e-3},
        "epsilon": {"dpadam": 1e-8, "dpadam_corrected": 1e-8},
    },
    "fashion_mnist": {
        "l2_norm_clip": 1.0, "noise_multiplier": 0.52, "batch_size": 256,
        "learning_rate": {"dpsgd": 4.0, "dpadam": 1e-3,
                          "dpadam_corrected": 1e-3},
        "epsilon": {"dpadam": 1e-8, "dpadam_corrected": None},
    },
    "snli": {
        "l2_norm_clip": 0.1, "noise_multiplier": 0.4, "batch_size": 256,
        "learning_rate": {"dpsgd": 4.0, "dpadam": 0.01,
                          "dpadam_corrected": 1e-3},
        "epsilon": {"dpadam": 1e-8, "dpadam_corrected": 1e-9},
    },
}
PAPER_DEFAULTS["glue/sst2"] = PAPER_DEFAULTS["snli"]
PAPER_DEFAULTS["sst2_tsv"] = PAPER_DEFAULTS["snli"]


def define_flags():
    """The flags every example binary takes (None: the paper's default)."""
    flags.DEFINE_enum("optimizer", "dpadam_corrected", list(OPTIMIZERS),
                      "Update rule on the privatized gradient.")
    flags.DEFINE_float("l2_norm_clip", None, "C, per-example clipping norm.")
    flags.DEFINE_float("noise_multiplier", None, "sigma.")
    flags.DEFINE_integer("batch_size", None,
                         "B, the expected (Poisson) batch size.")
    flags.DEFINE_integer("physical_batch_size", None,
                         "Examples per forward/backward pass; the logical "
                         "batch is accumulated over several. Default: all.")
    flags.DEFINE_float("learning_rate", None, "eta.")
    flags.DEFINE_string("epsilon", None,
                        "gamma (DP-Adam, outside the root) or gamma' "
                        "(DP-AdamBC, inside it); 'none' = 0.04 * Phi.")
    flags.DEFINE_float("phi", None, "Override of Phi (DP-AdamBC ablation).")
    flags.DEFINE_float("beta_1", 0.9, "Adam's beta_1.")
    flags.DEFINE_float("beta_2", 0.999, "Adam's beta_2.")
    flags.DEFINE_float("momentum", 0.0, "DP-SGD momentum.")
    flags.DEFINE_float("target_epsilon", 7.0,
                       "Train for the most steps with epsilon <= this "
                       "(calibrate_steps); 0 to use --epochs instead.")
    flags.DEFINE_float("delta", 1e-5, "delta.")
    flags.DEFINE_float("epochs", None,
                       "Epochs (N / B steps each) when --target_epsilon=0.")
    flags.DEFINE_integer("eval_every", 100,
                         "Steps between test-set evaluations (a Keras epoch).")
    flags.DEFINE_integer("max_examples", None,
                         "Use only this many training examples (subset).")
    flags.DEFINE_string("model_dir", None,
                        "Checkpoints and metrics.json; a rerun resumes.")
    flags.DEFINE_integer("seed", 0,
                         "Seed of the model's initialization and the data "
                         "order (e.g. --max_examples subsets); not of the DP "
                         "noise or the Poisson sampling (--noise_seed).")
    flags.DEFINE_integer("noise_seed", None,
                         "Seed of the DP noise and Poisson sampling, for "
                         "reproducible research only: anyone who knows it "
                         "can remove the noise. Default: drawn from the OS "
                         "entropy (secret).")
    flags.DEFINE_bool("jit_compile", False,
                      "XLA (slower than graphs on CPU, faster on GPU/TPU).")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The resolved hyperparameters of one run."""

    optimizer: str
    l2_norm_clip: float
    noise_multiplier: float
    batch_size: int
    physical_batch_size: int | None
    learning_rate: float
    epsilon: float | None
    phi: float | None
    beta_1: float
    beta_2: float
    momentum: float
    target_epsilon: float | None
    delta: float
    epochs: float | None
    eval_every: int
    model_dir: str | None
    seed: int
    jit_compile: bool
    # The key of the DP noise and the Poisson sampling; None: a secret one,
    # drawn from the OS entropy at every run (and at every resume).
    noise_seed: int | None = None


def config_from_flags(task, flag_values=None):
    """Fills the unset flags with the paper's defaults for `task`."""
    f = flag_values or flags.FLAGS
    defaults = PAPER_DEFAULTS[task]
    name = f.optimizer

    def pick(flag, default):
        return default if flag is None else flag

    if f.epsilon is None:
        epsilon = defaults["epsilon"].get(name)
    elif f.epsilon.lower() == "none":
        epsilon = None
    else:
        epsilon = float(f.epsilon)
    if name == "dpadam" and epsilon is None:
        epsilon = 1e-8
    target = f.target_epsilon or None
    if target is None and f.epochs is None:
        raise ValueError("Give --target_epsilon > 0 or --epochs.")
    return TrainConfig(
        optimizer=name,
        l2_norm_clip=pick(f.l2_norm_clip, defaults["l2_norm_clip"]),
        noise_multiplier=pick(f.noise_multiplier,
                              defaults["noise_multiplier"]),
        batch_size=pick(f.batch_size, defaults["batch_size"]),
        physical_batch_size=f.physical_batch_size,
        learning_rate=pick(f.learning_rate, defaults["learning_rate"][name]),
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
    )


def make_optimizer(config, accumulation_steps=1):
    """The tf_dpadam optimizer that `config` names."""
    common = dict(
        l2_norm_clip=config.l2_norm_clip,
        noise_multiplier=config.noise_multiplier,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        gradient_accumulation_steps=(
            accumulation_steps if accumulation_steps > 1 else None
        ),
    )
    if config.optimizer == "dpsgd":
        return tf_dpadam.DPSGD(momentum=config.momentum, **common)
    adam = dict(beta_1=config.beta_1, beta_2=config.beta_2, **common)
    if config.optimizer == "dpadam":
        return tf_dpadam.DPAdam(epsilon=config.epsilon, **adam)
    return tf_dpadam.DPAdamCorrected(
        epsilon=config.epsilon, phi=config.phi, **adam
    )


def total_steps(config, num_examples):
    """T: calibrated to --target_epsilon, or epochs * N / B."""
    if config.target_epsilon is not None:
        return tf_dpadam.calibrate_steps(
            target_epsilon=config.target_epsilon,
            num_examples=num_examples,
            batch_size=config.batch_size,
            noise_multiplier=config.noise_multiplier,
            delta=config.delta,
        )
    return max(1, round(config.epochs * num_examples / config.batch_size))


def poisson_plan(config, train):
    """`(N, T, batches)`: the examples, the steps and their Poisson batches."""
    num_examples = len(train[1])
    batches = tf_dpadam.data.poisson_batches(
        train,
        expected_batch_size=config.batch_size,
        physical_batch_size=config.physical_batch_size,
        steps_per_epoch=config.eval_every,
        seed=config.noise_seed,
        # Graphs take each batch at about its size (0.7x the step time of
        # static padding on Fashion-MNIST); XLA compiles once per shape, so
        # it gets the static padded batches.
        pad_to_multiple_of=None if config.jit_compile else 32,
    )
    return num_examples, total_steps(config, num_examples), batches


def spent_epsilon(config, steps, num_examples):
    """Epsilon at `config.delta` after `steps` (infinite without noise)."""
    if config.noise_multiplier == 0:
        return math.inf
    return tf_dpadam.epsilon_after_steps(
        steps=steps, num_examples=num_examples,
        batch_size=config.batch_size,
        noise_multiplier=config.noise_multiplier, delta=config.delta,
    )


class StepLog(keras.callbacks.Callback):
    """Records the logical step, test metrics and epsilon per evaluation."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_epoch_end(self, epoch, logs=None):
        row = {"step": int(self.model.optimizer.iterations.numpy())}
        row.update({k: float(v) for k, v in (logs or {}).items()})
        self.rows.append(row)


def compile_private(model, config, loss, accumulation_steps):
    """Compiles a private model with `config`'s optimizer and accuracy.

    The accuracy is a weighted metric, so that the padding rows of Poisson
    batches (sample weight 0) are not counted.
    """
    model.compile(
        optimizer=make_optimizer(config, accumulation_steps),
        loss=loss,
        weighted_metrics=["accuracy"],
        jit_compile=config.jit_compile,
    )


def fit_private(model_fn, train, test, config, loss, num_classes=None,
                on_trained=None):
    """Trains `make_private(model_fn())` with Poisson batches; resumes.

    Args:
        model_fn: builds the (non-private) Keras model.
        train: `(x, y)` NumPy arrays (x may be a dict of arrays).
        test: `(x, y)` for evaluation.
        config: a `TrainConfig`.
        loss: the Keras loss.
        num_classes: unused; kept for symmetry of the binaries.
        on_trained: optional `f(model)` called with the trained private
            model (the checkpoint's, after a resume) before returning.

    Returns:
        A dict of results (also written to model_dir/metrics.json).
    """
    del num_classes
    keras.utils.set_random_seed(config.seed)
    num_examples, steps, batches = poisson_plan(config, train)
    k = batches.accumulation_steps
    checkpoint = None
    model = None
    if config.model_dir:
        os.makedirs(config.model_dir, exist_ok=True)
        checkpoint = os.path.join(config.model_dir, "checkpoint.keras")
        if os.path.exists(checkpoint):
            model = keras.models.load_model(checkpoint)
    if model is None:
        model = tf_dpadam.make_private(model_fn(), seed=config.noise_seed)
        compile_private(model, config, loss, k)
    done = int(model.optimizer.iterations.numpy())
    budget = tf_dpadam.PrivacyBudget(
        num_examples=num_examples,
        delta=config.delta,
        target_epsilon=config.target_epsilon,
    )
    step_log = StepLog()
    callbacks = [budget, step_log]
    if checkpoint:
        callbacks.append(keras.callbacks.ModelCheckpoint(checkpoint))
    epochs = math.ceil(steps / config.eval_every)
    start = time.time()
    if done < steps:
        model.fit(
            batches.dataset.repeat(),
            steps_per_epoch=config.eval_every * k,
            epochs=epochs,
            initial_epoch=done // config.eval_every,
            validation_data=test,
            validation_batch_size=512,
            callbacks=callbacks,
            verbose=2,
        )
    wall = time.time() - start
    test_loss, test_accuracy = model.evaluate(*test, batch_size=512, verbose=0)
    steps_done = int(model.optimizer.iterations.numpy())
    epsilon = spent_epsilon(config, steps_done, num_examples)
    results = {
        "config": dataclasses.asdict(config),
        "num_examples": num_examples,
        "steps": steps_done,
        "planned_steps": steps,
        "epsilon": epsilon,
        "delta": config.delta,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "wall_seconds": wall,
        "history": step_log.rows,
    }
    if config.model_dir:
        previous = os.path.join(config.model_dir, "metrics.json")
        if os.path.exists(previous):
            with open(previous) as f:
                # Keep the curve of the runs before a resume.
                old_rows = json.load(f).get("history", [])
            results["history"] = [
                r for r in old_rows if r["step"] < (step_log.rows or
                                                   [{"step": 1e18}])[0]["step"]
            ] + step_log.rows
        with open(previous, "w") as f:
            json.dump(results, f, indent=1)
    if on_trained is not None:
        on_trained(model)
    return results


def print_results(results):
    print(
        f"test accuracy {results['test_accuracy']:.4f} after"
        f" {results['steps']} steps; spent epsilon"
        f" {results['epsilon']:.3f} at delta {results['delta']:g}"
    )
