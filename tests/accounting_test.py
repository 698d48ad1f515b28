"""Tests of tf_dpadam.accounting: epsilon, calibration and the statement."""

import ast
import contextlib
import io
import math
import os
import re

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting

from tf_dpadam import accounting
from tf_dpadam.accounting import epsilon as accounting_epsilon

DELTA = 1e-5

# A cheap setting for the PLD searches: q = 0.01, sigma = 1.
SMALL = dict(num_examples=10_000, batch_size=100, noise_multiplier=1.0)


def _eps(steps, accountant="rdp", **setting):
    return accounting.epsilon_after_steps(
        steps=steps, delta=DELTA, accountant=accountant, **setting
    )


class ComputeDpSgdPrivacyTest(parameterized.TestCase):

    # Golden values of tensorflow-privacy 0.9.0's compute_dp_sgd_privacy.
    # TF-Privacy's orders put only integers between 5 and 63, so the optimal
    # orders are integers and our values agree to about 1e-13; the order list
    # [1 + x / 10 for x in range(1, 100)] + ... would give (2.59666, 8.1) and
    # (1.55985, 9.7) instead, which the order assertion (and, for the second,
    # the tolerance) rejects.
    @parameterized.parameters(
        ((60000, 256, 1.1, 60, 1e-5), 2.597079519657094, 8.0),
        ((60000, 256, 1.0, 15, 1e-5), 1.5710682146464534, 10.0),
    )
    def test_tf_privacy_golden_values(self, args, epsilon, order):
        got_epsilon, got_order = accounting.compute_dp_sgd_privacy(*args)
        self.assertAlmostEqual(got_epsilon, epsilon, delta=1e-6 * epsilon)
        self.assertEqual(got_order, order)
        self.assertIsInstance(got_epsilon, float)
        self.assertIsInstance(got_order, float)

    def test_prints_nothing(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            accounting.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
        self.assertEqual(out.getvalue(), "")


class EpsilonAfterStepsTest(parameterized.TestCase):

    def test_opacus_published_value(self):
        # Opacus' published RDP example: sigma = 1.5, q = 0.04, 2,250 steps,
        # delta = 1e-5 -> epsilon 7.329. With our dense orders: 7.3285 (order
        # 3.9); with Opacus' default alphas, [1 + x / 10 for x in
        # range(1, 100)] + list(range(12, 64)): 7.3293.
        setting = dict(
            num_examples=60000, batch_size=2400, noise_multiplier=1.5
        )
        epsilon = _eps(2250, **setting)
        self.assertAlmostEqual(epsilon, 7.329, delta=0.005 * 7.329)

        opacus_alphas = [1 + x / 10.0 for x in range(1, 100)] + list(
            range(12, 64)
        )
        rdp = dp_accounting.rdp.RdpAccountant(opacus_alphas)
        rdp.compose(accounting.dp_sgd_event(0.04, 1.5, 2250))
        self.assertAlmostEqual(rdp.get_epsilon(DELTA), 7.329, delta=1e-3)
        # A denser list of orders can only help.
        self.assertLessEqual(epsilon, rdp.get_epsilon(DELTA))
        # PLD is tighter than RDP here.
        self.assertLess(_eps(2250, "pld", **setting), epsilon)

    @parameterized.parameters(1, 7, 548, 100_000)
    def test_rdp_equals_accountant_on_the_composed_event(self, steps):
        # The scaled one-step curve must give exactly what the RdpAccountant
        # gives for SelfComposedDpEvent(PoissonSampledDpEvent(...), T).
        accountant = dp_accounting.rdp.RdpAccountant(
            list(accounting.RDP_ORDERS)
        )
        accountant.compose(accounting.dp_sgd_event(2048 / 50000, 1.0, steps))
        expected = accountant.get_epsilon(DELTA)
        got = _eps(
            steps, num_examples=50000, batch_size=2048, noise_multiplier=1.0
        )
        self.assertEqual(got, expected)

    def test_pld_equals_accountant_on_the_composed_event(self):
        accountant = dp_accounting.pld.PLDAccountant(
            value_discretization_interval=(
                accounting.PLD_VALUE_DISCRETIZATION_INTERVAL
            )
        )
        accountant.compose(accounting.dp_sgd_event(0.01, 1.0, 300))
        self.assertEqual(
            _eps(300, "pld", **SMALL), accountant.get_epsilon(DELTA)
        )

    @parameterized.parameters("rdp", "pld")
    def test_zero_steps_and_monotone(self, accountant):
        self.assertEqual(_eps(0, accountant, **SMALL), 0.0)
        values = [_eps(t, accountant, **SMALL) for t in (1, 10, 100)]
        self.assertEqual(values, sorted(values))
        self.assertGreater(values[0], 0.0)

    def test_steps_for_epochs(self):
        self.assertEqual(accounting.steps_for_epochs(60, 60000, 256), 14063)
        self.assertEqual(accounting.steps_for_epochs(1, 60000, 60000), 1)
        self.assertEqual(accounting.steps_for_epochs(0, 100, 10), 0)
        # 0.1 * 3000 / 100 = 3.0000000000000004 in floating point.
        self.assertEqual(accounting.steps_for_epochs(0.1, 3000, 100), 3)
        self.assertEqual(accounting.steps_for_epochs(0.25, 1000, 100), 3)

    def test_training_steps_from_epochs_or_steps(self):
        sizes = dict(num_examples=60000, batch_size=256)
        self.assertEqual(accounting.training_steps(epochs=60, **sizes), 14063)
        self.assertEqual(accounting.training_steps(steps=7, **sizes), 7)
        for kwargs, message in (
            (dict(), "exactly one of epochs=None and steps=None"),
            (dict(epochs=1, steps=2), "exactly one of epochs=1 and steps=2"),
            (dict(epochs=0), "Expected epochs=0 > 0."),
            (dict(steps=0), "Expected steps=0 > 0."),
            (dict(steps=1.5), "Expected steps=1.5 to be an integer."),
        ):
            with self.assertRaisesRegex(ValueError, re.escape(message)):
                accounting.training_steps(**kwargs, **sizes)


class CalibrateStepsTest(parameterized.TestCase):

    def _assert_bracket(self, steps, target, accountant, **setting):
        self.assertIsInstance(steps, int)
        self.assertGreaterEqual(steps, 1)
        self.assertLessEqual(_eps(steps, accountant, **setting), target)
        self.assertGreater(_eps(steps + 1, accountant, **setting), target)

    @parameterized.product(accountant=["rdp", "pld"], target=[1.0, 3.0])
    def test_brackets_exactly(self, accountant, target):
        steps = accounting.calibrate_steps(
            target_epsilon=target, delta=DELTA, accountant=accountant, **SMALL
        )
        self._assert_bracket(steps, target, accountant, **SMALL)

    def test_target_equal_to_an_epsilon_is_inclusive(self):
        steps = accounting.calibrate_steps(
            target_epsilon=_eps(37, **SMALL), delta=DELTA, accountant="rdp",
            **SMALL
        )
        self.assertEqual(steps, 37)

    # The paper's settings (Tang & Lecuyer), delta = 1e-5, target epsilon 7.
    # Values obtained with dp-accounting 0.6.0:
    #   CIFAR-10 (N=50,000, B=2048, sigma=1):   RDP T = 548  (22.4 epochs),
    #                                            PLD T = 664  (27.2 epochs);
    #   SNLI (N=550,152, B=256, sigma=0.4):     RDP T = 1320 (0.61 epochs),
    #                                            PLD T = 5468 (2.54 epochs).
    # Only the RDP searches run here (the PLD ones take a few seconds each).
    @parameterized.named_parameters(
        ("cifar10", 50_000, 2048, 1.0, 400, 700),
        ("snli", 550_152, 256, 0.4, 1000, 1700),
    )
    def test_paper_settings(self, n, batch_size, sigma, low, high):
        setting = dict(
            num_examples=n, batch_size=batch_size, noise_multiplier=sigma
        )
        steps = accounting.calibrate_steps(
            target_epsilon=7.0, delta=DELTA, accountant="rdp", **setting
        )
        self._assert_bracket(steps, 7.0, "rdp", **setting)
        self.assertBetween(steps, low, high)

    @parameterized.parameters("rdp", "pld")
    def test_one_step_over_target_raises(self, accountant):
        smallest = _eps(1, accountant, **SMALL)
        with self.assertRaisesRegex(
            ValueError, re.escape(f"target_epsilon=0.001 >= {smallest!r}")
        ):
            accounting.calibrate_steps(
                target_epsilon=0.001,
                delta=DELTA,
                accountant=accountant,
                **SMALL,
            )


class CalibrateNoiseMultiplierTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("rdp_epochs_small_sigma", "rdp", dict(epochs=3), 8.0),
        ("rdp_steps_large_sigma", "rdp", dict(steps=1000), 0.3),
        ("pld_steps", "pld", dict(steps=300), 1.0),
    )
    def test_meets_target_and_one_percent_less_does_not(
        self, accountant, length, target
    ):
        setting = dict(num_examples=10_000, batch_size=100)
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=target, delta=DELTA, accountant=accountant,
            **length, **setting,
        )
        steps = length.get("steps") or accounting.steps_for_epochs(
            length["epochs"], **setting
        )

        def eps(s):
            return _eps(steps, accountant, noise_multiplier=s, **setting)

        self.assertLessEqual(eps(sigma), target)
        self.assertGreater(eps(0.99 * sigma), target)

    def test_prints_and_logs_nothing(self):
        # Probing sigma = 0.5 at q = 0.04 makes dp-accounting's series for
        # a few low fractional orders fail to converge; it excludes those
        # orders and would log one warning per order.
        accounting_epsilon.rdp_one_step.cache_clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertNoLogs(
            "absl", level="WARNING"
        ):
            sigma = accounting.calibrate_noise_multiplier(
                target_epsilon=7.0, num_examples=50_000, batch_size=2048,
                epochs=20, delta=DELTA, accountant="rdp",
            )
        self.assertEqual(out.getvalue(), "")
        self.assertBetween(sigma, 0.9, 1.0)

    def test_epochs_and_steps_agree(self):
        common = dict(
            target_epsilon=2.0, num_examples=60000, batch_size=256, delta=DELTA,
            accountant="rdp",
        )
        self.assertEqual(
            accounting.calibrate_noise_multiplier(epochs=60, **common),
            accounting.calibrate_noise_multiplier(steps=14063, **common),
        )


