"""Tests of `tf_dpadam.independence.rows`: the pure helpers of the
independence check and the tolerance that decides "unchanged".

The check itself is tested on zoos of mixing and non-mixing models in
sensitivity_zoo_test, guard_misses_test, guard_corpus_test and
independence_guard_test.
"""

import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.training import independence
from tf_dpadam.training.independence import rows


class RowsTest(parameterized.TestCase):

    def test_the_package_re_exports_the_helpers(self):
        for name in ("change_of_rows", "copies_of_row", "has_distinct_row",
                     "num_rows", "relative_tolerance", "ROUNDING_ULPS",
                     "ABSOLUTE_TOLERANCE"):
            self.assertIs(getattr(independence, name), getattr(rows, name))

    def test_num_rows_reads_the_first_leaf(self):
        x = {"a": np.zeros((5, 2)), "b": np.zeros((5,))}
        self.assertEqual(rows.num_rows(x), 5)

    def test_copies_of_row_dense_ragged_sparse_and_none(self):
        dense = np.array([[0.0], [1.0], [2.0]])
        ragged = tf.ragged.constant([[1], [2, 3], [4, 5, 6]])
        sparse = tf.sparse.from_dense(tf.constant([[0, 1], [2, 0], [0, 3]]))
        out = rows.copies_of_row((dense, ragged, None, sparse), 2)
        np.testing.assert_array_equal(out[0], [[2.0], [2.0], [2.0]])
        self.assertEqual(out[1].to_list(), [[4, 5, 6]] * 3)
        self.assertIsNone(out[2])
        np.testing.assert_array_equal(tf.sparse.to_dense(out[3]),
                                      [[0, 3]] * 3)

    def test_has_distinct_row(self):
        x = np.array([[1.0], [1.0], [2.0]])
        self.assertTrue(rows.has_distinct_row(x, 0))
        self.assertFalse(rows.has_distinct_row(x[:2], 0))
        # A difference in any leaf counts, ragged ones too.
        labels = tf.ragged.constant([[1], [1, 2], [1]])
        self.assertTrue(rows.has_distinct_row((x[:2], labels[:2]), 0))

    @parameterized.parameters(("float16", 2.0 ** -10),
                              ("bfloat16", 2.0 ** -7),
                              ("float32", 2.0 ** -23),
                              ("float64", 2.0 ** -52))
    def test_relative_tolerance_is_units_in_the_last_place(self, dtype, eps):
        if dtype != "bfloat16":  # NumPy's own, independently.
            self.assertEqual(eps, float(np.finfo(dtype).eps))
        self.assertEqual(rows.relative_tolerance(dtype),
                         rows.ROUNDING_ULPS * eps)
        self.assertEqual(rows.relative_tolerance("int32"),
                         rows.relative_tolerance("float32"))

    def test_change_of_rows_in_units_of_the_tolerance(self):
        a = np.arange(12.0).reshape(4, 3)
        b = a.copy()
        b[1] += 100.0  # not a compared row
        self.assertEqual(rows.change_of_rows(a, b, [3]), 0.0)
        # Scale of row 3: max |a| = 11; twice the tolerance.
        b[3, 0] += 11.0 * rows.relative_tolerance("float64") * 2
        self.assertAlmostEqual(rows.change_of_rows(a, b, [3]), 2.0,
                               places=3)

    def test_change_of_rows_nan_inf_and_shapes(self):
        a = np.array([[np.nan], [np.inf]])
        self.assertEqual(rows.change_of_rows(a, a.copy(), [0, 1]), 0.0)
        b = np.array([[1.0], [np.inf]])  # NaN -> number: changed
        self.assertEqual(rows.change_of_rows(a, b, [0]), float("inf"))
        self.assertEqual(
            rows.change_of_rows(np.zeros((2, 1)), np.zeros((3, 1)), [0]),
            float("inf"))

    def test_example_rows_with_augmult(self):
        self.assertEqual(rows.example_rows(0, 1), [0])
        self.assertEqual(rows.example_rows(2, 3), [6, 7, 8])


if __name__ == "__main__":
    absltest.main()
