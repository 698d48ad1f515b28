"""Ghost clipping of LayerNormalization and GroupNormalization against
explicit clipping."""

import keras
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import helpers


class LayerNormalizationTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(
        ("last_axis", {}, (4, 6)),
        ("two_axes", {"axis": [-2, -1]}, (4, 6)),
        ("middle_axis", {"axis": 1}, (4, 6)),
        ("scale_only", {"center": False}, (4, 6)),
        ("center_only", {"scale": False}, (4, 6)),
        ("2d", {}, (6,)),
    )
    def test_layer_normalization(self, kwargs, input_shape):
        keras.utils.set_random_seed(0)
        norm = keras.layers.LayerNormalization(
            gamma_initializer="random_normal", beta_initializer="random_normal",
            name="layer_normalization", **kwargs,
        )
        model = helpers.sequential(input_shape, keras.layers.Dense(6), norm,
                            keras.layers.Flatten(), keras.layers.Dense(3))
        x, y = helpers.normal((helpers.BATCH, *input_shape)), helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, layer_normalization="ghost")
        self.assert_lockstep(model, x, y)

    @parameterized.named_parameters(
        ("image", {}, (5, 4, 6), False),
        ("sequence", {"groups": 3}, (4, 6), False),
        ("one_group", {"groups": 1}, (4, 6), False),
        ("channels_first", {"axis": 1}, (6, 5, 4), False),
        ("scale_only", {"center": False}, (5, 4, 6), False),
        ("center_only", {"scale": False}, (5, 4, 6), False),
        ("image_jit", {}, (5, 4, 6), True),
    )
    @pytest.mark.slow
    def test_group_normalization(self, kwargs, input_shape, jit):
        keras.utils.set_random_seed(0)
        kwargs = {"groups": 2, **kwargs}
        norm = keras.layers.GroupNormalization(
            gamma_initializer="random_normal", beta_initializer="random_normal",
            name="group_normalization", **kwargs,
        )
        # A Dense before it (channels last) so its input varies per example.
        model = helpers.sequential(
            input_shape, keras.layers.Dense(input_shape[-1]), norm,
            keras.layers.Flatten(), keras.layers.Dense(3))
        x = helpers.normal((helpers.BATCH, *input_shape))
        y = helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, group_normalization="ghost")
        self.assert_lockstep(model, x, y, jit=jit)


if __name__ == "__main__":
    absltest.main()
