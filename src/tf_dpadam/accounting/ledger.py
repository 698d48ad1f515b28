"""The privacy ledger: what a model's training released, and its epsilon.

A ledger is a list of segments. Each segment is one mechanism (how the
batches of its steps were drawn, and the noise) and the number of logical
steps taken with it. A private model owns one ledger
(`tf_dpadam.training.model_ledger`); its train step counts the steps, its `fit`
and `train_on_batch` open the segments, every save and checkpoint carries
it, and every epsilon the package prints is the composition of its
segments:

* `Mechanism.poisson(...)`: tf_dpadam's Poisson batches at q = B / N, one
  `PoissonSampledDpEvent(q, GaussianDpEvent(sigma))` per step;
* `Mechanism.poisson(..., bands=b)`, b > 1: cyclic Poisson sampling for
  banded correlated noise (Choquette-Choo, McMahan, Rush & Thakurta 2023,
  arXiv 2306.08153, "Amplified banded matrix factorization"): the data in
  b groups, step t samples only group t mod b, each of its examples with
  probability q = min(1, b B / N); with a strategy of at most b bands a
  segment of T steps is DP-SGD with ceil(T / b) steps at q
  (`epsilon.banded_dp_sgd_event`). Whichever group a segment starts at, an
  example joins at most ceil(T / b) of its steps, so summing ceil(T_i / b)
  over the segments bounds its participations over the whole run;
* `Mechanism.passes(...)`: fixed batches whose pass structure is known
  (`fit(..., sampling="shuffled")` on in-memory data: each pass over the
  data holds every example at most once). The segment's steps, counted from
  the start of a pass, bound an example's participations S (the sum of its
  squared copies per step, `passes.participation_bound`); the segment is a
  Gaussian mechanism of multiplier sigma / sqrt(S);
* `Mechanism.every_step(...)`: batches the package did not draw (a user's
  `tf.data` pipeline, a `PyDataset`, a generator, `train_on_batch`): every
  logical step may hold the example in each of its k physical batches,
  S = k^2 per step, no amplification.

Composition (`Ledger.dp_event`) is dp-accounting's
`ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, Gaussian
(sigma)), T), ..., GaussianDpEvent(sigma_eff)])`: all fixed-batch segments
together are one Gaussian mechanism, sigma_eff = (sum_i S_i /
sigma_i^2)^(-1/2) (Gaussians compose exactly so). `Ledger.epsilon` is that
event's epsilon under the accountants of `tf_dpadam.accounting` (PLD, value
discretization 1e-3, pessimistic; or RDP over `RDP_ORDERS`; each
`Accountant.ledger_epsilon`), cached per composition, equal (q, sigma)
segments merged first. No TensorFlow here.
"""

import dataclasses
import functools
import json
import math
import uuid

import dp_accounting

from tf_dpadam.common import validation
from tf_dpadam.accounting import accountants
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import passes
from tf_dpadam.accounting import search

# The sampling kinds of a `Mechanism`.
SAMPLINGS = ("poisson", "passes", "every_step")

# The version of `Ledger.to_json`'s format.
FORMAT_VERSION = 1

