"""research/experiments.py: grids, plans and phases, on a fake training
(no TensorFlow training) and on recorded runs (tests/testdata)."""

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from research import common
from research import experiments
from research import runs
from research.runs import Setting

from research.tests import research_helpers

_GRIDS = research_helpers.RECORDED_GRIDS
_GAMMAS = research_helpers.RECORDED_GAMMAS


class GridTest(absltest.TestCase):

    def test_grids(self):
        with self.assertRaisesRegex(ValueError, "numeric gammas"):
            experiments.make_grid("dpadam", (1e-3,), (None,))
        with self.assertRaisesRegex(ValueError, "learning rates > 0"):
            experiments.make_grid("dpsgd", (0.0,))
        grid = experiments.make_grid("dpadam_corrected", (1e-3, 1e-2),
                                     (None, 1e-9))
        self.assertLen(grid, 4)
        # DP-SGD has no gamma: one setting per learning rate.
        self.assertEqual(experiments.make_grid("dpsgd", (1.0,), (1e-8, 1e-9)),
                         (Setting("dpsgd", 1.0, None),))
        names = {runs.run_name(s, seed) for s in grid for seed in (0, 1)}
        self.assertLen(names, 8)

    def test_base_config_and_plan(self):
        base = common.base_config("fashion_mnist")
        self.assertEqual((base.noise_multiplier, base.batch_size, base.delta),
                         (0.52, 256, 1e-5))
        with self.assertRaisesRegex(ValueError, "epochs"):
            common.base_config("fashion_mnist", target_epsilon=0)
        plan = research_helpers.recorded_plan("/runs")
        self.assertEqual((plan.tune_seed, plan.seeds), (0, (0, 1)))
        config = experiments.planned_config(plan, Setting("dpsgd", 1.0, None),
                                            1)
        self.assertEqual(config.model_dir, "/runs/dpsgd_lr1_seed1")
        with self.assertRaisesRegex(ValueError, "Repeated seeds"):
            experiments.make_plan("fashion_mnist", base=base,
                                  learning_rates=_GRIDS, gammas=_GAMMAS,
                                  seeds=(0, 0), runs_dir="/r", data={})
        with self.assertRaisesRegex(ValueError, "Unknown task"):
            experiments.make_plan("mnist", base=base, learning_rates=_GRIDS,
                                  gammas=_GAMMAS, seeds=(0,), runs_dir="/r",
                                  data={})

    def test_pick_best_per_optimizer(self):
        scored = [
            (Setting("dpsgd", 0.1, None), 0.60),
            (Setting("dpsgd", 1.0, None), 0.72),   # Best DP-SGD.
            (Setting("dpsgd", 10.0, None), math.nan),  # Diverged: never best.
            (Setting("dpadam", 1e-3, 1e-8), 0.70),  # Tie: the first listed.
            (Setting("dpadam", 1e-2, 1e-8), 0.70),
            (Setting("dpadam_corrected", 1e-3, None), None),  # Missing.
            (Setting("dpadam_corrected", 1e-2, None), 0.10),
        ]
        best = experiments.pick_best(scored)
        self.assertEqual(best["dpsgd"], (Setting("dpsgd", 1.0, None), 0.72))
        self.assertEqual(best["dpadam"][0], Setting("dpadam", 1e-3, 1e-8))
        self.assertEqual(best["dpadam_corrected"][0],
                         Setting("dpadam_corrected", 1e-2, None))
        self.assertEmpty(experiments.pick_best([]))

    def test_data_spec_and_train_fn_arguments(self):
        self.assertEqual(experiments.data_spec("fashion_mnist", max_examples=5),
                         {"task": "fashion_mnist", "dataset": "fashion_mnist",
                          "max_examples": 5})
        self.assertEqual(experiments.data_spec("sst2", sequence_length=32),
                         {"task": "sst2", "dataset": "sst2_tsv",
                          "max_examples": None, "max_test_examples": None,
                          "preset": None, "sequence_length": 32,
                          "cache_frozen": True})
        # LoRA and full fine-tuning: no frozen-feature cache; the rank is
        # part of the data spec, so runs of another rank are not mixed in.
        self.assertEqual(
            experiments.data_spec("sst2_lora", sequence_length=32,
                                  lora_rank=4),
            {"task": "sst2_lora", "dataset": "sst2_tsv", "max_examples": None,
             "max_test_examples": None, "preset": None, "sequence_length": 32,
             "cache_frozen": False, "lora_rank": 4, "pooling": "mean"})
        # The cached top blocks and the last block's [CLS] head otherwise.
        self.assertEqual(
            experiments.data_spec("sst2_full", finetune_blocks=2,
                                  pooling="cls"),
            {"task": "sst2_full", "dataset": "sst2_tsv", "max_examples": None,
             "max_test_examples": None, "preset": None,
             "sequence_length": None, "cache_frozen": True,
             "finetune_blocks": 2, "pooling": "cls"})
        self.assertNotIn("pooling", experiments.data_spec("sst2"))
        self.assertNotIn("lora_rank", experiments.data_spec("sst2_full"))
        from research import train_text
        for task, expected in (("sst2", {"finetune": "last_block"}),
                               ("sst2_lora", {"finetune": "lora",
                                              "lora_rank": 4}),
                               ("sst2_full", {"finetune": "full"})):
            with mock.patch.object(train_text, "run") as run:
                experiments.make_train_fn(
                    task, sequence_length=32,
                    lora_rank=expected.get("lora_rank"))("config")
            self.assertEqual(run.call_args.args[4], "config")
            for key, value in expected.items():
                self.assertEqual(run.call_args.kwargs[key], value, task)
        with self.assertRaisesRegex(ValueError, "sst2 only"):
            experiments.make_train_fn("fashion_mnist", max_test_examples=5)
        with self.assertRaisesRegex(ValueError, "Unknown task"):
            experiments.make_train_fn("mnist")