class StatementTest(absltest.TestCase):

    def test_contents(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            text = accounting.compute_dp_sgd_privacy_statement(
                number_of_examples=60000,
                batch_size=256,
                num_epochs=60,
                noise_multiplier=1.1,
                delta=1e-5,
            )
        self.assertEqual(out.getvalue(), "")
        setting = dict(num_examples=60000, batch_size=256, noise_multiplier=1.1)
        rdp = _eps(14063, "rdp", **setting)
        pld = _eps(14063, "pld", **setting)
        self.assertIn("14063 steps", text)
        self.assertIn("q = 0.004267", text)
        self.assertIn("Poisson sampling", text)
        self.assertIn("adding or removing one example", text)
        self.assertIn("per example", text)
        self.assertIn("delta = 1e-05", text)
        self.assertIn(f"epsilon = {rdp:.4g} (RDP", text)
        self.assertIn(f"epsilon = {pld:.4g} (PLD", text)
        self.assertNotIn("User-level", text)
        self.assertGreater(len(text.splitlines()), 5)

    def test_microbatching_doubles_the_sensitivity(self):
        text = accounting.compute_dp_sgd_privacy_statement(
            10_000, 100, 3, 2.0, 1e-5, used_microbatching=True
        )
        halved = _eps(
            300, num_examples=10_000, batch_size=100, noise_multiplier=1.0
        )
        self.assertIn(f"epsilon = {halved:.4g} (RDP", text)
        self.assertIn("with microbatching", text)

    def test_user_level(self):
        def user_epsilon(k):
            text = accounting.compute_dp_sgd_privacy_statement(
                10_000, 100, 3, 2.0, 1e-5, max_examples_per_user=k
            )
            match = re.search(r"User-level.*\n  epsilon = (\S+)", text)
            return float(match.group(1))

        example = _eps(
            300, num_examples=10_000, batch_size=100, noise_multiplier=2.0
        )
        self.assertLess(example, user_epsilon(2))
        self.assertLess(user_epsilon(2), user_epsilon(4))
        # k = 3 is rounded up to a group of 4.
        self.assertEqual(user_epsilon(3), user_epsilon(4))


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
        "accounting/__init__.py", "accounting/epsilon.py",
        "accounting/calibration.py", "accounting/statement.py",
        "validation.py", "privacy_cli.py", "privacy.py", "command_line.py",
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
                    r"^tf_dpadam\.(accounting|validation|privacy_cli|command_line)\b",
                )


