"""research/study_plan.py: cells calibrated to epsilon at equal epochs, the
grids, the phases on a fake training, refusal of other settings, and the
moment statistics against NumPy."""

import dataclasses
import math
import os
import tempfile
import types

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from research import common
from research import study_plan
from research import study_report

from research.tests import research_helpers


def _cells(batch_sizes=(16, 32), num_examples=64, **kwargs):
    """Cells of a fixed sigma (the steps calibrated: quicker than sigma)."""
    kwargs.setdefault("noise_multiplier", 2.0)
    return [study_plan.make_cell(target_epsilon=3.0, batch_size=b,
                                 num_examples=num_examples, eval_every=2,
                                 **kwargs)
            for b in batch_sizes]


def _plan(runs_dir, cells=None, names=("dpadam", "dpadam_corrected"),
          seeds=(0, 1), lr_span=1, edge_extensions=0):
    variants = study_plan.default_variants()
    return study_plan.make_plan(
        "regime_map", cells=cells or _cells(),
        variants=[variants[n] for n in names], seeds=seeds,
        runs_dir=runs_dir, data=study_plan.data_spec(64), lr_span=lr_span,
        edge_extensions=edge_extensions)


class CellTest(parameterized.TestCase):

    # The regime map's cells (tiny ones in study_test.py).
    @parameterized.parameters((60_000, (256, 1024, 4096), 4.0))
    def test_sigma_spends_the_target_at_equal_epochs(self, n, sizes, epochs):
        cells = [study_plan.make_cell(target_epsilon=3.0, batch_size=b,
                                      num_examples=n, epochs=epochs)
                 for b in sizes]
        for cell in cells:
            c = cell.base
            # Equal epochs: the steps are round(epochs N / B).
            self.assertEqual(cell.steps, round(epochs * n / c.batch_size))
            self.assertAlmostEqual(cell.steps * c.batch_size / n, epochs,
                                   delta=c.batch_size / n)
            # With the accountant the runs record epsilon with (PLD).
            spent = tf_dpadam.epsilon_after_steps(
                steps=cell.steps, num_examples=n, batch_size=c.batch_size,
                noise_multiplier=c.noise_multiplier, delta=1e-5,
                accountant=common.ACCOUNTANT)
            self.assertBetween(spent, 3.0 - 1e-3, 3.0)
            # A sigma 0.1% smaller overspends: calibrated, not just safe.
            more = tf_dpadam.epsilon_after_steps(
                steps=cell.steps, num_examples=n, batch_size=c.batch_size,
                noise_multiplier=0.999 * c.noise_multiplier, delta=1e-5,
                accountant=common.ACCOUNTANT)
            self.assertGreater(more, 3.0)
            self.assertIsNone(c.target_epsilon)
        # Larger batches at the same epsilon and epochs need more noise.
        sigmas = [c.base.noise_multiplier for c in cells]
        self.assertEqual(sigmas, sorted(sigmas))
        self.assertGreater(sigmas[-1], 1.1 * sigmas[0])
    def test_rdp_calibration_gives_the_recorded_studies_sigma(self):
        # research/run_records/regime_map_small's runs were calibrated with
        # RDP before the binaries moved to PLD: eps3_B256 (10 epochs)
        # recorded sigma 0.7419272708403193. A cell calibrated by RDP must
        # give that sigma to read those runs back.
        rdp = study_plan.make_cell(target_epsilon=3.0, batch_size=256,
                                   num_examples=60_000, epochs=10.0,
                                   accountant="rdp")
        self.assertEqual(rdp.accountant, "rdp")
        self.assertAlmostEqual(rdp.base.noise_multiplier, 0.7419272708403193,
                               delta=1e-9)
        spent = tf_dpadam.epsilon_after_steps(
            steps=rdp.steps, num_examples=60_000, batch_size=256,
            noise_multiplier=rdp.base.noise_multiplier, delta=1e-5,
            accountant="rdp")
        self.assertBetween(spent, 3.0 - 1e-3, 3.0)
        # PLD is tighter: it needs less noise for the same target.
        pld = study_plan.make_cell(target_epsilon=3.0, batch_size=256,
                                   num_examples=60_000, epochs=10.0)
        self.assertEqual(pld.accountant, "pld")
        self.assertLess(pld.base.noise_multiplier,
                        0.97 * rdp.base.noise_multiplier)

    def test_rdp_calibrated_steps_are_the_steps_the_runs_train(self):
        # The paper CNN's cell of research/results/RESULTS_fashion_mnist.md
        # (sigma = 0.52, B = 256, epsilon = 7): 719 steps by RDP, which the
        # runs must train although they count with PLD (1,468 steps).
        rdp = study_plan.make_cell(target_epsilon=7.0, batch_size=256,
                                   num_examples=60_000, noise_multiplier=0.52,
                                   accountant="rdp")
        self.assertEqual(rdp.steps, 719)
        self.assertEqual(common.total_steps(rdp.base, 60_000), 719)
        pld = study_plan.make_cell(target_epsilon=7.0, batch_size=256,
                                   num_examples=60_000, noise_multiplier=0.52)
        self.assertEqual(common.total_steps(pld.base, 60_000), pld.steps)
        self.assertGreater(pld.steps, 1.5 * 719)


    def test_fixed_sigma_calibrates_the_steps(self):
        cell = study_plan.make_cell(target_epsilon=3.0, batch_size=16,
                                    num_examples=64, noise_multiplier=2.0)
        self.assertEqual(cell.base.noise_multiplier, 2.0)
        self.assertEqual(cell.steps, tf_dpadam.calibrate_steps(
            target_epsilon=3.0, num_examples=64, batch_size=16,
            noise_multiplier=2.0, delta=1e-5))
        with self.assertRaisesRegex(ValueError, "exactly one"):
            study_plan.make_cell(target_epsilon=3.0, batch_size=16,
                                 num_examples=64)

    def test_recipe_settings_are_in_the_config(self):
        (cell,) = _cells((16,), augmult=2, ema_momentum=0.9,
                         normalization="group")
        c = cell.base
        self.assertEqual((c.augmult, c.ema, c.ema_momentum, c.normalization),
                         (2, True, 0.9, "group"))
        (plain,) = _cells((16,))
        self.assertEqual((plain.base.augmult, plain.base.ema), (0, False))
        self.assertEqual(plain.base.imbalance_ratio, 1.0)
        (cut,) = _cells((16,), imbalance_ratio=0.01)
        self.assertEqual(cut.base.imbalance_ratio, 0.01)
        self.assertNotEqual(cut.name, plain.name)  # Runs of their own.


