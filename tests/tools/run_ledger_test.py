"""src/tf_dpadam/tools/run_ledger.py: a run folder's privacy record and the rules of a
resume (pure: ledgers and records, no model)."""

import json
import re

import dp_accounting
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.tools import run_ledger
from tf_dpadam.accounting import ledger as ledger_lib

_SETTINGS = run_ledger.privacy_settings(
    noise_multiplier=1.0, l2_norm_clip=1.0, batch_size=16, num_examples=64,
    optimizer="dpsgd", physical_batch_size=None, accumulation_steps=1,
    delta=1e-5)
_RUN = ledger_lib.Mechanism.poisson(1.0, 64, 16)
_OTHER_RUN = ledger_lib.Mechanism.poisson(0.5, 64, 16)
_FLAG = re.escape(run_ledger.COUNT_ALL_FLAG)


def _ledger(*steps, mechanism=_RUN, ids="abcdefgh"):
    return ledger_lib.Ledger(tuple(
        ledger_lib.Segment(mechanism, n, segment_id)
        for n, segment_id in zip(steps, ids)))


def _record(ledger, reserved=None, checkpoint_steps=-1):
    return run_ledger.Record(
        _SETTINGS, ledger,
        ledger.steps if checkpoint_steps == -1 else checkpoint_steps,
        ledger.steps if reserved is None else reserved)


def _checkpoint(ledger, carries_ledger=True, iterations=None):
    return run_ledger.Checkpoint(
        ledger, ledger.steps if iterations is None else iterations,
        carries_ledger)


def _pld_epsilon(*mechanisms_and_steps):
    """Independent: dp_accounting's PLD accountant as tf_dpadam sets it up
    (add-or-remove-one, value discretization 1e-3)."""
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-3)
    for mechanism, steps in mechanisms_and_steps:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(
            mechanism.sampling_rate,
            dp_accounting.GaussianDpEvent(mechanism.noise_multiplier)), steps)
    return accountant.get_epsilon(1e-5)


class RecordTest(absltest.TestCase):

    def test_round_trip_through_json(self):
        record = _record(_ledger(3, 2), reserved=9)
        value = json.loads(json.dumps(record.to_json()))
        self.assertEqual(value["format"], run_ledger.FORMAT)
        self.assertEqual(value["reserved_steps"], 9)
        self.assertEqual(run_ledger.Record.from_json(value), record)
        none_yet = _record(_ledger(), reserved=4, checkpoint_steps=None)
        self.assertEqual(run_ledger.Record.from_json(none_yet.to_json()),
                         none_yet)

    def test_a_reservation_is_never_below_the_ledger(self):
        value = _record(_ledger(5)).to_json()
        value["reserved_steps"] = 2
        self.assertEqual(run_ledger.Record.from_json(value).reserved_steps, 5)

    def test_a_ledger_from_before_the_model_ledger_is_read(self):
        old = {"settings": _SETTINGS, "segments": [
            {"first_step": 0, "steps": 30, "settings": _SETTINGS},
            {"first_step": 30, "steps": 0, "settings": _SETTINGS},
            {"first_step": 30, "steps": 20, "settings": _SETTINGS}]}
        record = run_ledger.Record.from_json(old)
        self.assertEqual(record.settings, _SETTINGS)
        self.assertEqual([s.steps for s in record.ledger.segments], [30, 20])
        self.assertEqual((record.checkpoint_steps, record.reserved_steps),
                         (50, 50))
        self.assertEqual(record.ledger.segments[0].mechanism.sampling_rate,
                         16 / 64)

    def test_damaged_records_are_value_errors(self):
        for value in (None, [], {"format": 1}, {"format": 2},
                      {"format": 2, "settings": None, "ledger": {}}):
            with self.assertRaises(ValueError):
                run_ledger.Record.from_json(value)


class HistoryTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("same", (3, 2), (3, 2), True),
        ("last_segment_shorter", (3, 5), (3, 2), True),
        ("fewer_segments", (3, 2, 4), (3,), True),
        ("partial_segment_then_more", (3, 2, 4), (3, 1), True),
        ("empty", (3,), (), True),
        ("longer", (3,), (3, 2), False),
        ("more_steps", (3, 2), (3, 5), False),
        ("an_earlier_segment_differs", (3, 2), (4, 2), False),
    )
    def test_extends(self, longer, shorter, expected):
        self.assertEqual(run_ledger.extends(_ledger(*longer),
                                            _ledger(*shorter)), expected)

    def test_other_ids_or_mechanisms_are_another_history(self):
        self.assertFalse(run_ledger.extends(_ledger(3), _ledger(3, ids="z")))
        self.assertFalse(run_ledger.extends(
            _ledger(3), _ledger(3, mechanism=_OTHER_RUN)))

    def test_agrees_both_ways_within_the_reservation(self):
        checkpoint = _ledger(3, 4)
        self.assertTrue(run_ledger.agrees(checkpoint, _record(_ledger(3, 4))))
        # An older checkpoint (the newer one damaged).
        self.assertTrue(run_ledger.agrees(_ledger(3, 1),
                                          _record(_ledger(3, 4))))
        # A newer checkpoint (a kill between its rename and the record's
        # write): within the record's reservation only.
        self.assertTrue(run_ledger.agrees(checkpoint,
                                          _record(_ledger(3, 2), reserved=7)))
        self.assertFalse(run_ledger.agrees(
            checkpoint, _record(_ledger(3, 2), reserved=6)))
        self.assertFalse(run_ledger.agrees(checkpoint,
                                           _record(_ledger(7, ids="xy"))))


