"""What a study run measures besides accuracy: Adam's second moment.

The regime map asks where DP-AdamBC's correction matters: where the clean
second moment v^c is not small against the noise's Phi = (sigma C / B)^2.
`final_moments` reads the private v of a trained DP-Adam or DP-AdamBC and
`moment_statistics` summarizes (v_hat - Phi) / Phi over its coordinates
(`research.study_plan` stores them with each run).
"""

import numpy as np

import tf_dpadam


def moment_statistics(velocities, *, steps, beta_2, phi, gamma=None):
    """Statistics of (v_hat - Phi) / Phi over every coordinate.

    v_hat = v / (1 - beta_2^t) after t = `steps` steps is the private second
    moment; v_hat - Phi estimates the clean second moment v^c (unbiased, but
    with noise of about Phi sqrt(2 (1 - beta_2)) per coordinate).

    Args:
        velocities: Adam's v, arrays of any shapes.
        steps, beta_2: t and the optimizer's beta_2.
        phi: (sigma C / B)^2.
        gamma: DP-AdamBC's gamma' (None for DP-Adam).

    Returns:
        A dict: `median_vc_over_phi`, `mean_vc_over_phi` and, with gamma,
        `below_gamma` (the fraction of coordinates with v_hat - Phi < gamma',
        on which DP-AdamBC divides by sqrt(gamma')).
    """
    v = np.concatenate([np.ravel(x) for x in velocities]).astype(np.float64)
    excess = v / (1.0 - beta_2 ** steps) - phi
    stats = {"median_vc_over_phi": float(np.median(excess) / phi),
             "mean_vc_over_phi": float(np.mean(excess) / phi)}
    if gamma is not None:
        stats["below_gamma"] = float(np.mean(excess < gamma))
    return stats


def final_moments(model):
    """`{"final_moments": moment_statistics(...)}` of a trained private
    model's DP-Adam or DP-AdamBC (`{}` for DP-SGD or before any step):
    for `training.train_private(measure=...)`; costs no training."""
    optimizer = model.optimizer
    steps = int(optimizer.iterations.numpy())
    if not hasattr(optimizer, "moments") or steps == 0:
        return {}
    phi = float(optimizer.noise_phi())
    gamma = (float(optimizer.step_gamma(optimizer.step_phi()))
             if isinstance(optimizer, tf_dpadam.DPAdamCorrected) else None)
    velocities = [optimizer.moments(v)[1].numpy()
                  for v in model.trainable_variables]
    return {"final_moments": moment_statistics(
        velocities, steps=steps, beta_2=float(optimizer.beta_2), phi=phi,
        gamma=gamma)}
