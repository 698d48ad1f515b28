"""Issue 34: PrivacyBudget with PLD is cheap per step, and PLD is the default.

Every batch end used to compose a new PLD (40-260 ms a step at
q = 256/60000, sigma = 1 down to 0.3). Now, in a fit of more than
`pld_log_every` batches, the batch logs' epsilon is exact at multiples of
`pld_log_every` and, between them, the epsilon of the next multiple (or of
`max_steps`): an upper bound, never below the true epsilon. Epoch ends and
the end of training stay exact. The references are dp-accounting's
`PLDAccountant` (and `RdpAccountant`) on the composed event.

Since issue 49 the callback reads only the private model's privacy ledger,
whose steps the model's train step counts where the noise is drawn (not the
optimizer's `iterations`, which these tests used to assign). So the fits
here are real: a one-weight private model on N = 60000 rows of two
features, Poisson batches at q = B / N drawn by `fit`, a few hundred steps
(about a second each fit). The multiples of `pld_log_every` count the
ledger's steps, all the model's fits together.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting
import keras
import numpy as np
import pytest

import tf_dpadam
from tf_dpadam import accounting
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import ledger as ledger_lib

N, B, DELTA = 60000, 256, 1e-5
STEPS = 250  # One epoch of 250 batches: more than pld_log_every (100).


def _exact(steps, sigma=1.0, accountant="pld"):
    """Independent: dp-accounting's accountant on the composed event."""
    if steps == 0:
        return 0.0
    if accountant == "pld":
        pld = dp_accounting.pld.PLDAccountant(
            value_discretization_interval=(
                accounting.PLD_VALUE_DISCRETIZATION_INTERVAL))
    else:
        pld = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS))
    pld.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            B / N, dp_accounting.GaussianDpEvent(sigma)), steps))
    return pld.get_epsilon(DELTA)


def _model(sigma=1.0):
    # Without the first batch's independence check (1 to 2 s a model on
    # 2 cores; tested in independence_rows_test.py): the steps, the ledger and
    # its epsilon are the same.
    model = tf_dpadam.make_private(
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
        check_independence=False)
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=sigma, batch_size=B), loss="mse")
    return model


_DATA = []


def _data():
    if not _DATA:
        rng = np.random.default_rng(0)
        _DATA.extend((rng.normal(size=(N, 2)).astype("float32"),
                      rng.normal(size=(N, 1)).astype("float32")))
    return _DATA


class _BatchLogs(keras.callbacks.Callback):
    """The batch logs' epsilons and the last epoch end's, as a callback
    after the budget sees them; the batches that ended are the steps taken
    (counted here, not read from the ledger)."""

    def __init__(self):
        super().__init__()
        self.logged = []
        self.epoch_end = None

    def on_train_batch_end(self, batch, logs=None):
        self.logged.append(logs["epsilon"])

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end = logs["epsilon"]


def _run(budget, model, steps=STEPS, epochs=1):
    """A fit of `epochs` epochs of `steps` Poisson batches; returns the
    batch logs' epsilons, the last epoch end's and the steps taken."""
    x, y = _data()
    logs = _BatchLogs()
    model.fit(x, y, steps_per_epoch=steps, epochs=epochs, verbose=0,
              callbacks=[budget, logs])
    return logs.logged, logs.epoch_end, len(logs.logged)


class PldPerStepTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_batch_logs_exact_at_multiples_upper_bound_between(self):
        accounting_epsilon.epsilon_at_rate.cache_clear()
        ledger_lib.epsilon_of.cache_clear()
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        self.assertEqual(budget.accountant, "pld")  # The default.
        model = _model()
        with mock.patch.object(accounting_epsilon, "pld_epsilon",
                               wraps=accounting_epsilon.pld_epsilon) as pld:
            logged, epoch_end, steps = _run(budget, model)
        self.assertEqual(steps, STEPS)
        self.assertEqual(model.privacy_ledger.steps, STEPS)
        # Three compositions for 250 batches (at 100, 200 and 300), and
        # one for the exact epoch end (250); it used to be 250.
        self.assertEqual(sorted(c.args[2] for c in pld.call_args_list),
                         [100, 200, 250, 300])
        exact = {t: _exact(t) for t in (1, 57, 100, 101, 199, 200, 250, 300)}
        for t in (100, 200):
            self.assertEqual(logged[t - 1], exact[t])
        for t, ahead in ((1, 100), (57, 100), (101, 200), (199, 200),
                         (250, 300)):
            self.assertEqual(logged[t - 1], exact[ahead], msg=t)
            self.assertGreater(logged[t - 1], exact[t], msg=t)  # Bound.
        self.assertEqual(logged, sorted(logged))  # Never decreases.
        # Epoch end and end of training: exact.
        self.assertEqual(epoch_end, exact[250])
        self.assertEqual(budget.epsilon, exact[250])
        self.assertEqual(model.spent_epsilon(DELTA), exact[250])

    @pytest.mark.slow
    def test_logs_never_exceed_the_target_in_one_fit_or_two(self):
        # max_steps = 150 lies between two multiples: the logs' bound stops
        # there, so the progress bar never shows more than the budget.
        target = _exact(150)
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0,
                                         target_epsilon=target)
        model = _model()
        first, epoch_end, steps = _run(budget, model)
        self.assertEqual(budget.max_steps, 150)
        self.assertEqual(steps, 150)  # Stopped exactly at the budget.
        self.assertEqual(model.privacy_ledger.steps, 150)
        self.assertLessEqual(max(first), target)
        self.assertEqual(first[120], target)  # Step 121: epsilon(150).
        self.assertEqual(epoch_end, target)
        self.assertGreater(_exact(151), target)

        # A second fit of the same model with the budget epsilon(330): the
        # multiples count the ledger's steps (exact at 200 and 300, the
        # bound of the next multiple or of max_steps = 330 between), and it
        # stops at 330 steps in all, 180 of its own.
        target = _exact(330)
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0,
                                         target_epsilon=target)
        logged, epoch_end, steps = _run(budget, model)
        self.assertEqual(budget.max_steps, 330)
        self.assertEqual(steps, 180)
        self.assertEqual(model.privacy_ledger.steps, 330)
        # logged[t - 151] is the log after the ledger's step t.
        for t, ahead in ((151, 200), (199, 200), (200, 200), (201, 300),
                         (300, 300), (301, 330), (330, 330)):
            self.assertEqual(logged[t - 151], _exact(ahead), msg=t)
            if t != ahead:
                self.assertGreater(logged[t - 151], _exact(t), msg=t)
        self.assertLessEqual(max(logged), target)
        self.assertEqual(first + logged, sorted(first + logged))
        self.assertEqual(epoch_end, target)
        self.assertGreater(_exact(331), target)

    @pytest.mark.slow
    def test_rdp_stays_exact_at_every_step(self):
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0,
                                         accountant="rdp")
        logged, epoch_end, _ = _run(budget, _model(), steps=120)
        for t in (1, 57, 101, 120):
            self.assertAlmostEqual(logged[t - 1], _exact(t, accountant="rdp"),
                                   delta=1e-12)
        self.assertEqual(epoch_end, logged[-1])

    @pytest.mark.slow
    def test_short_fits_log_exact_epsilons(self):
        # At most pld_log_every batches in the fit (2 epochs of 10): exact
        # at every batch (each a PLD composition of its own, so few).
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        logged, epoch_end, steps = _run(budget, _model(), steps=10, epochs=2)
        self.assertEqual(steps, 20)
        for t in (1, 7, 15, 19):
            self.assertEqual(logged[t - 1], _exact(t), msg=t)
        self.assertEqual(logged, sorted(logged))
        self.assertEqual(epoch_end, _exact(20))


class PldCachedCompositionTest(parameterized.TestCase):

    @parameterized.parameters((256 / 60000, 0.52, 1), (256 / 60000, 0.52, 700),
                              (0.01, 1.0, 300), (0.1, 3.0, 17))
    def test_equals_the_accountant_bit_for_bit(self, q, sigma, steps):
        accountant = dp_accounting.pld.PLDAccountant(
            value_discretization_interval=(
                accounting.PLD_VALUE_DISCRETIZATION_INTERVAL))
        accountant.compose(accounting.dp_sgd_event(q, sigma, steps))
        self.assertEqual(accounting_epsilon.pld_epsilon(q, sigma, steps, DELTA),
                         accountant.get_epsilon(DELTA))
        # Again from the cache: the cached one-step PLD is not changed.
        self.assertEqual(accounting_epsilon.pld_epsilon(q, sigma, steps, DELTA),
                         accountant.get_epsilon(DELTA))


class DefaultAccountantTest(absltest.TestCase):

    def test_calibration_defaults_to_pld(self):
        setting = dict(num_examples=10_000, batch_size=100,
                       noise_multiplier=1.0, delta=DELTA)
        default = accounting.calibrate_steps(target_epsilon=2.0, **setting)
        pld = accounting.calibrate_steps(target_epsilon=2.0,
                                         accountant="pld", **setting)
        rdp = accounting.calibrate_steps(target_epsilon=2.0,
                                         accountant="rdp", **setting)
        self.assertEqual(default, pld)
        self.assertGreater(pld, rdp)  # The tighter accountant.
        sigma = dict(num_examples=10_000, batch_size=100, steps=300,
                     delta=DELTA, target_epsilon=1.0)
        self.assertEqual(accounting.calibrate_noise_multiplier(**sigma),
                         accounting.calibrate_noise_multiplier(
                             accountant="pld", **sigma))

    def test_compute_dp_sgd_privacy_keeps_tf_privacys_rdp(self):
        epsilon, order = accounting.compute_dp_sgd_privacy(
            60000, 256, 1.1, 60, 1e-5)
        self.assertAlmostEqual(epsilon, 2.597079519657094, delta=1e-6)
        self.assertEqual(order, 8.0)


if __name__ == "__main__":
    absltest.main()
