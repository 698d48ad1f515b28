"""Ghost clipping of Dense and EinsumDense against explicit clipping."""

import keras
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer.ghost_clipping import dense

import helpers


class DenseTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(
        ("2d", (5,), True, "tanh", False),
        ("2d_no_bias", (5,), False, None, False),
        ("3d", (4, 5), True, "relu", False),
        ("3d_no_bias_jit", (4, 5), False, "tanh", True),
        ("4d", (2, 3, 5), True, None, False),
    )
    @pytest.mark.slow
    def test_dense(self, input_shape, use_bias, activation, jit):
        model = helpers.sequential(
            input_shape,
            keras.layers.Dense(6, use_bias=use_bias, activation=activation,
                               name="dense"),
            # Named: Keras' automatic name of a first Dense is "dense" too.
            keras.layers.Dense(3, name="head"),
        )
        x = helpers.normal((helpers.BATCH, *input_shape))
        y = helpers.normal((helpers.BATCH, *input_shape[:-1], 3), seed=1)
        self.assert_kinds(model, dense="ghost")
        self.assert_lockstep(model, x, y, jit=jit)

    @pytest.mark.slow
    def test_dense_long_sequence_uses_ghost_norm(self):
        # T^2 = 400 < d p = 32 * 24: the ghost norm, not materialized.
        model = helpers.sequential(
            (20, 32), keras.layers.Dense(24, activation="tanh"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
        )
        x, y = helpers.normal((helpers.BATCH, 20, 32)), helpers.normal((helpers.BATCH, 2), seed=1)
        self.assert_lockstep(model, x, y)
        self.assert_lockstep(model, x, y, jit=True)


class EinsumDenseTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(
        ("matrix", "ab,bc->ac", (5,), 4, "c"),
        ("sequence", "abc,cd->abd", (3, 5), (3, 4), "d"),
        ("heads", "abc,cde->abde", (3, 5), (3, 2, 4), "de"),
        ("merge_heads", "abcd,cde->abe", (3, 2, 4), (3, 5), "e"),
        ("position_bias", "abc,cd->abd", (3, 5), (3, 4), "bd"),
        ("ellipsis", "...b,bc->...c", (3, 5), 4, "c"),
        ("no_bias", "abc,dc->abd", (3, 5), (3, 4), None),
    )
    @pytest.mark.slow
    def test_einsum_dense(self, equation, input_shape, output_shape, bias):
        layer = keras.layers.EinsumDense(
            equation, output_shape, bias_axes=bias, activation="tanh",
            name="einsum_dense",
        )
        model = helpers.sequential(input_shape, layer, keras.layers.Flatten(),
                            keras.layers.Dense(3))
        x, y = helpers.normal((helpers.BATCH, *input_shape)), helpers.normal((helpers.BATCH, 3), seed=1)
        self.assert_kinds(model, einsum_dense="ghost")
        self.assert_lockstep(model, x, y)


class ParseEinsumTest(parameterized.TestCase):
    """Which EinsumDense equations the rule takes, and why it refuses."""

    @parameterized.parameters(
        ("ab,bc->ac", ("ab", "bc", "ac", False)),
        ("abc,cde->abde", ("abc", "cde", "abde", False)),
        ("...b,bc->...c", ("...b", "bc", "...c", True)),
        ("ab...,bc->ac...", ("ab...", "bc", "ac...", False)),
    )
    def test_accepted(self, equation, parsed):
        self.assertEqual(dense.parse_einsum(equation), parsed)

    @parameterized.parameters(
        ("ab,bc->abc", "neither only contracted nor only an output index"),
        ("abc,bd->ad", "summed without the kernel"),
        ("ab,bc->acd", "output index 'd' is unknown"),
        ("ab,ac->bc", "the batch axis must lead"),
        ("aab,bc->ac", "repeated index"),
        ("ab,...b->a...", "unsupported ellipsis"),
    )
    def test_refused(self, equation, reason):
        with self.assertRaisesRegex(ValueError, reason):
            dense.parse_einsum(equation)
        layer = keras.layers.EinsumDense(equation, 4)
        self.assertIn(reason, dense.EinsumDenseRule.refusal(layer))


if __name__ == "__main__":
    absltest.main()
