"""Augmentation multiplicity: K augmented views of each example per step.

De, Berrada, Hayes, Smith & Balle, "Unlocking High-Accuracy Differentially
Private Image Classification through Scale" (2022): each example's gradient
is the mean over K augmented views of it, taken BEFORE clipping,

    g_i = grad [ (1/K) sum_k loss(f(v_ik), y_i) ] + grad R,
    v_i1, ..., v_iK = augment(x_i, ..., x_i)    (K copies of example i),

then `sum_i min(1, C / ||g_i||) g_i + N(0, sigma^2 C^2 I)`, divided by B.
Example i still moves the sum by at most C, so the sensitivity, the noise,
B and epsilon are those without augmentation; the views only lower the
variance of g_i, at K times the compute of the forward and backward passes.

`make_private(augment=..., augmult=K)` makes the views here, once per step
and outside any per-example gradient machinery (`views`: each example
repeated K times in consecutive rows, then `augment` on the whole `[B K,
...]` batch with `training=True`); both clipping paths then take each group
of K consecutive rows as one example (their `group_size`). The augmentation
must transform each row on its own: one that mixes examples (MixUp, CutMix)
would put example j's data into example i's gradient and is refused.
"""

import inspect

import keras
import tensorflow as tf

from tf_dpadam.common import compat
from tf_dpadam.common import validation

# Keras augmentations that mix the examples of a batch (where this Keras
# has them).
EXAMPLE_MIXING_AUGMENTATIONS = tuple(
    getattr(keras.layers, name) for name in ("MixUp", "CutMix")
    if hasattr(keras.layers, name)
)


def check_arguments(augment, augmult):
    """Validates `make_private`'s `augment` and `augmult`.

    Raises:
        ValueError: naming the argument: `augmult` not an int >= 1, `augment`
            neither None nor callable, `augmult > 1` without `augment`, or
            an `augment` layer with trainable weights or that mixes examples.
    """
    validation.check(validation.is_int(augmult) and augmult >= 1, "augmult",
                     augmult, "to be an int >= 1")
    validation.check(augment is None or callable(augment), "augment",
                     augment, "to be None or a callable (a function or a"
                     " Keras layer)")
    validation.check(
        augment is not None or augmult == 1, "augment", augment,
        f"to be a callable with augmult={augmult!r} > 1 (the views of an"
        " example are augment applied to its augmult copies; identical"
        " copies would only repeat the work)",
    )
    if not isinstance(augment, keras.layers.Layer):
        return
    validation.check(
        not augment.trainable_weights, "augment", augment,
        "to have no trainable weights (the augmentation is not trained; put"
        " trainable layers in the model)",
    )
    for layer in compat.all_layers(augment):
        validation.check(
            not isinstance(layer, EXAMPLE_MIXING_AUGMENTATIONS), "augment",
            augment,
            f"not to contain {type(layer).__name__} (layer {layer.name!r}),"
            " which mixes the examples of a batch: one example's views would"
            " carry another's data, and clipping would not bound one"
            " example's influence",
        )


def repeat_examples(structure, augmult):
    """Each example of a structure of `[B, ...]` tensors `augmult` times in a
    row (`[B K, ...]`, example i in rows i K to i K + K - 1); None stays."""
    if augmult == 1:
        return structure
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.repeat(t, augmult, axis=0),
        structure,
    )


def views(augment, x, augmult):
    """The K views of every example of `x`: `augment(repeat_examples(x))`.

    `augment` is called once on the whole repeated batch, with
    `training=True` if it takes a `training` argument (Keras layers do: their
    random preprocessing is off otherwise). None: the copies themselves.

    Raises:
        ValueError: if `augment` changes the (static) number of rows, or
            built trainable weights in this call.
    """
    repeated = repeat_examples(x, augmult)
    if augment is None:
        return repeated
    if _takes_training(augment):
        out = augment(repeated, training=True)
    else:
        out = augment(repeated)
    check_arguments(augment, augmult)  # A layer is built now.
    rows = tf.nest.flatten(repeated)[0].shape[0]
    for t in tf.nest.flatten(out):
        leading = tf.convert_to_tensor(t).shape[0]
        if rows is not None and leading is not None and leading != rows:
            raise ValueError(
                f"make_private(augment={augment!r}) must return one view per"
                f" row: it received {rows} rows and returned {leading}."
            )
    return out


def _takes_training(augment):
    if isinstance(augment, keras.layers.Layer):
        return True
    try:
        parameters = inspect.signature(augment).parameters.values()
    except (TypeError, ValueError):  # E.g. some builtins.
        return False
    return any(p.name == "training" or p.kind == p.VAR_KEYWORD
               for p in parameters)


def serialize(augment):
    """`augment` for `PrivateModel.get_config` (None stays None).

    A Keras layer (e.g. a `keras.Sequential` of preprocessing layers), or a
    function or class registered with
    `keras.saving.register_keras_serializable`, is saved by Keras. Any other callable (a lambda, a closure, an
    unregistered function) could not be loaded back: refused, rather than
    saved as a model that trains differently.

    Raises:
        ValueError: for a callable that Keras cannot load back.
    """
    if augment is None:
        return None
    if isinstance(augment, keras.layers.Layer) or _registered(augment):
        return keras.saving.serialize_keras_object(augment)
    raise ValueError(
        f"Cannot save a model made private with augment={augment!r}: a"
        " .keras file can hold a Keras layer (e.g. keras.Sequential of"
        " preprocessing layers) or a function registered with"
        " @keras.saving.register_keras_serializable(), not this callable, and"
        " the loaded model would not augment. Pass one of those, or save the"
        " weights only (model.save_weights, ModelCheckpoint with"
        " save_weights_only=True)."
    )


def _registered(augment):
    """Whether Keras can load `augment` back by its registered name."""
    target = augment if inspect.isfunction(augment) else type(augment)
    if not inspect.isfunction(augment) and not hasattr(augment, "get_config"):
        return False
    name = keras.saving.get_registered_name(target)
    return keras.saving.get_registered_object(name) is target


def deserialize(config, custom_objects=None):
    """The inverse of `serialize`."""
    if config is None:
        return None
    return keras.saving.deserialize_keras_object(
        config, custom_objects=custom_objects
    )
