"""Tests of the command line `python -m tf_dpadam.accounting.cli`, installed
as the console script `tf_dpadam_privacy` (pyproject.toml).
"""

import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
from absl import app
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam import accounting
from tf_dpadam.accounting import cli as privacy_cli

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DELTA = 1e-5


def _start(module, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_ROOT, env.get("PYTHONPATH")) if p
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class CommandLineTest(absltest.TestCase):

    @pytest.mark.slow
    def test_subprocess_statement(self):
        # Two invocations only (the module and the console script, one mode
        # each): each pays the package's import time. The other modes are
        # tested through `privacy_cli.report` below.
        process = _start(
            "tf_dpadam.accounting.cli", "--num_examples=60000",
            "--batch_size=256",
            "--noise_multiplier=1.1", "--epochs=60", "--delta=1e-5",
        )
        out, err = process.communicate(timeout=120)
        self.assertEqual(process.returncode, 0, msg=err)
        # The statement, then which sampling it assumes and the other's.
        self.assertStartsWith(
            out,
            accounting.compute_dp_sgd_privacy_statement(
                60000, 256, 60, 1.1, DELTA
            ) + "\n\nAssumed sampling: Poisson sampling",
        )
        setting = dict(num_examples=60000, batch_size=256, noise_multiplier=1.1)
        for accountant, name in (("rdp", "RDP"), ("pld", "PLD")):
            epsilon = accounting.epsilon_after_steps(
                steps=14063, delta=DELTA, accountant=accountant, **setting
            )
            self.assertIn(f"epsilon = {epsilon:.4g} ({name}", out)

    @pytest.mark.slow
    def test_subprocess_calibrated_steps_under_the_new_name(self):
        process = _start(
            "tf_dpadam.accounting.cli", "--num_examples=50000",
            "--batch_size=2048", "--noise_multiplier=1.0",
            "--target_epsilon=7", "--delta=1e-5",
        )
        out, err = process.communicate(timeout=120)
        self.assertEqual(process.returncode, 0, msg=err)
        self.assertEqual(
            out,
            privacy_cli.steps_report(
                num_examples=50000, batch_size=2048, noise_multiplier=1.0,
                target_epsilon=7.0, delta=DELTA,
            ) + "\n",
        )

    @pytest.mark.slow
    def test_subprocess_usage_errors_take_one_line(self):
        # A bad value, a missing one, an impossible combination: one line
        # naming the flag, exit code 2, no help text and no traceback.
        cases = (
            (["--num_examples=60000", "--batch_size=256", "--epochs=1",
              "--noise_multiplier=-1", "--delta=1e-5"], "--noise_multiplier"),
            (["--batch_size=256"], "--num_examples"),
            (["--num_examples=100", "--batch_size=200", "--epochs=1",
              "--noise_multiplier=1", "--delta=1e-5"], "batch_size=200"),
        )
        # Started together: each process mostly imports.
        processes = [_start("tf_dpadam.accounting.cli", *args)
                     for args, _ in cases]
        for process, (_, flag) in zip(processes, cases):
            out, err = process.communicate(timeout=120)
            lines = [l for l in err.splitlines()
                     if l.startswith("cli.py: error:")]
            self.assertEqual(process.returncode, 2, msg=err)
            self.assertLen(lines, 1, msg=err)
            self.assertIn(flag, lines[0])
            self.assertNotIn("Traceback", err)
            self.assertNotIn("--accountant", err + out)  # No help dump.

    @pytest.mark.slow
    def test_console_script_shows_the_usage_and_flags(self):
        script = shutil.which("tf_dpadam_privacy") or os.path.join(
            os.path.dirname(sys.executable), "tf_dpadam_privacy")
        if not os.path.exists(script):
            self.skipTest("tf_dpadam is not installed (pip install -e .)")
        process = subprocess.run([script, "--help"], capture_output=True,
                                 text=True, timeout=120, check=False)
        self.assertIn("Command line for the privacy accounting",
                      process.stdout)
        for flag in ("--num_examples", "--target_epsilon", "--accountant"):
            self.assertIn(flag, process.stdout)
        process = subprocess.run([script, "--batch_size=256"],
                                 capture_output=True, text=True, timeout=120,
                                 check=False)
        self.assertEqual(process.returncode, 2, process.stderr)
        self.assertIn("tf_dpadam_privacy: error:", process.stderr)

    def test_main_rejects_stray_arguments(self):
        with self.assertRaisesRegex(app.UsageError, "Unexpected arguments: x"):
            privacy_cli.main(["privacy", "x"])


