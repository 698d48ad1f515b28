"""The errors of the independence check: what mixes, and the way out."""

TURN_OFF = (
    " If you have verified yourself that the examples of a batch are"
    " independent, make_private(..., check_independence=False) turns this"
    " check off."
)


def mixing_error(what, score, cure, evidence=None):
    """The `ValueError` saying that `what` mixes examples, and `cure`."""
    evidence = evidence or (
        "replacing one example of the first training batch by another"
        " changed the outputs of the other examples")
    return ValueError(
        f"{what} mixes the examples of a batch in training: {evidence}"
        f" ({score:.3g} times the tolerance of the check). Per-example"
        " clipping then does not bound one example's influence, and training"
        " would not be differentially private (with"
        " clipping='vectorized' the model would silently train on batches"
        f" of one instead). {cure}" + TURN_OFF
    )


# The way out for a layer, and for a loss, that mixes examples.
LAYER_CURE = (
    "Use layers that treat each example on its own and keep the examples on"
    " axis 0: e.g. LayerNormalization or GroupNormalization instead of batch"
    " statistics, no transpose or reduction over the batch axis."
)
LOSS_CURE = (
    "Use a per-example loss: example i's loss may depend on (y_i, y_pred_i)"
    " only, not on other examples (no in-batch negatives as in a CLIP-style"
    " contrastive loss, no normalization by batch statistics)."
)
