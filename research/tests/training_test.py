"""research/training.py: the binaries' one training loop on tiny data."""

import contextlib
import fcntl
import io
import json
import os
import re
import tempfile
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from research import common
from research import runs
from research import training

import helpers
from research.tests import research_helpers


class LoopTest(absltest.TestCase):

    def test_training_accuracy_ignores_the_poisson_padding(self):
        # A model that always says class 1, on examples all of class 1: the
        # padding rows (label 0, weight 0) must not count as mistakes.
        import keras

        def model_fn():
            model = keras.Sequential([
                keras.Input((3,)),
                keras.layers.Dense(2, kernel_initializer="zeros",
                                   bias_initializer=keras.initializers
                                   .Constant([0.0, 100.0])),
            ])
            return model

        x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
        y = np.ones(64, "int64")
        config = research_helpers.train_config(optimizer="dpsgd", learning_rate=1e-6,
                         physical_batch_size=32, epochs=4 * 16 / 64)
        results = training.fit_private(
            model_fn, (x, y), (x, y), config,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.assertEqual([r["accuracy"] for r in results["history"]],
                         [1.0, 1.0])
        self.assertEqual(results["test_accuracy"], 1.0)

    def test_resume_keeps_the_curve_and_stop_at_step(self):
        x, y = _tiny_data()
        model_dir = tempfile.mkdtemp()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        # 64 examples, B = 16: 4 steps per epoch; 2 steps, then resumed to 4.
        first = training.fit_private(
            _tiny_model, (x, y), (x, y),
            research_helpers.train_config(epochs=2 * 16 / 64, model_dir=model_dir), loss)
        self.assertEqual([r["step"] for r in first["history"]], [2])
        # The wall time counts the sessions before a resume: say the first
        # took 1000 s.
        elapsed = os.path.join(model_dir, runs.ELAPSED)
        self.assertAlmostEqual(runs.seconds_spent(model_dir),
                               first["wall_seconds"], delta=5.0)
        with open(elapsed, "w") as f:
            json.dump({"wall_seconds": 1000.0}, f)
        second = training.fit_private(
            _tiny_model, (x, y), (x, y),
            research_helpers.train_config(epochs=4 * 16 / 64, model_dir=model_dir), loss)
        self.assertEqual([r["step"] for r in second["history"]], [2, 4])
        self.assertBetween(second["wall_seconds"], 1000.0, 1300.0)
        with open(os.path.join(model_dir, "metrics.json")) as f:
            self.assertEqual(json.load(f)["history"], second["history"])
        # A run killed after a checkpoint has no metrics.json yet: its
        # resume still keeps the curve (and time) up to the checkpoint.
        killed_dir = tempfile.mkdtemp()
        training.fit_private(
            _tiny_model, (x, y), (x, y),
            research_helpers.train_config(epochs=2 * 16 / 64, model_dir=killed_dir),
            loss)
        os.remove(os.path.join(killed_dir, runs.METRICS))
        resumed = training.fit_private(
            _tiny_model, (x, y), (x, y),
            research_helpers.train_config(epochs=4 * 16 / 64, model_dir=killed_dir),
            loss)
        self.assertEqual([r["step"] for r in resumed["history"]], [2, 4])
        self.assertEqual(runs.read_json(os.path.join(
            killed_dir, runs.ELAPSED))["history"], resumed["history"])
        # The resumed run's batches continue the run's (no replay).
        with mock.patch.object(tf_dpadam.data, "poisson_batches",
                               wraps=tf_dpadam.data.poisson_batches) as made:
            training.fit_private(
                _tiny_model, (x, y), (x, y),
                research_helpers.train_config(epochs=5 * 16 / 64,
                                     model_dir=model_dir), loss)
        self.assertEqual(made.call_args.kwargs["first_step"], 4)
        # StopAtStep ends an epoch early; no validation: no val_ metrics.
        _, _, results = training.train_private(
            _tiny_model, (x, y), (x, y), research_helpers.train_config(epochs=4 * 16 / 64), loss,
            callbacks=[training.StopAtStep(3)], validate=False)
        self.assertEqual((results["steps"], results["planned_steps"]), (3, 4))
        self.assertNotIn("val_accuracy", results["history"][0])


class FitSegmentsTest(absltest.TestCase):

    def test_every_epoch_is_as_long_as_the_steps_it_takes(self):
        # (initial_epoch, epochs, steps_per_epoch) of each fit call.
        self.assertEqual(training.fit_segments(0, 719, 100),
                         [(0, 7, 100), (7, 8, 19)])
        self.assertEqual(training.fit_segments(0, 400, 100), [(0, 4, 100)])
        # A resume after a shorter run (119 steps): up to the next
        # evaluation, then whole epochs, then the rest.
        self.assertEqual(training.fit_segments(119, 350, 100),
                         [(1, 2, 81), (2, 3, 100), (3, 4, 50)])
        self.assertEqual(training.fit_segments(5, 5, 2), [])
        self.assertEqual(training.fit_segments(0, 1, 100), [(0, 1, 1)])


class ProgressTest(absltest.TestCase):

    def test_live_bar_only_on_a_terminal(self):
        for tty, verbose in ((True, 1), (False, 2)):
            with mock.patch("sys.stdout") as stdout:
                stdout.isatty.return_value = tty
                self.assertEqual(training.progress_verbosity(), verbose)

    def test_epoch_lines_count_the_steps_and_tensorboard_gets_epsilon(self):
        x, y = _tiny_data()
        log_dir = tempfile.mkdtemp()
        # 5 steps evaluated every 2: epochs of 2, 2 and 1 steps (k = 1).
        config = research_helpers.train_config(epochs=5 * 16 / 64,
                                      physical_batch_size=None)
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            results = training.fit_private(
                _tiny_model, (x, y), (x, y), config,
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                callbacks=training.tensorboard_callbacks(log_dir),
                verbose=2)
        self.assertEqual(results["steps"], 5)
        self.assertEqual(re.findall(r"^(\d+/\d+) - ", output.getvalue(), re.M),
                         ["2/2", "2/2", "1/1"])
        # Every line counts to the run's last epoch, across the fit calls
        # (Keras': "Epoch 1/2", "Epoch 2/2", "Epoch 3/3"; issue 52).
        self.assertEqual(re.findall(r"^Epoch \d+/\d+", output.getvalue(), re.M),
                         ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"])
        scalars = _tensorboard_scalars(os.path.join(log_dir, "train"))
        self.assertEqual([s for s, _ in scalars["batch_epsilon"]],
                         [1, 2, 3, 4, 5])
        for step, value in scalars["batch_epsilon"]:
            self.assertAlmostEqual(
                value, tf_dpadam.epsilon_after_steps(
                    steps=step, num_examples=64, batch_size=16,
                    noise_multiplier=1.0, delta=1e-5,
                    accountant="pld"), places=4)  # The binaries' (PLD).
        for tag in ("batch_loss", "batch_accuracy"):
            self.assertLen(scalars[tag], 5)
        self.assertLen(scalars["epoch_epsilon"], 3)
        self.assertAlmostEqual(scalars["epoch_epsilon"][-1][1],
                               results["epsilon"], places=4)


def _tensorboard_scalars(folder):
    """{tag: [(step, value)]} of the event files in `folder`."""
    scalars = {}
    for name in sorted(os.listdir(folder)):
        for event in tf.compat.v1.train.summary_iterator(
                os.path.join(folder, name)):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


def _tiny_data(n=64):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.integers(0, 2, size=n))


def _tiny_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


class _RecordWeights(keras.callbacks.Callback):
    """The trainable weights after every step (k = 1)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(helpers.numpy_values(self.model.trainable_weights))


class AveragingTest(absltest.TestCase):
    """--ema and --weight_decay in the loop: training runs on the raw weights
    over several fit calls and a resume; evaluation, the test metrics and
    the returned model use the average; the checkpoint keeps both."""

    def test_raw_trajectory_average_and_resume(self):
        # B = N = 16: every example in every step (q = 1) and no noise, so
        # the run is deterministic whatever the secret seeds; 5 steps
        # evaluated every 2.
        data = _tiny_data(16)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def train(max_steps=None, **overrides):
            config = research_helpers.train_config(
                optimizer="dpsgd", learning_rate=0.5, noise_multiplier=0.0,
                batch_size=16, physical_batch_size=None, epochs=5.0,
                weight_decay=0.1, ema_momentum=0.5, **overrides)
            recorder = _RecordWeights()
            model, _, results = training.train_private(
                _tiny_model, data, data, config, loss, callbacks=[recorder],
                max_steps=max_steps, verbose=0)
            return model, results, recorder.steps

        # Without averaging: the raw trajectory, and its average.
        _, plain, raw = train()
        average = [raw[0]]
        for weights in raw[1:]:
            average.append([0.5 * a + 0.5 * w
                            for a, w in zip(average[-1], weights)])

        # Averaged, stopped after 3 steps (fit calls of 2 and 1 steps),
        # then resumed from the checkpoint for the last 2.
        model_dir = tempfile.mkdtemp()
        checkpoint = os.path.join(model_dir, "checkpoint.keras")
        for steps in (3, 5):
            model, results, trained = train(
                max_steps=steps, ema=True, model_dir=model_dir)
            # Each step trained the raw weights of the plain run ...
            for got, want in zip(trained, raw[steps - len(trained):steps]):
                _assert_all_close(got, want)
            # ... and the model returned holds their average, ...
            _assert_all_close(helpers.numpy_values(model.trainable_weights),
                              average[steps - 1])
            # ... which the test metrics and the last evaluation measured.
            self.assertEqual(results["history"][-1]["step"], steps)
            self.assertAlmostEqual(results["history"][-1]["val_loss"],
                                   results["test_loss"], places=6)
            # The checkpoint holds the raw weights (the average in the
            # optimizer's state), for the resume.
            saved = keras.models.load_model(checkpoint)
            _assert_all_close(helpers.numpy_values(saved.trainable_weights),
                              raw[steps - 1])
        self.assertEqual([r["step"] for r in results["history"]],
                         [2, 3, 4, 5])
        self.assertNotAlmostEqual(results["test_loss"], plain["test_loss"])
        optimizer = model.optimizer
        self.assertEqual((optimizer.weight_decay, optimizer.use_ema,
                          optimizer.ema_momentum), (0.1, True, 0.5))
        self.assertEqual(results["config"]["ema"], True)
        # A resume must average (and decay) as the checkpoint did.
        with self.assertRaisesRegex(training.SettingsError, "ema"):
            train(model_dir=model_dir)
        # ... and augment as it did (the checkpoint's model has K = 1).
        with self.assertRaisesRegex(training.SettingsError, "augmult"):
            train(model_dir=model_dir, ema=True, augmult=2)


def _assert_all_close(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class NoiseSeedTest(absltest.TestCase):
    """--seed sets the model and data order; --noise_seed the noise and batches."""

    def fit(self, noise_seed):
        """The weights after 2 steps at seed 0, and the seeds the library got."""
        data = _tiny_data()
        trained = []
        with mock.patch.object(
                tf_dpadam.data, "poisson_batches",
                wraps=tf_dpadam.data.poisson_batches) as sampling, \
                mock.patch.object(tf_dpadam, "make_private",
                                  wraps=tf_dpadam.make_private) as private:
            training.fit_private(
                _tiny_model, data, data,
                research_helpers.train_config(epochs=2 * 16 / 64, noise_seed=noise_seed),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                on_trained=lambda model: trained.append(model.get_weights()))
        return (trained[0], sampling.call_args.kwargs["seed"],
                private.call_args.kwargs["seed"])

    def test_default_noise_and_sampling_are_secret(self):
        first, sampling_seed, noise_seed = self.fit(None)
        self.assertIsNone(sampling_seed)
        self.assertIsNone(noise_seed)
        # Same --seed (model and data), other noise and batches.
        second = self.fit(None)[0]
        self.assertFalse(all(np.array_equal(a, b)
                             for a, b in zip(first, second)))

    def test_noise_seed_makes_a_run_reproducible(self):
        runs = []
        for _ in range(2):
            with self.assertWarnsRegex(UserWarning, "explicit seed=5"):
                runs.append(self.fit(5))
        self.assertEqual(runs[0][1:], (5, 5))
        for a, b in zip(runs[0][0], runs[1][0]):
            np.testing.assert_array_equal(a, b)


def _ledger(model_dir):
    return runs.read_json(os.path.join(model_dir, runs.LEDGER))


def _iterations(path):
    return int(keras.models.load_model(path).optimizer.iterations)


_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class RunDirTest(parameterized.TestCase):
    """Issue 34: a model_dir keeps its privacy settings and ledger, whole
    checkpoints, one process at a time."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # 2 steps (B = 16 of N = 64, physical batches of 8), a checkpoint
        # after each.
        cls.model_dir = tempfile.mkdtemp()
        cls.data = _tiny_data()
        cls.first = training.fit_private(
            _tiny_model, cls.data, cls.data,
            research_helpers.train_config(epochs=2 * 16 / 64, eval_every=1,
                                 model_dir=cls.model_dir), _LOSS,
            validate=False, verbose=0)

    def fit(self, model_dir, data=None, **overrides):
        config = dict(epochs=2 * 16 / 64, eval_every=1, model_dir=model_dir)
        config.update(overrides)
        return training.fit_private(
            _tiny_model, data or self.data, self.data,
            research_helpers.train_config(**config), _LOSS, validate=False,
            verbose=0)

    @parameterized.named_parameters(
        ("sigma", dict(noise_multiplier=1.2), "--noise_multiplier", "1.0",
         "1.2"),
        ("clip", dict(l2_norm_clip=0.5), "--l2_norm_clip", "1.0", "0.5"),
        ("batch", dict(batch_size=8), "--batch_size", "16", "8"),
        ("optimizer", dict(optimizer="dpadam"), "--optimizer",
         "dpadam_corrected", "dpadam"),
        ("physical", dict(physical_batch_size=16), "--physical_batch_size",
         "8", "16"),
        ("delta", dict(delta=1e-6), "--delta", "1e-05", "1e-06"),
        ("examples", dict(max_examples=48), r"--max_examples \(N\)", "64",
         "48"),
    )
    def test_resume_with_other_privacy_settings_is_refused(
            self, overrides, flag, saved, got):
        data = self.data
        if overrides.pop("max_examples", None):
            data = (data[0][:48], data[1][:48])
        before = _ledger(self.model_dir)
        with self.assertRaisesRegex(
                training.SettingsError,
                f"^{flag}: the run in {re.escape(self.model_dir)} was trained"
                f" with {saved}, got {got} "):
            self.fit(self.model_dir, data, epochs=4 * 16 / 64, **overrides)
        # Before any step: the ledger and the checkpoint are untouched.
        self.assertEqual(_ledger(self.model_dir), before)
        self.assertEqual(_iterations(os.path.join(self.model_dir,
                                                  runs.CHECKPOINT)), 2)

    def test_several_changes_in_one_line(self):
        with self.assertRaises(training.SettingsError) as raised:
            self.fit(self.model_dir, noise_multiplier=1.2, batch_size=8)
        message = str(raised.exception)
        self.assertNotIn("\n", message)
        self.assertIn("--noise_multiplier: ", message)
        self.assertIn("; --batch_size: ", message)

    def test_resume_with_more_steps_extends_the_ledger(self):
        model_dir = tempfile.mkdtemp()
        self.fit(model_dir)
        # More steps and another evaluation interval: allowed.
        results = self.fit(model_dir, epochs=5 * 16 / 64, eval_every=2)
        record = _ledger(model_dir)
        # One segment per `fit` (the resume's 3 steps in two: evaluations
        # every 2 steps), in the model's ledger and ledger.json.
        self.assertEqual([s["steps"] for s in record["ledger"]["segments"]],
                         [2, 2, 1])
        self.assertEqual(record["settings"]["noise_multiplier"], 1.0)
        self.assertEqual(results["ledger"], record["ledger"])
        self.assertEqual(results["steps"], 5)
        self.assertAlmostEqual(
            results["epsilon"], tf_dpadam.epsilon_after_steps(
                steps=5, num_examples=64, batch_size=16,
                noise_multiplier=1.0, delta=1e-5,
                accountant=common.ACCOUNTANT), places=9)

    def test_a_resume_takes_the_learning_rate_asked_for(self):
        # Issue 52: a resume kept the checkpoint's learning rate, whatever
        # --learning_rate said; and its bar counted to each fit's last epoch.
        model_dir = tempfile.mkdtemp()
        self.fit(model_dir, eval_every=2)  # lr 1e-3, steps 1-2: epoch 1.
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            results = training.fit_private(
                _tiny_model, self.data, self.data, research_helpers.
                train_config(epochs=5 * 16 / 64, model_dir=model_dir), _LOSS,
                validate=False, verbose=2, learning_rate=0.25)
        self.assertEqual(results["steps"], 5)
        checkpoint = keras.models.load_model(
            os.path.join(model_dir, runs.CHECKPOINT))
        self.assertEqual(float(checkpoint.optimizer.learning_rate), 0.25)
        # Steps 3-4 and 5: two fit calls, epochs 2 and 3 of 3.
        self.assertEqual(re.findall(r"^Epoch (\d+/\d+)$", output.getvalue(),
                                    re.M), ["2/3", "3/3"])
        # None (no --learning_rate): the checkpoint's, not the config's.
        self.fit(model_dir, epochs=6 * 16 / 64)
        checkpoint = keras.models.load_model(
            os.path.join(model_dir, runs.CHECKPOINT))
        self.assertEqual(float(checkpoint.optimizer.learning_rate), 0.25)

    def test_damaged_checkpoint_falls_back_to_the_earlier_one(self):
        model_dir = tempfile.mkdtemp()
        self.fit(model_dir)  # Checkpoints of steps 1 (prev) and 2.
        checkpoint = os.path.join(model_dir, runs.CHECKPOINT)
        previous = os.path.join(model_dir, runs.PREVIOUS_CHECKPOINT)
        self.assertEqual(_iterations(previous), 1)
        for damage in (b"", b"PK\x03\x04 not a zip"):
            with open(checkpoint, "wb") as f:
                f.write(damage)
            with self.assertLogs(level="WARNING") as logs:
                results = self.fit(model_dir, epochs=3 * 16 / 64)
            self.assertLen(logs.records, 1)
            line = logs.records[0].getMessage()
            self.assertIn(f"checkpoint.keras in {model_dir} is damaged", line)
            self.assertIn("resuming from the earlier checkpoint.prev.keras"
                          " (step 1)", line)
            self.assertNotIn("\n", line)
            # From step 1, but the lost step 2 was taken: it is counted
            # (ledger.json holds it), and only step 3 runs.
            self.assertEqual(results["steps"], 3)
            self.assertEqual([s["steps"] for s in
                              _ledger(model_dir)["ledger"]["segments"]],
                             [2, 1])
            self.assertEqual(_iterations(checkpoint), 2)
            with open(checkpoint, "wb") as f:
                f.write(damage)
            os.remove(previous)  # The damaged file before step 3.
            with self.assertRaisesRegex(
                    training.SettingsError,
                    "checkpoint.keras in .* is damaged .* no earlier"
                    " checkpoint loads"):
                self.fit(model_dir, epochs=3 * 16 / 64)
            model_dir = tempfile.mkdtemp()
            self.fit(model_dir)
            checkpoint = os.path.join(model_dir, runs.CHECKPOINT)
            previous = os.path.join(model_dir, runs.PREVIOUS_CHECKPOINT)

    def test_a_second_process_is_refused(self):
        model_dir = tempfile.mkdtemp()
        # Another holder of the lock (flock locks are per open file, so
        # this process's own open file stands in for another process).
        with open(os.path.join(model_dir, runs.TRAIN_LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with self.assertRaisesRegex(training.SettingsError,
                                        "another process is training"):
                self.fit(model_dir)
            self.assertFalse(os.path.exists(
                os.path.join(model_dir, runs.CHECKPOINT)))
        # Released when the holder ends (here: closes it).
        self.assertEqual(self.fit(model_dir)["steps"], 2)
        with open(os.path.join(model_dir, runs.TRAIN_LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Free again.

    def test_unwritable_model_dir_is_refused_before_any_step(self):
        blocker = tempfile.mktemp()
        open(blocker, "w").close()
        unwritable = [os.path.join(blocker, "run")]  # Under a file.
        if os.getuid() == 0:
            unwritable.append("/proc/self/fdinfo")  # Even root cannot.
        else:
            read_only = tempfile.mkdtemp()
            os.chmod(read_only, 0o500)
            unwritable.append(read_only)
        for model_dir in unwritable:
            built = []
            with self.assertRaisesRegex(
                    training.SettingsError,
                    f"--model_dir={re.escape(model_dir)} is not writable"):
                training.fit_private(
                    lambda: built.append(1) or _tiny_model(), self.data,
                    self.data, research_helpers.train_config(model_dir=model_dir,
                                                    epochs=0.5), _LOSS)
            self.assertEqual(built, [])


if __name__ == "__main__":
    absltest.main()
