"""Checks, during training, that each example's gradient depends on it alone.

Per-example clipping bounds one example's influence on the clipped sum by C
only if example i's clipped contribution depends on example i alone. A layer
that mixes the examples of a batch in training (batch statistics, attention
over the batch axis, the batch max), a zero-initialized scale around such a
layer (whose gradient mixes before its outputs do), a loss that mixes (in-
batch negatives, a normalization by batch statistics), an augmentation that
mixes (MixUp, CutMix) or a layer that moves the examples off axis 0 (which
ghost clipping's rules assume) breaks that: removing example j then moves
other examples' contributions and the remove-one sensitivity exceeds C
(tests/sensitivity_zoo_test.py, tests/guard_misses_test.py). A list of known
layers cannot cover user code, so the guard tests the property itself, on
the user's model, loss and training batches:

1. For `CHECKED_ROWS` examples i of a checked batch, drawn at random among
   its present examples, the batch is compared with the batch in which
   every OTHER row is a copy of example i (the same shape, so that every
   random layer draws the same numbers for row i: the state of every
   `keras.random.SeedGenerator`, of Keras' global one and every
   non-trainable variable is restored before each pass and after the
   check). Example i's training-mode predictions, its compiled loss and its
   gradient norm as the private step computes it (ghost clipping or the
   vectorized map, the optimizer's per-example transform included;
   `probe.Probe`, a `tf.function` compiled with XLA when the step is) must
   be the same in both. Replacing all other rows, not one, makes the change
   a fraction of the row's scale whatever the batch size (a centering over
   16,384 examples moves by its whole value, not by 1/B).
2. The compiled loss on the whole batch: its gradient w.r.t. example i's
   prediction must not change when the other rows of `(y, y_pred)` are
   copies of row i. The step evaluates the loss per example, so only this
   sees a loss with in-batch negatives (it would train on batches of one).
3. `augment`: example i's views, in `model_check.AUGMENT_DRAWS` random
   draws, against those of the copies (an augmentation that mixes with
   probability p per batch escapes with probability (1 - p) ** 16). On a
   failure of 1 the first layer (of a functional or Sequential model) whose
   outputs for row i differ is named, else the model.
4. When (`guard.Guard`): Keras' train function checks the first batch of
   its first call, of every call after the compiled loss, the trainable
   weights, `augment` or the clipping method changed, and of each later
   call with probability `CHECK_RATE` (1%, drawn from the operating
   system's entropy), eagerly before the steps run, on the very batches it
   then trains on. A layer's `trainable` set after the step was traced
   changes nothing in the traced step (as in Keras): a warning says so,
   once.

"Unchanged" means `abs(a' - a) <= ROUNDING_ULPS * eps(dtype) * scale`
per tensor, plus `ABSOLUTE_TOLERANCE` (1e-30) (64 units in the last
place; `scale` is the largest absolute value of the compared rows): both sides are the same program on batches of the same
shape, so a per-example model differs by float rounding at most (and in
practice by nothing), while a mixing one moves by a fraction of its scale.

What it cannot catch: mixing in a batch or a step it does not check (the
random later checks make a model that mixes in a fraction f of its steps
escape n calls with probability (1 - 0.01 f) ** n), mixing that leaves the
checked rows' predictions, losses and gradient norms unchanged (e.g. the
batch max, when every checked row holds it), a random op outside
`keras.random` (the outputs are then not reproducible and the check raises
a `ValueError` saying so rather than guessing), `add_loss` terms, and a
batch whose present examples are all equal (a warning says so).

Cost: a checked call runs the probe 1 + `CHECKED_ROWS` times (three batches'
forward and backward passes, as a step without the update) and the loss a
few times; the steady-state cost at `CHECK_RATE` is in the performance guide
(benchmarks/guard_cost.py). `make_private(check_independence=False)` turns
it off, for models the user has verified.

`check` takes the batch's tensors as they are if they are one of
`composite_types` (dense, ragged or sparse tensors), else converts them.

Modules: `rows` (pure helpers on `[rows, ...]` structures and the
tolerance), `probe` (what is compared), `model_check` (random state,
`augment`, the layer that mixes), `loss_check` (2), `errors` (the
messages), `guard` (`check`, and `Guard`, the schedule on Keras' train
function).
"""

from tf_dpadam.training.independence.guard import CHECK_RATE
from tf_dpadam.training.independence.guard import CHECKED_ROWS
from tf_dpadam.training.independence.guard import Guard
from tf_dpadam.training.independence.guard import check
from tf_dpadam.training.independence.guard import composite_types
from tf_dpadam.training.independence.rows import ABSOLUTE_TOLERANCE
from tf_dpadam.training.independence.rows import ROUNDING_ULPS
from tf_dpadam.training.independence.rows import change_of_rows
from tf_dpadam.training.independence.rows import copies_of_row
from tf_dpadam.training.independence.rows import has_distinct_row
from tf_dpadam.training.independence.rows import num_rows
from tf_dpadam.training.independence.rows import relative_tolerance

__all__ = [
    "ABSOLUTE_TOLERANCE",
    "CHECKED_ROWS",
    "CHECK_RATE",
    "Guard",
    "ROUNDING_ULPS",
    "change_of_rows",
    "check",
    "composite_types",
    "copies_of_row",
    "has_distinct_row",
    "num_rows",
    "relative_tolerance",
]