class SharedStudyTest(absltest.TestCase):

    def test_two_processes_share_the_runs(self):
        # The same study started twice: each run is trained once, by one of
        # them, and both finish with every run.
        runs_dir = os.path.join(tempfile.mkdtemp(), "runs")
        os.makedirs(runs_dir)
        script = os.path.join(os.path.dirname(__file__),
                              "shared_runs_check.py")
        root = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        children = [subprocess.Popen(
            [sys.executable, script, runs_dir, name], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env) for name in ("first", "second")]
        for child in children:
            self.addCleanup(child.kill)
            self.assertEqual(child.stdout.readline().strip(), "ready")
        for child in children:  # Go.
            child.stdin.write("\n")
            child.stdin.flush()
        for child in children:
            _, stderr = child.communicate(timeout=120)
            self.assertEqual(child.returncode, 0, stderr)
        with open(os.path.join(runs_dir, "trained.log")) as log:
            trained = [line.split() for line in log]
        folders = [folder for _, folder in trained]
        plan = research_helpers.recorded_plan(runs_dir)
        self.assertLen(experiments.collect(plan), 9)  # 6 tuning, 3 seeds
        self.assertCountEqual(folders, set(folders))  # each once
        self.assertLen(folders, 9)
        self.assertEqual({name for name, _ in trained}, {"first", "second"})


class RecordedRunsTest(absltest.TestCase):

    def test_collect_and_best_of_tuning(self):
        plan = research_helpers.recorded_plan(research_helpers.copy_testdata("runs_fashion_mnist"))
        records = experiments.collect(plan)
        self.assertLen(records, 9)  # 6 tuning runs, 3 more seeds of the best.
        best = experiments.best_of_tuning(plan, records)
        for name, grid in plan.grids.items():
            top = max(records[runs.run_name(s, 0)].accuracy for s in grid)
            self.assertEqual(records[runs.run_name(best[name], 0)].accuracy,
                             top)
            self.assertIn(runs.run_name(best[name], 1), records)


