"""Tests of tf_dpadam.accounting.statement: the privacy statement TF-Privacy prints."""

import contextlib
import io
import re

from absl.testing import absltest

from tf_dpadam import accounting

DELTA = 1e-5


def _eps(steps, accountant="rdp", **setting):
    return accounting.epsilon_after_steps(
        steps=steps, delta=DELTA, accountant=accountant, **setting
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

if __name__ == "__main__":
    absltest.main()