class GridTest(absltest.TestCase):

    def test_half_decade_grid(self):
        self.assertEqual(study_plan.half_decade_grid(0.002, 1),
                         (0.001, 0.00316, 0.01))
        self.assertEqual(study_plan.half_decade_grid(2.0, 2),
                         (0.316, 1.0, 3.16, 10.0, 31.6))
        self.assertEqual(study_plan.half_decade_grid(0.01, 0), (0.01,))
        with self.assertRaises(ValueError):
            study_plan.half_decade_grid(0.0, 1)

    def test_centres_scale_with_the_batch(self):
        variants = study_plan.default_variants()
        sgd, adam = variants["dpsgd"], variants["dpadam"]
        self.assertAlmostEqual(study_plan.scaled_centre(sgd, 1024),
                               4 * sgd.lr_centre)
        self.assertAlmostEqual(study_plan.scaled_centre(adam, 4096),
                               2 * adam.lr_centre)
        centred = study_plan.with_centres(variants, {"dpsgd": 0.5})
        self.assertEqual(centred["dpsgd"].lr_centre, 0.5)
        with self.assertRaisesRegex(ValueError, "Unknown"):
            study_plan.with_centres(variants, {"adamw": 1.0})

    def test_configs_of_the_variants(self):
        plan = _plan(tempfile.mkdtemp(), names=(
            "dpsgd", "dpadam_corrected_wd", "dpadam_corrected_b2"))
        config = study_plan.planned_config(
            plan, study_plan.Run("eps3_B16", "dpadam_corrected_b2", 0.01, 2))
        self.assertEqual((config.optimizer, config.beta_1, config.beta_2,
                          config.learning_rate, config.seed,
                          config.noise_seed, config.epsilon),
                         ("dpadam_corrected", 0.9, 0.9999, 0.01, 2, 2, None))
        self.assertEqual(config.model_dir, os.path.join(
            plan.runs_dir, "eps3_B16", "dpadam_corrected_b2_lr0.01_seed2"))
        wd = study_plan.planned_config(
            plan, study_plan.Run("eps3_B32", "dpadam_corrected_wd", 0.01, 0))
        self.assertEqual((wd.weight_decay, wd.beta_2), (0.1, 0.999))
        # DP-SGD's grid moves with B, 2x from B = 16 to 32.
        self.assertEqual(plan.grids[("eps3_B16", "dpsgd")],
                         study_plan.half_decade_grid(2 / 16, 1))
        self.assertEqual(plan.grids[("eps3_B32", "dpsgd")],
                         study_plan.half_decade_grid(2 / 8, 1))
        with self.assertRaisesRegex(ValueError, "weight decay"):
            study_plan.make_plan(
                "x", cells=_cells((16,)), variants=[
                    study_plan.default_variants(weight_decay=500.0)[
                        "dpadam_corrected_wd"]],
                seeds=(0,), runs_dir="r", data={})


