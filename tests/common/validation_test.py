"""src/tf_dpadam/common/validation.py: each check's accepted values and exact message.

The messages are matched whole: users and other tests rely on them.
"""

import math

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.common import validation


class PredicatesTest(absltest.TestCase):

    def test_is_int_and_is_real(self):
        for value in (3, np.int64(3), np.int32(-1)):
            self.assertTrue(validation.is_int(value), msg=repr(value))
            self.assertTrue(validation.is_real(value), msg=repr(value))
        for value in (2.5, np.float32(0.5), math.inf):
            self.assertFalse(validation.is_int(value), msg=repr(value))
            self.assertTrue(validation.is_real(value), msg=repr(value))
        for value in (True, False, "1", None, 1j):
            self.assertFalse(validation.is_int(value), msg=repr(value))
            self.assertFalse(validation.is_real(value), msg=repr(value))

    def test_check_formats_the_message(self):
        validation.check(True, "x", -1, "> 0")
        with self.assertRaises(ValueError) as raised:
            validation.check(False, "name", "v", "to be good")
        self.assertEqual(str(raised.exception),
                         "Expected name='v' to be good.")


# (check, args, message); `None` as message: the arguments pass.
_CASES = (
    # Hyperparameters: one message naming the whole expectation.
    ("positive", ("epsilon", 1e-7), None),
    ("positive", ("epsilon", 0.0),
     "Expected epsilon=0.0 to be a finite number > 0."),
    ("positive", ("epsilon", math.inf),
     "Expected epsilon=inf to be a finite number > 0."),
    ("positive", ("epsilon", True),
     "Expected epsilon=True to be a finite number > 0."),
    ("non_negative", ("momentum", 0), None),
    ("non_negative", ("momentum", -0.5),
     "Expected momentum=-0.5 to be a finite number >= 0."),
    ("non_negative", ("momentum", math.nan),
     "Expected momentum=nan to be a finite number >= 0."),
    ("beta", ("beta_1", 0.0), None),
    ("beta", ("beta_2", 1.0), "Expected beta_2=1.0 to be in [0, 1)."),
    ("beta", ("beta_1", "0.9"), "Expected beta_1='0.9' to be in [0, 1)."),
    # Data pipeline counts: one message; NumPy ints (and, as ever, bools)
    # pass.
    ("count", ("physical_batch_size", np.int64(8)), None),
    ("count", ("physical_batch_size", True), None),
    ("count", ("expected_batch_size", 0),
     "Expected expected_batch_size=0 to be an int > 0."),
    ("count", ("expected_batch_size", 4.0),
     "Expected expected_batch_size=4.0 to be an int > 0."),
    # Accounting: the type first, then the range.
    ("positive_int", ("num_examples", 10), None),
    ("positive_int", ("num_examples", 1.5),
     "Expected num_examples=1.5 to be an integer."),
    ("positive_int", ("num_examples", True),
     "Expected num_examples=True to be an integer."),
    ("positive_int", ("num_examples", 0), "Expected num_examples=0 > 0."),
    ("positive_real", ("noise_multiplier", 0.5), None),
    ("positive_real", ("noise_multiplier", "1"),
     "Expected noise_multiplier='1' to be a real number."),
    ("positive_real", ("noise_multiplier", -0.5),
     "Expected noise_multiplier=-0.5 > 0."),
    ("positive_real", ("target_epsilon", math.inf),
     "Expected target_epsilon=inf > 0."),
    ("sizes", ("n", 100, 100), None),
    ("sizes", ("n", 0, 1), "Expected n=0 > 0."),
    ("sizes", ("num_examples", 10, 0), "Expected batch_size=0 > 0."),
    ("sizes", ("num_examples", 5, 6),
     "Expected batch_size=6 <= num_examples=5 (the sampling rate batch_size"
     " / num_examples must be at most 1)."),
    ("delta", (1e-5,), None),
    ("delta", (None,), "Expected delta=None to be a real number."),
    ("delta", (1.0,), "Expected delta=1.0 in (0, 1)."),
    ("steps", (0,), None),
    ("steps", (1.5,), "Expected steps=1.5 to be an integer."),
    ("steps", (-1,), "Expected steps=-1 >= 0."),
    ("epochs", (0.5,), None),
    ("epochs", ("1",), "Expected epochs='1' to be a real number."),
    ("epochs", (-2.0, "num_epochs"), "Expected num_epochs=-2.0 >= 0."),
    ("epochs", (math.inf,), "Expected epochs=inf >= 0."),
    # An accountant's name: tests/accounting/accountants_test.py.
)


class ChecksTest(parameterized.TestCase):

    @parameterized.parameters(*_CASES)
    def test_check(self, check, args, message):
        function = getattr(validation, "check_" + check)
        if message is None:
            self.assertIsNone(function(*args))
            return
        with self.assertRaises(ValueError) as raised:
            function(*args)
        self.assertEqual(str(raised.exception), message)


class LearningRateTest(parameterized.TestCase):
    """Issue 34: a learning rate is checked like the other hyperparameters."""

    @parameterized.parameters(0, 0.0, 1e-3, 4, np.float32(0.5))
    def test_finite_non_negative_numbers_pass(self, value):
        validation.check_learning_rate(value)

    @parameterized.parameters(float("nan"), float("inf"), -0.1, -1,
                              np.float64("nan"))
    def test_nan_infinite_or_negative_raise(self, value):
        with self.assertRaises(ValueError) as raised:
            validation.check_learning_rate(value)
        self.assertEqual(
            str(raised.exception),
            f"Expected learning_rate={value!r} to be a finite number >= 0"
            " (or a LearningRateSchedule or a callable).")

    def test_schedules_and_callables_are_left_to_keras(self):
        validation.check_learning_rate(lambda: 0.1)
        validation.check_learning_rate(object())


class LargeDeltaTest(parameterized.TestCase):

    def test_message_names_delta_and_n(self):
        self.assertEqual(
            validation.large_delta_message(0.05, 100),
            "delta=0.05 >= 1/N = 0.01: an (epsilon, delta) guarantee with"
            " delta >= 1/N allows releasing an example outright; use delta"
            " well below 1/N (N = 100 examples).")

    @parameterized.parameters((0.01, 100, True), (0.0099, 100, False),
                              (0.5, 3, True), (1e-5, 60000, False),
                              (1 / 60000, 60000, True))
    def test_boundary_is_one_over_n(self, delta, n, warns):
        self.assertEqual(validation.large_delta_message(delta, n) is not None,
                         warns)



class PlainTextTest(absltest.TestCase):

    def test_keras_call_errors_keep_their_bold_message_only(self):
        # As Keras 3 words an error raised inside a layer's call.
        error = ValueError(
            "Exception encountered when calling Sequential.call().\n\n"
            "\x1b[1mInput 0 is incompatible:\n shape (4, 5)\x1b[0m\n\n"
            "Arguments received by Sequential.call():\n  • inputs=...")
        self.assertEqual(validation.plain_text(error),
                         "Input 0 is incompatible: shape (4, 5)")
        self.assertEqual(validation.plain_text(
            ValueError("two\n  lines \x1b[31mred\x1b[0m")), "two lines red")


if __name__ == "__main__":
    absltest.main()