class PhasesTest(absltest.TestCase):

    def test_tune_then_seeds_then_nothing_left(self):
        plan = research_helpers.recorded_plan(os.path.join(tempfile.mkdtemp(), "runs"))
        calls = []
        # The larger the learning rate, the better (DP-SGD: 1.0).
        train_fn = research_helpers.fake_train_fn(lambda c: min(0.9, c.learning_rate), calls)
        kwargs = dict(command="python -m research.reproduce",
                      machine={"platform": "test"})
        with self.assertRaisesRegex(ValueError, "--phase=tune first"):
            experiments.run_phase(plan, train_fn, "seeds", **kwargs)
        experiments.run_phase(plan, train_fn, "tune", **kwargs)
        self.assertLen(calls, 6)
        self.assertEqual({c.seed for c in calls}, {0})
        experiments.run_phase(plan, train_fn, "seeds", **kwargs)
        # Seed 1 of each best setting; its seed 0 is the tuning run.
        self.assertEqual(
            [(c.optimizer, c.learning_rate, c.seed) for c in calls[6:]],
            [("dpsgd", 1.0, 1), ("dpadam", 1e-2, 1),
             ("dpadam_corrected", 1e-2, 1)])
        for phase in ("all", "report"):
            experiments.run_phase(plan, None, phase, **kwargs)
        self.assertLen(calls, 9)
        with self.assertRaisesRegex(ValueError, "Unknown phase"):
            experiments.run_phase(plan, None, "everything", **kwargs)

    def test_tuning_extends_a_grid_past_the_end_where_its_best_sits(self):
        plan = dataclasses.replace(
            research_helpers.recorded_plan(os.path.join(tempfile.mkdtemp(), "runs")),
            edge_extensions=2)
        # Accuracy peaks at lr 10 for DP-SGD (grid 0.1, 1: two rates above,
        # the second worse), at 1e-3 for DP-Adam (grid 1e-3, 1e-2: one rate
        # below, worse) and below 1e-5 for DP-AdamBC (two rates below, then
        # the limit).
        peaks = {"dpsgd": 10.0, "dpadam": 1e-3, "dpadam_corrected": 1e-6}

        def accuracy(config):
            distance = abs(math.log10(config.learning_rate
                                      / peaks[config.optimizer]))
            return 0.9 - 0.1 * distance

        calls = []
        kwargs = dict(command="python -m research.reproduce",
                      machine={"platform": "test"})
        experiments.run_phase(plan, research_helpers.fake_train_fn(accuracy, calls),
                              "tune", **kwargs)
        tried = {name: sorted(c.learning_rate for c in calls
                              if c.optimizer == name) for name in peaks}
        self.assertEqual(tried, {"dpsgd": [0.1, 1.0, 10.0, 100.0],
                                 "dpadam": [1e-4, 1e-3, 1e-2],
                                 "dpadam_corrected": [1e-5, 1e-4, 1e-3,
                                                      1e-2]})
        # Every later phase and the report see the extended grids.
        extended = experiments.extended_plan(plan)
        self.assertEqual(experiments.extended_plan(extended), extended)
        best = experiments.best_of_tuning(plan, experiments.collect(plan))
        self.assertEqual(best["dpsgd"].learning_rate, 10.0)
        self.assertEqual(best["dpadam_corrected"].learning_rate, 1e-5)
        experiments.run_phase(plan, research_helpers.fake_train_fn(accuracy, calls),
                              "seeds", **kwargs)
        self.assertEqual(
            sorted((c.optimizer, c.learning_rate) for c in calls[11:]),
            [("dpadam", 1e-3), ("dpadam_corrected", 1e-5),
             ("dpsgd", 10.0)])
        self.assertLen(experiments.collect(plan), 14)
        # Without extensions the grids are as given.
        self.assertEqual(
            experiments.extended_plan(research_helpers.recorded_plan(
                plan.runs_dir)).grids, plan.grids)

    def test_an_optimizers_seeds_do_not_wait_for_anothers_tuning(self):
        plan = research_helpers.recorded_plan(os.path.join(tempfile.mkdtemp(), "runs"))
        train_fn = research_helpers.fake_train_fn(lambda c: min(0.9, c.learning_rate))
        kwargs = dict(command="c", machine={})
        # Another process still trains DP-Adam's lr 1e-2.
        held = Setting("dpadam", 1e-2, _GAMMAS["dpadam"][0])
        tuning = experiments.next_round(plan)
        self.assertLen(tuning, 6)
        experiments.execute_runs(plan, [p for p in tuning if p[0] != held],
                                 train_fn, **kwargs)
        self.assertEqual(experiments.next_round(plan), [(held, 0)])
        self.assertCountEqual(experiments.next_round(plan, seeds=True), [
            (held, 0), (Setting("dpsgd", 1.0, None), 1),
            (Setting("dpadam_corrected", 1e-2,
                     _GAMMAS["dpadam_corrected"][0]), 1)])
        experiments.execute_runs(plan, [(held, 0)], train_fn, **kwargs)
        self.assertCountEqual(
            [(s.optimizer, seed)
             for s, seed in experiments.next_round(plan, seeds=True)],
            [("dpsgd", 1), ("dpadam", 1), ("dpadam_corrected", 1)])

    def test_next_rate_continues_the_grid_ratio(self):
        self.assertEqual(experiments.next_rate((0.1, 0.316, 1.0), 1), 3.16)
        self.assertEqual(experiments.next_rate((0.1, 0.316, 1.0), -1),
                         0.0316)
        self.assertEqual(experiments.next_rate((1.3, 4.0), 1), 12.3)
        # On the half-decade lattice despite the rounded 3.16.
        self.assertEqual(experiments.next_rate((3.16e-4, 1e-3, 3.16e-3), 1),
                         0.01)
        self.assertEqual(experiments.next_rate((0.01, 0.0316, 0.1), -1),
                         0.00316)

    def test_runs_on_other_data_are_refused_before_training(self):
        runs_dir = research_helpers.copy_testdata("runs_fashion_mnist")
        plan = research_helpers.recorded_plan(runs_dir)
        other = experiments.make_plan(
            "fashion_mnist", base=plan.base, learning_rates=_GRIDS,
            gammas=_GAMMAS, seeds=(0,), runs_dir=runs_dir,
            data=experiments.data_spec("fashion_mnist", max_examples=32))
        with self.assertRaisesRegex(ValueError, "other data"):
            experiments.run_phase(other, None, "tune", command="x",
                                  machine={})