class ProblemTest(absltest.TestCase):

    def problem(self, checkpoint, record):
        return run_ledger.problem("D/checkpoint.keras", "D/ledger.json",
                                  checkpoint, record)

    def test_agreeing_files_and_new_runs_pass(self):
        self.assertIsNone(self.problem(None, None))
        self.assertIsNone(self.problem(_checkpoint(_ledger(3)),
                                       _record(_ledger(3), reserved=9)))
        # No process saved a checkpoint yet; its reserved steps count.
        self.assertIsNone(self.problem(
            None, _record(_ledger(), reserved=4, checkpoint_steps=None)))

    def test_each_refusal_names_both_files_and_the_flag(self):
        cases = {
            "D/ledger.json records a checkpoint of 3 steps but"
            " D/checkpoint.keras is missing; pass " + _FLAG + " to start"
            " over counting its 9 steps, or use another --model_dir.$":
                (None, _record(_ledger(3), reserved=9)),
            "D/checkpoint.keras holds 3 steps but D/ledger.json is missing,"
            " so the steps after that checkpoint are unknown; pass " + _FLAG
            + " to resume counting the checkpoint's steps only, or use"
            " another --model_dir.$": (_checkpoint(_ledger(3)), None),
            r"D/checkpoint.keras and D/ledger.json disagree: the"
            r" checkpoint's privacy ledger \(3 steps in 1 segment\) is not"
            r" the one the ledger records \(7 steps in 2 segments\), e.g. a"
            r" ledger.json of another run; pass " + _FLAG + " to resume"
            " counting the steps of both, or use another --model_dir.$":
                (_checkpoint(_ledger(3)), _record(_ledger(3, 4, ids="xy"))),
            r"D/checkpoint.keras carries no privacy ledger \(saved before"
            r" tf_dpadam kept one\): its 5 steps cannot be checked against"
            " D/ledger.json; pass " + _FLAG + " to count the steps of both,"
            " or use another --model_dir.$":
                (_checkpoint(_ledger(), False, 5), _record(_ledger(5))),
        }
        for pattern, (checkpoint, record) in cases.items():
            message = self.problem(checkpoint, record)
            self.assertRegex(message, "^" + pattern)
            self.assertNotIn("\n", message)


