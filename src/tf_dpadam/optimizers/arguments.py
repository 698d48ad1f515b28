"""The DP keyword arguments of every DP optimizer, declared once.

`ARGUMENTS` lists them (name, default, type annotation, documentation).
`DPOptimizerMixin.__init__` takes them out of its keyword arguments
(`pop_arguments`), so a DP optimizer's constructor declares only its update
rule's own arguments and `**kwargs`; `signature` gives the constructor the
full signature (the DP arguments, then the update rule's) that
`inspect.signature`, IDEs and Sphinx show, and `DP_ARGS_DOC` is the
docstring section that documents them. Checked, they become a `DPConfig`
(C, sigma, B, k), which the private train step reads.
"""

import dataclasses
import inspect
import re
import textwrap
from typing import Any, Callable, Mapping, Optional, Union

from tf_dpadam.common import validation

__all__ = ["ARGUMENTS", "Argument", "DEFAULT_CLIP_LEARNING_RATE",
           "DPConfig", "DP_ARGS_DOC", "NAMES", "REQUIRED", "pop_arguments", "signature"]

REQUIRED = inspect.Parameter.empty  # The default of a required argument.
# eta's default: `tf_dpadam.privatizer.adaptive_clipping`'s
# DEFAULT_CLIP_LEARNING_RATE (tests/optimizers/arguments_test.py checks
# that they agree), written out: the DP optimizers' signatures are made
# while their modules load, maybe before adaptive_clipping has finished.
DEFAULT_CLIP_LEARNING_RATE = 0.2


@dataclasses.dataclass(frozen=True)
class Argument:
    """One DP keyword argument.

    Attributes:
        name: its keyword.
        default: its default (`REQUIRED`: none, the caller must give it).
        annotation: its type annotation.
        doc: its documentation, one paragraph (wrapped when rendered).
    """

    name: str
    default: Any
    annotation: Any
    doc: str

    def parameter(self) -> inspect.Parameter:
        """The keyword-only parameter of a signature."""
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY,
                                 default=self.default,
                                 annotation=self.annotation)


ARGUMENTS = (
    Argument(
        "l2_norm_clip", REQUIRED, Union[float, Mapping[str, float]],
        "C, each example's gradient is clipped to this global L2 norm (over"
        " all trainable variables). Must be finite and > 0."),
    Argument(
        "noise_multiplier", REQUIRED, float,
        "sigma; Gaussian noise of std sigma * C is added once to the sum of"
        " clipped gradients. Must be >= 0."),
    Argument(
        "batch_size", None, Optional[int],
        "B, the public denominator. `None` divides by the number of examples"
        " in the step; an int divides by that constant (use the expected"
        " batch size under Poisson sampling, or the logical batch size)."),
    Argument(
        "gradient_accumulation_steps", None, Optional[int],
        "k. With k > 1 one DP step spans k physical batches: their clipped"
        " gradients are summed, noise is added once, and the optimizer (its"
        " moments and `iterations`) advances once per k batches. B is then"
        " the logical batch size. Under `tf.distribute` every replica"
        " accumulates its own k physical batches; the logical batch is k"
        " global batches, its sums are all-reduced once and noised once."),
    Argument(
        "target_unclipped_quantile", None, Optional[float],
        "None (C fixed), or gamma in (0, 1) for adaptive clipping (Andrew et"
        " al. 2021, `tf_dpadam.privatizer.adaptive_clipping`): after each"
        " step C moves geometrically toward the gamma-quantile of the"
        " per-example gradient norms, C <- C exp(-eta (b_tilde - gamma)),"
        " b_tilde being the privatized fraction of unclipped examples. The"
        " gradient's noise multiplier is raised so that the gradient and the"
        " count together have `noise_multiplier`, which accounting uses"
        " unchanged. `l2_norm_clip` is then the initial C, and the"
        " `l2_norm_clip` attribute reports the current one."),
    Argument(
        "clip_learning_rate", DEFAULT_CLIP_LEARNING_RATE, float,
        "eta > 0, the geometric step of adaptive clipping (the paper's"
        " 0.2)."),
    Argument(
        "clipped_count_stddev", None, Optional[float],
        "sigma_b, the std of the count's noise; None for the paper's"
        " B / 20."),
    Argument(
        "per_layer_clipping", False, bool,
        "with a number `l2_norm_clip` C, clip each layer's gradient on its"
        " own to C / sqrt(L) (L layers with trainable weights), so the total"
        " sensitivity stays C (`tf_dpadam.privatizer.clip_groups`)."
        " `l2_norm_clip` may also be a mapping `{layer name or path: C_l}`,"
        " one group per key; the noise and Phi then use"
        " sqrt(sum_l C_l^2)."),
    Argument(
        "noise_strategy", None, Any,
        "None (independent noise, DP-SGD's), an int b in [1, 64] (banded"
        " correlated noise with b bands: the banded inverse square root,"
        " BISR), or a `tf_dpadam.privatizer.correlated_noise.BandedToeplitz`"
        " (e.g. `BandedToeplitz.optimized(b, steps)`). With b > 1, step t"
        " adds noise correlated with the last b - 1 steps' (a matrix"
        " factorization), `fit` samples cyclic Poisson batches (b groups;"
        " step t samples group t mod b) and accounts them so, and the"
        " optimizer gets the exact per-step Phi_t. One band is DP-SGD's"
        " noise exactly. b > 1 needs `fit`'s cyclic Poisson batches and one"
        " device (`tf_dpadam.privatizer.correlated_noise`)."),
)
NAMES = tuple(argument.name for argument in ARGUMENTS)