class EpsilonNoteTest(absltest.TestCase):

    def test_note_only_when_a_cell_mixes_accountants(self):

        @dataclasses.dataclass(frozen=True)
        class Run:
            cell: str
            seed: int

        def records(*spent):
            return {Run(cell, i): types.SimpleNamespace(
                record=types.SimpleNamespace(epsilon=e))
                for i, (cell, e) in enumerate(spent)}

        self.assertEmpty(study_report._epsilon_note(records(
            ("a", 3.0), ("a", 3.0000004), ("b", 7.0))))
        note = study_report._epsilon_note(records(
            ("a", 3.0), ("a", 2.4001), ("b", 7.0)))
        self.assertLen(note, 1)
        self.assertIn("2.40, 3.00 in a", note[0])
        self.assertIn("same mechanism", note[0])


class ImbalanceNoteTest(absltest.TestCase):

    def test_the_worst_classes_are_counted(self):
        def record(worst):
            return types.SimpleNamespace(worst_class=worst)

        self.assertEmpty(study_report._imbalance_note(
            {1: record(None), 2: record(None)}))
        note = study_report._imbalance_note(
            {1: record(6), 2: record(6), 3: record(2), 4: record(None)})
        self.assertLen(note, 1)
        self.assertIn("The worst class of the 3 runs: class 6 in 2, class 2"
                      " in 1.", note[0])


class MomentNoteTest(absltest.TestCase):

    def test_notes_for_the_optimizers_whose_noise_is_not_phi(self):
        def plan(*optimizers):
            return types.SimpleNamespace(variants=[
                types.SimpleNamespace(optimizer=o) for o in optimizers])

        self.assertEmpty(study_report._moment_note(
            plan("dpsgd", "dpadam", "dpadam_corrected")))
        (disk,) = study_report._moment_note(plan("dpadam", "dpadam_disk"))
        self.assertIn("κ/(2 − κ)·Φ", disk)
        self.assertLen(study_report._moment_note(
            plan("dpadam_stp", "dpadam_disk")), 2)

    def test_disk_filters_the_noise_to_kappa_over_two_minus_kappa(self):
        # The note's number: g_t = (1 - kappa) g_{t-1} + kappa z_t with
        # Var z = Phi has the steady variance kappa / (2 - kappa) Phi.
        rng = np.random.default_rng(0)
        kappa, g, squares = 0.7, np.zeros(20000), []
        for t in range(200):
            g = (1 - kappa) * g + kappa * rng.normal(size=g.shape)
            if t >= 50:
                squares.append(np.mean(g ** 2))
        self.assertAlmostEqual(float(np.mean(squares)),
                               kappa / (2 - kappa), delta=0.01)


