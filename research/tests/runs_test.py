"""research/runs.py: a run folder is written once, read back, resumed, and
refused when it holds another run; on recorded runs and a fake training."""

import dataclasses
import fcntl
import json
import os
import tempfile
import threading

from absl.testing import absltest

from research import common
from research import runs
from research.runs import Setting

from research.tests import research_helpers

_TESTDATA = research_helpers.TESTDATA
_BC = Setting("dpadam_corrected", 1e-3, None)
_DATA = {"task": "fashion_mnist", "dataset": "fashion_mnist",
         "max_examples": None}


def _config(model_dir, setting=_BC, seed=0):
    base = common.base_config("fashion_mnist", batch_size=16,
                                   target_epsilon=None, epochs=1.0)
    return runs.run_config(base, setting, seed, model_dir)


class NamesTest(absltest.TestCase):

    def test_run_names_and_gammas(self):
        adam = Setting("dpadam", 1e-3, 1e-8)
        self.assertEqual(runs.run_name(adam, 2), "dpadam_lr0.001_g1e-08_seed2")
        self.assertEqual(runs.run_name(_BC, 0),
                         "dpadam_corrected_lr0.001_gphi_seed0")
        self.assertEqual(runs.run_name(Setting("dpsgd", 4.0, None), 1),
                         "dpsgd_lr4_seed1")
        self.assertEqual(
            [runs.format_gamma(s) for s in (Setting("dpsgd", 1.0, None), _BC,
                                            adam)],
            ["-", "0.04·Φ", "1e-08"])
        self.assertEqual(runs.format_percent(0.81234), "81.23")
        self.assertEqual(runs.format_percent(float("nan")), "n/a")
        self.assertEqual(runs.format_seconds(None), "n/a")

    def test_run_config_keys_the_noise_with_the_seed(self):
        config = _config("/tmp/x", seed=3)
        self.assertEqual((config.optimizer, config.learning_rate,
                          config.epsilon, config.seed, config.noise_seed,
                          config.model_dir),
                         ("dpadam_corrected", 1e-3, None, 3, 3, "/tmp/x"))


class RunFolderTest(absltest.TestCase):

    def test_recorded_run_reads_back(self):
        model_dir = os.path.join(_TESTDATA, "runs_fashion_mnist",
                                 "dpsgd_lr1_seed0")
        base = common.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, epochs=1.0, eval_every=2)
        setting = Setting("dpsgd", 1.0, None)
        record = runs.load_record(
            model_dir, runs.run_config(base, setting, 0, model_dir), _DATA)
        self.assertEqual((record.name, record.setting, record.seed,
                          record.steps, record.num_examples),
                         ("dpsgd_lr1_seed0", setting, 0, 4, 64))
        self.assertEqual(record.accuracy, 0.21875)
        self.assertEqual(record.history, ((2, 0.0), (4, 0.21875)))
        self.assertEqual(record.command, "python -m research.reproduce")
        self.assertFalse(record.resumed)

    def test_execute_trains_once_then_reads_back(self):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        config = _config(model_dir)
        calls = []
        train_fn = research_helpers.fake_train_fn(lambda c: 0.75, calls)
        kwargs = dict(data=_DATA, command="python -m x",
                      machine={"platform": "p"})
        self.assertIsNone(runs.load_record(model_dir, config, _DATA))
        record = runs.execute(model_dir, config, train_fn=train_fn, **kwargs)
        self.assertEqual((record.accuracy, record.command), (0.75, "python -m x"))
        self.assertEqual(record.machine, {"platform": "p"})
        again = runs.execute(model_dir, config, train_fn=None, **kwargs)
        self.assertEqual(again, record)
        self.assertLen(calls, 1)

    def test_a_train_fn_that_stops_short_is_a_clear_error(self):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        config = _config(model_dir)
        finish = research_helpers.fake_train_fn(lambda c: 0.5)

        def short(config):  # Writes a record of 2 of 4 planned steps.
            results = dict(finish(config), steps=2)
            runs.write_json(os.path.join(model_dir, runs.METRICS), results)

        with self.assertRaisesRegex(
                RuntimeError, "reports 2 of 4 planned steps"):
            runs.execute(model_dir, config, train_fn=short, data=_DATA,
                         command="x", machine={})

    def test_interrupted_run_is_trained_again_as_resumed(self):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        config = _config(model_dir)
        os.makedirs(model_dir)
        # A session that stopped after its first checkpoint.
        with open(os.path.join(model_dir, runs.SIDECAR), "w") as f:
            json.dump({"config": runs.comparable_config(config),
                       "data": _DATA, "status": "running"}, f)
        open(os.path.join(model_dir, "checkpoint.keras"), "w").close()
        # It had trained 1000 s (training.ElapsedTime).
        with open(os.path.join(model_dir, runs.ELAPSED), "w") as f:
            json.dump({"wall_seconds": 1000.0}, f)
        self.assertIsNone(runs.load_record(model_dir, config, _DATA))
        record = runs.execute(model_dir, config,
                              train_fn=research_helpers.fake_train_fn(lambda c: 0.5),
                              data=_DATA, command="x", machine={})
        self.assertTrue(record.resumed)
        # The run's time counts the session before.
        self.assertBetween(record.wall_seconds, 1000.0, 1100.0)

    def test_other_hyperparameters_or_data_are_refused(self):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        config = _config(model_dir)
        runs.execute(model_dir, config, train_fn=research_helpers.fake_train_fn(lambda c: 0.5),
                     data=_DATA, command="x", machine={})
        other = dataclasses.replace(config, learning_rate=1e-2)
        with self.assertRaisesRegex(ValueError, r"other hyperparameters "
                                                r"\(learning_rate\)"):
            runs.check_run_dir(model_dir, other, _DATA)
        with self.assertRaisesRegex(ValueError, "other data"):
            runs.load_record(model_dir, config, dict(_DATA, max_examples=32))

    def test_runs_from_before_noise_seed_are_the_same_run(self):
        # Their config has no noise_seed; their seed keyed the noise.
        model_dir = tempfile.mkdtemp()
        config = _config(model_dir, seed=3)
        saved = dataclasses.asdict(config)
        del saved["noise_seed"]
        with open(os.path.join(model_dir, "metrics.json"), "w") as f:
            json.dump({"config": saved}, f)
        runs.check_run_dir(model_dir, config, data=None)
        other = dataclasses.replace(config, noise_seed=4)
        with self.assertRaisesRegex(ValueError, "noise_seed"):
            runs.check_run_dir(model_dir, other, data=None)

    def test_runs_from_before_normalization_and_augmult(self):
        # Their config has neither field: they trained the paper's CNN
        # without augmentation, and read back as such.
        model_dir = tempfile.mkdtemp()
        config = _config(model_dir)
        saved = dataclasses.asdict(config)
        del saved["normalization"], saved["augmult"]
        with open(os.path.join(model_dir, "metrics.json"), "w") as f:
            json.dump({"config": saved}, f)
        runs.check_run_dir(model_dir, config, data=None)
        for field, value in (("normalization", "group"), ("augmult", 2)):
            other = dataclasses.replace(config, **{field: value})
            with self.assertRaisesRegex(ValueError, rf"\({field}\)"):
                runs.check_run_dir(model_dir, other, data=None)

    def test_machine_info(self):
        info = runs.machine_info()
        for key in ("platform", "cpu_count", "python", "tensorflow", "keras"):
            self.assertIn(key, info)