class ReportTest(parameterized.TestCase):

    def test_statement(self):
        text = privacy_cli.report(
            num_examples=60000, batch_size=256, noise_multiplier=1.1,
            epochs=60, delta=DELTA,
        )
        self.assertStartsWith(
            text,
            accounting.compute_dp_sgd_privacy_statement(
                60000, 256, 60, 1.1, DELTA
            ) + "\n\nAssumed sampling: Poisson sampling",
        )

    def test_statement_says_which_sampling_and_gives_the_other(self):
        setting = dict(num_examples=80, batch_size=8, noise_multiplier=1.0,
                       epochs=3, delta=1e-5)
        poisson = privacy_cli.report(**setting)
        self.assertIn("Assumed sampling: Poisson sampling at q = 8/80:"
                      " after 30 steps epsilon = 4.848 (RDP), 4.178 (PLD)",
                      poisson)
        self.assertIn("For comparison: shuffled fixed batches", poisson)
        shuffled = privacy_cli.report(sampling="shuffled", **setting)
        self.assertIn("Assumed sampling: shuffled fixed batches of 8 of 80"
                      " examples (no amplification by subsampling): after 30"
                      " steps epsilon = 9.01 (RDP), 8.385 (PLD)", shuffled)
        budget = privacy_cli.report(
            num_examples=80, batch_size=8, noise_multiplier=1.0, delta=1e-5,
            target_epsilon=9.0, sampling="shuffled", accountant="rdp")
        self.assertIn("steps = 20", budget)
        with self.assertRaisesRegex(ValueError, "Poisson sampling only"):
            privacy_cli.report(num_examples=80, batch_size=8, epochs=3,
                               delta=1e-5, target_epsilon=9.0,
                               sampling="shuffled")

    def test_statement_with_steps(self):
        text = privacy_cli.report(
            num_examples=10000, batch_size=100, noise_multiplier=1.0,
            steps=300, delta=DELTA,
        )
        self.assertIn("= 300 steps", text)

    def test_calibrated_steps_and_epochs(self):
        text = privacy_cli.report(
            num_examples=50000, batch_size=2048, noise_multiplier=1.0,
            target_epsilon=7.0, delta=DELTA,
        )
        steps = accounting.calibrate_steps(
            target_epsilon=7.0, num_examples=50000, batch_size=2048,
            noise_multiplier=1.0, delta=DELTA,
        )
        self.assertIn(f"steps = {steps}\n", text)
        epochs = float(re.search(r"epochs = (\S+)", text).group(1))
        self.assertAlmostEqual(epochs, steps * 2048 / 50000, places=3)

    def test_statement_then_budget_with_all_three(self):
        # The README's command with --target_epsilon=7 added: the
        # statement of the 60 epochs, then the steps that epsilon 7 allows.
        setting = dict(num_examples=60000, batch_size=256,
                       noise_multiplier=1.1, delta=DELTA)
        text = privacy_cli.report(epochs=60, target_epsilon=7.0, **setting)
        self.assertEqual(
            text,
            privacy_cli.report(epochs=60, **setting) + "\n\n"
            + privacy_cli.steps_report(target_epsilon=7.0, **setting))

    @pytest.mark.slow
    def test_calibrated_noise_multiplier_with_steps_and_pld(self):
        text = privacy_cli.report(
            num_examples=10000, batch_size=100, steps=300, target_epsilon=1.0,
            delta=DELTA, accountant="pld",
        )
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=1.0, num_examples=10000, batch_size=100, steps=300,
            delta=DELTA, accountant="pld",
        )
        self.assertIn(f"noise_multiplier = {sigma:.6g}", text)
        self.assertIn("PLD accountant", text)

    @parameterized.named_parameters(
        ("missing_delta", dict(num_examples=100, batch_size=10, delta=None,
                               noise_multiplier=1.0, epochs=1), "--delta"),
        ("nothing_to_do", dict(num_examples=100, batch_size=10, delta=DELTA,
                               epochs=1), "--noise_multiplier or"),
        ("no_length", dict(num_examples=100, batch_size=10, delta=DELTA,
                           noise_multiplier=1.0), "--epochs or --steps"),
        ("both_lengths", dict(num_examples=100, batch_size=10, delta=DELTA,
                              noise_multiplier=1.0, epochs=1, steps=10),
         "at most one"),
        ("bad_batch_size", dict(num_examples=100, batch_size=200, delta=DELTA,
                                noise_multiplier=1.0, epochs=1),
         "batch_size=200 <= num_examples=100"),
    )
    def test_invalid_combinations(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, re.escape(message)):
            privacy_cli.report(**kwargs)


class BoundedTest(parameterized.TestCase):
    """Every flag combination answers within seconds (the issue's
    --epochs=1e9 grew to 23.5 GB)."""

    def _report(self, **kwargs):
        """`report` of the issue's setting; fails if it takes >= 10 s or
        grows the process's peak memory by >= 1 GB."""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.monotonic()
        try:
            return privacy_cli.report(num_examples=60000, batch_size=256,
                                      delta=DELTA, **kwargs)
        finally:
            self.assertLess(time.monotonic() - start, 10.0)
            growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.assertLess(growth - before, 1 << 20)  # KB.

    def test_huge_epochs_give_rdp_and_say_pld_is_not_computed(self):
        text = self._report(noise_multiplier=6.0, epochs=1e9)
        self.assertIn("= 234375000000 steps", text)
        self.assertRegex(text, r"epsilon = \S+ \(RDP accountant")
        self.assertIn("epsilon not computed by the PLD accountant", text)
        self.assertIn("after 234375000000 steps epsilon = 6.995e+04 (RDP),"
                      " nan (PLD) at delta = 1e-05. PLD: not computed, over"
                      " 524,288 points.", text)

    def test_huge_steps_and_shuffled_batches(self):
        text = self._report(noise_multiplier=6.0, steps=10**15,
                            sampling="shuffled")
        self.assertIn("nan (PLD)", text)

    @parameterized.named_parameters(
        ("steps_beyond_the_cap", dict(noise_multiplier=6.0,
                                      target_epsilon=50.0),
         "target_epsilon=50.0 allows 10,000,000 steps or more"),
        ("the_same_with_a_statement", dict(noise_multiplier=6.0,
                                           target_epsilon=50.0, epochs=1e9),
         "allows 10,000,000 steps or more"),
        ("noise_for_huge_epochs", dict(target_epsilon=8.0, epochs=1e9),
         "cannot account"),
        ("noise_for_a_huge_target", dict(target_epsilon=1e9, epochs=60),
         "PLD accountant"),
        ("epochs_overflow", dict(noise_multiplier=1.0, epochs=1e305),
         "epochs=1e+305 to give a finite number of steps"),
    )
    def test_one_line_errors(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, re.escape(message)) as error:
            self._report(**kwargs)
        self.assertNotIn("\n", str(error.exception))


if __name__ == "__main__":
    absltest.main()
