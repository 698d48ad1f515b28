"""Empirical privacy auditing in one training run (Steinke, Nasr & Jagielski 2023).

m canaries are each included in training independently with probability 1/2;
the model is trained once with the user's own DP settings; each canary gets a
score; the auditor guesses "included" for the highest scores and "excluded"
for the lowest, abstaining on the rest; and the number of correct guesses
gives a lower bound on epsilon at a stated confidence:

    tf_dpadam.tools.audit.epsilon_lower_bound(num_canaries, num_guesses,
                                        num_correct, delta, confidence=0.95)

A bound at or below the claimed epsilon is consistent with the claim (it does
not prove it); a bound above it means the run is not as private as claimed.
m canaries can never show more than `best_possible_bound(m, delta)` (about 6
for m = 1,000 at delta = 1e-5).

* `bound`: `p_value`, `epsilon_lower_bound`, `best_possible_bound`;
* `canaries`: `GradientCanaries` (white-box, added to the privatizer's
  clipped sum), `InputCanaries` (black-box, mislabeled examples), `guess`,
  `AuditResult`;
* `hooks`: how the canaries reach a `PrivateModel`'s step, and
  `break_privatizer`, which breaks it on purpose to test the auditor.

`python -m research.audit` audits a run of the paper's CNN on Fashion-MNIST.
"""

from tf_dpadam.tools.audit.bound import best_possible_bound
from tf_dpadam.tools.audit.bound import epsilon_lower_bound
from tf_dpadam.tools.audit.bound import p_value
from tf_dpadam.tools.audit.canaries import audit_result
from tf_dpadam.tools.audit.canaries import AuditResult
from tf_dpadam.tools.audit.canaries import GradientCanaries
from tf_dpadam.tools.audit.canaries import guess
from tf_dpadam.tools.audit.canaries import InputCanaries
from tf_dpadam.tools.audit.hooks import break_privatizer
from tf_dpadam.tools.audit.hooks import BREAKS
