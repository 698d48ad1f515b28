"""What every example shares: the paper's defaults and the run config.

`TrainConfig` holds the resolved hyperparameters of one run; `make_optimizer`,
`total_steps` and `spent_epsilon` turn it into the tf_dpadam optimizer, the
number of steps and the epsilon spent. The flags that fill it are in
`research.shared_flags`, the training loop in `research.training`.
"""

import dataclasses
import inspect
import math

import tf_dpadam
from tf_dpadam.optimizers import registry

# Every --optimizer's name: tf_dpadam's registered DP optimizers.
OPTIMIZERS = tuple(registry.OPTIMIZERS)
# The paper's three, as the comparison's plans, tables and plots name them
# (`research.reproduce`, the results pages).
OPTIMIZER_NAMES = {
    "dpsgd": "DP-SGD",
    "dpadam": "DP-Adam",
    "dpadam_corrected": "DP-AdamBC",
}
# Every --optimizer's name (issue 37 added the last two).
OPTIMIZER_LABELS = {
    **OPTIMIZER_NAMES,
    "dpadam_stp": "DP-Adam STP",  # scale-then-privatize
    "dpadam_disk": "DP-Adam DiSK",
}
# The optimizers whose `epsilon` is Keras Adam's, outside the root.
KERAS_ADAM_EPSILON = ("dpadam", "dpadam_stp", "dpadam_disk")

# The paper's hyperparameters (Tang & Lecuyer, Appendix), per task and
# optimizer: learning rate and gamma (DP-Adam, outside the root) or gamma'
# (DP-AdamBC, inside it). Fashion-MNIST is ours: the CIFAR-10 setting with
# B = 256 and sigma = 0.52, which reaches epsilon = 7 in about 3 epochs
# (a CPU-sized run); gamma' None means 0.04 * Phi. DP-Adam STP and DiSK are
# not in the paper: they start from DP-Adam's settings.
PAPER_DEFAULTS = {
    "cifar10": {
        "l2_norm_clip": 1.0, "noise_multiplier": 1.0, "batch_size": 2048,
        "learning_rate": {"dpsgd": 4.0, "dpadam": 1e-3,
                          "dpadam_corrected": 1e-3,
                          "dpadam_stp": 1e-3, "dpadam_disk": 1e-3},
        "epsilon": {"dpadam": 1e-8, "dpadam_corrected": 1e-8,
                    "dpadam_stp": 1e-8, "dpadam_disk": 1e-8},
    },
    "fashion_mnist": {
        "l2_norm_clip": 1.0, "noise_multiplier": 0.52, "batch_size": 256,
        "learning_rate": {"dpsgd": 4.0, "dpadam": 1e-3,
                          "dpadam_corrected": 1e-3,
                          "dpadam_stp": 1e-3, "dpadam_disk": 1e-3},
        "epsilon": {"dpadam": 1e-8, "dpadam_corrected": None,
                    "dpadam_stp": 1e-8, "dpadam_disk": 1e-8},
    },
    "snli": {
        "l2_norm_clip": 0.1, "noise_multiplier": 0.4, "batch_size": 256,
        "learning_rate": {"dpsgd": 4.0, "dpadam": 0.01,
                          "dpadam_corrected": 1e-3,
                          "dpadam_stp": 0.01, "dpadam_disk": 0.01},
        "epsilon": {"dpadam": 1e-8, "dpadam_corrected": 1e-9,
                    "dpadam_stp": 1e-8, "dpadam_disk": 1e-8},
    },
}
PAPER_DEFAULTS["glue/sst2"] = PAPER_DEFAULTS["snli"]
PAPER_DEFAULTS["sst2_tsv"] = PAPER_DEFAULTS["snli"]


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
    # Decoupled weight decay (Keras' `weight_decay`: each step multiplies the
    # weights by 1 - learning_rate * weight_decay); 0: none.
    weight_decay: float = 0.0
    # Evaluate and return the exponential moving average of the weights
    # (Keras' `use_ema`, with this momentum); training runs on the raw ones.
    ema: bool = False
    ema_momentum: float = 0.999
    # The image CNN's normalization (`research.models.make_cnn`: "none", the
    # paper's CNN, or "group") and augmentation multiplicity K (each
    # example's gradient the mean over K augmented views; 0: no
    # augmentation). Runs recorded before these fields read back as "none"
    # and 0 (`runs.check_run_dir`); the text binary leaves them so.
    normalization: str = "none"
    augmult: int = 0
    # The image CNN (`research.models.make_cnn`'s `cnn`: "paper" or
    # "small"); runs recorded before it read back as "paper".
    cnn: str = "paper"
    # Heavy-tailed class imbalance (`research.imbalance`): class c of the
    # training set keeps imbalance_ratio^(c / (K - 1)) of its images; 1.0:
    # all (runs recorded before it read back as 1.0).
    imbalance_ratio: float = 1.0
    # b, the bands of correlated (BandMF) noise: the optimizer's
    # `noise_strategy=b` with cyclic Poisson batches of b groups, T steps
    # accounted as ceil(T / b) DP-SGD steps at q = b B / N; every `fit`
    # takes a multiple of b steps (`bands_steps`). 1: independent noise,
    # the runs as before (and their records: `config_record` leaves the
    # field out at 1; runs recorded before it read back as 1).
    noise_bands: int = 1
    # V, the training examples held out as a validation split
    # (`datasets.split_validation`: a fixed choice, not the run's seed)
    # after the --max_examples cap and the imbalance subset: the run trains
    # on (and accounts) the N - V others, and its results add the
    # validation accuracy, by which the studies select learning rates
    # (`comparison.selection_accuracies`). 0: none, the runs as before (and
    # their records: `config_record` leaves the field out at 0; runs
    # recorded before it read back as 0).
    validation_examples: int = 0


