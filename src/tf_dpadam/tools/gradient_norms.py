"""Per-example gradient norms, to choose the clip norm C (NOT private).

Clipping to C only works well relative to the norms of the examples'
gradients: far below all of them, every example adds a vector of length C
whatever its loss and the update becomes a vote (see "Choosing C" in
docs/guides/layers_and_clipping.md); far above them, the noise sigma * C
swamps the signal. `per_example_gradient_norms` gives the norms the private
train step would clip, by the same computation (ghost or vectorized, with the
model's augmentation multiplicity), without updating the weights:

    private = tf_dpadam.make_private(model)
    private.compile(optimizer=tf_dpadam.DPAdamCorrected(...), loss=...)
    norms = tf_dpadam.per_example_gradient_norms(private, public_x, public_y)
    print(np.percentile(norms, [10, 50, 90]))

The norms are a function of the data given, with no noise: computed on the
private training data they reveal it, and a C chosen from them is not
covered by the privacy guarantee. Use public or synthetic data that look
like the private data (or accept that a pilot on the private data is not
private).
"""

import typing

import keras
import numpy as np
import tensorflow as tf

from tf_dpadam.common import compat
from tf_dpadam.data import pipeline
from tf_dpadam.training import private_model as private_model_lib
from tf_dpadam.common import validation


def per_example_gradient_norms(
    model: keras.Model,
    x: typing.Any,
    y: typing.Any = None,
    sample_weight: typing.Any = None,
    batch_size: int | None = None,
) -> np.ndarray:
    """Every example's gradient norm before clipping (NOT private).

    Args:
        model: a `tf_dpadam.make_private` model, compiled with a loss (and a
            DP optimizer, as for `fit`; its C does not matter here). Its
            weights are not changed; layers that draw random numbers in
            training (dropout, `augment`) draw as in a train step.
        x, y, sample_weight: as for `fit`: arrays (batched by `batch_size`,
            default 32) or a `tf.data.Dataset` of batches (then `y`,
            `sample_weight` and `batch_size` are None). A model with a
            keras-hub preprocessor takes raw inputs, as in `fit`.
            Examples of sample weight 0 (Poisson padding) are left out.

    Returns:
        A float32 NumPy array, one L2 norm per example (over all trainable
        weights, with the regularization's gradient, of the example's mean
        loss over its K views when `augmult` = K > 1), in the data's order.

    Raises:
        ValueError: if `model` is not private or not compiled with a loss,
            or for data `fit` would not take.
    """
    if not isinstance(model, private_model_lib.PrivateModel):
        raise ValueError(
            "per_example_gradient_norms computes the norms the private train"
            " step clips: expected model to be made by"
            f" tf_dpadam.make_private(...), got {type(model).__name__}."
        )
    if not model.compiled or compat.compile_loss(model) is None:
        raise ValueError(
            "per_example_gradient_norms needs the loss: compile the private"
            " model first, e.g. model.compile(optimizer=tf_dpadam.DPAdam"
            "Corrected(...), loss=...)."
        )
    if batch_size is not None:
        validation.check_positive_int("batch_size", batch_size)
    data = pipeline.batched(x, y, sample_weight, batch_size)
    preprocess = pipeline.preprocessor_of(model.base_model)
    if preprocess is not None:
        data = pipeline.map_preprocessing(data, preprocess)
    step = tf.function(model.per_example_norms_step, reduce_retracing=True)
    found = []
    for batch in data:
        norms, present = step(batch)
        found.append(norms.numpy()[present.numpy() > 0])
    if not found:
        return np.zeros((0,), np.float32)
    return np.concatenate(found).astype(np.float32)