# `Ledger.max_more_steps` searches no further (the calibrations' cap).
MAX_MORE_STEPS = 10**7


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """What one logical step releases: its sampling and its noise.

    Attributes:
        sampling: "poisson", "passes" or "every_step" (see the module).
        noise_multiplier: sigma >= 0 (0: no noise, epsilon infinite).
        num_examples: N (required for "poisson"; else None if unknown).
        expected_batch_size: B of "poisson" (None otherwise).
        batches_per_pass: physical batches of one pass ("passes" only).
        accumulation_steps: k >= 1 physical batches per logical step.
        source: what the data was, for people ("Poisson batches of fit",
            "a tf.data.Dataset", "train_on_batch", ...).
        bands: b >= 1, the cyclic Poisson groups of "poisson" (1: plain
            Poisson sampling; b > 1: step t samples only group t mod b, at
            q = min(1, b B / N), and T steps count as ceil(T / b)). Only
            "poisson" takes b > 1.
    """

    sampling: str
    noise_multiplier: float
    num_examples: int | None = None
    expected_batch_size: int | None = None
    batches_per_pass: int | None = None
    accumulation_steps: int = 1
    source: str = ""
    bands: int = 1

    def __post_init__(self):
        validation.check(self.sampling in SAMPLINGS, "sampling",
                         self.sampling, f"to be one of {SAMPLINGS}")
        validation.check_non_negative("noise_multiplier",
                                      self.noise_multiplier)
        validation.check_positive_int("accumulation_steps",
                                      self.accumulation_steps)
        validation.check_positive_int("bands", self.bands)
        validation.check(self.bands == 1 or self.sampling == "poisson",
                         "bands", self.bands,
                         f"to be 1 with sampling={self.sampling!r} (only"
                         " 'poisson' is cyclic)")
        if self.sampling == "poisson":
            validation.check_sizes("num_examples", self.num_examples,
                                   self.expected_batch_size)
        if self.sampling == "passes":
            validation.check_positive_int("batches_per_pass",
                                          self.batches_per_pass)

    @classmethod
    def poisson(cls, noise_multiplier, num_examples, expected_batch_size,
                accumulation_steps=1, source="Poisson batches", *, bands=1):
        """Poisson sampling at q = B / N; with `bands` = b > 1, cyclic
        Poisson sampling over b groups at q = min(1, b B / N)."""
        validation.check_positive_int("bands", bands)
        return cls("poisson", float(noise_multiplier), int(num_examples),
                   int(expected_batch_size), None, int(accumulation_steps),
                   source, int(bands))

    @classmethod
    def passes(cls, noise_multiplier, batches_per_pass, accumulation_steps=1,
               num_examples=None, source="fixed batches"):
        """Fixed batches, each pass holding every example at most once."""
        return cls("passes", float(noise_multiplier),
                   None if num_examples is None else int(num_examples), None,
                   int(batches_per_pass), int(accumulation_steps), source)

    @classmethod
    def every_step(cls, noise_multiplier, accumulation_steps=1,
                   num_examples=None, source="data of unknown sampling"):
        """Any batches: every step may hold every example."""
        return cls("every_step", float(noise_multiplier),
                   None if num_examples is None else int(num_examples), None,
                   None, int(accumulation_steps), source)

    @property
    def sampling_rate(self):
        """q = B / N of a Poisson mechanism, min(1, b B / N) of a cyclic
        one (its group's rate; None for the other samplings)."""
        if self.sampling != "poisson":
            return None
        return accounting_epsilon.cyclic_sampling_probability(
            self.expected_batch_size, self.num_examples, self.bands)

    def poisson_steps(self, steps):
        """The Poisson-sampled steps that `steps` logical steps of a
        "poisson" mechanism count as: ceil(T / b) (T for b = 1)."""
        return accounting_epsilon.cyclic_rounds(steps, self.bands)

    def participations(self, steps):
        """S of `steps` logical steps of a fixed-batch mechanism (an
        upper bound on the sum over steps of an example's squared copies),
        counted from the start of a pass."""
        return passes.participation_bound(
            int(steps), self.batches_per_pass, self.accumulation_steps)

    def describe(self):
        """One phrase for people: the sampling, its amplification, sigma."""
        if self.sampling == "poisson" and self.bands > 1:
            how = (f"cyclic Poisson sampling over {self.bands} groups at"
                   f" q = min(1, bB/N) = min(1, {self.bands}*"
                   f"{self.expected_batch_size}/{self.num_examples}) ="
                   f" {self.sampling_rate:.4g} (each step samples one"
                   f" group; T steps count as ceil(T/{self.bands});"
                   " amplification by subsampling)")
        elif self.sampling == "poisson":
            how = (f"Poisson sampling at q = B/N = {self.expected_batch_size}/"
                   f"{self.num_examples} = {self.sampling_rate:.4g}"
                   " (amplification by subsampling)")
        elif self.sampling == "passes":
            how = ("no amplification by subsampling; each pass over the data"
                   " is one Gaussian mechanism per example"
                   f" ({self.batches_per_pass} batches a pass)")
        else:
            how = ("no amplification by subsampling; pass structure unknown,"
                   " so every step is accounted as a Gaussian mechanism on"
                   " every example")
        return (f"{self.source}, {how}, noise_multiplier ="
                f" {self.noise_multiplier:g}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """`steps` logical steps of one `mechanism`.

    Attributes:
        mechanism: the `Mechanism`.
        steps: T >= 0.
        id: a unique name, so that two copies of one ledger (a checkpoint
            and the model it came from) merge without counting a segment
            twice.
    """

    mechanism: Mechanism
    steps: int
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    def to_json(self):
        return {"id": self.id, "steps": int(self.steps),
                **dataclasses.asdict(self.mechanism)}

    @classmethod
    def from_json(cls, value):
        value = dict(value)
        segment_id, steps = value.pop("id"), value.pop("steps")
        validation.check_steps(steps)
        return cls(Mechanism(**value), int(steps), str(segment_id))


def _composition_key(segments):
    """The ledger's composition, normalized: ((q, sigma, T) of the Poisson
    segments, merged and sorted, a cyclic segment of T steps over b groups
    counting ceil(T / b) at its group's q; sum of S / sigma^2 of the fixed
    batches; whether a step had no noise)."""
    poisson = {}
    gaussian = 0.0
    noiseless = False
    for segment in segments:
        mechanism, steps = segment.mechanism, int(segment.steps)
        if steps == 0:
            continue
        if mechanism.noise_multiplier == 0:
            noiseless = True
            continue
        if mechanism.sampling == "poisson":
            key = (mechanism.sampling_rate, mechanism.noise_multiplier)
            poisson[key] = (poisson.get(key, 0)
                            + mechanism.poisson_steps(steps))
        else:
            gaussian += (mechanism.participations(steps)
                         / mechanism.noise_multiplier**2)
    return (tuple(sorted((q, s, t) for (q, s), t in poisson.items())),
            gaussian, noiseless)


def _gaussian_multiplier(gaussian):
    """sigma_eff of the fixed batches' composed Gaussian mechanism."""
    return 1.0 / math.sqrt(gaussian)