# The fields `config_record` leaves out at these values: a run without
# them is recorded as before they existed (readers take a missing one as
# this value: `noise_bands_of`, `runs.check_run_dir`).
OMITTED_AT_DEFAULT = {"noise_bands": 1, "validation_examples": 0}


def config_record(config):
    """`dataclasses.asdict(config)`, the config of a run's records
    (metrics.json, reproduce.json), without the fields of
    `OMITTED_AT_DEFAULT` at their default (`noise_bands` 1: independent
    noise; `validation_examples` 0: no validation split): such a run is
    recorded as before the field."""
    values = dataclasses.asdict(config)
    for name, default in OMITTED_AT_DEFAULT.items():
        if values.get(name, default) == default:
            values.pop(name, None)
    return values


def noise_bands_of(config_values):
    """b of a recorded config (a dict; 1 when absent: independent noise)."""
    return int((config_values or {}).get("noise_bands", 1))


def check_validation_examples(name, value):
    """--validation_examples: an int V >= 0 (0: no validation split)."""
    if not (isinstance(value, int) and not isinstance(value, bool)
            and value >= 0):
        raise ValueError(f"Expected {name}={value!r} to be an int >= 0 (the"
                         " training examples held out for validation; 0:"
                         " none).")


def check_noise_bands(name, value):
    """--noise_bands: an int b in [1, 64] (`tf_dpadam.data`'s most cyclic
    Poisson groups)."""
    if not (isinstance(value, int) and 1 <= value <= MAX_NOISE_BANDS):
        raise ValueError(f"Expected {name}={value!r} to be an int in"
                         f" [1, {MAX_NOISE_BANDS}].")


# The most bands `tf_dpadam.data.poisson_batches` samples groups for.
MAX_NOISE_BANDS = 64


