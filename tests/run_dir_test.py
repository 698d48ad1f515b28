"""tf_dpadam/run_dir.py: a run folder's lock, whole checkpoints and ledger."""

import fcntl
import json
import math
import os
import re
import tempfile

import dp_accounting
import keras
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam import run_dir

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
            optimizer="dpadam_corrected", accumulation_steps=1))


class LedgerTest(absltest.TestCase):

    def test_resumed_segments_cut_the_steps_past_the_checkpoint(self):
        segments = [dict(first_step=0, steps=5), dict(first_step=5, steps=4),
                    dict(first_step=9, steps=3)]
        # The checkpoint holds 7 steps: the second segment ends at 7, the
        # third (steps 10-12, lost with its process) is dropped.
        self.assertEqual(run_dir.resumed_segments(segments, 7),
                         [dict(first_step=0, steps=5),
                          dict(first_step=5, steps=2)])
        self.assertEqual(run_dir.resumed_segments(segments, 0), [])
        self.assertEqual(segments[1]["steps"], 4)  # Not modified.

    def test_epsilon_is_the_composition_of_all_segments(self):
        settings = _settings()
        segments = [dict(first_step=0, steps=30, settings=settings),
                    dict(first_step=30, steps=20,
                         settings=dict(settings, accountant="pld"))]
        self.assertAlmostEqual(run_dir.ledger_epsilon(segments),
                               _pld_epsilon(50, 16 / 64, 1.0, 1e-5),
                               places=6)
        self.assertEqual(run_dir.ledger_epsilon([]), 0.0)
        silent = [dict(first_step=0, steps=3,
                       settings=_settings(noise_multiplier=0.0))]
        self.assertEqual(run_dir.ledger_epsilon(silent), math.inf)
        mixed = segments[:1] + [dict(first_step=30, steps=1,
                                     settings=_settings(batch_size=8))]
        with self.assertRaisesRegex(ValueError, "other settings"):
            run_dir.ledger_epsilon(mixed)

    def test_begin_record_and_read_back(self):
        model_dir = tempfile.mkdtemp()
        ledger = run_dir.RunLedger(model_dir)
        self.assertIsNone(ledger.settings)
        ledger.begin(_settings(), 0)
        ledger.record(3)
        again = run_dir.RunLedger(model_dir)
        self.assertEqual(again.settings, _settings())
        self.assertEqual([(s["first_step"], s["steps"])
                          for s in again.segments], [(0, 3)])
        # A second process resumes a checkpoint of 2 steps (the third was
        # lost): its segment begins at 2.
        again.begin(_settings(), 2)
        again.record(6)
        self.assertEqual([(s["first_step"], s["steps"])
                          for s in run_dir.RunLedger(model_dir).segments],
                         [(0, 2), (2, 4)])
        self.assertEqual(again.steps(), 6)
        self.assertAlmostEqual(again.epsilon(),
                               _pld_epsilon(6, 16 / 64, 1.0, 1e-5), places=6)
        self.assertEqual(
            [n for n in os.listdir(model_dir) if "partial" in n], [])

    def test_a_damaged_ledger_is_refused(self):
        model_dir = tempfile.mkdtemp()
        with open(os.path.join(model_dir, run_dir.LEDGER), "w") as f:
            f.write('{"settings": ')
        with self.assertRaisesRegex(run_dir.SettingsError, "is damaged"):
            run_dir.RunLedger(model_dir)

    def test_begin_ledger_refuses_before_writing(self):
        model_dir = tempfile.mkdtemp()
        run_dir.begin_ledger(model_dir, _settings())
        path = os.path.join(model_dir, run_dir.LEDGER)
        with open(path) as f:
            before = f.read()
        with self.assertRaisesRegex(run_dir.SettingsError, "^--delta: "):
            run_dir.begin_ledger(model_dir, _settings(delta=1e-6))
        with open(path) as f:
            self.assertEqual(f.read(), before)

    def test_a_checkpoint_without_ledger_is_checked_by_its_optimizer(self):
        model = _tiny_private_model(batch_size=32)
        with self.assertRaisesRegex(
                run_dir.SettingsError,
                "^--batch_size: the run in .* was trained with 32, got 16"):
            run_dir.begin_ledger(tempfile.mkdtemp(),
                                 _settings(accumulation_steps=1), model)


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
        for name in ("checkpoint.123.partial.keras", "checkpoint.prev.9.partial"):
            open(os.path.join(model_dir, name), "w").close()
        with run_dir.hold(model_dir):
            self.assertEqual(os.listdir(model_dir), [run_dir.TRAIN_LOCK])


class CheckpointTest(absltest.TestCase):

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
        x, y = _data()
        settings = _settings(physical_batch_size=None, accumulation_steps=1)
        for steps in (2, 5):  # A run of 2 steps, resumed to 5.
            with run_dir.hold(model_dir):
                model = (run_dir.load_checkpoint(model_dir)
                         or _tiny_private_model())
                ledger = run_dir.begin_ledger(model_dir, settings, model)
                done = int(model.optimizer.iterations.numpy())
                model.fit(x, y, steps_per_epoch=1, epochs=steps,
                          initial_epoch=done, verbose=0,
                          callbacks=[run_dir.AtomicCheckpoint(model_dir,
                                                              ledger)])
        saved = run_dir.load_checkpoint(model_dir)
        self.assertEqual(int(saved.optimizer.iterations.numpy()), 5)
        ledger = run_dir.RunLedger(model_dir)
        self.assertEqual([(s["first_step"], s["steps"])
                          for s in ledger.segments], [(0, 2), (2, 3)])
        self.assertAlmostEqual(ledger.epsilon(),
                               _pld_epsilon(5, 16 / 64, 1.0, 1e-5), places=6)


if __name__ == "__main__":
    absltest.main()
