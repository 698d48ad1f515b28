"""Every data path of `fit`: the sampling read from the steps, and its epsilon.

A probe model reads which examples each step used from the step itself: the
input of example i is the one-hot vector e_i, the model is one bias-free
Dense unit w and the loss is its output, so example i's gradient is e_i
(norm 1, below C). With DPSGD (noise 0, learning rate B, denominator B) a
logical step moves w by exactly minus the sum of the e_i it holds: -dw is
the step's vector of counts, whatever the sampler's own bookkeeping says.

For tf_dpadam's Poisson pipelines (the default of `fit` on in-memory data)
the counts must look like Poisson sampling: each entry 0 or 1, batch sizes
spread as Binomial(N, q) (mean and variance within stated tolerances), every
example sampled about T q times; and `PrivacyBudget` must report the
Poisson-subsampled Gaussian's epsilon, computed here directly with
dp-accounting. For every other path the batches are fixed, each example
once per pass, and the epsilon is that of the Gaussian mechanism composed
over the passes (or over every step, when the passes are unknown).
"""

import contextlib
import io
import math

import pytest
from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting
import keras
import numpy as np
import tensorflow as tf
from keras import ops

import tf_dpadam
from tf_dpadam.training import private_fit
from tf_dpadam.data import sharding
from tf_dpadam.accounting import RDP_ORDERS
from tf_dpadam.data import sampling as sampling_lib
from tf_dpadam.accounting import plans
from tf_dpadam.accounting.ledger import Ledger

N = 60
B = 6
DELTA = 1e-5
SIGMA = 1.0
_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def _probe_loss(y_true, y_pred):
    del y_true
    return ops.sum(y_pred, axis=-1)


def _ids(n=N):
    return np.eye(n, dtype="float32")


def _targets(n=N):
    return np.zeros((n, 1), "float32")


def _probe(noise_multiplier=0.0, batch_size=B, accumulation=None,
           jit_compile=False):
    model = tf_dpadam.make_private(keras.Sequential([
        keras.Input((N,)),
        keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
    ]))
    model.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=10.0, noise_multiplier=noise_multiplier,
            batch_size=batch_size, learning_rate=float(batch_size or 1),
            gradient_accumulation_steps=accumulation),
        loss=_probe_loss, jit_compile=jit_compile)
    return model


class _StepCounts(keras.callbacks.Callback):
    """The count vector of every logical step, read from the weights."""

    def __init__(self):
        super().__init__()
        self.counts = []

    def _state(self):
        kernel = self.model.trainable_variables[0]
        return (int(ops.convert_to_numpy(self.model.optimizer.iterations)),
                np.array(ops.convert_to_numpy(kernel))[:, 0])

    def on_train_begin(self, logs=None):
        self._last = self._state()

    def on_train_batch_end(self, batch, logs=None):
        state = self._state()
        if state[0] != self._last[0]:
            self.counts.append(np.rint(self._last[1] - state[1]))
            self._last = state


def _rdp_epsilon(event):
    accountant = dp_accounting.rdp.RdpAccountant(list(RDP_ORDERS), _RELATION)
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def _poisson_epsilon(steps, n=N, b=B):
    return _rdp_epsilon(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            b / n, dp_accounting.GaussianDpEvent(SIGMA)), steps))


def _passes_epsilon(participations):
    return _rdp_epsilon(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(SIGMA), participations))


class _Sequence(keras.utils.PyDataset):

    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return math.ceil(len(self.x) / self.batch)

    def __getitem__(self, index):
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[rows], self.y[rows]


def _generator(x, y, batch):
    while True:
        for start in range(0, len(x), batch):
            yield x[start:start + batch], y[start:start + batch]