class NewerOptimizersTest(parameterized.TestCase):
    """DP-Adam STP and DiSK (common.OPTIMIZER_LABELS beyond the paper's
    three), alone or beside them."""

    @parameterized.parameters("dpadam_stp", "dpadam_disk")
    def test_grid_takes_a_numeric_gamma_outside_the_root(self, name):
        self.assertEqual(experiments.make_grid(name, (1e-3, 1e-2), (1e-8,)),
                         (Setting(name, 1e-3, 1e-8), Setting(name, 1e-2, 1e-8)))
        # Like DP-Adam's gamma: 'none' (0.04 Phi) is DP-AdamBC's only.
        with self.assertRaisesRegex(ValueError,
                                    f"{common.OPTIMIZER_LABELS[name]} needs "
                                    "numeric gammas"):
            experiments.make_grid(name, (1e-3,), (None,))
        self.assertEqual(experiments.DEFAULT_LEARNING_RATES[name],
                         experiments.DEFAULT_LEARNING_RATES["dpadam"])

    def test_unknown_optimizer(self):
        with self.assertRaisesRegex(ValueError,
                                    "Unknown optimizer 'adam'.*dpadam_disk"):
            experiments.make_grid("adam", (1e-3,))

    def test_plan_has_grids_for_its_optimizers_only(self):
        base = common.base_config("fashion_mnist")
        kwargs = dict(learning_rates={"dpadam_stp": (1e-3,),
                                      "dpadam_disk": (1e-3, 1e-2)},
                      gammas={"dpadam_stp": (1e-8,), "dpadam_disk": (1e-8,)},
                      seeds=(0,), runs_dir="/r", data={})
        plan = experiments.make_plan(
            "fashion_mnist", base=base,
            optimizers=("dpadam_disk", "dpadam_stp"), **kwargs)
        self.assertEqual(plan.optimizers, ("dpadam_disk", "dpadam_stp"))
        self.assertEqual(plan.grids["dpadam_disk"],
                         (Setting("dpadam_disk", 1e-3, 1e-8),
                          Setting("dpadam_disk", 1e-2, 1e-8)))
        config = experiments.planned_config(plan, plan.grids["dpadam_stp"][0],
                                            0)
        self.assertEqual((config.optimizer, config.epsilon, config.model_dir),
                         ("dpadam_stp", 1e-8,
                          "/r/dpadam_stp_lr0.001_g1e-08_seed0"))
        # The default: the paper's three, in common.OPTIMIZER_NAMES' order.
        self.assertEqual(research_helpers.recorded_plan("/r").optimizers,
                         ("dpsgd", "dpadam", "dpadam_corrected"))
        with self.assertRaisesRegex(ValueError, "Repeated optimizers"):
            experiments.make_plan("fashion_mnist", base=base,
                                  optimizers=("dpadam_stp", "dpadam_stp"),
                                  **kwargs)
        with self.assertRaisesRegex(ValueError, "at least one optimizer"):
            experiments.make_plan("fashion_mnist", base=base, optimizers=(),
                                  **kwargs)

    def test_phases_train_only_the_plans_optimizers(self):
        base = research_helpers.recorded_plan("/r").base
        plan = experiments.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpadam_stp": (1e-3, 1e-2),
                            "dpadam_disk": (1e-3, 1e-2)},
            gammas={"dpadam_stp": (1e-8,), "dpadam_disk": (1e-8,)},
            seeds=(0, 1), runs_dir=os.path.join(tempfile.mkdtemp(), "runs"),
            data=experiments.data_spec("fashion_mnist"),
            optimizers=("dpadam_stp", "dpadam_disk"), edge_extensions=1)
        calls = []
        # STP is best at 1e-2 (the grid's top: one rate above, 0.1, worse),
        # DiSK at 1e-3 (one rate below, 1e-4, worse).
        scores = {("dpadam_stp", 1e-2): 0.8, ("dpadam_disk", 1e-3): 0.8}
        train_fn = research_helpers.fake_train_fn(
            lambda c: scores.get((c.optimizer, c.learning_rate), 0.5), calls)
        experiments.run_phase(plan, train_fn, "all", command="c", machine={})
        self.assertEqual({c.optimizer for c in calls},
                         {"dpadam_stp", "dpadam_disk"})
        self.assertCountEqual(
            [(c.optimizer, c.learning_rate, c.seed) for c in calls],
            [("dpadam_stp", 1e-3, 0), ("dpadam_stp", 1e-2, 0),
             ("dpadam_stp", 0.1, 0), ("dpadam_stp", 1e-2, 1),
             ("dpadam_disk", 1e-3, 0), ("dpadam_disk", 1e-2, 0),
             ("dpadam_disk", 1e-4, 0), ("dpadam_disk", 1e-3, 1)])
        best = experiments.best_of_tuning(plan, experiments.collect(plan))
        self.assertEqual(best, {"dpadam_stp": Setting("dpadam_stp", 1e-2, 1e-8),
                                "dpadam_disk": Setting("dpadam_disk", 1e-3,
                                                       1e-8)})