def pop_arguments(kwargs: dict, owner: str) -> dict:
    """Takes the DP arguments out of `kwargs` (in place).

    Args:
        kwargs: a DP optimizer constructor's keyword arguments.
        owner: the optimizer class's name, for the error message.

    Returns:
        `{name: value}` of every DP argument, with its default where
        `kwargs` lacks it.

    Raises:
        TypeError: a required argument is missing (Python's message for a
            missing keyword-only argument).
    """
    missing = [a.name for a in ARGUMENTS
               if a.default is REQUIRED and a.name not in kwargs]
    if missing:
        quoted = [repr(name) for name in missing]
        listed = (quoted[0] if len(quoted) == 1 else
                  ", ".join(quoted[:-1]) + (", and " if len(quoted) > 2
                                            else " and ") + quoted[-1])
        plural = "s" if len(missing) > 1 else ""
        raise TypeError(
            f"{owner}.__init__() missing {len(missing)} required"
            f" keyword-only argument{plural}: {listed}")
    return {a.name: kwargs.pop(a.name, a.default) for a in ARGUMENTS}


def signature(init: Callable) -> inspect.Signature:
    """The full signature of a DP optimizer's constructor.

    Args:
        init: the `__init__` that declares the update rule's own arguments
            (the DP optimizer's, or the Keras optimizer's).

    Returns:
        `(self, *, <the DP arguments>, <init's own arguments>, **kwargs)`:
        its own arguments keyword-only, as the DP constructor takes them.
    """
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(init).parameters.values()
           if p.name not in NAMES and p.name != "self" and p.kind in (
               inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.KEYWORD_ONLY)]
    return inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(a.parameter() for a in ARGUMENTS), *own,
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def _wrapped(name: str, doc: str) -> str:
    """`name: doc` as a Google-style entry, wrapped below 80 columns
    without breaking inside a `literal`."""
    # A space inside backquotes is no break: a placeholder while wrapping.
    text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), doc)
    lines = textwrap.wrap(f"{name}: {text}", width=78,
                          initial_indent=" " * 8,
                          subsequent_indent=" " * 12,
                          break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines).replace("\0", " ") + "\n"