def dp_event_of(key):
    """The dp-accounting event of a `_composition_key`."""
    poisson, gaussian, noiseless = key
    events = [accounting_epsilon.dp_sgd_event(q, sigma, steps)
              for q, sigma, steps in poisson]
    if gaussian:
        events.append(dp_accounting.GaussianDpEvent(
            _gaussian_multiplier(gaussian)))
    if noiseless:
        events.append(dp_accounting.NonPrivateDpEvent())
    return dp_accounting.ComposedDpEvent(events)


@functools.lru_cache(maxsize=4096)
def epsilon_of(key, delta, accountant):
    """Epsilon at `delta` of a `_composition_key` by an
    `accountants.Accountant` (cached; its `ledger_epsilon`).

    With PLD, a composition whose privacy loss distribution would exceed
    `pld.MAX_PLD_POINTS` (very many steps, or a tiny effective sigma) gets
    the RDP accountant's epsilon instead, also an upper bound and larger
    than the PLD's: a ledger always has an epsilon, and it never decreases
    as steps are added.
    """
    poisson, gaussian, noiseless = key
    if noiseless:
        return math.inf
    if not poisson and not gaussian:
        return 0.0
    return accountant.ledger_epsilon(
        poisson, _gaussian_multiplier(gaussian) if gaussian else None, delta)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """An immutable tuple of `Segment` objects, in the order taken.

    `epsilon` only grows as segments are added or lengthened: every
    accountant here is monotone in each mechanism's steps.
    """

    segments: tuple = ()

    @property
    def steps(self):
        """All logical steps of all segments."""
        return sum(int(s.steps) for s in self.segments)

    def appended(self, segment):
        """This ledger with `segment` at the end."""
        return Ledger(self.segments + (segment,))

    def with_steps(self, mechanism, steps):
        """This ledger and `steps` more steps of `mechanism`, as a new
        segment (for calibration and planned runs)."""
        if steps == 0:
            return self
        return self.appended(Segment(mechanism, int(steps), "planned"))

    def dp_event(self):
        """The dp-accounting `ComposedDpEvent` of the ledger (see the
        module); an accountant's epsilon of it is `epsilon`'s."""
        return dp_event_of(_composition_key(self.segments))

    def epsilon(self, delta, accountant="pld"):
        """Epsilon at `delta` of everything the ledger holds.

        Raises:
            ValueError: if `delta` is out of range or `accountant` is not
                a name in `ACCOUNTANTS`.
        """
        validation.check_delta(delta)
        return epsilon_of(_composition_key(self.segments), float(delta),
                          accountants.get_accountant(accountant))

    def max_more_steps(self, mechanism, target_epsilon, delta,
                       accountant="pld", cap=MAX_MORE_STEPS):
        """The most steps of `mechanism` after this ledger within
        `target_epsilon`: the largest s in [0, cap] with
        epsilon(ledger + s steps) <= target_epsilon < epsilon(ledger + s + 1)
        (both sides evaluated; `cap` if that many still fit).

        The accountant's `steps_guess` starts the search
        (`search.largest_within`): for PLD, RDP's answer (cheap at any size,
        and never above the PLD's, since RDP's epsilon is the larger), so
        the PLD is probed only near it.
        """
        validation.check_positive_real("target_epsilon", target_epsilon)
        validation.check_delta(delta)
        chosen = accountants.get_accountant(accountant)
        if self.epsilon(delta, accountant) > target_epsilon:
            return 0

        def epsilon(steps, accountant=chosen):
            planned = self.with_steps(mechanism, steps)
            return epsilon_of(_composition_key(planned.segments),
                              float(delta), accountant)

        start = chosen.steps_guess(epsilon, target_epsilon, cap)
        return search.largest_within(epsilon, target_epsilon, cap=cap,
                                     start=start)

    def merged(self, other):
        """The union of two copies of a model's history: segments with the
        same id keep the larger step count, the others are all kept (a
        segment of `other` unknown here is composed, never dropped)."""
        theirs = {s.id: s.steps for s in other.segments}
        mine = {s.id for s in self.segments}
        merged = [dataclasses.replace(s, steps=max(s.steps,
                                                   theirs.get(s.id, 0)))
                  for s in self.segments]
        return Ledger(tuple(merged) + tuple(
            s for s in other.segments if s.id not in mine))

    def to_json(self):
        """The ledger as a JSON-serializable dict."""
        return {"format": FORMAT_VERSION,
                "segments": [s.to_json() for s in self.segments]}

    @classmethod
    def from_json(cls, value):
        """The ledger of `to_json`'s value.

        Raises:
            ValueError: if the value is not a ledger of a known format.
        """
        if (not isinstance(value, dict)
                or value.get("format") != FORMAT_VERSION
                or not isinstance(value.get("segments"), list)):
            raise ValueError(
                f"Expected a privacy ledger of format {FORMAT_VERSION}, got"
                f" {str(value)[:80]!r}.")
        try:
            return cls(tuple(Segment.from_json(s) for s in value["segments"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"A damaged privacy ledger: {error}.") from error

    def dumps(self):
        """`to_json` as a compact string."""
        return json.dumps(self.to_json(), sort_keys=True,
                          separators=(",", ":"))

    @classmethod
    def loads(cls, text):
        """The ledger of a `dumps` string (`ValueError` if damaged)."""
        return cls.from_json(json.loads(text))  # JSONDecodeError: ValueError