# The steps of research/results/RESULTS_fashion_mnist.md and RESULTS_sst2.md,
# recorded when the binaries calibrated with RDP (delta = 1e-5, epsilon = 7,
# B = 256), and PLD's for the same sigma.
_RECORDED_STEPS = (
    ("fashion_mnist", "fashion_mnist", 60_000, 0.52, 719, 1468),
    ("sst2", "sst2_tsv", 67_349, 0.5, 536, 1221),
)


class CalibrationTest(parameterized.TestCase):

    @parameterized.parameters(*_RECORDED_STEPS)
    def test_rdp_gives_the_runs_the_recorded_steps(
            self, task, dataset, num_examples, sigma, rdp_steps, pld_steps):
        base = common.base_config(dataset, noise_multiplier=sigma)
        self.assertEqual((base.batch_size, base.delta, base.target_epsilon),
                         (256, 1e-5, 7.0))
        kwargs = dict(learning_rates=experiments.DEFAULT_LEARNING_RATES,
                      gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
                      seeds=(0,), runs_dir="/r", data={})
        plan = experiments.make_plan(task, base=base,
                                     calibration_accountant="rdp",
                                     num_examples=num_examples, **kwargs)
        self.assertEqual(plan.calibration, experiments.Calibration(
            "rdp", 7.0, rdp_steps, num_examples))
        self.assertEqual(plan.target_epsilon, 7.0)
        # The runs count their steps with PLD: they get RDP's as epochs.
        self.assertIsNone(plan.base.target_epsilon)
        self.assertAlmostEqual(plan.base.epochs,
                               rdp_steps * 256 / num_examples)
        for grid in plan.grids.values():
            for setting in grid:
                config = experiments.planned_config(plan, setting, 0)
                self.assertEqual(common.total_steps(config, num_examples),
                                 rdp_steps)
        # PLD (the default): the runs calibrate at train time, to more steps.
        pld = experiments.make_plan(task, base=base, **kwargs)
        self.assertIsNone(pld.calibration)
        self.assertEqual(pld.base, base)
        self.assertEqual(common.total_steps(pld.base, num_examples),
                         pld_steps)
        self.assertEqual(pld.target_epsilon, 7.0)

    def test_rdp_without_a_target_or_examples(self):
        kwargs = dict(learning_rates=experiments.DEFAULT_LEARNING_RATES,
                      gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
                      seeds=(0,), runs_dir="/r", data={},
                      calibration_accountant="rdp")
        # Epochs decide the steps: no accountant calibrates them.
        epochs = common.base_config("fashion_mnist", target_epsilon=None,
                                    epochs=2.0)
        plan = experiments.make_plan("fashion_mnist", base=epochs, **kwargs)
        self.assertEqual((plan.base, plan.calibration, plan.target_epsilon),
                         (epochs, None, None))
        base = common.base_config("fashion_mnist")
        with self.assertRaisesRegex(ValueError, "needs num_examples"):
            experiments.make_plan("fashion_mnist", base=base, **kwargs)
        with self.assertRaisesRegex(ValueError, "accountant='moments'"):
            experiments.make_plan("fashion_mnist", base=base,
                                  **dict(kwargs,
                                         calibration_accountant="moments"))
        # A budget below one step is the library's error.
        with self.assertRaisesRegex(ValueError, "target_epsilon"):
            experiments.calibrated_base(
                common.base_config("fashion_mnist", target_epsilon=0.01),
                60_000, "rdp")


