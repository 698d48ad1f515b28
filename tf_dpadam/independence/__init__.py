"""Checks, before the first private step, that the examples are independent.

Per-example clipping bounds one example's influence on the clipped sum by C
only if example i's gradient depends on example i alone. A layer that mixes
the examples of a batch in training (batch statistics, attention over the
batch axis, a transpose that puts the examples on another axis) or a loss
that does (in-batch negatives, a normalization by batch statistics) breaks
that: removing example j then moves every other example's gradient, and the
measured remove-one sensitivity exceeds C (tests/sensitivity_zoo_test.py).
Under `clipping="vectorized"` the same model or loss silently trains on
batches of one instead. A list of known layers cannot cover user code, so
`check` tests the property itself, on the user's model, loss and first
training batch, eagerly:

1. The model in training mode (with `augment` and `augmult` as the step
   applies them): example j's input is replaced by example k's, and no other
   example's output may change. The random state of every
   `keras.random.SeedGenerator` (Dropout, GaussianNoise, random
   augmentations, Keras' global generator) and every non-trainable variable
   (BatchNormalization's moving statistics, seed states) is restored before
   each pass and after the check, so random layers give no false alarm and
   the model is left as it was. On a failure the first layer (in the order
   of a functional or Sequential model) whose outputs mix is named, else the
   model.
2. The loss: the per-example losses the step uses
   (`ghost_clipping.compiled_loss_fn` on the whole batch) must not change
   for the other examples when example j changes, and must equal those of
   one-example slices (compared on up to `SLICED_ROWS` rows); and the
   gradient of the compiled loss w.r.t. the predictions of the other
   examples must not change when example j's `(y, y_pred)` does (this
   catches a contrastive loss even where the step would evaluate it one
   example at a time).

"Unchanged" means `max |a' - a| <= rtol * max |a| + atol` per tensor
(`atol = ABSOLUTE_TOLERANCE`, 1e-12), with
`rtol = RELATIVE_TOLERANCE` (1e-4) for 32- and 64-bit floats and
`LOW_PRECISION_RELATIVE_TOLERANCE` (1e-2) for 16-bit ones: float32
rounding (~1e-7) cannot trip it, while a mixing layer moves the other rows
by about |x_j - x_k| / B (centering a batch of 256 moves them by ~4e-3 of
their scale).

What it cannot catch: mixing that only shows in the backward pass (a custom
gradient), in `add_loss` of a layer, in a random op outside
`keras.random` (the outputs are then not reproducible and the check raises
a `ValueError` saying so rather than guessing), or only in batches other
than the first (e.g. a layer that mixes only above some batch size), or for
examples identical to the one that replaces them. A first batch with fewer
than two distinct examples cannot be checked (a warning says so).

Cost: once per model and compiled loss (`compile` with another loss checks
again), on the first training batch: three forward passes in training mode
(a fourth and a per-layer probe only when it fails), the compiled loss a few
times and two gradients of it w.r.t. the predictions, all eager; measured
by benchmarks/guard_cost.py. `make_private(check_independence=False)` turns
it off, for models the user has verified.

`check` takes the batch's tensors as they are if they are one of
`composite_types` (dense, ragged or sparse tensors), else converts them.

Modules: `rows` (pure helpers on `[rows, ...]` structures and the
tolerance), `model_check` (1), `loss_check` (2), `errors` (the messages),
`guard` (`check`, and `checked_on_first_call`, the hook on Keras' train
function).
"""

from tf_dpadam.independence.guard import check
from tf_dpadam.independence.guard import checked_on_first_call
from tf_dpadam.independence.guard import composite_types
from tf_dpadam.independence.rows import ABSOLUTE_TOLERANCE
from tf_dpadam.independence.rows import LOW_PRECISION_RELATIVE_TOLERANCE
from tf_dpadam.independence.rows import RELATIVE_TOLERANCE
from tf_dpadam.independence.rows import SLICED_ROWS
from tf_dpadam.independence.rows import change_of_other_rows
from tf_dpadam.independence.rows import distinct_row
from tf_dpadam.independence.rows import num_rows
from tf_dpadam.independence.rows import relative_tolerance
from tf_dpadam.independence.rows import replace_row
from tf_dpadam.independence.rows import replace_rows

__all__ = [
    "ABSOLUTE_TOLERANCE",
    "LOW_PRECISION_RELATIVE_TOLERANCE",
    "RELATIVE_TOLERANCE",
    "SLICED_ROWS",
    "change_of_other_rows",
    "check",
    "checked_on_first_call",
    "composite_types",
    "distinct_row",
    "num_rows",
    "relative_tolerance",
    "replace_row",
    "replace_rows",
]
