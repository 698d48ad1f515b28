"""Tests of tf_dpadam.accounting.accountants: the accountants' registry.

Every `accountant=` argument is looked up in one registry, so an accountant
registered here (a toy) must be accepted everywhere the built-in ones are,
and the built-in objects must give the numbers the names gave before.
"""

import pytest
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting

from tf_dpadam import accounting
from tf_dpadam.accounting import accountants
from tf_dpadam.accounting import ledger as ledger_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
DELTA = 1e-5
# Opacus' published RDP example (also in epsilon_test.py): sigma = 1.5,
# q = 0.04, 2,250 steps, delta = 1e-5 -> epsilon 7.329.
OPACUS = dict(steps=2250, num_examples=60000, batch_size=2400,
              noise_multiplier=1.5, delta=DELTA)
# A cheap setting for the calibrations: q = 0.01, sigma = 1.
SMALL = dict(num_examples=10_000, batch_size=100, delta=DELTA)


class _CountingRdp(accountants.RdpAccountant):
    """A toy: RDP's numbers under another name, counting its calls."""

    name = "toy"

    def __init__(self):
        self.calls = []

    def poisson_epsilon(self, q, sigma, steps, delta):
        self.calls.append("poisson")
        return super().poisson_epsilon(q, sigma, steps, delta)

    def gaussian_epsilon(self, sigma, delta):
        self.calls.append("gaussian")
        return super().gaussian_epsilon(sigma, delta)

    def ledger_epsilon(self, poisson, gaussian_sigma, delta):
        self.calls.append("ledger")
        return super().ledger_epsilon(poisson, gaussian_sigma, delta)


class _Doubled(accountants.Accountant):
    """A deliberately different toy: twice RDP's epsilons."""

    name = "toy"

    def poisson_epsilon(self, q, sigma, steps, delta):
        return 2 * accountants.RDP.poisson_epsilon(q, sigma, steps, delta)

    def gaussian_epsilon(self, sigma, delta):
        return 2 * accountants.RDP.gaussian_epsilon(sigma, delta)

    def ledger_epsilon(self, poisson, gaussian_sigma, delta):
        return 2 * accountants.RDP.ledger_epsilon(poisson, gaussian_sigma,
                                                  delta)


class RegistryTest(parameterized.TestCase):

    def test_lists_rdp_then_pld(self):
        # The flags' choices are `list(ACCOUNTANTS)`: their order is kept.
        self.assertEqual(list(accounting.ACCOUNTANTS), ["rdp", "pld"])
        self.assertIs(accounting.ACCOUNTANTS["rdp"], accountants.RDP)
        self.assertIs(accounting.ACCOUNTANTS["pld"], accountants.PLD)
        for name, accountant in accounting.ACCOUNTANTS.items():
            self.assertIsInstance(accountant, accounting.Accountant)
            self.assertEqual(accountant.name, name)
            self.assertIs(accounting.get_accountant(name), accountant)
        # PLD builds a distribution per epsilon; RDP scales a cached curve.
        self.assertFalse(accountants.RDP.costly)
        self.assertTrue(accountants.PLD.costly)

    def test_read_only(self):
        with self.assertRaises(TypeError):
            accounting.ACCOUNTANTS["toy"] = _CountingRdp()

    @parameterized.parameters("RDP", "", "prv", None, (["rdp"],))
    def test_unknown_name_raises_the_old_message(self, name):
        # The message validation.check_accountant gave, word for word.
        with self.assertRaises(ValueError) as raised:
            accounting.get_accountant(name)
        self.assertEqual(str(raised.exception),
                         f"Expected accountant={name!r} in ('rdp', 'pld').")

    def test_every_function_taking_accountant_refuses_an_unknown_one(self):
        ledger = ledger_lib.Ledger()
        for call in (
                lambda: accounting.epsilon_after_steps(**OPACUS,
                                                       accountant="prv"),
                lambda: accounting.calibrate_steps(
                    target_epsilon=1.0, noise_multiplier=1.0, **SMALL,
                    accountant="prv"),
                lambda: accounting.calibrate_noise_multiplier(
                    target_epsilon=1.0, steps=10, **SMALL, accountant="prv"),
                lambda: accounting.epsilon_without_amplification(
                    steps=3, noise_multiplier=1.0, delta=DELTA,
                    accountant="prv"),
                lambda: ledger.epsilon(DELTA, "prv"),
                lambda: ledger.max_more_steps(
                    ledger_lib.Mechanism.every_step(1.0), 1.0, DELTA,
                    "prv")):
            with self.assertRaisesRegex(ValueError, "accountant='prv'"):
                call()

    def test_register_refuses_what_is_not_a_new_accountant(self):
        class Nameless(_CountingRdp):
            name = ""

        with self.assertRaisesRegex(ValueError, "to be an Accountant"):
            accounting.register_accountant("toy")
        with self.assertRaisesRegex(ValueError, "non-empty string"):
            accounting.register_accountant(Nameless())
        with self.assertRaisesRegex(ValueError, "'rdp' not to be taken"):
            accounting.register_accountant(accountants.RdpAccountant())
        self.assertEqual(list(accounting.ACCOUNTANTS), ["rdp", "pld"])

    def test_the_base_is_abstract(self):
        with self.assertRaises(TypeError):
            # pylint: disable-next=abstract-class-instantiated
            accounting.Accountant()


