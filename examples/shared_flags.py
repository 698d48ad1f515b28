"""The flags the example binaries share, and their parsing.

Every binary defines its flags in its own `define_flags()` (called under
`__main__`, not on import) and takes the DP flags from here, so that C, sigma,
B and the run's length mean the same everywhere:

- `define_dp_flags`: C, sigma, B, the physical batch, the epsilon target or
  epochs, delta, the evaluation interval, a training subset and XLA (all
  binaries; None: the paper's value for the dataset).
- `define_training_flags`: those and the optimizer's own flags, for the
  binaries that train one run (`train_image`, `train_text`, `diagnostics`);
  `config_from_flags` turns them into a `common.TrainConfig`.

Only `config_from_flags` reads absl's FLAGS; the other helpers take values.
"""

from absl import flags

from examples import common


def define_dp_flags(*, eval_every):
    """The DP and run-length flags (None: the paper's default)."""
    flags.DEFINE_float("l2_norm_clip", None,
                       "C, the per-example clipping norm (default: the "
                       "paper's for the dataset).")
    flags.DEFINE_float("noise_multiplier", None,
                       "sigma (default: the paper's for the dataset).")
    flags.DEFINE_integer("batch_size", None,
                         "B, the expected (Poisson) batch size (default: the "
                         "paper's for the dataset).")
    flags.DEFINE_integer("physical_batch_size", None,
                         "Examples per forward/backward pass; the logical "
                         "batch is accumulated over several. Default: all.")
    flags.DEFINE_float("target_epsilon", 7.0,
                       "Train for the most steps with epsilon <= this "
                       "(calibrate_steps); 0 to use --epochs instead.")
    flags.DEFINE_float("delta", 1e-5, "delta.")
    flags.DEFINE_float("epochs", None,
                       "Epochs (N / B steps each) when --target_epsilon=0.")
    flags.DEFINE_integer("eval_every", eval_every,
                         "Steps between test-set evaluations (a Keras epoch; "
                         "the points of the curves).")
    flags.DEFINE_integer("max_examples", None,
                         "Use only this many training examples (a subset).")
    flags.DEFINE_bool("jit_compile", False,
                      "XLA (slower than graphs on CPU, faster on GPU/TPU).")


def define_training_flags():
    """The flags of a binary that trains one run (None: the paper's)."""
    flags.DEFINE_enum("optimizer", "dpadam_corrected", list(common.OPTIMIZERS),
                      "Update rule on the privatized gradient.")
    flags.DEFINE_float("learning_rate", None, "eta.")
    flags.DEFINE_string("epsilon", None,
                        "gamma (DP-Adam, outside the root) or gamma' "
                        "(DP-AdamBC, inside it); 'none' = 0.04 * Phi.")
    flags.DEFINE_float("phi", None, "Override of Phi (DP-AdamBC ablation).")
    flags.DEFINE_float("beta_1", 0.9, "Adam's beta_1.")
    flags.DEFINE_float("beta_2", 0.999, "Adam's beta_2.")
    flags.DEFINE_float("momentum", 0.0, "DP-SGD momentum.")
    define_dp_flags(eval_every=100)
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
    if name == "dpadam" and epsilon is None:
        epsilon = 1e-8
    target = f.target_epsilon or None
    if target is None and f.epochs is None:
        raise ValueError("Give --target_epsilon > 0 or --epochs.")
    return common.TrainConfig(
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


def base_config_from_flags(dataset, flag_values=None):
    """`common.base_config` of the DP flags (`define_dp_flags`): the
    hyperparameters that the runs of an experiment share."""
    f = flag_values or flags.FLAGS
    return common.base_config(
        dataset, l2_norm_clip=f.l2_norm_clip,
        noise_multiplier=f.noise_multiplier, batch_size=f.batch_size,
        physical_batch_size=f.physical_batch_size,
        target_epsilon=f.target_epsilon, delta=f.delta, epochs=f.epochs,
        eval_every=f.eval_every, jit_compile=f.jit_compile)


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