class PoissonPathsTest(parameterized.TestCase):
    """In-memory data and tf_dpadam's pipelines: Poisson, read from steps."""

    def _fit(self, data, epochs, **fit_kwargs):
        model = _probe()
        recorder = _StepCounts()
        self.budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        model.fit(data[0], data[1], epochs=epochs,
                  callbacks=[recorder, self.budget], verbose=0, **fit_kwargs)
        return model, np.array(recorder.counts)

    def _check_poisson(self, counts, n, q, sampled_rows=None):
        steps = len(counts)
        # The plan the callback read accounts the independent epsilon of T
        # Poisson steps at q (the probe itself trains without noise).
        self.assertAlmostEqual(
            Ledger().with_steps(self.budget.plan.mechanism(SIGMA),
                                steps).epsilon(DELTA, "rdp"),
            _poisson_epsilon(steps, n, round(q * n)), places=9)
        self.assertGreaterEqual(steps, 200)
        self.assertTrue(np.all((counts == 0) | (counts == 1)),
                        "an example twice in a step")
        rows = n if sampled_rows is None else sampled_rows
        self.assertEqual(np.sum(counts[:, rows:]), 0,
                         "a step used a row outside the training data")
        sizes = counts[:, :rows].sum(axis=1)
        mean, var = n * q, n * q * (1 - q)
        # The mean of T binomial sizes within 5 standard errors.
        self.assertLess(abs(sizes.mean() - mean), 5 * math.sqrt(var / steps))
        # The sample variance within +-40% (T >= 200: its relative standard
        # error is about sqrt(2 / T) = 0.1).
        self.assertBetween(sizes.var(ddof=1) / var, 0.6, 1.4)
        # Fixed batches would have one size; Poisson sizes spread.
        self.assertGreater(len(set(sizes.tolist())), 3)
        # Every example sampled about T q times (within 6 binomial stds).
        per_example = counts[:, :rows].sum(axis=0)
        spread = 6 * math.sqrt(steps * q * (1 - q))
        self.assertLess(np.max(np.abs(per_example - steps * q)), spread)

    @pytest.mark.slow
    def test_arrays(self):
        model, counts = self._fit((_ids(), _targets()), epochs=25,
                                  batch_size=B)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, B))
        self._check_poisson(counts, N, B / N)

    @pytest.mark.slow
    def test_tensors_and_optimizer_batch_size(self):
        model, counts = self._fit(
            (tf.constant(_ids()), tf.constant(_targets())), epochs=25)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, B))
        self._check_poisson(counts, N, B / N)

    @pytest.mark.slow
    def test_validation_split_samples_only_the_training_rows(self):
        # Keras keeps the last 25% for validation: N = 45, q = 6 / 45.
        model, counts = self._fit((_ids(), _targets()), epochs=34,
                                  validation_split=0.25)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(45, B))
        self._check_poisson(counts, 45, B / 45, sampled_rows=45)

    @pytest.mark.slow
    def test_poisson_batches_dataset(self):
        batches = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B)
        model, counts = self._fit((batches.dataset.repeat(), None),
                                  epochs=1, steps_per_epoch=250)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, B))
        self._check_poisson(counts, N, B / N)

    @pytest.mark.slow
    def test_poisson_batches_through_map(self):
        # The package's row-wise map (as the examples' transforms) keeps it
        # Poisson (a map of the user's own is refused:
        # poisson_pipeline_map_test).
        batches = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B)
        dataset = batches.map_examples(lambda x, y: (x, y)).dataset.repeat()
        model, counts = self._fit((dataset, None), epochs=1,
                                  steps_per_epoch=250)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, B))
        self._check_poisson(counts, N, B / N)

    @pytest.mark.slow
    def test_poisson_batches_reshuffled_are_not_poisson(self):
        # Unbatched and batched anew: the steps are no longer the samples.
        batches = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B)
        dataset = batches.dataset.unbatch().batch(B)
        model = _probe()
        model.fit(dataset, verbose=0)
        self.assertFalse(model.sampling_plan.amplified)

    def test_take_and_skip_keep_one_batch_steps_poisson(self):
        # Each batch kept is its own step's Poisson sample.
        batches = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B)
        cut = batches.dataset.repeat().skip(2).take(5)
        self.assertEqual(sampling_lib.poisson_plan_of(cut),
                         plans.PoissonPlan(N, B))
        # With k > 1 batches a step, a cut could join two steps' rows.
        split = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B,
            physical_batch_size=B)
        self.assertGreater(split.accumulation_steps, 1)
        self.assertIsNotNone(sampling_lib.poisson_plan_of(split.dataset))
        self.assertIsNone(sampling_lib.poisson_plan_of(
            split.dataset.take(3)))

    @pytest.mark.slow
    def test_poisson_batches_from_source(self):
        rows = list(zip(_ids(), _targets()))
        batches = tf_dpadam.data.poisson_batches_from_source(
            rows, expected_batch_size=B)
        model, counts = self._fit((batches.dataset.repeat(), None),
                                  epochs=1, steps_per_epoch=250)
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, B))
        self._check_poisson(counts, N, B / N)

    @pytest.mark.slow
    def test_sharded(self):
        batches = sharding.sharded_poisson_batches(
            (_ids(), _targets()), expected_batch_size=B,
            physical_batch_size=8, num_workers=1, replicas_per_worker=1)
        strategy = tf.distribute.get_strategy()
        dataset = strategy.distribute_datasets_from_function(
            batches.dataset_fn)
        model = _probe(accumulation=batches.accumulation_steps)
        recorder = _StepCounts()
        self.budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        model.fit(dataset.repeat(), epochs=1, verbose=0,
                  steps_per_epoch=250 * batches.accumulation_steps,
                  callbacks=[recorder, self.budget])
        self.assertEqual(model.sampling_plan,
                         plans.PoissonPlan(N, B, batches.accumulation_steps))
        self._check_poisson(np.array(recorder.counts), N, B / N)

    @pytest.mark.slow
    def test_accumulation_derived_from_the_optimizer(self):
        model = _probe(accumulation=2)
        recorder = _StepCounts()
        self.budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
        model.fit(_ids(), _targets(), epochs=25, verbose=0,
                  callbacks=[recorder, self.budget])
        self.assertEqual(model.sampling_plan, plans.PoissonPlan(N, B, 2))
        self._check_poisson(np.array(recorder.counts), N, B / N)

    @parameterized.parameters(False, True)
    @pytest.mark.slow
    def test_reported_epsilon_is_the_poisson_one(self, jit_compile):
        model = _probe(noise_multiplier=SIGMA, jit_compile=jit_compile)
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0,
                                         accountant="rdp")
        model.fit(_ids(), _targets(), epochs=2, callbacks=[budget],
                  verbose=0)
        steps = int(ops.convert_to_numpy(model.optimizer.iterations))
        self.assertEqual(steps, 2 * N // B)
        self.assertAlmostEqual(budget.epsilon, _poisson_epsilon(steps),
                               places=9)


class FixedPathsTest(parameterized.TestCase):
    """Everything else: fixed batches, accounted without amplification."""

    def _fit(self, x, y=None, epochs=3, noise_multiplier=0.0, **kwargs):
        model = _probe(noise_multiplier=noise_multiplier)
        recorder = _StepCounts()
        budget = tf_dpadam.PrivacyBudget(num_examples=N, delta=DELTA,
                                         verbose=0, accountant="rdp")
        model.fit(x, y, epochs=epochs, verbose=0,
                  callbacks=[recorder, budget], **kwargs)
        return model, np.array(recorder.counts), budget

    def _check_passes(self, counts, passes):
        self.assertEqual(len(counts), passes * N // B)
        for one in np.split(counts, passes):
            # Each example exactly once per pass, B per step.
            np.testing.assert_array_equal(one.sum(axis=0), np.ones(N))
            np.testing.assert_array_equal(one.sum(axis=1), np.full(N // B, B))

    def _dataset(self):
        return (tf.data.Dataset.from_tensor_slices((_ids(), _targets()))
                .shuffle(N, seed=0).batch(B))

    @pytest.mark.slow
    def test_shuffled_arrays_opt_out(self):
        model, counts, _ = self._fit(_ids(), _targets(), batch_size=B,
                                     sampling="shuffled")
        self._check_passes(counts, 3)
        self.assertEqual(model.sampling_plan.batches_per_pass, N // B)

    @pytest.mark.slow
    def test_dataset(self):
        _, counts, _ = self._fit(self._dataset())
        self._check_passes(counts, 3)

    @pytest.mark.slow
    def test_py_dataset(self):
        _, counts, _ = self._fit(_Sequence(_ids(), _targets(), B))
        self._check_passes(counts, 3)

    @pytest.mark.slow
    def test_generator(self):
        _, counts, _ = self._fit(_generator(_ids(), _targets(), B),
                                 steps_per_epoch=N // B)
        self._check_passes(counts, 3)

    @pytest.mark.slow
    def test_epsilon_composes_the_passes(self):
        # fit's own shuffled batches: each epoch one pass over the data.
        model, _, budget = self._fit(_ids(), _targets(), batch_size=B,
                                     sampling="shuffled",
                                     noise_multiplier=SIGMA)
        self.assertEqual(int(ops.convert_to_numpy(model.optimizer.iterations)),
                         3 * N // B)
        self.assertAlmostEqual(budget.epsilon, _passes_epsilon(3), places=9)
        self.assertGreater(budget.epsilon, _poisson_epsilon(3 * N // B))

    @parameterized.named_parameters(
        ("dataset", lambda: FixedPathsTest()._dataset()),
        ("py_dataset", lambda: _Sequence(_ids(), _targets(), B)),
    )
    def test_user_pipeline_epsilon_composes_every_step(self, make):
        # Nothing says which rows a batch of a user's pipeline holds (it
        # could `repeat` or slice): every step is one participation.
        model, _, budget = self._fit(make(), noise_multiplier=SIGMA)
        steps = 3 * N // B
        self.assertEqual(int(ops.convert_to_numpy(model.optimizer.iterations)),
                         steps)
        self.assertAlmostEqual(budget.epsilon, _passes_epsilon(steps),
                               places=9)

    def test_generator_epsilon_composes_every_step(self):
        # Its passes are unknown: every step may hold every example.
        _, _, budget = self._fit(_generator(_ids(), _targets(), B),
                                 noise_multiplier=SIGMA, epochs=1,
                                 steps_per_epoch=4)
        self.assertAlmostEqual(budget.epsilon, _passes_epsilon(4), places=9)

    @pytest.mark.slow
    def test_start_line_compares_with_poisson(self):
        model = _probe(noise_multiplier=SIGMA)
        budget = tf_dpadam.PrivacyBudget(delta=DELTA, accountant="rdp")
        with _Stdout() as out:
            model.fit(_ids(), _targets(), batch_size=B, epochs=3, verbose=0,
                      sampling="shuffled", callbacks=[budget])
        line = out.text()
        self.assertIn("no amplification", line)
        self.assertIn(f"epsilon = {_passes_epsilon(3):.4g}", line)
        self.assertIn(f"would give {_poisson_epsilon(3 * N // B):.4g}", line)


class _Stdout:
    """Captures what is printed."""

    def __enter__(self):
        self._buffer = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._buffer)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)

    def text(self):
        return self._buffer.getvalue()


class RefusalsTest(parameterized.TestCase):

    def test_optimizer_without_batch_size_under_poisson(self):
        model = _probe(batch_size=None)
        with self.assertRaisesRegex(ValueError, "batch_size=None divides"):
            model.fit(_ids(), _targets(), batch_size=B, verbose=0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)

    def test_optimizer_without_batch_size_on_poisson_dataset(self):
        batches = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B)
        model = _probe(batch_size=None)
        with self.assertRaisesRegex(ValueError, "batch_size=None divides"):
            model.fit(batches.dataset, verbose=0)

    def test_fit_batch_size_disagrees_with_optimizer(self):
        with self.assertRaisesRegex(ValueError, "batch_size=12"):
            _probe().fit(_ids(), _targets(), batch_size=12, verbose=0)

    def test_accumulation_disagrees_with_the_batches(self):
        batches = tf_dpadam.data.poisson_batches(
            (_ids(), _targets()), expected_batch_size=B,
            physical_batch_size=4)
        model = _probe(accumulation=2 * batches.accumulation_steps)
        with self.assertRaisesRegex(
                ValueError, "gradient_accumulation_steps to batches"):
            model.fit(batches.dataset, verbose=0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)

    def test_num_examples_disagrees_with_the_data(self):
        budget = tf_dpadam.PrivacyBudget(num_examples=N, delta=DELTA)
        with self.assertRaisesRegex(ValueError, "num_examples=60 .* 45"):
            _probe().fit(_ids(), _targets(), validation_split=0.25,
                         callbacks=[budget], verbose=0)

    def test_poisson_batches_that_workers_would_reshard(self):
        # Two workers of one replica each: fit would re-shard the batches.
        class Extended:
            worker_devices = ("/job:worker/task:0/device:CPU:0",)

        class TwoWorkers:
            extended = Extended()
            num_replicas_in_sync = 2

        with self.assertRaisesRegex(ValueError, "sharded_poisson_batches"):
            private_fit.check_one_worker(TwoWorkers())
        private_fit.check_one_worker(tf.distribute.get_strategy())

    def test_unknown_sampling(self):
        with self.assertRaisesRegex(ValueError, "sampling='poisson_'"):
            _probe().fit(_ids(), _targets(), sampling="poisson_", verbose=0)


class PaddingTest(parameterized.TestCase):
    """What fit pads is invisible: metrics and loss count real rows only."""

    @parameterized.parameters(False, True)
    @pytest.mark.slow
    def test_metrics_and_loss_ignore_padding(self, jit_compile):
        # A model that always predicts class 2 on labels that are all 2:
        # accuracy 1 and loss 0 on the real rows; the padding rows (label 0,
        # input 0) would be wrong and costly if they counted.
        model = tf_dpadam.make_private(keras.Sequential([
            keras.Input((3,)),
            keras.layers.Dense(3, kernel_initializer="zeros",
                               bias_initializer=keras.initializers.Constant(
                                   [0.0, 0.0, 50.0])),
        ]))
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0,
                                      batch_size=B, learning_rate=0.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], weighted_metrics=["accuracy"],
            jit_compile=jit_compile)
        x = np.random.default_rng(0).normal(size=(N, 3)).astype("float32")
        history = model.fit(x, np.full(N, 2), epochs=2, verbose=0)
        self.assertEqual(history.history["accuracy"], [1.0, 1.0])
        self.assertEqual(history.history["weighted_accuracy"], [1.0, 1.0])
        self.assertLess(max(history.history["loss"]), 1e-6)


if __name__ == "__main__":
    absltest.main()