class NumTrainExamplesTest(absltest.TestCase):

    def test_sst2_counts_the_rows_of_train_tsv(self):
        folder = research_helpers.write_sst2_tsv(train=48, dev=16)
        for task in ("sst2", "sst2_lora", "sst2_full", "sst2_scratch"):
            self.assertEqual(
                experiments.num_train_examples(task, data_dir=folder), 48)
        self.assertEqual(experiments.num_train_examples(
            "sst2", data_dir=folder, max_examples=20), 20)
        self.assertEqual(experiments.num_train_examples(
            "sst2", data_dir=folder, max_examples=100), 48)
        with self.assertRaises(FileNotFoundError):
            experiments.num_train_examples("sst2",
                                           data_dir=tempfile.mkdtemp())

    def test_the_offline_data_sets(self):
        # 60,000 whether read from Debian's IDX files or tensorflow-datasets'.
        self.assertEqual(experiments.num_train_examples("fashion_mnist"),
                         60_000)
        self.assertEqual(experiments.num_train_examples(
            "fashion_mnist", data_dir=tempfile.mkdtemp()), 60_000)
        self.assertEqual(experiments.num_train_examples(
            "fashion_mnist", max_examples=20_000), 20_000)
        if not os.path.exists(os.path.join(experiments.DEFAULT_SST2_DIR,
                                           "train.tsv")):
            self.skipTest("No SST-2 in ../shared/data/sst2.")
        self.assertEqual(experiments.num_train_examples("sst2"), 67_349)


if __name__ == "__main__":
    absltest.main()