class PhasesTest(absltest.TestCase):
    """The phases on a fake training (metrics.json written, nothing
    trained)."""

    def test_tune_then_seeds_then_read_back(self):
        plan = _plan(tempfile.mkdtemp())
        calls = []
        # DP-Adam's best is its middle rate, DP-AdamBC's its lowest.
        best = {"dpadam": 0.01, "dpadam_corrected": 0.001}

        def accuracy(config):
            if config.learning_rate >= 0.03:
                return math.nan  # Diverged.
            right = best[config.optimizer] == config.learning_rate
            return 0.8 + 0.01 * config.seed if right else 0.5

        train_fn = research_helpers.fake_train_fn(accuracy, calls)
        with self.assertRaisesRegex(ValueError, "Tuning is not finished"):
            study_plan.run_phase(plan, train_fn, "seeds", command="c",
                                 machine={})
        records = study_plan.run_phase(plan, train_fn, "tune", command="c",
                                       machine={})
        self.assertLen(calls, 12)  # 2 cells x 2 variants x 3 rates.
        self.assertEqual({c.seed for c in calls}, {0})
        got = study_plan.best_learning_rates(plan, records)
        self.assertEqual(got, {(cell.name, name): lr for cell in plan.cells
                               for name, lr in best.items()})
        calls.clear()
        records = study_plan.run_phase(plan, train_fn, "all", command="c",
                                       machine={})
        # Only the best rates with seed 1 are new.
        self.assertEqual(sorted((c.optimizer, c.learning_rate, c.seed)
                                for c in calls),
                         [("dpadam", 0.01, 1)] * 2
                         + [("dpadam_corrected", 0.001, 1)] * 2)
        self.assertLen(records, 16)
        self.assertEqual(records, study_plan.collect(plan))
        calls.clear()
        study_plan.run_phase(plan, train_fn, "all", command="c", machine={})
        self.assertEmpty(calls)

    def test_tuning_goes_past_a_grid_end_while_the_best_sits_there(self):
        plan = _plan(tempfile.mkdtemp(), cells=_cells((16,)),
                     edge_extensions=2)
        adam_grid = plan.grids[("eps3_B16", "dpadam")]
        bc_grid = plan.grids[("eps3_B16", "dpadam_corrected")]
        step = study_plan.half_decade_step
        # DP-Adam peaks one half-decade above its grid; DP-AdamBC keeps
        # improving below its grid, past the two rates allowed.
        peak = step(max(adam_grid), 1)

        def accuracy(config):
            k = round(2 * math.log10(config.learning_rate))
            if config.optimizer == "dpadam":
                return 0.9 - 0.01 * abs(k - round(2 * math.log10(peak)))
            return 0.5 - 0.01 * k + 0.001 * config.seed

        calls = []
        train_fn = research_helpers.fake_train_fn(accuracy, calls)
        records = study_plan.run_phase(plan, train_fn, "tune", command="c",
                                       machine={})
        # One edge rate per grid and round, after the grids.
        self.assertEqual(
            [(c.optimizer, c.learning_rate) for c in calls][6:],
            [("dpadam", peak), ("dpadam_corrected", step(min(bc_grid), -1)),
             ("dpadam", step(max(adam_grid), 2)),
             ("dpadam_corrected", step(min(bc_grid), -2))])
        best = study_plan.best_learning_rates(plan, records)
        self.assertEqual(best, {
            ("eps3_B16", "dpadam"): peak,
            ("eps3_B16", "dpadam_corrected"): step(min(bc_grid), -2)})
        self.assertIsNone(study_plan.next_edge_rate(
            plan, records, ("eps3_B16", "dpadam_corrected")))
        # Read back from disk, the added rates included; nothing retrained.
        self.assertEqual(study_plan.collect(plan), records)
        calls.clear()
        records = study_plan.run_phase(plan, train_fn, "all", command="c",
                                       machine={})
        self.assertEqual(sorted((c.optimizer, c.learning_rate, c.seed)
                                for c in calls),
                         [("dpadam", peak, 1),
                          ("dpadam_corrected", step(min(bc_grid), -2), 1)])
        # The report flags the best that is still at an end.
        summaries = study_report.best_summaries(plan, records)
        self.assertFalse(summaries[("eps3_B16", "dpadam")]["edge"])
        self.assertTrue(summaries[("eps3_B16", "dpadam_corrected")]["edge"])
        # Without extensions the same runs on disk are the grid's only.
        self.assertLen(study_plan.collect(dataclasses.replace(
            plan, edge_extensions=0)), 6)
        self.assertEqual(step(0.01, 1), 0.0316)
        self.assertEqual(step(0.00316, -3), 0.0001)

    def test_a_finished_grid_goes_past_its_end_while_another_is_unfinished(
            self):
        # What a second process trains while the first holds a grid's run.
        plan = _plan(tempfile.mkdtemp(), cells=_cells((16,)),
                     edge_extensions=1)
        adam = ("eps3_B16", "dpadam")
        bc = ("eps3_B16", "dpadam_corrected")
        train_fn = research_helpers.fake_train_fn(
            lambda config: 0.5 + config.learning_rate)  # Best at the top.
        unfinished = study_plan.Run(*bc, max(plan.grids[bc]), plan.tune_seed)
        runs = [r for r in study_plan.tuning_runs(plan) if r != unfinished]
        records = study_plan.execute(plan, runs, train_fn, command="c",
                                     machine={})
        edge = study_plan.Run(
            *adam, study_plan.half_decade_step(max(plan.grids[adam]), 1),
            plan.tune_seed)
        self.assertEqual(study_plan.tuning_round(plan, records),
                         [unfinished, edge])
        records.update(study_plan.execute(plan, [unfinished, edge], train_fn,
                                          command="c", machine={}))
        bc_edge = study_plan.Run(
            *bc, study_plan.half_decade_step(max(plan.grids[bc]), 1),
            plan.tune_seed)
        self.assertEqual(study_plan.tuning_round(plan, records), [bc_edge])
        records.update(study_plan.execute(plan, [bc_edge], train_fn,
                                          command="c", machine={}))
        self.assertEqual(study_plan.tuning_round(plan, records), [])

    def test_a_folder_of_other_settings_is_refused(self):
        runs_dir = tempfile.mkdtemp()
        plan = _plan(runs_dir, lr_span=0, seeds=(0,))
        train_fn = research_helpers.fake_train_fn(lambda c: 0.5)
        study_plan.run_phase(plan, train_fn, "tune", command="c", machine={})
        for change in (dict(augmult=2), dict(ema_momentum=0.9),
                       dict(normalization="group")):
            other = _plan(runs_dir, cells=_cells(**change), lr_span=0,
                          seeds=(0,))
            with self.assertRaisesRegex(ValueError, "other hyperparameters"):
                study_plan.run_phase(other, train_fn, "report", command="c",
                                     machine={})
        # Another sigma.
        with self.assertRaisesRegex(ValueError, "noise_multiplier"):
            study_plan.collect(_plan(runs_dir, cells=_cells(
                noise_multiplier=3.0), lr_span=0, seeds=(0,)))


if __name__ == "__main__":
    absltest.main()