# The docstring section of the DP arguments ("Args:" and one entry each),
# which a DP optimizer's docstring continues with its own arguments.
DP_ARGS_DOC = "\n    Args:\n" + "".join(
    _wrapped(a.name, a.doc) for a in ARGUMENTS)


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """The public DP hyperparameters of one privatized step.

    Attributes:
        l2_norm_clip: C, the bound on each example's gradient L2 norm (global over
            all trainable variables).
        noise_multiplier: sigma; the Gaussian noise has std sigma * C.
        batch_size: B, the denominator. `None` means the number of examples in
            the step; an int is a public constant (the expected batch size under
            Poisson sampling, or the logical batch size).
        accumulation_steps: k, the physical batches that make one step.
        noise_strategy: None (independent noise) or the
            `correlated_noise.BandedToeplitz` of correlated noise.
    """

    l2_norm_clip: float
    noise_multiplier: float
    batch_size: int | None = None
    accumulation_steps: int = 1
    noise_strategy: Any = None

    def __post_init__(self):
        validation.check_positive("l2_norm_clip", self.l2_norm_clip)
        validation.check_non_negative("noise_multiplier", self.noise_multiplier)
        b = self.batch_size
        if b is not None:
            validation.check(validation.is_int(b) and b > 0, "batch_size", b,
                             "to be None or an int > 0")
            object.__setattr__(self, "batch_size", int(b))
        k = self.accumulation_steps
        validation.check(validation.is_int(k) and k >= 1,
                         "gradient_accumulation_steps", k,
                         "to be None or an int >= 1")
        object.__setattr__(self, "accumulation_steps", int(k))
        object.__setattr__(self, "l2_norm_clip", float(self.l2_norm_clip))
        object.__setattr__(self, "noise_multiplier",
                           float(self.noise_multiplier))
        object.__setattr__(self, "noise_strategy",
                           noise_strategy_of(self.noise_strategy))

    @property
    def noise_bands(self) -> int:
        """b, the bands of the noise strategy (1: independent noise)."""
        return 1 if self.noise_strategy is None else self.noise_strategy.bands

    @property
    def noise_stddev(self) -> float:
        """sigma * C, the std of the noise added once to the clipped sum."""
        return noise_stddev(self.l2_norm_clip, self.noise_multiplier)

    def denominator(self, num_examples):
        """B: `batch_size` if set, else `num_examples` (the examples in the step)."""
        if self.batch_size is not None:
            return self.batch_size
        return num_examples


def noise_strategy_of(value):
    """The `BandedToeplitz` of a `noise_strategy` argument (None stays
    None): an int b is `BandedToeplitz.bisr(b)`; a dict is a strategy's
    `to_config()` (a saved optimizer's).

    Raises:
        ValueError: naming `noise_strategy`, for anything else.
    """
    # pylint: disable=import-outside-toplevel
    from tf_dpadam.privatizer import correlated_noise
    if value is None or isinstance(value, correlated_noise.BandedToeplitz):
        return value
    if validation.is_int(value):
        validation.check(1 <= value <= correlated_noise.MAX_BANDS,
                         "noise_strategy", value,
                         f"to be None, an int in [1,"
                         f" {correlated_noise.MAX_BANDS}] or a"
                         " BandedToeplitz")
        return correlated_noise.BandedToeplitz.bisr(int(value))
    if isinstance(value, Mapping) and set(value) == {"coefficients", "name"}:
        return correlated_noise.BandedToeplitz(tuple(value["coefficients"]),
                                               str(value["name"]))
    raise ValueError(
        f"Expected noise_strategy={value!r} to be None, an int number of"
        " bands or a tf_dpadam.privatizer.correlated_noise.BandedToeplitz.")


def noise_stddev(l2_norm_clip, noise_multiplier):
    """The std of the Gaussian noise added to the sum of clipped gradients."""
    return noise_multiplier * l2_norm_clip
