"""Layers for DP training that normalize each example on its own.

`WSConv2D`: a Conv2D with weight standardization (Qiao et al. 2019), which
De et al. 2022 ("Unlocking High-Accuracy Differentially Private Image
Classification through Scale") pair with GroupNormalization in place of
BatchNormalization. The standardization is a function of the weights only,
so an example's gradient depends on that example alone; ghost clipping has
an exact rule for it (`ghost_clipping/standardized.py`).
"""

import typing

import keras


def standardize_kernel(kernel: typing.Any, epsilon: float) -> typing.Any:
    """Each output channel's weights (the last axis) minus their mean,
    divided by sqrt(their variance + epsilon) (the variance over the
    channel's n weights, divided by n)."""
    axes = tuple(range(len(kernel.shape) - 1))
    mean = keras.ops.mean(kernel, axis=axes, keepdims=True)
    variance = keras.ops.var(kernel, axis=axes, keepdims=True)
    return (kernel - mean) * keras.ops.rsqrt(variance + epsilon)


@keras.saving.register_keras_serializable(package="tf_dpadam")
class WSConv2D(keras.layers.Conv2D):
    """A Conv2D whose kernel is standardized per output channel in each call:
    `standardize_kernel(kernel, standardization_epsilon)`.

    The trained variable is the raw kernel; the bias (if any) is added after
    the convolution as usual.
    """

    def __init__(
        self,
        *args: typing.Any,
        standardization_epsilon: float = 1e-5,
        **kwargs: typing.Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not standardization_epsilon > 0:
            raise ValueError(
                "Expected standardization_epsilon > 0, got"
                f" {standardization_epsilon!r}.")
        self.standardization_epsilon = standardization_epsilon

    def convolution_op(self, inputs, kernel):
        return super().convolution_op(
            inputs, standardize_kernel(kernel, self.standardization_epsilon))

    def get_config(self):
        return {**super().get_config(),
                "standardization_epsilon": self.standardization_epsilon}
