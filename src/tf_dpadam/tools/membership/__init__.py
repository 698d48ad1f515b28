"""Membership inference: how well can an attacker tell members from non-members?

The one-run audit (`tf_dpadam.tools.audit`) measures the training algorithm; this
package measures a trained model. Given the model, its training examples
(members) and held-out examples of the same distribution (non-members):

* `scores`: per-example scores, higher for "member": minus the loss, or the
  logit-scaled confidence log p_y - log(1 - p_y) of Carlini et al. 2022
  ("Membership Inference Attacks From First Principles"), computed stably
  from the logits (`logit_confidence`, `model_scores`, `evaluate_model`);
* `roc`: the attack's ROC curve, AUC, balanced accuracy and TPR at FPR 0.1%
  and 1%, with bootstrap confidence intervals (`roc_curve`,
  `evaluate_attack`, `AttackResult`);
* `lira`: the Likelihood Ratio Attack with shadow models trained by the
  user's own `train_fn(x, y) -> model` on random halves of a pool
  (`train_shadows`), offline (out-models only, the cheaper default) or
  online (`lira_offline`, `lira_online`);
* `queries`: augmented queries, each example scored under several views
  (`image_queries`: flips and shifts), which LiRA fits and tests per view
  and averages (`model_scores`, `train_shadows` and the LiRA functions
  take them);
* `plot`: the ROC on log-log axes, as a PNG (`save_roc_plot`; matplotlib).

An attack's success is a lower bound on what the model leaks: a weak attack
does not show that the model is private. A differentially private training
run bounds every attack: at (epsilon, delta), TPR <= e^epsilon FPR + delta
at every threshold.

`python -m examples.membership` compares a non-private model with DP models
at epsilon 7 and 1 on Fashion-MNIST (docs/guides/membership.md).
"""

from tf_dpadam.tools.membership.lira import fit_gaussians
from tf_dpadam.tools.membership.lira import gaussian_log_density
from tf_dpadam.tools.membership.lira import inclusion_masks
from tf_dpadam.tools.membership.lira import lira_offline
from tf_dpadam.tools.membership.lira import lira_online
from tf_dpadam.tools.membership.lira import ShadowScores
from tf_dpadam.tools.membership.lira import train_shadows
from tf_dpadam.tools.membership.plot import save_roc_plot
from tf_dpadam.tools.membership.queries import horizontal_flip
from tf_dpadam.tools.membership.queries import image_queries
from tf_dpadam.tools.membership.queries import shift
from tf_dpadam.tools.membership.roc import auc
from tf_dpadam.tools.membership.roc import AttackResult
from tf_dpadam.tools.membership.roc import evaluate_attack
from tf_dpadam.tools.membership.roc import roc_curve
from tf_dpadam.tools.membership.roc import tpr_at_fpr
from tf_dpadam.tools.membership.scores import cross_entropy
from tf_dpadam.tools.membership.scores import evaluate_model
from tf_dpadam.tools.membership.scores import logit_confidence
from tf_dpadam.tools.membership.scores import model_scores
from tf_dpadam.tools.membership.scores import scores_from_logits

__all__ = [
    "AttackResult",
    "ShadowScores",
    "auc",
    "cross_entropy",
    "evaluate_attack",
    "evaluate_model",
    "fit_gaussians",
    "gaussian_log_density",
    "horizontal_flip",
    "image_queries",
    "inclusion_masks",
    "lira_offline",
    "lira_online",
    "model_scores",
    "roc_curve",
    "save_roc_plot",
    "scores_from_logits",
    "shift",
    "tpr_at_fpr",
    "train_shadows",
]
