"""Issue 34: PrivacyBudget with PLD is cheap per step, and PLD is the default.

Every batch end used to compose a new PLD (40-260 ms a step at
q = 256/60000, sigma = 1 down to 0.3). Now, in a fit of more than
`pld_log_every` batches, the batch logs' epsilon is exact at multiples of
`pld_log_every` and, between them, the epsilon of the next multiple (or of
`max_steps`): an upper bound, never below the true epsilon. Epoch ends and
the end of training stay exact. The references are `epsilon_after_steps`
and dp-accounting's `PLDAccountant` on the composed event.

The hooks are driven directly (the optimizer's `iterations` assigned step by
step), so a run of hundreds of steps costs no training.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting
import keras

import tf_dpadam
from tf_dpadam import accounting
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import plans

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
    pld.compose(accounting.dp_sgd_event(B / N, sigma, steps))
    return pld.get_epsilon(DELTA)


def _model(sigma=1.0):
    model = tf_dpadam.make_private(
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=sigma, batch_size=B), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.sampling_plan = plans.PoissonPlan(N, B)
    return model


def _run(budget, model, steps=STEPS, epochs=1):
    """Drives the hooks of a fit of `steps` batches; returns the batch
    logs' epsilons, the epoch end's and the steps taken."""
    budget.set_model(model)
    budget.set_params({"steps": steps, "epochs": epochs, "verbose": 0})
    budget.on_train_begin({})
    logged = []
    for t in range(1, steps + 1):
        model.optimizer.iterations.assign(t)
        logs = {}
        budget.on_train_batch_end(t - 1, logs)
        logged.append(logs["epsilon"])
        if model.stop_training:
            break
    logs = {}
    budget.on_epoch_end(0, logs)
    budget.on_train_end({})
    return logged, logs["epsilon"], len(logged)


class PldPerStepTest(parameterized.TestCase):

    def test_batch_logs_exact_at_multiples_upper_bound_between(self):
        accounting_epsilon.epsilon_at_rate.cache_clear()
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        self.assertEqual(budget.accountant, "pld")  # The default.
        with mock.patch.object(accounting_epsilon, "pld_epsilon",
                               wraps=accounting_epsilon.pld_epsilon) as pld:
            logged, epoch_end, steps = _run(budget, _model())
        self.assertEqual(steps, STEPS)
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

    def test_logs_never_exceed_the_target(self):
        # max_steps = 150 lies between two multiples: the logs' bound stops
        # there, so the progress bar never shows more than the budget.
        target = _exact(150)
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0,
                                         target_epsilon=target)
        logged, epoch_end, steps = _run(budget, _model())
        self.assertEqual(budget.max_steps, 150)
        self.assertEqual(steps, 150)  # Stopped exactly at the budget.
        self.assertLessEqual(max(logged), target)
        self.assertEqual(logged[120], target)  # Step 121: epsilon(150).
        self.assertEqual(epoch_end, target)
        self.assertGreater(_exact(151), target)

    def test_rdp_stays_exact_at_every_step(self):
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0,
                                         accountant="rdp")
        logged, epoch_end, _ = _run(budget, _model(), steps=120)
        for t in (1, 57, 101, 120):
            self.assertAlmostEqual(logged[t - 1], _exact(t, accountant="rdp"),
                                   delta=1e-12)
        self.assertEqual(epoch_end, logged[-1])

    def test_short_fits_log_exact_epsilons(self):
        # At most pld_log_every batches in the fit: exact at every batch.
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        logged, _, _ = _run(budget, _model(), steps=20, epochs=5)
        self.assertEqual(logged[6], _exact(7))


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
