"""Tests of the tf_dpadam.accounting package: argument validation, no TensorFlow import."""

import ast
import math
import os
import re

from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam import accounting
from tf_dpadam.accounting import epsilon as accounting_epsilon

DELTA = 1e-5

_N = dict(num_examples=1000, batch_size=10)
_GOOD = dict(noise_multiplier=1.0, delta=DELTA)


class ValidationTest(parameterized.TestCase):

    @parameterized.named_parameters(
        # compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta)
        ("n", "compute_dp_sgd_privacy", (0, 10, 1.0, 1, DELTA), "n=0 > 0"),
        ("n_float", "compute_dp_sgd_privacy", (100.5, 10, 1.0, 1, DELTA),
         "n=100.5 to be an integer"),
        ("b_zero", "compute_dp_sgd_privacy", (100, 0, 1.0, 1, DELTA),
         "batch_size=0 > 0"),
        ("b_over_n", "compute_dp_sgd_privacy", (100, 101, 1.0, 1, DELTA),
         "batch_size=101 <= n=100"),
        ("sigma", "compute_dp_sgd_privacy", (100, 10, -0.5, 1, DELTA),
         "Expected noise_multiplier=-0.5 > 0."),
        ("epochs", "compute_dp_sgd_privacy", (100, 10, 1.0, -1, DELTA),
         "epochs=-1 >= 0"),
        ("delta_zero", "compute_dp_sgd_privacy", (100, 10, 1.0, 1, 0.0),
         "delta=0.0 in (0, 1)"),
        ("delta_one", "compute_dp_sgd_privacy", (100, 10, 1.0, 1, 1.0),
         "delta=1.0 in (0, 1)"),
        ("statement_n", "compute_dp_sgd_privacy_statement",
         (0, 10, 1, 1.0, DELTA), "number_of_examples=0 > 0"),
        ("statement_sigma", "compute_dp_sgd_privacy_statement",
         (100, 10, 1, 0.0, DELTA), "noise_multiplier=0.0 > 0"),
        ("statement_epochs", "compute_dp_sgd_privacy_statement",
         (100, 10, -2.0, 1.0, DELTA), "num_epochs=-2.0 >= 0"),
        ("statement_delta", "compute_dp_sgd_privacy_statement",
         (100, 10, 1, 1.0, 2.0), "delta=2.0 in (0, 1)"),
        ("statement_user", "compute_dp_sgd_privacy_statement",
         (100, 10, 1, 1.0, DELTA, False, 0), "max_examples_per_user=0 > 0"),
    )
    def test_positional(self, function, args, message):
        with self.assertRaisesRegex(ValueError, re.escape(message)):
            getattr(accounting, function)(*args)

    @parameterized.named_parameters(
        ("eps_steps", "epsilon_after_steps", dict(steps=-1, **_N, **_GOOD),
         "steps=-1 >= 0"),
        ("eps_steps_float", "epsilon_after_steps",
         dict(steps=1.5, **_N, **_GOOD), "steps=1.5 to be an integer"),
        ("eps_n", "epsilon_after_steps",
         dict(steps=1, num_examples=-5, batch_size=1, **_GOOD),
         "num_examples=-5 > 0"),
        ("eps_b", "epsilon_after_steps",
         dict(steps=1, num_examples=5, batch_size=6, **_GOOD),
         "batch_size=6 <= num_examples=5"),
        ("eps_sigma", "epsilon_after_steps",
         dict(steps=1, **_N, noise_multiplier=0.0, delta=DELTA),
         "noise_multiplier=0.0 > 0"),
        ("eps_sigma_nan", "epsilon_after_steps",
         dict(steps=1, **_N, noise_multiplier=math.nan, delta=DELTA),
         "noise_multiplier=nan > 0"),
        ("eps_delta", "epsilon_after_steps",
         dict(steps=1, **_N, noise_multiplier=1.0, delta=-1e-5),
         "delta=-1e-05 in (0, 1)"),
        ("eps_accountant", "epsilon_after_steps",
         dict(steps=1, **_N, **_GOOD, accountant="prv"),
         "accountant='prv' in ('rdp', 'pld')"),
        ("steps_target", "calibrate_steps",
         dict(target_epsilon=0.0, **_N, **_GOOD), "target_epsilon=0.0 > 0"),
        ("steps_target_neg", "calibrate_steps",
         dict(target_epsilon=-1, **_N, **_GOOD), "target_epsilon=-1 > 0"),
        ("steps_sigma", "calibrate_steps",
         dict(target_epsilon=1.0, **_N, noise_multiplier=-1.0, delta=DELTA),
         "noise_multiplier=-1.0 > 0"),
        ("steps_b", "calibrate_steps",
         dict(target_epsilon=1.0, num_examples=10, batch_size=0, **_GOOD),
         "batch_size=0 > 0"),
        ("steps_delta", "calibrate_steps",
         dict(target_epsilon=1.0, **_N, noise_multiplier=1.0, delta=1.5),
         "delta=1.5 in (0, 1)"),
        ("steps_accountant", "calibrate_steps",
         dict(target_epsilon=1.0, **_N, **_GOOD, accountant="RDP"),
         "accountant='RDP'"),
        ("sigma_both", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, epochs=1, steps=10, delta=DELTA),
         "exactly one of epochs=1 and steps=10"),
        ("sigma_neither", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, delta=DELTA),
         "exactly one of epochs=None and steps=None"),
        ("sigma_epochs", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, epochs=-1.0, delta=DELTA),
         "epochs=-1.0 >= 0"),
        ("sigma_epochs_zero", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, epochs=0, delta=DELTA), "epochs=0 > 0"),
        ("sigma_steps", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, steps=-3, delta=DELTA),
         "steps=-3 >= 0"),
        ("sigma_steps_zero", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, steps=0, delta=DELTA), "steps=0 > 0"),
        ("sigma_target", "calibrate_noise_multiplier",
         dict(target_epsilon=0, **_N, steps=10, delta=DELTA),
         "target_epsilon=0 > 0"),
        ("sigma_n", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, num_examples=0, batch_size=1, steps=10,
              delta=DELTA), "num_examples=0 > 0"),
        ("sigma_delta", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, steps=10, delta=0),
         "delta=0 in (0, 1)"),
        ("sigma_accountant", "calibrate_noise_multiplier",
         dict(target_epsilon=1.0, **_N, steps=10, delta=DELTA, accountant=""),
         "accountant=''"),
    )
    def test_keyword(self, function, kwargs, message):
        with self.assertRaisesRegex(ValueError, re.escape(message)):
            getattr(accounting, function)(**kwargs)

    @parameterized.parameters(
        "epsilon_after_steps", "calibrate_steps", "calibrate_noise_multiplier"
    )
    def test_keyword_only(self, function):
        with self.assertRaises(TypeError):
            getattr(accounting, function)(1.0, 1000, 10, 1.0, DELTA)


class NoTensorFlowTest(parameterized.TestCase):

    @parameterized.parameters(
        "accounting/__init__.py", "accounting/accountants.py",
        "accounting/epsilon.py",
        "accounting/calibration.py", "accounting/statement.py",
        "accounting/cli.py", "common/validation.py",
        "common/command_line.py",
    )
    def test_module_does_not_import_tensorflow(self, filename):
        package = os.path.dirname(os.path.dirname(os.path.abspath(
            accounting_epsilon.__file__)))
        with open(os.path.join(package, filename), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.update(
                    f"{node.module}.{alias.name}" for alias in node.names
                )
        self.assertNotEmpty(imported)
        for name in imported:
            root = name.split(".")[0]
            self.assertNotIn(root, ("tensorflow", "keras"), msg=name)
            if root == "tf_dpadam":
                self.assertRegex(
                    name,
                    r"^tf_dpadam\.(accounting|common\.validation"
                    r"|common\.command_line)\b",
                )

if __name__ == "__main__":
    absltest.main()
