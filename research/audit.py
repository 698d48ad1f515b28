"""Audits a DP training run from the outside, in one run (Steinke et al. 2023).

    python -m research.audit                         # the real privatizer
    python -m research.audit --break=no_noise        # must be caught: L > E
    python -m research.audit --canaries=input        # black-box, mislabeled

Trains the paper's CNN on a Fashion-MNIST subset with the given DP settings
and m canaries, each included with probability 1/2, then guesses inclusion
from the canaries' scores and prints, as its last line,

    audit: epsilon lower bound L (95% confidence) vs claimed epsilon E

E is the accountant's epsilon for the run (q, sigma, T, delta); L the
audit's. L <= E is consistent with the claim (not a proof of it); L > E
means the run leaked more than claimed. m canaries can never show more than
about 6 (m = 1,000, delta = 1e-5), so the defaults keep E near 1.

--canaries=gradient (white-box, the default): each canary is a Dirac gradient
of norm --canary_norm * C on one weight, sampled into each step with the
data's rate q and clipped by the privatizer like an example. --score picks
its score: "gradients" (default), the privatized gradients' sum along it,
or "movement", how far its weight moved (Adam's per-coordinate scaling hides
part of the signal there). --canaries=input (black-box): mislabeled test
images added to the training data; score = the drop of their loss.

--break=no_noise|no_clipping deliberately BREAKS the privatizer to test the
auditor; such a run is NOT private.
"""

import dataclasses
import sys
import time

from absl import app
from absl import flags

# Before Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order
import keras
import numpy as np

import tf_dpadam
from research import common
from research import datasets
from research import models
from tf_dpadam.tools import audit

DATASET = "fashion_mnist"