class WithoutAmplificationTest(parameterized.TestCase):
    """Shuffled fixed batches: each pass one Gaussian mechanism, composed."""

    def _gaussian_epsilon(self, passes, orders, sigma=1.0, delta=1e-5):
        accountant = dp_accounting.rdp.RdpAccountant(list(orders))
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(sigma), passes))
        return accountant.get_epsilon(delta)

    def test_the_issues_example(self):
        # N = 80, B = 8, sigma = 1, 3 epochs: 30 steps, 3 passes.
        eps, _ = accounting.compute_dp_sgd_privacy(
            80, 8, 1.0, 3, 1e-5, sampling="shuffled")
        self.assertAlmostEqual(eps, self._gaussian_epsilon(
            3, accounting.TF_PRIVACY_RDP_ORDERS), places=9)
        poisson, _ = accounting.compute_dp_sgd_privacy(80, 8, 1.0, 3, 1e-5)
        self.assertAlmostEqual(poisson, 4.848, places=3)
        self.assertAlmostEqual(eps, 9.018, places=3)
        # PLD: the Gaussian mechanism of multiplier 1 / sqrt(3), 8.39.
        pld = accounting.epsilon_without_amplification(
            steps=30, noise_multiplier=1.0, delta=1e-5, batches_per_pass=10,
            accountant="pld")
        self.assertAlmostEqual(pld, 8.385, places=3)

    def test_a_begun_pass_counts_whole(self):
        for steps, passes in ((1, 1), (10, 1), (11, 2), (20, 2), (21, 3)):
            self.assertAlmostEqual(
                accounting.epsilon_without_amplification(
                    steps=steps, noise_multiplier=1.0, delta=1e-5,
                    batches_per_pass=10),
                self._gaussian_epsilon(passes, accounting.RDP_ORDERS),
                places=9)

    def test_accumulation_across_passes_and_unknown_passes(self):
        passes = accounting.passes
        # k = 4 divides 8 batches a pass: 3 steps are 12 batches, 2 passes.
        self.assertEqual(passes.participation_bound(3, 8, 4), 2)
        # k = 3 does not divide 8: a step can hold an example twice.
        self.assertEqual(passes.participation_bound(3, 8, 3), 2 * 2)
        # Unknown passes: every physical batch may hold it, k^2 per step.
        self.assertEqual(passes.participation_bound(5, None, 2), 20)
        self.assertEqual(passes.participation_bound(0, None, 2), 0)

    def test_calibrated_steps_end_where_a_pass_would_exceed(self):
        # 3 passes of 10 steps fit a budget of 9.02 (RDP), a 4th does not.
        budget = self._gaussian_epsilon(3, accounting.RDP_ORDERS) + 1e-9
        self.assertEqual(
            accounting.calibrate_steps(
                target_epsilon=budget, num_examples=80, batch_size=8,
                noise_multiplier=1.0, delta=1e-5, sampling="shuffled",
                accountant="rdp"), 30)
        self.assertGreater(
            accounting.calibrate_steps(
                target_epsilon=budget, num_examples=80, batch_size=8,
                noise_multiplier=1.0, delta=1e-5, accountant="rdp"), 100)
        with self.assertRaisesRegex(ValueError, "single pass"):
            accounting.calibrate_steps(
                target_epsilon=0.1, num_examples=80, batch_size=8,
                noise_multiplier=1.0, delta=1e-5, sampling="shuffled")

    def test_bad_sampling(self):
        with self.assertRaisesRegex(ValueError, "sampling='random'"):
            accounting.compute_dp_sgd_privacy(80, 8, 1.0, 3, 1e-5,
                                              sampling="random")


if __name__ == "__main__":
    absltest.main()