def bands_steps(steps, bands, *, up=False):
    """`steps` rounded to a multiple of b = `bands` (every `fit` call of a
    run with correlated noise takes whole cycles of the b groups): down
    (at least b: a run's length, `max_steps`) or, with `up`, up (an
    evaluation interval, the steps a resumed run has taken). The same
    `steps` for b = 1."""
    if bands == 1:
        return steps
    if up:
        return -(-steps // bands) * bands
    return max(bands, steps - steps % bands)


def base_config(dataset, *, l2_norm_clip=None, noise_multiplier=None,
                batch_size=None, physical_batch_size=None,
                target_epsilon=7.0, delta=1e-5, epochs=None, eval_every=50,
                jit_compile=False, noise_bands=1, validation_examples=0):
    """The hyperparameters all runs share; None: PAPER_DEFAULTS[dataset]."""
    defaults = PAPER_DEFAULTS[dataset]
    target_epsilon = target_epsilon or None
    if target_epsilon is None and epochs is None:
        raise ValueError("Give target_epsilon > 0 or epochs.")

    def pick(value, key):
        return defaults[key] if value is None else value

    return TrainConfig(
        optimizer="dpsgd",  # Placeholders, replaced per run.
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
        noise_bands=noise_bands,
        validation_examples=validation_examples,
    )


# The config's update-rule fields, each passed to the optimizers whose
# constructor takes it (DPSGD: momentum; the Adams: beta_1, beta_2,
# epsilon; DP-AdamBC also phi).
RULE_FIELDS = ("momentum", "beta_1", "beta_2", "epsilon", "phi")


def make_optimizer(config, accumulation_steps=1):
    """The tf_dpadam optimizer that `config` names (a name of the
    optimizers' registry; an unknown one is a ValueError), with the DP
    arguments and those of `RULE_FIELDS` its constructor takes."""
    optimizer_class = registry.optimizer_class(config.optimizer)
    accepted = inspect.signature(optimizer_class).parameters
    return optimizer_class(
        l2_norm_clip=config.l2_norm_clip,
        noise_multiplier=config.noise_multiplier,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        gradient_accumulation_steps=(
            accumulation_steps if accumulation_steps > 1 else None
        ),
        weight_decay=config.weight_decay or None,
        use_ema=config.ema,
        ema_momentum=config.ema_momentum,
        # Correlated (BandMF) noise of b bands (left out, i.e. None, for
        # independent noise).
        **({"noise_strategy": config.noise_bands}
           if config.noise_bands > 1 else {}),
        **{name: getattr(config, name) for name in RULE_FIELDS
           if name in accepted},
    )


# The binaries' accountant: PLD, the tighter (`PrivacyBudget`'s and
# `calibrate_steps`' default too).
ACCOUNTANT = "pld"


def total_steps(config, num_examples, accountant=ACCOUNTANT):
    """T: calibrated to --target_epsilon (by `accountant`), or
    epochs * N / B; with `config.noise_bands` = b > 1 a multiple of b
    (`calibrate_steps(..., bands=b)`'s; epochs rounded down to one, at
    least b)."""
    bands = config.noise_bands
    if config.target_epsilon is not None:
        return tf_dpadam.calibrate_steps(
            target_epsilon=config.target_epsilon,
            num_examples=num_examples,
            batch_size=config.batch_size,
            noise_multiplier=config.noise_multiplier,
            delta=config.delta,
            accountant=accountant,
            **({"bands": bands} if bands > 1 else {}),
        )
    return bands_steps(
        max(1, round(config.epochs * num_examples / config.batch_size)),
        bands)


def steps_epsilon(*, steps, num_examples, batch_size, noise_multiplier,
                  delta, noise_bands=1, accountant=ACCOUNTANT):
    """Epsilon after `steps` Poisson steps; with `noise_bands` = b > 1,
    of T steps of b-banded correlated noise on cyclic Poisson batches:
    ceil(T / b) DP-SGD steps at q = b B / N, as the ledger counts them."""
    return tf_dpadam.epsilon_after_steps(
        steps=steps, num_examples=num_examples, batch_size=batch_size,
        noise_multiplier=noise_multiplier, delta=delta,
        accountant=accountant, bands=noise_bands)


def spent_epsilon(config, steps, num_examples):
    """Epsilon at `config.delta` after `steps` (infinite without noise)."""
    if config.noise_multiplier == 0:
        return math.inf
    return steps_epsilon(
        steps=steps, num_examples=num_examples,
        batch_size=config.batch_size,
        noise_multiplier=config.noise_multiplier, delta=config.delta,
        noise_bands=config.noise_bands, accountant=ACCOUNTANT,
    )


def print_results(results):
    held_out = ("" if results.get("validation_accuracy") is None else
                f" (validation accuracy {results['validation_accuracy']:.4f}"
                f" on {results['config']['validation_examples']} held-out"
                " training examples)")
    print(
        f"test accuracy {results['test_accuracy']:.4f}{held_out} after"
        f" {results['steps']} steps; spent epsilon"
        f" {results['epsilon']:.3f} at delta {results['delta']:g}"
    )
