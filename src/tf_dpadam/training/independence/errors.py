"""The errors of the independence check: what mixes, and the way out."""

TURN_OFF = (
    " If you have verified yourself that the examples of a batch are"
    " independent, make_private(..., check_independence=False) turns this"
    " check off."
)


def replaced_evidence(i, what="training-mode outputs"):
    """What the check saw, for example i."""
    return (f"example {i}'s {what} changed when the other examples of its"
            " training batch were replaced by copies of it")


def mixing_error(what, score, cure, evidence):
    """The `ValueError` saying that `what` mixes examples, and `cure`."""
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
GRADIENT_CURE = (
    "Its outputs and loss did not change, its gradient did: a layer whose"
    " gradient depends on the batch (e.g. a zero-initialized scale around"
    " batch statistics, as ReZero or LayerScale around batch centering) or"
    " a layer that moves the examples off axis 0 (a transpose of the batch"
    " axis), which ghost clipping's rules assume to hold the examples. Use"
    " layers that treat each example on its own; for a layer that only"
    " moves the batch axis and back, make_private(clipping='vectorized')"
    " computes each example's gradient on its own."
)
