"""--noise_bands in the harness: correlated (BandMF) noise on cyclic Poisson
batches, a few steps on tiny data."""

import contextlib
import dataclasses
import io
import os
import re
import tempfile

import keras
import numpy as np
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.tools import run_dir as run_dir_lib
from research import common
from research import runs
from research import study_plan
from research import training
from research.tests import research_helpers

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# N = 128, B = 8: b B / N = 0.25 for b = 4 bands.
_N, _B = 128, 8


def _tiny_data(n=_N):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.integers(0, 2, size=n))


def _tiny_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _config(**overrides):
    # 10 steps by epochs, evaluated every 3: with b = 4, 8 steps evaluated
    # every 4.
    values = dict(batch_size=_B, physical_batch_size=None,
                  epochs=10 * _B / _N, eval_every=3, noise_bands=4)
    values.update(overrides)
    return research_helpers.train_config(**values)


class NoiseBandsTrainingTest(absltest.TestCase):

    def test_a_run_with_four_bands_trains_and_accounts_them(self):
        data = _tiny_data()
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            model, batches, results = training.train_private(
                _tiny_model, data, data, _config(), _LOSS, verbose=2)
            common.print_results(results)
        # Steps rounded down to a multiple of b, evaluations up: every fit
        # call took whole cycles of the 4 groups.
        self.assertEqual((results["steps"], results["planned_steps"]),
                         (8, 8))
        self.assertEqual([r["step"] for r in results["history"]], [4, 8])
        self.assertEqual(model.optimizer.noise_bands, 4)
        self.assertEqual(batches.steps_per_epoch, 4)
        # The ledger: every segment cyclic over 4 groups at q = 4 B / N.
        segments = model.privacy_ledger.segments
        self.assertNotEmpty(segments)
        for segment in segments:
            self.assertEqual(segment.mechanism.bands, 4)
            self.assertAlmostEqual(segment.mechanism.sampling_rate,
                                   4 * _B / _N)
        self.assertEqual(sum(s.steps for s in segments), 8)
        # The recorded and printed epsilon is the model's, that of
        # ceil(8 / 4) = 2 DP-SGD steps at q = 4 B / N.
        spent = model.spent_epsilon(1e-5, common.ACCOUNTANT)
        self.assertEqual(results["epsilon"], spent)
        self.assertAlmostEqual(spent, common.steps_epsilon(
            steps=8, num_examples=_N, batch_size=_B, noise_multiplier=1.0,
            delta=1e-5, noise_bands=4), places=9)
        self.assertAlmostEqual(spent, tf_dpadam.epsilon_after_steps(
            steps=2, num_examples=_N, batch_size=4 * _B,
            noise_multiplier=1.0, delta=1e-5, accountant="pld"), places=9)
        self.assertIn(f"spent epsilon {spent:.3f} at delta 1e-05",
                      output.getvalue())
        self.assertEqual(results["config"]["noise_bands"], 4)

    def test_one_band_leaves_the_run_and_its_record_as_before(self):
        data = _tiny_data()
        model, _, results = training.train_private(
            _tiny_model, data, data, _config(noise_bands=1), _LOSS,
            verbose=0)
        # 10 steps evaluated every 3, independent noise, plain Poisson.
        self.assertEqual(results["steps"], 10)
        self.assertEqual([r["step"] for r in results["history"]],
                         [3, 6, 9, 10])
        self.assertEqual(model.optimizer.noise_bands, 1)
        self.assertIsNone(model.optimizer.noise_strategy)
        self.assertEqual({s.mechanism.bands
                          for s in model.privacy_ledger.segments}, {1})
        self.assertNotIn("noise_bands", results["config"])
        self.assertEqual(results["epsilon"], tf_dpadam.epsilon_after_steps(
            steps=10, num_examples=_N, batch_size=_B, noise_multiplier=1.0,
            delta=1e-5, accountant="pld"))

    def test_model_dir_records_the_bands_and_refuses_others_on_resume(self):
        data = _tiny_data()
        model_dir = tempfile.mkdtemp()

        def fit(**overrides):
            return training.fit_private(
                _tiny_model, data, data,
                _config(model_dir=model_dir, **overrides), _LOSS,
                validate=False, verbose=0)

        first = fit(epochs=4 * _B / _N)
        self.assertEqual(first["steps"], 4)
        record = runs.read_json(os.path.join(model_dir, runs.LEDGER))
        self.assertEqual(record["settings"]["noise_bands"], 4)
        self.assertEqual(first["ledger"], record["ledger"])
        self.assertEqual(
            {s["bands"] for s in record["ledger"]["segments"]},
            {4})
        # The noise history is saved beside the checkpoint.
        self.assertTrue(os.path.exists(os.path.join(model_dir,
                                                    "noise_state.npz")))
        for other in (1, 2):
            with self.assertRaisesRegex(
                    training.SettingsError,
                    f"--noise_bands: the run in {re.escape(model_dir)} was"
                    f" trained with 4, got {other} "):
                fit(epochs=8 * _B / _N, noise_bands=other)
        self.assertEqual(runs.read_json(os.path.join(
            model_dir, runs.LEDGER))["ledger"], record["ledger"])
        # The same b resumes: 4 more steps from step 4.
        resumed = fit(epochs=8 * _B / _N)
        self.assertEqual(resumed["steps"], 8)
        self.assertAlmostEqual(resumed["epsilon"], common.steps_epsilon(
            steps=8, num_examples=_N, batch_size=_B, noise_multiplier=1.0,
            delta=1e-5, noise_bands=4), places=9)

    def test_a_kill_before_the_first_checkpoint_resumes_to_a_record(self):
        # A kill (here an exception) at step 3 of 20, evaluated every 12:
        # no checkpoint, but the ledger reserved (and counts) 10 steps. The
        # resume starts the plan at step 12, a whole cycle of the 4 groups,
        # and takes 8 steps: 18 of the run's 20 (the study once crashed on
        # the unfinished record).
        data = _tiny_data()
        model_dir = tempfile.mkdtemp()
        config = _config(model_dir=model_dir, epochs=20 * _B / _N,
                         eval_every=12)

        class Kill(Exception):
            pass

        class KillAtStep3(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 3:
                    raise Kill()

        def train_fn(callbacks):
            return lambda config: training.fit_private(
                _tiny_model, data, data, config, _LOSS, validate=False,
                verbose=0, callbacks=callbacks)

        kwargs = dict(data={}, command="x", machine={})
        with self.assertRaises(Kill):
            runs.execute(model_dir, config, train_fn=train_fn([KillAtStep3()]),
                         **kwargs)
        self.assertFalse(run_dir_lib.has_checkpoint(model_dir))
        self.assertEqual(runs.read_json(os.path.join(
            model_dir, runs.LEDGER))["reserved_steps"], 10)
        record = runs.execute(model_dir, config, train_fn=train_fn([]),
                              **kwargs)
        self.assertIsNotNone(record)
        metrics = runs.read_json(os.path.join(model_dir, runs.METRICS))
        self.assertEqual((metrics["steps"], metrics["planned_steps"]),
                         (18, 18))
        # The 10 counted steps (3 rounds) and the 8 taken (2 rounds): the 5
        # rounds of the 20 planned.
        self.assertEqual(
            [(s["steps"], s["bands"]) for s in metrics["ledger"]["segments"]],
            [(10, 4), (8, 4)])
        self.assertAlmostEqual(record.epsilon, common.steps_epsilon(
            steps=20, num_examples=_N, batch_size=_B, noise_multiplier=1.0,
            delta=1e-5, noise_bands=4), places=9)
        # Read back, finished, without training.
        self.assertEqual(runs.execute(model_dir, config, train_fn=None,
                                      **kwargs), record)

    def test_random_access_sources_train_cyclic_batches(self):
        # A --data_source run reads its cyclic Poisson batches by random
        # access: the same steps, rounds and epsilon as from arrays.
        x, y = _tiny_data()
        source = training.record_sources.RecordSource(
            list(range(_N)), lambda records: (x[records], y[records]))
        model, batches, results = training.train_private(
            _tiny_model, source, (x, y), _config(), _LOSS, verbose=0)
        self.assertEqual(results["steps"], 8)
        self.assertEqual(batches.steps_per_epoch, 4)
        self.assertEqual({s.mechanism.bands
                          for s in model.privacy_ledger.segments}, {4})
        self.assertAlmostEqual(results["epsilon"], common.steps_epsilon(
            steps=8, num_examples=_N, batch_size=_B, noise_multiplier=1.0,
            delta=1e-5, noise_bands=4), places=9)


class NoiseBandsPlumbingTest(absltest.TestCase):

    def test_steps_calibrated_for_the_bands(self):
        config = _config(epochs=None, target_epsilon=3.0, batch_size=256)
        steps = common.total_steps(config, 60_000)
        self.assertEqual(steps, tf_dpadam.calibrate_steps(
            target_epsilon=3.0, num_examples=60_000, batch_size=256,
            noise_multiplier=1.0, delta=1e-5, accountant="pld", bands=4))
        self.assertEqual(steps % 4, 0)
        self.assertLessEqual(common.spent_epsilon(config, steps, 60_000), 3.0)
        self.assertGreater(
            common.spent_epsilon(config, steps + 1, 60_000), 3.0)
        # Rounding: a run's steps down (at least b), intervals up.
        self.assertEqual(common.bands_steps(10, 4), 8)
        self.assertEqual(common.bands_steps(3, 4), 4)
        self.assertEqual(common.bands_steps(3, 4, up=True), 4)
        self.assertEqual(common.bands_steps(9, 1), 9)
        self.assertEqual(training.eval_interval(_config(eval_every=50)), 52)

    def test_optimizer_and_privacy_settings(self):
        banded = common.make_optimizer(_config())
        self.assertEqual(banded.noise_bands, 4)
        self.assertIsNone(common.make_optimizer(
            _config(noise_bands=1)).noise_strategy)
        self.assertEqual(training.privacy_settings(
            _config(), _N, 1)["noise_bands"], 4)
        with self.assertRaisesRegex(ValueError, "noise_bands"):
            common.check_noise_bands("noise_bands", 65)

    def test_records_of_one_band_match_runs_recorded_before(self):
        plain = _config(noise_bands=1, model_dir="x")
        self.assertNotIn("noise_bands", runs.comparable_config(plain))
        self.assertEqual(runs.comparable_config(_config(model_dir="x"))[
            "noise_bands"], 4)
        folder = tempfile.mkdtemp()
        # A run recorded before the field reads back as b = 1 ...
        saved = runs.comparable_config(plain)
        runs.write_json(os.path.join(folder, runs.SIDECAR),
                        {"config": saved, "data": {}})
        runs.check_run_dir(folder, plain, {})
        # ... and is not a run with 4 bands.
        with self.assertRaisesRegex(ValueError, r"\(noise_bands\)"):
            runs.check_run_dir(folder, dataclasses.replace(
                plain, noise_bands=4), {})

    def test_study_cells_calibrate_sigma_for_the_bands(self):
        plain = study_plan.make_cell(target_epsilon=3.0, batch_size=256,
                                     num_examples=60_000, epochs=1.0)
        banded = study_plan.make_cell(target_epsilon=3.0, batch_size=256,
                                      num_examples=60_000, epochs=1.0,
                                      noise_bands=4)
        self.assertEqual(plain.name, "eps3_B256")
        self.assertEqual(banded.name, "eps3_B256_bands4")
        self.assertEqual(banded.base.noise_bands, 4)
        self.assertEqual(banded.steps % 4, 0)
        epsilon = common.steps_epsilon(
            steps=banded.steps, num_examples=60_000, batch_size=256,
            noise_multiplier=banded.base.noise_multiplier, delta=1e-5,
            noise_bands=4)
        self.assertBetween(epsilon, 3.0 - study_plan.EPSILON_TOLERANCE, 3.0)


if __name__ == "__main__":
    absltest.main()