class SharedRunsTest(absltest.TestCase):
    """Two processes on one study: a run another process holds (its LOCK,
    here held through a file description of its own, as flock treats one
    of another process) is left to it, then waited for."""

    def setUp(self):
        super().setUp()
        root = tempfile.mkdtemp()
        self.held = _config(os.path.join(root, "held"))
        self.free = _config(os.path.join(root, "free"), seed=1)
        os.makedirs(self.held.model_dir)
        self.lock = open(os.path.join(self.held.model_dir, runs.LOCK), "a")
        self.addCleanup(self.lock.close)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.calls = []
        self.kwargs = dict(data=_DATA, command="x", machine={})

    def _the_other_process(self, started, finishes):
        """Once `started` is set: finishes the held run (its metrics and a
        "done" sidecar, as `runs.execute` writes them) if `finishes`, else
        dies; either way its lock goes. Without `started` in 10 s (this
        process waits for the held run first), it gives up (`self.late`)."""
        self.late = not started.wait(timeout=10)
        if finishes:
            research_helpers.fake_train_fn(lambda c: 0.25)(self.held)
            runs.write_json(
                os.path.join(self.held.model_dir, runs.SIDECAR),
                {"config": runs.comparable_config(self.held), "data": _DATA,
                 "status": "done"})
        fcntl.flock(self.lock, fcntl.LOCK_UN)

    def _execute_all(self, finishes):
        started = threading.Event()
        train = research_helpers.fake_train_fn(lambda c: 0.5, self.calls)

        def train_fn(config):
            started.set()  # This process trains the free run meanwhile.
            return train(config)

        other = threading.Thread(target=self._the_other_process,
                                 args=(started, finishes))
        other.start()
        self.addCleanup(other.join)
        records = runs.execute_all(
            [self.held, self.free],
            train_fn=train_fn, **self.kwargs)
        self.assertFalse(self.late)
        return records

    def test_a_held_run_is_skipped_without_waiting(self):
        self.assertIsNone(runs.execute(
            self.held.model_dir, self.held, wait=False,
            train_fn=research_helpers.fake_train_fn(lambda c: 0.5, self.calls),
            **self.kwargs))
        self.assertEmpty(self.calls)

    def test_the_free_run_first_then_the_held_one_read_back(self):
        held, free = self._execute_all(finishes=True)
        self.assertEqual([c.model_dir for c in self.calls],
                         [self.free.model_dir])
        self.assertEqual((held.accuracy, free.accuracy), (0.25, 0.5))

    def test_a_run_whose_process_died_is_trained_here(self):
        held, free = self._execute_all(finishes=False)
        self.assertEqual([c.model_dir for c in self.calls],
                         [self.free.model_dir, self.held.model_dir])
        self.assertEqual((held.accuracy, free.accuracy), (0.5, 0.5))


if __name__ == "__main__":
    absltest.main()
