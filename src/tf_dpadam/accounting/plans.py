"""How a training's batches were drawn: the mechanism of its ledger segment.

A private model's `fit` records one of these for the data it trains on
(`tf_dpadam.training.private_fit`) and opens a segment of the model's privacy ledger
with its `mechanism` (`tf_dpadam.accounting.ledger`), which alone computes
epsilon:

* `PoissonPlan`: the batches of tf_dpadam's Poisson samplers (the default of
  `fit` on in-memory data, `tf_dpadam.data.poisson_batches`,
  `poisson_batches_from_source`, `sharding.sharded_poisson_batches`):
  amplification by subsampling at q = B / N, as RDP / PLD assume.
* `FixedBatchesPlan`: anything else (shuffled fixed batches, a user's
  `tf.data` pipeline, a `PyDataset`, a generator): no amplification; each
  pass over the data one Gaussian mechanism per example where the passes
  are known (fit's shuffled batches), else every step one.
"""

import dataclasses
import typing

from tf_dpadam.common import validation
from tf_dpadam.accounting import ledger


@dataclasses.dataclass(frozen=True)
class PoissonPlan:
    """Poisson sampling at q = B / N: every example joins every logical step
    independently, by a secret coin.

    Attributes:
        num_examples: N.
        expected_batch_size: B, also the optimizer's denominator.
        accumulation_steps: k physical batches per logical step.
        groups: b, the cyclic Poisson groups (`data.poisson_batches(...,
            groups=b)`): 1 for plain Poisson sampling; b > 1: each step
            samples one group at q = min(1, b B / N), the ledger's
            `Mechanism.poisson(..., bands=b)`.
        group_offset: the group of the pipeline's first step of every pass,
            in [0, groups) (`poisson_batches(..., group_offset=o)`), which
            `fit` checks against the noise's steps.
    """

    num_examples: int
    expected_batch_size: int
    accumulation_steps: int = 1
    groups: int = 1
    group_offset: int = 0

    amplified: typing.ClassVar[bool] = True

    def __post_init__(self):
        validation.check_sizes("num_examples", self.num_examples,
                               self.expected_batch_size)
        validation.check_positive_int("groups", self.groups)
        validation.check(validation.is_int(self.group_offset)
                         and 0 <= self.group_offset < self.groups,
                         "group_offset", self.group_offset,
                         f"to be an int in [0, groups={self.groups})")

    def mechanism(self, noise_multiplier, source="Poisson batches"):
        """The ledger's `Mechanism` of one step of this plan."""
        return ledger.Mechanism.poisson(
            noise_multiplier, self.num_examples, self.expected_batch_size,
            self.accumulation_steps, source, bands=self.groups)

@dataclasses.dataclass(frozen=True)
class FixedBatchesPlan:
    """Batches not drawn by tf_dpadam's Poisson samplers: no amplification.

    Attributes:
        source: what the data was, for messages ("shuffled batches of
            arrays", "a tf.data.Dataset", "a PyDataset", "a generator").
        batches_per_pass: physical batches of one pass over the data (each
            example at most once per pass), or None if unknown.
        accumulation_steps: k physical batches per logical step.
        num_examples: N if known (for the comparison with Poisson sampling).
        logical_batch_size: the batch of one logical step if known (idem).
    """

    source: str
    batches_per_pass: typing.Optional[int]
    accumulation_steps: int = 1
    num_examples: typing.Optional[int] = None
    logical_batch_size: typing.Optional[int] = None

    amplified: typing.ClassVar[bool] = False

    def mechanism(self, noise_multiplier):
        """The ledger's `Mechanism` of one step of this plan: "passes" if
        the pass structure is known, else "every_step"."""
        if self.batches_per_pass is None:
            return ledger.Mechanism.every_step(
                noise_multiplier, self.accumulation_steps, self.num_examples,
                self.source)
        return ledger.Mechanism.passes(
            noise_multiplier, self.batches_per_pass, self.accumulation_steps,
            self.num_examples, self.source)

    def poisson_alternative(self):
        """The `PoissonPlan` of the same data and batch size, if known."""
        n, b = self.num_examples, self.logical_batch_size
        if n is None or b is None or not 0 < b <= n:
            return None
        return PoissonPlan(n, b, self.accumulation_steps)