class GoldenValueTest(absltest.TestCase):
    """The objects give what the names gave: dp-accounting's numbers."""

    def test_opacus_published_value(self):
        event = accounting.dp_sgd_event(0.04, 1.5, 2250)
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        rdp = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS),
                                              relation)
        rdp.compose(event)
        pld = dp_accounting.pld.PLDAccountant(
            relation, value_discretization_interval=(
                accounting.PLD_VALUE_DISCRETIZATION_INTERVAL))
        pld.compose(event)
        by_rdp = accountants.RDP.poisson_epsilon(0.04, 1.5, 2250, DELTA)
        by_pld = accountants.PLD.poisson_epsilon(0.04, 1.5, 2250, DELTA)
        self.assertAlmostEqual(by_rdp, 7.329, delta=0.005 * 7.329)
        # Bit for bit dp-accounting's, as before the registry (7.3285083
        # and 6.7694787 with dp-accounting 0.4.4).
        self.assertEqual(by_rdp, rdp.get_epsilon(DELTA))
        self.assertEqual(by_pld, pld.get_epsilon(DELTA))
        self.assertAlmostEqual(by_rdp, 7.3285083, delta=1e-6)
        self.assertAlmostEqual(by_pld, 6.7694787, delta=1e-6)
        for name, expected in (("rdp", by_rdp), ("pld", by_pld)):
            self.assertEqual(
                accounting.epsilon_after_steps(**OPACUS, accountant=name),
                expected)


class ToyAccountantTest(absltest.TestCase):
    """A registered toy is accepted wherever `accountant=` is."""

    def setUp(self):
        super().setUp()
        self.toy = accounting.register_accountant(_CountingRdp())

    def tearDown(self):
        accounting.unregister_accountant("toy")
        super().tearDown()

    def assert_same_as_rdp(self, function, **kwargs):
        calls = len(self.toy.calls)
        self.assertEqual(function(**kwargs, accountant="toy"),
                         function(**kwargs, accountant="rdp"))
        self.assertGreater(len(self.toy.calls), calls)  # It was asked.

    def test_listed_last_and_named_in_the_message(self):
        self.assertEqual(list(accounting.ACCOUNTANTS), ["rdp", "pld", "toy"])
        with self.assertRaisesRegex(
                ValueError, r"in \('rdp', 'pld', 'toy'\)\.$"):
            accounting.get_accountant("prv")

    @pytest.mark.slow
    def test_epsilon_and_calibrations(self):
        self.assert_same_as_rdp(accounting.epsilon_after_steps, **OPACUS)
        self.assert_same_as_rdp(accounting.calibrate_steps,
                                target_epsilon=3.0, noise_multiplier=1.0,
                                **SMALL)
        self.assert_same_as_rdp(accounting.calibrate_noise_multiplier,
                                target_epsilon=3.0, steps=1000, **SMALL)

    def test_fixed_batches_and_ledgers(self):
        self.assert_same_as_rdp(accounting.epsilon_without_amplification,
                                steps=30, noise_multiplier=1.0, delta=DELTA,
                                batches_per_pass=10)
        mechanism = ledger_lib.Mechanism.poisson(1.0, 10_000, 100)
        fixed = ledger_lib.Mechanism.passes(2.0, 10)
        ledger = ledger_lib.Ledger().with_steps(mechanism, 500).with_steps(
            fixed, 25)
        self.assert_same_as_rdp(ledger.epsilon, delta=DELTA)
        self.assertIn("ledger", self.toy.calls)
        self.assert_same_as_rdp(ledger.max_more_steps, mechanism=mechanism,
                                target_epsilon=6.0, delta=DELTA)

    @pytest.mark.slow
    def test_command_line_accepts_it(self):
        # The flags are defined once a process: a fresh one defines them
        # after registering the toy.
        program = (
            "from absl import flags\n"
            "from tf_dpadam import accounting\n"
            "from tf_dpadam.accounting import accountants, cli\n"
            "class Toy(accountants.RdpAccountant):\n"
            "    name = 'toy'\n"
            "accounting.register_accountant(Toy())\n"
            "cli.define_flags()\n"
            "argv = flags.FLAGS(['cli', '--accountant=toy',"
            " '--num_examples=10000', '--batch_size=100',"
            " '--noise_multiplier=1', '--target_epsilon=3',"
            " '--delta=1e-5'])\n"
            "cli.main(argv)\n")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(_ROOT, "src"), env.get("PYTHONPATH"))
            if p)
        done = subprocess.run([sys.executable, "-c", program], cwd=_ROOT,
                              env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        self.assertEqual(done.returncode, 0, msg=done.stderr)
        steps = accounting.calibrate_steps(
            target_epsilon=3.0, noise_multiplier=1.0, **SMALL,
            accountant="rdp")
        self.assertIn("(TOY accountant)", done.stdout)
        self.assertIn(f"steps = {steps}\n", done.stdout)


class ReplacedAccountantTest(absltest.TestCase):
    """The caches are keyed on the object, not the name."""

    def test_a_name_registered_again_gets_its_own_numbers(self):
        setting = dict(OPACUS, accountant="toy")
        rdp = accounting.epsilon_after_steps(**dict(OPACUS, accountant="rdp"))
        for toy, factor in ((_CountingRdp(), 1), (_Doubled(), 2),
                            (_CountingRdp(), 1)):
            accounting.register_accountant(toy)
            try:
                self.assertEqual(accounting.epsilon_after_steps(**setting),
                                 factor * rdp)
            finally:
                accounting.unregister_accountant("toy")
        with self.assertRaisesRegex(ValueError, "accountant='toy'"):
            accounting.epsilon_after_steps(**setting)


if __name__ == "__main__":
    absltest.main()
