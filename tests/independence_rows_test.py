"""Tests of `tf_dpadam.independence.rows`: the pure helpers of the
independence check and the tolerance that decides "unchanged".

The check itself (`model_check`, `loss_check`, `guard`) is tested on a zoo
of mixing and non-mixing models in sensitivity_zoo_test.
"""

import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam import independence
from tf_dpadam.independence import rows


class RowsTest(parameterized.TestCase):

    def test_the_package_re_exports_the_helpers(self):
        for name in ("change_of_other_rows", "distinct_row", "num_rows",
                     "relative_tolerance", "replace_row", "replace_rows",
                     "RELATIVE_TOLERANCE", "ABSOLUTE_TOLERANCE"):
            self.assertIs(getattr(independence, name), getattr(rows, name))

    def test_num_rows_reads_the_first_leaf(self):
        x = {"a": np.zeros((5, 2)), "b": np.zeros((5,))}
        self.assertEqual(rows.num_rows(x), 5)

    def test_replace_row_dense_ragged_and_none(self):
        dense = np.array([[0.0], [1.0], [2.0]])
        ragged = tf.ragged.constant([[1], [2, 3], [4, 5, 6]])
        out = rows.replace_row((dense, ragged, None), 0, 2)
        np.testing.assert_array_equal(out[0], [[2.0], [1.0], [2.0]])
        self.assertEqual(out[1].to_list(), [[4, 5, 6], [2, 3], [4, 5, 6]])
        self.assertIsNone(out[2])

    def test_replace_rows_in_order(self):
        x = np.arange(4.0)
        np.testing.assert_array_equal(
            rows.replace_rows(x, [0, 1], [3, 0]), [3.0, 3.0, 2.0, 3.0])

    def test_distinct_row(self):
        x = np.array([[1.0], [1.0], [2.0]])
        self.assertEqual(rows.distinct_row(x, 0), 2)
        self.assertIsNone(rows.distinct_row(x[:2], 0))
        # A difference in any leaf counts, ragged ones too.
        labels = tf.ragged.constant([[1], [1, 2], [1]])
        self.assertEqual(rows.distinct_row((x[:2], labels[:2]), 0), 1)

    @parameterized.parameters(
        ("float16", rows.LOW_PRECISION_RELATIVE_TOLERANCE),
        ("bfloat16", rows.LOW_PRECISION_RELATIVE_TOLERANCE),
        ("float32", rows.RELATIVE_TOLERANCE),
        ("float64", rows.RELATIVE_TOLERANCE),
        ("int32", rows.RELATIVE_TOLERANCE),
    )
    def test_relative_tolerance(self, dtype, expected):
        self.assertEqual(rows.relative_tolerance(dtype), expected)

    def test_change_of_other_rows_in_units_of_the_tolerance(self):
        a = np.arange(12.0).reshape(4, 3)  # scale max |a| = 11
        b = a.copy()
        b[1] += 100.0  # the replaced example: skipped
        self.assertEqual(rows.change_of_other_rows(a, b, [1]), 0.0)
        b[3, 0] += 11.0 * rows.RELATIVE_TOLERANCE * 2  # twice the tolerance
        self.assertAlmostEqual(rows.change_of_other_rows(a, b, [1]), 2.0,
                               places=3)

    def test_change_of_other_rows_nan_and_shapes(self):
        a = np.array([[np.nan], [1.0]])
        self.assertEqual(rows.change_of_other_rows(a, a.copy(), []), 0.0)
        b = np.array([[1.0], [1.0]])  # NaN -> number: changed
        self.assertEqual(rows.change_of_other_rows(a, b, []), float("inf"))
        self.assertEqual(
            rows.change_of_other_rows(np.zeros((2, 1)), np.zeros((3, 1)), []),
            float("inf"))

    def test_example_rows_with_augmult(self):
        self.assertEqual(rows.example_rows(0, 1), [0])
        self.assertEqual(rows.example_rows(2, 3), [6, 7, 8])


if __name__ == "__main__":
    absltest.main()
