"""src/tf_dpadam/tools/run_dir.py: a run folder's lock, whole checkpoints and ledger."""

import contextlib
import errno
import fcntl
import io
import json
import os
import re
import shutil
import tempfile
from unittest import mock

import dp_accounting
import keras
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.tools import run_dir
from tf_dpadam.tools import run_ledger

_SETTINGS = dict(noise_multiplier=1.0, l2_norm_clip=1.0, batch_size=16,
                 num_examples=64, optimizer="dpadam_corrected",
                 physical_batch_size=8, accumulation_steps=2, delta=1e-5)


def _settings(**overrides):
    return run_dir.privacy_settings(**{**_SETTINGS, **overrides})


def _tiny_private_model(batch_size=16, noise_multiplier=1.0):
    keras.utils.set_random_seed(0)
    model = tf_dpadam.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
            batch_size=batch_size, learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(64, 3)).astype("float32"),
            rng.integers(0, 2, size=64))


def _pld_epsilon(steps, q, sigma, delta):
    """Independent of tf_dpadam: dp_accounting's PLD accountant (as
    tf_dpadam sets it up: add-or-remove-one, discretization 1e-3)."""
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-3)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


class SettingsTest(parameterized.TestCase):

    def test_settings_are_json_values_with_the_sampling_rate(self):
        settings = _settings()
        self.assertEqual(json.loads(json.dumps(settings)), settings)
        self.assertEqual(settings["sampling_rate"], 16 / 64)
        self.assertEqual(settings["sampling"], "poisson")
        self.assertEqual(settings["accountant"], "pld")

    @parameterized.named_parameters(
        ("sigma", "noise_multiplier", 1.2, "--noise_multiplier"),
        ("clip", "l2_norm_clip", 0.5, "--l2_norm_clip"),
        ("batch", "batch_size", 8, "--batch_size"),
        ("examples", "num_examples", 48, r"--max_examples \(N\)"),
        ("optimizer", "optimizer", "dpsgd", "--optimizer"),
        ("physical", "physical_batch_size", 16, "--physical_batch_size"),
        ("delta", "delta", 1e-6, "--delta"),
    )
    def test_a_changed_privacy_setting_is_refused(self, key, value, flag):
        saved = _settings()
        with self.assertRaisesRegex(
                run_dir.SettingsError,
                f"^{flag}: the run in DIR was trained with {saved[key]}, got"
                f" {value} "):
            run_dir.check_settings("DIR", saved, _settings(**{key: value}))

    def test_the_accountant_and_the_same_settings_pass(self):
        run_dir.check_settings("DIR", _settings(),
                               _settings(accountant="rdp"))

    def test_several_changes_in_one_line_and_derived_only_alone(self):
        changes = run_dir.settings_changes(
            "DIR", _settings(), _settings(noise_multiplier=2.0, batch_size=8,
                                          accumulation_steps=4))
        self.assertLen(changes, 2)  # k follows from B: not named as well.
        self.assertTrue(changes[0].startswith("--noise_multiplier: "))
        self.assertTrue(changes[1].startswith("--batch_size: "))
        only_k = run_dir.settings_changes(
            "DIR", _settings(), _settings(accumulation_steps=4))
        self.assertEqual(only_k, ["accumulation steps (--batch_size /"
                                  " --physical_batch_size): the run in DIR"
                                  " was trained with 2, got 4"])
        with self.assertRaises(ValueError) as raised:  # A ValueError.
            run_dir.check_settings("DIR", _settings(),
                                   _settings(noise_multiplier=2.0, delta=0.1))
        self.assertNotIn("\n", str(raised.exception))

    def test_checkpoint_settings_read_the_optimizer(self):
        model = _tiny_private_model()
        self.assertEqual(run_dir.checkpoint_settings(model), dict(
            noise_multiplier=1.0, l2_norm_clip=1.0, batch_size=16,
            optimizer="dpadam_corrected", accumulation_steps=1,
            noise_bands=1))