def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_float("noise_multiplier", 2.0, "sigma.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "C, the per-example clip norm.")
    flags.DEFINE_integer("batch_size", 50,
                         "B, the expected (Poisson) batch size in examples.")
    flags.DEFINE_integer("train_size", 2000,
                         "N, the training examples (a Fashion-MNIST subset).")
    flags.DEFINE_integer("steps", 400, "T, the DP steps (logical batches).")
    flags.DEFINE_enum("optimizer", "dpadam_corrected", list(common.OPTIMIZERS),
                      "Update rule on the privatized gradient.")
    flags.DEFINE_float("learning_rate", None,
                       "eta (default: the paper's for the optimizer).")
    flags.DEFINE_integer("num_canaries", 1000, "m, the canaries.")
    flags.DEFINE_integer("num_guesses", 200,
                         "r: guess 'included' for the r/2 highest scores and"
                         " 'excluded' for the r/2 lowest.")
    flags.DEFINE_enum("canaries", "gradient", ["gradient", "input"],
                      "gradient: white-box Dirac gradients added to the"
                      " clipped sum; input: mislabeled test images.")
    flags.DEFINE_float("canary_norm", 10.0,
                       "A gradient canary's L2 norm, in units of C (>= 1).")
    flags.DEFINE_enum("score", "gradients", ["gradients", "movement"],
                      "Gradient canaries' score: the privatized gradients'"
                      " sum along the canary, or its weight's movement.")
    flags.DEFINE_enum("break", "none", list(audit.BREAKS),
                      "Deliberately break the privatizer (NOT private; for"
                      " testing the auditor only).")
    flags.DEFINE_float("delta", 1e-5, "delta of the claim.")
    flags.DEFINE_float("confidence", 0.95, "Confidence of the lower bound.")
    flags.DEFINE_enum("accountant", "pld", list(tf_dpadam.accounting.ACCOUNTANTS),
                      "The accountant of the claimed epsilon.")
    flags.DEFINE_integer("seed", 0, "Model initialization and data subset.")
    flags.DEFINE_integer("canary_seed", None,
                         "Seed of the canaries (default: fresh each run).")
    flags.DEFINE_string("data_dir", None,
                        "Folder of the Fashion-MNIST files (default: the"
                        " loader's).")


FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """The settings of one audit run (the binary's flags, as values)."""

    noise_multiplier: float = 2.0
    l2_norm_clip: float = 1.0
    batch_size: int = 50
    train_size: int = 2000
    steps: int = 400
    optimizer: str = "dpadam_corrected"
    learning_rate: float | None = None
    num_canaries: int = 1000
    num_guesses: int = 200
    canaries: str = "gradient"
    canary_norm: float = 10.0
    score: str = "gradients"
    broken: str = "none"
    delta: float = 1e-5
    confidence: float = 0.95
    accountant: str = "pld"
    seed: int = 0
    canary_seed: int | None = None


def _train_config(config):
    defaults = common.PAPER_DEFAULTS[DATASET]
    base = common.base_config(
        DATASET, l2_norm_clip=config.l2_norm_clip,
        noise_multiplier=config.noise_multiplier,
        batch_size=config.batch_size, target_epsilon=0, epochs=1.0,
    )
    return dataclasses.replace(
        base,
        optimizer=config.optimizer,
        learning_rate=(config.learning_rate
                       or defaults["learning_rate"][config.optimizer]),
        epsilon=defaults["epsilon"].get(config.optimizer),
    )


def _check(config, train_size_available, test_size_available):
    def require(condition, flag, message):
        if not condition:
            raise app.UsageError(f"--{flag}: {message}")

    require(config.noise_multiplier >= 0, "noise_multiplier", "must be >= 0")
    require(config.l2_norm_clip > 0, "l2_norm_clip", "must be > 0")
    require(0 < config.batch_size <= config.train_size, "batch_size",
            "must be in (0, --train_size]")
    require(0 < config.train_size <= train_size_available, "train_size",
            f"must be in (0, {train_size_available}]")
    require(config.steps > 0, "steps", "must be > 0")
    require(0 < config.num_guesses <= config.num_canaries, "num_guesses",
            "must be in (0, --num_canaries]")
    require(config.canary_norm >= 1, "canary_norm", "must be >= 1 (units of C)")
    require(0 < config.delta < 1, "delta", "must be in (0, 1)")
    require(0 < config.confidence < 1, "confidence", "must be in (0, 1)")
    limit = test_size_available if config.canaries == "input" else None
    require(config.num_canaries > 0 and (limit is None
                                         or config.num_canaries <= limit),
            "num_canaries", f"must be in (0, {limit or 'the weights'}]")


def claimed_epsilon(config, num_examples):
    """E: the accountant's epsilon for the run (inf without noise)."""
    if config.noise_multiplier == 0:
        return float("inf")
    return tf_dpadam.epsilon_after_steps(
        steps=config.steps, num_examples=num_examples,
        batch_size=config.batch_size,
        noise_multiplier=config.noise_multiplier, delta=config.delta,
        accountant=config.accountant,
    )


def run(config, data_dir=None, verbose=None, max_test_examples=None):
    """Trains once with canaries and audits; returns a dict of results.

    The test accuracy is measured on the first `max_test_examples` test
    images (None: all).
    """
    (x_train, y_train), (x_test, y_test) = datasets.load_image_dataset(
        DATASET, data_dir)
    _check(config, len(x_train), len(x_test))
    rng = np.random.default_rng(config.seed)
    subset = rng.choice(len(x_train), config.train_size, replace=False)
    x, y = x_train[subset], y_train[subset]
    num_classes = int(y_train.max()) + 1

    input_canaries = None
    if config.canaries == "input":
        chosen = rng.choice(len(x_test), config.num_canaries, replace=False)
        input_canaries = audit.InputCanaries(
            x_test[chosen], y_test[chosen], num_classes=num_classes,
            seed=config.canary_seed,
        )
        x, y = input_canaries.training_data(x, y)
    batches = tf_dpadam.data.poisson_batches(
        (x, y), expected_batch_size=config.batch_size,
        steps_per_epoch=config.steps, pad_to_multiple_of=32,
    )
    keras.utils.set_random_seed(config.seed)
    model = tf_dpadam.make_private(models.make_cnn(x.shape[1:], num_classes))
    model.compile(
        optimizer=common.make_optimizer(_train_config(config),
                                        batches.accumulation_steps),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    gradient_canaries = None
    if config.canaries == "gradient":
        gradient_canaries = audit.GradientCanaries(
            num_canaries=config.num_canaries,
            sampling_probability=batches.sampling_rate,
            norm_multiple=config.canary_norm, seed=config.canary_seed,
        )
        gradient_canaries.attach(model)
    else:
        input_canaries.start(model)
    audit.break_privatizer(model, config.broken)

    if verbose is None:  # A live bar on a terminal, one line in logs.
        verbose = 1 if sys.stdout.isatty() else 2
    start = time.time()
    model.fit(batches.dataset, epochs=1,
              steps_per_epoch=config.steps * batches.accumulation_steps,
              verbose=verbose)
    seconds = time.time() - start
    by_score = {}
    if gradient_canaries is not None:
        by_score = {
            kind: gradient_canaries.result(
                model, num_guesses=config.num_guesses, delta=config.delta,
                confidence=config.confidence, kind=kind,
            )
            for kind in ("gradients", "movement")
        }
        result = by_score[config.score]
    else:
        result = input_canaries.result(
            model, num_guesses=config.num_guesses, delta=config.delta,
            confidence=config.confidence,
        )
    _, accuracy = model.evaluate(x_test[:max_test_examples],
                                 y_test[:max_test_examples], batch_size=1000,
                                 verbose=0)
    return {
        "result": result,
        # Gradient canaries: the result under each score (same run); only
        # `result`, of the score chosen beforehand, is the audit's.
        "by_score": by_score,
        "claimed_epsilon": claimed_epsilon(config, len(y)),
        "best_possible": audit.best_possible_bound(
            config.num_canaries, config.delta, config.confidence),
        "sampling_rate": batches.sampling_rate,
        "test_accuracy": float(accuracy),
        "train_seconds": seconds,
    }


def last_line(lower_bound, confidence, claimed):
    """The binary's last line, exactly as documented."""
    return (f"audit: epsilon lower bound {lower_bound:.3f}"
            f" ({confidence:.0%} confidence) vs claimed epsilon {claimed:.3f}")


def config_from_flags():
    return AuditConfig(
        noise_multiplier=FLAGS.noise_multiplier,
        l2_norm_clip=FLAGS.l2_norm_clip,
        batch_size=FLAGS.batch_size,
        train_size=FLAGS.train_size,
        steps=FLAGS.steps,
        optimizer=FLAGS.optimizer,
        learning_rate=FLAGS.learning_rate,
        num_canaries=FLAGS.num_canaries,
        num_guesses=FLAGS.num_guesses,
        canaries=FLAGS.canaries,
        canary_norm=FLAGS.canary_norm,
        score=FLAGS.score,
        broken=FLAGS["break"].value,
        delta=FLAGS.delta,
        confidence=FLAGS.confidence,
        accountant=FLAGS.accountant,
        seed=FLAGS.seed,
        canary_seed=FLAGS.canary_seed,
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = config_from_flags()
    caps = shared_flags.smoke_test_caps()  # $TF_DPADAM_SMOKE_TEST: 2 steps
    if caps.max_steps:
        config = dataclasses.replace(config,
                                     steps=min(config.steps, caps.max_steps))
    if config.broken != "none":
        print(f"*** --break={config.broken}: the privatizer is DELIBERATELY"
              " BROKEN; this run is NOT private (testing the auditor) ***")
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT):
        out = run(config, FLAGS.data_dir,
                  max_test_examples=caps.max_test_examples)
    result = out["result"]
    print(f"{config.canaries} canaries ({config.score if config.canaries == 'gradient' else 'loss drop'}"
          f" score), q = {out['sampling_rate']:.4f}, T = {config.steps},"
          f" sigma = {config.noise_multiplier:g}, C = {config.l2_norm_clip:g},"
          f" {config.optimizer}; test accuracy {out['test_accuracy']:.4f}")
    print(result.describe(out["claimed_epsilon"]))
    for score, other in out["by_score"].items():
        if score != config.score:  # for information; not the audit's result
            print(f"(the {score} score, not chosen: {other.describe()})")
    print(f"(no audit with {config.num_canaries} canaries can show more than"
          f" {out['best_possible']:.2f})")
    print(last_line(result.epsilon_lower_bound, config.confidence,
                    out["claimed_epsilon"]))


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