class RestoreTest(absltest.TestCase):

    def restore(self, checkpoint, record):
        return run_ledger.to_restore(checkpoint, record,
                                     run_ledger.mechanism_of(_SETTINGS))

    def resumed(self, checkpoint, record):
        """The resumed model's ledger (`ModelLedger.restore` merges)."""
        known = ledger_lib.Ledger() if checkpoint is None else checkpoint.ledger
        return known.merged(self.restore(checkpoint, record))

    def test_agreeing_files_add_nothing(self):
        ledger = _ledger(3, 4)
        self.assertEqual(self.resumed(_checkpoint(ledger), _record(ledger)),
                         ledger)
        self.assertEqual(self.resumed(None, None), ledger_lib.Ledger())

    def test_reserved_steps_after_the_checkpoint_are_added(self):
        resumed = self.resumed(_checkpoint(_ledger(3, 4)),
                               _record(_ledger(3, 4), reserved=12))
        self.assertEqual([s.steps for s in resumed.segments], [3, 4, 5])
        added = resumed.segments[-1]
        self.assertEqual(added.mechanism,
                         run_ledger.mechanism_of(_SETTINGS))
        self.assertEqual(added.mechanism.source, run_ledger.ABANDONED)
        self.assertNotIn(added.id, "abcdefgh")

    def test_an_older_or_newer_checkpoint_gets_the_reservation(self):
        record = _record(_ledger(3, 4), reserved=12)
        # The newer checkpoint was damaged: its steps are counted.
        self.assertEqual(self.resumed(_checkpoint(_ledger(3, 1)),
                                      record).steps, 12)
        # A kill between the checkpoint's rename and the record's write.
        self.assertEqual(self.resumed(_checkpoint(_ledger(3, 6)),
                                      record).steps, 12)

    def test_a_process_killed_before_any_checkpoint(self):
        record = _record(_ledger(), reserved=4, checkpoint_steps=None)
        self.assertEqual(self.resumed(None, record).steps, 4)
        # Its restart killed too: the steps found before are kept.
        again = _record(self.resumed(None, record), reserved=7,
                        checkpoint_steps=None)
        self.assertEqual(self.resumed(None, again).steps, 7)

    def test_resumed_again_keeps_the_added_segment(self):
        first = self.resumed(_checkpoint(_ledger(3)),
                             _record(_ledger(3), reserved=5))
        # The restart's record holds the added steps, its checkpoint not.
        second = self.resumed(_checkpoint(_ledger(3)),
                              _record(first, reserved=9,
                                      checkpoint_steps=3))
        self.assertEqual(second.segments[:2], first.segments)
        self.assertEqual([s.steps for s in second.segments], [3, 2, 4])

    def test_disagreeing_files_count_both_and_the_reservation(self):
        mine, theirs = _ledger(30), _ledger(20, mechanism=_OTHER_RUN, ids="z")
        resumed = self.resumed(_checkpoint(mine),
                               _record(theirs, reserved=26))
        self.assertEqual([(s.steps, s.mechanism.noise_multiplier)
                          for s in resumed.segments],
                         [(30, 1.0), (20, 0.5), (6, 1.0)])
        self.assertAlmostEqual(
            resumed.epsilon(1e-5),
            _pld_epsilon((_RUN, 36), (_OTHER_RUN, 20)), delta=1e-3)
        self.assertGreater(resumed.epsilon(1e-5), mine.epsilon(1e-5))
        self.assertGreater(resumed.epsilon(1e-5), theirs.epsilon(1e-5))

    def test_reserved_steps_of_a_banded_run_count_its_cyclic_groups(self):
        # A run with b = 4 bands killed before its first checkpoint, 10
        # steps reserved: they were cyclic Poisson steps over 4 groups, so
        # they count as ceil(10 / 4) = 3 Poisson steps at q = 4 B / N, not
        # as 10 at q = B / N (whose epsilon is smaller: a kill once
        # printed it).
        settings = dict(_SETTINGS, noise_bands=4)
        mechanism = run_ledger.mechanism_of(settings)
        self.assertEqual((mechanism.bands, mechanism.sampling_rate),
                         (4, 4 * 16 / 64))
        record = run_ledger.Record(settings, _ledger(), None, 10)
        resumed = run_ledger.to_restore(None, record, mechanism)
        self.assertEqual([(s.steps, s.mechanism.bands)
                          for s in resumed.segments], [(10, 4)])
        cyclic = ledger_lib.Mechanism.poisson(1.0, 64, 4 * 16)
        self.assertAlmostEqual(resumed.epsilon(1e-5),
                               _pld_epsilon((cyclic, 3)), delta=1e-3)
        self.assertGreater(resumed.epsilon(1e-5),
                           _pld_epsilon((_RUN, 10)) + 0.5)
        # A checkpoint from before the model's ledger: its steps likewise.
        before = run_ledger.to_restore(
            _checkpoint(_ledger(), False, 8), None, mechanism)
        self.assertEqual(before.segments[0].mechanism.bands, 4)

    def test_deleted_checkpoints_start_from_the_record(self):
        resumed = self.resumed(None, _record(_ledger(3, 4), reserved=9))
        self.assertEqual([s.steps for s in resumed.segments], [3, 4, 2])

    def test_a_checkpoint_without_ledger_counts_its_optimizer_steps(self):
        before = self.resumed(_checkpoint(_ledger(), False, 8), None)
        self.assertEqual(before.steps, 8)
        self.assertEqual(before.segments[0].mechanism.source,
                         run_ledger.BEFORE_LEDGER)
        # With the record of those steps: counted once.
        record = _record(_ledger(8))
        self.assertEqual(self.resumed(_checkpoint(_ledger(), False, 8),
                                      record).steps, 8)
        self.assertEqual(self.resumed(_checkpoint(_ledger(), False, 11),
                                      record).steps, 11)


class ReservationTest(absltest.TestCase):

    def test_a_chunk_at_a_time_within_the_epoch(self):
        chunk = run_ledger.RESERVE_STEPS
        self.assertEqual(run_ledger.reservation(0, 0, 1), chunk)
        self.assertEqual(run_ledger.reservation(0, 0, 1, left=3), 3)
        self.assertIsNone(run_ledger.reservation(4, chunk, 1))
        self.assertIsNone(run_ledger.reservation(chunk - 1, chunk, 1))
        self.assertEqual(run_ledger.reservation(chunk, chunk, 1),
                         2 * chunk)
        # A call of more steps than a chunk reserves them all.
        self.assertEqual(run_ledger.reservation(5, 5, 3 * chunk, left=2),
                         5 + 3 * chunk)
        self.assertEqual(run_ledger.reservation(0, 2, 3), 10)

    def test_steps_within_physical_batches(self):
        self.assertEqual(run_ledger.steps_within(1, 4), 1)
        self.assertEqual(run_ledger.steps_within(4, 4), 1)
        self.assertEqual(run_ledger.steps_within(5, 4), 2)
        self.assertEqual(run_ledger.steps_within(3, 1), 3)
        self.assertEqual(run_ledger.steps_within(0, 2), 1)


if __name__ == "__main__":
    absltest.main()
