"""How a training's batches were drawn, and the epsilon that follows.

A private model's `fit` records one of these for the data it trains on
(`tf_dpadam.private_fit`), and `tf_dpadam.PrivacyBudget` accounts with it:

* `PoissonPlan`: the batches of tf_dpadam's Poisson samplers (the default of
  `fit` on in-memory data, `tf_dpadam.data.poisson_batches`,
  `poisson_batches_from_source`, `sharding.sharded_poisson_batches`):
  amplification by subsampling at q = B / N, as RDP / PLD assume.
* `FixedBatchesPlan`: anything else (shuffled fixed batches, a user's
  `tf.data` pipeline, a `PyDataset`, a generator): no amplification, each
  pass over the data is one Gaussian mechanism per example
  (`tf_dpadam.accounting.passes`).
"""

import dataclasses
import typing

from tf_dpadam import validation
from tf_dpadam.accounting import calibration
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import ledger
from tf_dpadam.accounting import passes


@dataclasses.dataclass(frozen=True)
class PoissonPlan:
    """Poisson sampling at q = B / N: every example joins every logical step
    independently, by a secret coin.

    Attributes:
        num_examples: N.
        expected_batch_size: B, also the optimizer's denominator.
        accumulation_steps: k physical batches per logical step.
    """

    num_examples: int
    expected_batch_size: int
    accumulation_steps: int = 1

    amplified: typing.ClassVar[bool] = True

    def __post_init__(self):
        validation.check_sizes("num_examples", self.num_examples,
                               self.expected_batch_size)

    def epsilon(self, steps, noise_multiplier, delta, accountant):
        if steps == 0:
            return 0.0
        if noise_multiplier == 0:
            return float("inf")
        validation.check_steps(steps)
        validation.check_positive_real("noise_multiplier", noise_multiplier)
        validation.check_delta(delta)
        validation.check_accountant(accountant)
        # Not `epsilon_after_steps`: no delta warning at every step (the
        # caller warns once, `PrivacyBudget` at the start of training).
        return accounting_epsilon.epsilon_at_rate(
            self.expected_batch_size / self.num_examples,
            float(noise_multiplier), int(steps), float(delta), accountant)

    def max_steps(self, target_epsilon, noise_multiplier, delta, accountant):
        validation.check_positive_real("target_epsilon", target_epsilon)
        validation.check_positive_real("noise_multiplier", noise_multiplier)
        validation.check_delta(delta)
        validation.check_accountant(accountant)
        return calibration.steps_within(
            target_epsilon=target_epsilon, num_examples=self.num_examples,
            batch_size=self.expected_batch_size,
            noise_multiplier=noise_multiplier, delta=delta,
            accountant=accountant)

    def mechanism(self, noise_multiplier, source="Poisson batches"):
        """The ledger's `Mechanism` of one step of this plan."""
        return ledger.Mechanism.poisson(
            noise_multiplier, self.num_examples, self.expected_batch_size,
            self.accumulation_steps, source)

    def describe(self):
        q = self.expected_batch_size / self.num_examples
        return (f"Poisson sampling at q = B/N = {self.expected_batch_size}/"
                f"{self.num_examples} = {q:.4g} (amplification by"
                " subsampling)")


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

    def _kwargs(self, noise_multiplier, delta, accountant):
        return dict(noise_multiplier=noise_multiplier, delta=delta,
                    batches_per_pass=self.batches_per_pass,
                    accumulation_steps=self.accumulation_steps,
                    accountant=accountant)

    def epsilon(self, steps, noise_multiplier, delta, accountant):
        return passes.epsilon_without_amplification(
            steps=steps, **self._kwargs(noise_multiplier, delta, accountant))

    def max_steps(self, target_epsilon, noise_multiplier, delta, accountant):
        steps = passes.max_steps_without_amplification(
            target_epsilon=target_epsilon,
            **self._kwargs(noise_multiplier, delta, accountant))
        if steps == 0:
            raise ValueError(
                f"Expected target_epsilon={target_epsilon!r} >="
                f" {self.epsilon(1, noise_multiplier, delta, accountant)!r},"
                " the epsilon of a single step without amplification by"
                f" subsampling ({self.source}), with"
                f" noise_multiplier={noise_multiplier!r} and delta={delta!r}."
            )
        return steps

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

    def describe(self):
        if self.batches_per_pass is None:
            how = ("passes unknown: every step is accounted as a Gaussian"
                   " mechanism on every example")
        else:
            how = ("each pass over the data is one Gaussian mechanism per"
                   f" example ({self.batches_per_pass} batches a pass)")
        return f"{self.source}, no amplification by subsampling ({how})"