def _run_settings():
    """The settings of `_tiny_private_model` fit on `_data()`."""
    return _settings(physical_batch_size=None, accumulation_steps=1)


def _train(model_dir, steps, model=None, callbacks=(), **kwargs):
    """Trains `steps` more steps in `model_dir` (one epoch each, a
    checkpoint after each) in a held folder; the model."""
    x, y = _data()
    with run_dir.hold(model_dir):
        model = (model or run_dir.load_checkpoint(model_dir)
                 or _tiny_private_model())
        ledger = run_dir.begin_ledger(model_dir, _run_settings(), model,
                                      **kwargs)
        done = model.privacy_ledger.steps
        model.fit(x, y, steps_per_epoch=1, epochs=done + steps,
                  initial_epoch=done, verbose=0,
                  callbacks=[run_dir.AtomicCheckpoint(model_dir, ledger),
                             *callbacks])
    return model, ledger


def _record(model_dir):
    return run_dir.read_json(os.path.join(model_dir, run_dir.LEDGER))


class LedgerTest(absltest.TestCase):
    """A run's ledger.json beside its checkpoints (issue 49)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.base = tempfile.mkdtemp()
        _train(cls.base, 3)  # 3 steps, a checkpoint after each.
        cls.other_run = tempfile.mkdtemp()
        _train(cls.other_run, 2)  # Another run of the same settings.

    def copy(self, run=None):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        shutil.copytree(run or self.base, model_dir)
        return model_dir

    def resume(self, model_dir, **kwargs):
        """`begin_ledger` of the checkpoint (or a new model); the model."""
        model = run_dir.load_checkpoint(model_dir) or _tiny_private_model()
        run_dir.begin_ledger(model_dir, _run_settings(), model, **kwargs)
        return model

    def assert_refused(self, model_dir, message):
        before = sorted(os.listdir(model_dir))
        record = _record(model_dir)
        with self.assertRaisesRegex(run_dir.SettingsError, message) as error:
            self.resume(model_dir)
        self.assertNotIn("\n", str(error.exception))
        self.assertIn(run_ledger.COUNT_ALL_FLAG, str(error.exception))
        self.assertEqual(sorted(os.listdir(model_dir)), before)
        self.assertEqual(_record(model_dir), record)  # Nothing written.

    def test_the_record_is_the_checkpoints_ledger(self):
        record = _record(self.base)
        model = run_dir.load_checkpoint(self.base)
        self.assertEqual(record["ledger"], model.privacy_ledger.to_json())
        self.assertEqual((record["checkpoint_steps"],
                          record["reserved_steps"]), (3, 3))
        self.assertEqual(record["settings"], _run_settings())
        self.assertEqual(
            [n for n in os.listdir(self.base) if "partial" in n], [])

    def test_a_resume_of_agreeing_files_adds_nothing(self):
        model_dir = self.copy()
        model = self.resume(model_dir)
        self.assertEqual(model.privacy_ledger,
                         run_dir.load_checkpoint(self.base).privacy_ledger)

    @pytest.mark.slow
    def test_steps_reserved_after_the_checkpoint_are_counted(self):
        # A process killed 2 steps after its last checkpoint.
        model_dir = self.copy()
        record = _record(model_dir)
        record["reserved_steps"] = 5
        run_dir.write_json(os.path.join(model_dir, run_dir.LEDGER), record)
        model, ledger = _train(model_dir, 1)
        self.assertEqual(model.privacy_ledger.steps, 6)
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertEqual(model.privacy_ledger.segments[-2].mechanism.source,
                         run_ledger.ABANDONED)
        self.assertAlmostEqual(ledger.epsilon(),
                               _pld_epsilon(6, 16 / 64, 1.0, 1e-5), places=6)
        self.assertEqual(_record(model_dir)["ledger"],
                         model.privacy_ledger.to_json())

    @pytest.mark.slow
    def test_every_step_is_reserved_before_it_runs(self):
        model_dir = tempfile.mkdtemp()
        seen = []

        class Check(keras.callbacks.Callback):

            def on_train_batch_begin(self, batch, logs=None):
                reserved = _record(model_dir)["reserved_steps"]
                seen.append(reserved)
                assert reserved > self.model.privacy_ledger.steps, reserved

        x, y = _data()
        with run_dir.hold(model_dir):
            model = _tiny_private_model()
            ledger = run_dir.begin_ledger(model_dir, _run_settings(), model)
            model.fit(x, y, steps_per_epoch=13, verbose=0, callbacks=[
                run_dir.AtomicCheckpoint(model_dir, ledger), Check()])
        chunk = run_ledger.RESERVE_STEPS
        self.assertEqual(sorted(set(seen)), [chunk, 13])  # Two writes.
        self.assertEqual(_record(model_dir)["reserved_steps"], 13)

    def test_a_ledger_of_another_run_is_refused(self):
        model_dir = self.copy()
        shutil.copy(os.path.join(self.other_run, run_dir.LEDGER), model_dir)
        self.assert_refused(
            model_dir, r"^\S+/checkpoint.keras and \S+/ledger.json disagree:"
            r" the checkpoint's privacy ledger \(3 steps in 1 segment\) is"
            r" not the one the ledger records \(2 steps in 1 segment\)")
        model = self.resume(model_dir, count_all_steps=True)
        self.assertEqual(model.privacy_ledger.steps, 5)  # Both runs'.
        self.assertAlmostEqual(model.spent_epsilon(1e-5),
                               _pld_epsilon(5, 16 / 64, 1.0, 1e-5), places=6)

    def test_a_checkpoint_without_its_ledger_is_refused(self):
        model_dir = self.copy()
        os.remove(os.path.join(model_dir, run_dir.LEDGER))
        self.assert_refused(model_dir, r"^\S+/checkpoint.keras holds 3 steps"
                            r" but \S+/ledger.json is missing")
        self.assertEqual(
            self.resume(model_dir, count_all_steps=True).privacy_ledger.steps,
            3)

    @pytest.mark.slow
    def test_a_ledger_without_its_checkpoints_is_refused(self):
        model_dir = self.copy()
        for name in (run_dir.CHECKPOINT, run_dir.PREVIOUS_CHECKPOINT):
            os.remove(os.path.join(model_dir, name))
        self.assert_refused(model_dir, r"^\S+/ledger.json records a checkpoint"
                            r" of 3 steps but \S+/checkpoint.keras is missing")
        # A new model, which has spent the run's steps.
        model, _ = _train(model_dir, 1, count_all_steps=True)
        self.assertEqual(model.privacy_ledger.steps, 4)
        self.assertEqual(int(model.optimizer.iterations), 1)

    @pytest.mark.slow
    def test_a_checkpoint_saved_before_the_ledger_is_refused(self):
        model_dir = self.copy()
        # As a file of a tf_dpadam before the ledger loads: 3 steps of its
        # optimizer, none in its ledger.
        model = _tiny_private_model()
        model.optimizer.iterations.assign(3)
        with self.assertRaisesRegex(
                run_dir.SettingsError,
                r"^\S+/checkpoint.keras carries no privacy ledger \(saved"
                r" before tf_dpadam kept one\): its 3 steps"):
            run_dir.begin_ledger(model_dir, _run_settings(), model)
        run_dir.begin_ledger(model_dir, _run_settings(), model,
                             count_all_steps=True)
        # ledger.json's 3 steps; the optimizer's are the same steps.
        self.assertEqual(model.privacy_ledger.steps, 3)
        self.assertEqual(_record(model_dir)["ledger"],
                         model.privacy_ledger.to_json())

    @pytest.mark.slow
    def test_a_killed_first_process_is_counted_not_refused(self):
        model_dir = tempfile.mkdtemp()
        with run_dir.hold(model_dir):
            ledger = run_dir.begin_ledger(model_dir, _run_settings(),
                                          _tiny_private_model())
            ledger.reserve(1, 4)  # Then killed before its checkpoint.
        model, _ = _train(model_dir, 1)
        self.assertEqual(model.privacy_ledger.steps, 5)

    def test_the_checkpoints_settings_are_checked_too(self):
        model_dir = self.copy()
        os.remove(os.path.join(model_dir, run_dir.LEDGER))
        model = run_dir.load_checkpoint(model_dir)
        for settings, message in (
                (_settings(accumulation_steps=1, batch_size=8),
                 "^--batch_size: the run in .* was trained with 16, got 8"),
                (_settings(accumulation_steps=1, physical_batch_size=None,
                           num_examples=48),
                 r"^--max_examples \(N\): the run in .* was trained with 64,"
                 " got 48")):
            with self.assertRaisesRegex(run_dir.SettingsError, message):
                run_dir.begin_ledger(model_dir, settings, model,
                                     count_all_steps=True)
        self.assertFalse(os.path.exists(os.path.join(model_dir,
                                                     run_dir.LEDGER)))

    def test_a_damaged_ledger_is_refused(self):
        model_dir = tempfile.mkdtemp()
        with open(os.path.join(model_dir, run_dir.LEDGER), "w") as f:
            f.write('{"settings": ')
        with self.assertRaisesRegex(run_dir.SettingsError, "is damaged"):
            run_dir.RunLedger(model_dir)

    def test_begin_ledger_refuses_other_settings_before_writing(self):
        model_dir = self.copy()
        path = os.path.join(model_dir, run_dir.LEDGER)
        with open(path) as f:
            before = f.read()
        with self.assertRaisesRegex(run_dir.SettingsError, "^--delta: "):
            run_dir.begin_ledger(
                model_dir, _settings(physical_batch_size=None,
                                     accumulation_steps=1, delta=1e-6),
                run_dir.load_checkpoint(model_dir))
        with open(path) as f:
            self.assertEqual(f.read(), before)


class FolderTest(absltest.TestCase):

    def test_a_second_holder_is_refused_until_the_first_ends(self):
        model_dir = tempfile.mkdtemp()
        # flock locks are per open file: this open file stands in for
        # another process.
        with open(os.path.join(model_dir, run_dir.TRAIN_LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with self.assertRaisesRegex(run_dir.SettingsError,
                                        "another process is training"):
                with run_dir.hold(model_dir):
                    self.fail("held twice")
        with run_dir.hold(model_dir):
            with self.assertRaisesRegex(run_dir.SettingsError,
                                        "another process"):
                with run_dir.hold(model_dir):
                    self.fail("held twice")
        with run_dir.hold(model_dir):  # Released.
            pass

    def test_unwritable_folders_are_refused(self):
        blocker = os.path.join(tempfile.mkdtemp(), "file")
        open(blocker, "w").close()
        unwritable = [os.path.join(blocker, "run")]  # Under a file.
        if os.getuid() == 0:
            unwritable.append("/proc/self/fdinfo")  # Even root cannot.
        else:
            read_only = tempfile.mkdtemp()
            os.chmod(read_only, 0o500)
            unwritable.append(read_only)
        for model_dir in unwritable:
            with self.assertRaisesRegex(
                    run_dir.SettingsError,
                    f"^--model_dir={re.escape(model_dir)} is not writable"):
                with run_dir.hold(model_dir):
                    self.fail("held an unwritable folder")

    def test_hold_removes_what_a_killed_writer_left(self):
        model_dir = tempfile.mkdtemp()
        for name in ("checkpoint.123.partial.keras", "checkpoint.prev.9.partial",
                     "ledger.json.77.partial"):
            open(os.path.join(model_dir, name), "w").close()
        with run_dir.hold(model_dir):
            self.assertEqual(os.listdir(model_dir), [run_dir.TRAIN_LOCK])


def _os_error(code):
    return OSError(code, os.strerror(code))


class WriteFailureTest(absltest.TestCase):
    """Issue 52: a full disk or a folder made read-only mid-run is one line
    naming the file and the cause, and leaves no temporary file."""

    def assert_one_line(self, error, path, code):
        message = str(error)
        self.assertNotIn("\n", message)
        self.assertIn(f"Cannot write {path} ({os.strerror(code)},"
                      f" {errno.errorcode[code]})", message)

    @pytest.mark.slow
    def test_a_full_disk_at_a_checkpoint_leaves_the_last_one(self):
        model_dir = tempfile.mkdtemp()
        model, ledger = _train(model_dir, 1)
        before = sorted(os.listdir(model_dir))

        def fills_the_disk(model, path):
            with open(path, "w") as f:
                f.write("half a checkpoint")
            raise _os_error(errno.ENOSPC)

        x, y = _data()
        with mock.patch.object(run_dir, "write_model", fills_the_disk):
            with self.assertRaises(run_dir.SettingsError) as error:
                model.fit(x, y, steps_per_epoch=1, epochs=2,
                          initial_epoch=1, verbose=0,
                          callbacks=[run_dir.AtomicCheckpoint(model_dir,
                                                              ledger)])
        self.assert_one_line(error.exception, os.path.join(
            model_dir, run_dir.CHECKPOINT), errno.ENOSPC)
        self.assertEqual(sorted(os.listdir(model_dir)), before)
        self.assertEqual(int(run_dir.load_checkpoint(
            model_dir).optimizer.iterations.numpy()), 1)

    def test_a_crashed_writers_files_go_before_the_write_test(self):
        # The space a full disk lacks may be the crashed run's own files.
        model_dir = tempfile.mkdtemp()
        for name in ("checkpoint.123.partial.keras", ".write_test.77"):
            with open(os.path.join(model_dir, name), "w") as f:
                f.write("x" * 1000)

        def check(folder):
            self.assertEqual(os.listdir(folder), [run_dir.TRAIN_LOCK])

        with mock.patch.object(run_dir, "check_writable", check):
            with run_dir.hold(model_dir):
                pass


class ResumeLearningRateTest(absltest.TestCase):
    """Issue 52: --learning_rate on a resume was silently the checkpoint's."""

    @pytest.mark.slow
    def test_a_resume_takes_the_learning_rate_asked_for(self):
        model_dir = tempfile.mkdtemp()
        _train(model_dir, 1)  # learning_rate=0.01.
        model = run_dir.load_checkpoint(model_dir)
        run_dir.resume_learning_rate(model, None)  # Not given: kept.
        self.assertAlmostEqual(float(model.optimizer.learning_rate), 0.01)
        with self.assertLogs(level="INFO") as logs:
            run_dir.resume_learning_rate(model, 0.001)
        self.assertAlmostEqual(float(model.optimizer.learning_rate), 0.001)
        self.assertEqual([r.getMessage() for r in logs.records],
                         ["Resuming with learning_rate 0.001 (the"
                          " checkpoint's was 0.01)."])
        x, y = _data()
        model.fit(x, y, steps_per_epoch=1, verbose=0)
        self.assertAlmostEqual(float(model.optimizer.learning_rate), 0.001)

    def test_a_schedule_is_refused_in_one_line(self):
        model = _tiny_private_model()
        model.compile(optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=16,
            learning_rate=keras.optimizers.schedules.ExponentialDecay(
                0.1, 10, 0.5)), loss="mse")
        with self.assertRaisesRegex(
                run_dir.SettingsError,
                r"^--learning_rate=0.001: the checkpoint's optimizer has a"
                " learning-rate schedule") as error:
            run_dir.resume_learning_rate(model, 0.001)
        self.assertNotIn("\n", str(error.exception))


class ResumedTest(absltest.TestCase):

    def test_holds_the_folder_and_loads_with_the_learning_rate(self):
        model_dir = tempfile.mkdtemp()
        with run_dir.resumed(model_dir, 0.001) as model:
            self.assertIsNone(model)  # No checkpoint yet.
            self.assertTrue(os.path.exists(os.path.join(model_dir,
                                                        run_dir.TRAIN_LOCK)))
        _train(model_dir, 1)  # learning_rate=0.01.
        with run_dir.resumed(model_dir) as model:  # None: the checkpoint's.
            self.assertAlmostEqual(float(model.optimizer.learning_rate), 0.01)
        with run_dir.resumed(model_dir, 0.001) as model:
            self.assertAlmostEqual(float(model.optimizer.learning_rate),
                                   0.001)
            with self.assertRaisesRegex(run_dir.SettingsError,
                                        "another process is training"):
                with run_dir.hold(model_dir):
                    pass
        with run_dir.resumed(None, 0.001) as model:  # No run folder.
            self.assertIsNone(model)


class ProgressBarTest(absltest.TestCase):

    @pytest.mark.slow
    def test_epochs_count_to_the_runs_last_across_fit_calls(self):
        # Issue 52: Keras logged "Epoch 2/2" then "Epoch 3/3".
        model = _tiny_private_model()
        x, y = _data()
        bar = run_dir.ProgressBar(3)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for initial_epoch, epochs, length in ((0, 2, 2), (2, 3, 1)):
                model.fit(x, y, initial_epoch=initial_epoch, epochs=epochs,
                          steps_per_epoch=length, verbose=2,
                          callbacks=[bar])
        lines = [line for line in out.getvalue().splitlines()
                 if line.startswith("Epoch ")]
        self.assertEqual(lines, ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"])


class CheckpointTest(absltest.TestCase):

    @pytest.mark.slow
    def test_save_keeps_the_previous_and_load_falls_back(self):
        model_dir = tempfile.mkdtemp()
        self.assertIsNone(run_dir.load_checkpoint(model_dir))
        model = _tiny_private_model()
        x, y = _data()
        for _ in range(2):
            model.fit(x, y, steps_per_epoch=1, verbose=0)
            run_dir.save_checkpoint(model, model_dir)
        self.assertEqual(sorted(os.listdir(model_dir)),
                         [run_dir.CHECKPOINT, run_dir.PREVIOUS_CHECKPOINT])
        loaded = run_dir.load_checkpoint(model_dir)
        self.assertEqual(int(loaded.optimizer.iterations.numpy()), 2)
        self.assertIsInstance(loaded.optimizer, tf_dpadam.DPAdamCorrected)
        checkpoint = os.path.join(model_dir, run_dir.CHECKPOINT)
        with open(checkpoint, "wb") as f:
            f.write(b"PK\x03\x04 not a zip")
        with self.assertLogs(level="WARNING") as logs:
            loaded = run_dir.load_checkpoint(model_dir)
        self.assertEqual(int(loaded.optimizer.iterations.numpy()), 1)
        self.assertLen(logs.records, 1)
        line = logs.records[0].getMessage()
        self.assertIn(f"checkpoint.keras in {model_dir} is damaged", line)
        self.assertIn("resuming from the earlier checkpoint.prev.keras"
                      " (step 1)", line)
        os.remove(os.path.join(model_dir, run_dir.PREVIOUS_CHECKPOINT))
        with self.assertRaisesRegex(run_dir.SettingsError,
                                    "no earlier checkpoint loads"):
            run_dir.load_checkpoint(model_dir)

    @pytest.mark.slow
    def test_atomic_checkpoints_and_the_ledger_over_a_resume(self):
        model_dir = tempfile.mkdtemp()
        _train(model_dir, 2)  # A run of 2 steps, resumed to 5.
        _, ledger = _train(model_dir, 3)
        saved = run_dir.load_checkpoint(model_dir)
        self.assertEqual(int(saved.optimizer.iterations.numpy()), 5)
        self.assertEqual([s.steps for s in saved.privacy_ledger.segments],
                         [2, 3])
        self.assertEqual(_record(model_dir)["ledger"],
                         saved.privacy_ledger.to_json())
        self.assertAlmostEqual(ledger.epsilon(),
                               _pld_epsilon(5, 16 / 64, 1.0, 1e-5), places=6)


if __name__ == "__main__":
    absltest.main()
