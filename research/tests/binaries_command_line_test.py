"""The harness's binaries' command lines: --help lists every flag, and bad
values or impossible settings end with one line naming the flag, exit code 2.

The cases run through `binary_driver` (forked from one process that imported
the binaries once); they fail before training. `python -m` itself is run by
shared_flags_test (--help), readme_commands_test (the README's commands) and
privacy_cli_test (the privacy command line's usage errors).
"""

import json
import tempfile

from absl.testing import absltest

from research import datasets
from research.tests import binary_driver

BINARIES = ("research.train_image", "research.train_text",
            "research.reproduce", "research.ablations",
            "research.diagnostics")

_FASHION_MNIST = datasets.fashion_mnist_files() is not None
_EMPTY_DIR = tempfile.mkdtemp()

# (binary, arguments, what the one line must contain: the flag, the reason).
USAGE_ERRORS = [
    ("research.train_image", ["--noise_multiplier=-1"],
     "--noise_multiplier=-1.0: Expected noise_multiplier=-1.0 to be a finite"
     " number >= 0"),
    ("research.train_image", ["--target_epsilon=-3"],
     "--target_epsilon=-3.0: Expected target_epsilon=-3.0"),
    ("research.train_image", ["--target_epsilon=0"],
     "Give --target_epsilon > 0 or --epochs"),
    ("research.train_image", ["--l2_norm_clip=0"], "--l2_norm_clip=0.0"),
    ("research.train_image", ["--delta=1.5"], "--delta=1.5"),
    ("research.train_image", ["--epsilon=tiny"],
     "--epsilon=tiny: Expected epsilon='tiny' to be a number"),
    ("research.train_image", ["--dataset=mnist"], "--dataset=mnist"),
    ("research.train_image", ["--beta_2=1"], "--beta_2=1.0"),
    ("research.train_image", ["stray"], "Unexpected arguments"),
    ("research.train_image", ["--weight_decay=-0.1"],
     "--weight_decay=-0.1: Expected weight_decay=-0.1 to be a finite number"
     " >= 0"),
    ("research.train_image", ["--optimizer=dpsgd", "--weight_decay=0.5"],
     "Expected --weight_decay=0.5 times the learning rate 4 < 1"),
    ("research.train_image", ["--ema_momentum=1"],
     "--ema_momentum=1.0: Expected ema_momentum=1.0 in (0, 1)"),
    ("research.train_image", ["--normalization=batch"],
     "--normalization=batch"),
    ("research.train_image", ["--augmult=-1"],
     "--augmult=-1: Expected augmult=-1 to be a finite number >= 0"),
    ("research.train_image", ["--validation_examples=-1"],
     "--validation_examples=-1: Expected validation_examples=-1 to be an"
     " int >= 0"),
    # No network here: cifar10 is neither prepared in an empty folder nor
    # downloadable; the line names the offline alternatives.
    ("research.train_image", ["--dataset=cifar10", f"--data_dir={_EMPTY_DIR}"],
     "cannot be downloaded"),
    ("research.train_text", ["--sequence_length=0"], "--sequence_length=0"),
    ("research.train_text", [], "--dataset=sst2_tsv needs --data_dir"),
    ("research.train_text", [f"--data_dir={_EMPTY_DIR}"],
     "--data_dir: [Errno 2] No such file or directory"),
    ("research.train_text", ["--noise_multiplier=-1"], "--noise_multiplier"),
    ("research.train_text", ["--ema_momentum=0"], "--ema_momentum=0.0"),
    ("research.train_text", ["--validation_examples=-2"],
     "--validation_examples=-2: Expected validation_examples=-2"),
    ("research.train_text", ["--finetune_blocks=-1"],
     "Expected finetune_blocks=-1 >= 0 (0: every block)"),
    # No network here: a preset name (no folder) cannot be downloaded.
    ("research.train_text",
     [f"--data_dir={_EMPTY_DIR}", "--preset=bert_tiny_en_uncased"],
     "--preset=bert_tiny_en_uncased: no such folder, and keras-hub cannot"
     " download it (no network"),
    ("research.reproduce", ["--learning_rates_dpsgd=0.1,fast"],
     "--learning_rates_dpsgd=['0.1', 'fast']: Expected"
     " learning_rates_dpsgd='fast' to be a number"),
    ("research.reproduce", ["--seeds=0,one"], "--seeds"),
    ("research.reproduce", ["--target_epsilon=-3"], "--target_epsilon"),
    ("research.reproduce", ["--target_epsilon=0"],
     "Give target_epsilon > 0 or epochs"),
    ("research.ablations", ["--beta_2s=0.99,1.5"], "--beta_2s"),
    ("research.ablations", ["--gammas=1e-8,lots"], "--gammas"),
    ("research.ablations", ["--seed=1", "--spread_seeds=1,2"],
     "--spread_seeds repeats --seed=1"),
    ("research.ablations", ["--physical_batch_size=0"],
     "--physical_batch_size=0"),
    ("research.diagnostics", ["--report_steps=10,0"], "--report_steps"),
    ("research.diagnostics", ["--optimizer=dpsgd"],
     "use --optimizer=dpadam_corrected or dpadam"),
    ("research.diagnostics", ["--eval_every=0"], "--eval_every=0"),
    ("research.diagnostics", ["--validation_examples=10"],
     "--validation_examples is not supported"),
]
if _FASHION_MNIST:  # Impossible settings found once the data is loaded.
    USAGE_ERRORS += [
        ("research.train_image",
         ["--target_epsilon=0.5", "--max_examples=512"],
         "Expected target_epsilon=0.5 >= "),
        ("research.train_image", ["--batch_size=1000", "--max_examples=500"],
         "Expected batch_size=1000 <= num_examples=500"),
        # The split leaves nothing to train on.
        ("research.train_image",
         ["--validation_examples=512", "--max_examples=512"],
         "Expected validation_examples=512 < the 512 training examples"),
        ("research.diagnostics",
         ["--target_epsilon=0.5", "--max_examples=512"],
         "Expected target_epsilon=0.5 >= "),
    ]


class CommandLineTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cases = [{"module": m, "args": [], "mode": "help"} for m in BINARIES]
        cases += [{"module": m, "args": a, "mode": "run"}
                  for m, a, _ in USAGE_ERRORS]
        results = binary_driver.run_cases(cases)
        cls.help = dict(zip(BINARIES, results[:len(BINARIES)]))
        cls.errors = results[len(BINARIES):]

    def test_help_lists_every_flag_with_its_default(self):
        for binary, result in self.help.items():
            with self.subTest(binary):
                self.assertEqual(result["code"], 0, result["stderr"])
                shown = json.loads(result["stdout"])
                # Its own flags and the shared ones, each in --help.
                self.assertGreater(len(shown["defined"]), 15)
                for flag in shown["defined"]:
                    self.assertRegex(shown["help"], rf"--(\[no\])?{flag}:")
                self.assertIn("(default: '1e-05')", shown["help"])

    def test_bad_values_and_impossible_settings_take_one_line(self):
        for (binary, args, expected), result in zip(USAGE_ERRORS,
                                                    self.errors):
            with self.subTest(binary=binary, args=args):
                program = binary.split(".")[1] + ".py"
                self.assertEqual(result["code"], 2, result["stderr"])
                self.assertNotIn("Traceback", result["stderr"])
                self.assertEqual(result["stderr"].count("\n"), 1,
                                 result["stderr"])
                self.assertTrue(result["stderr"].startswith(
                    f"{program}: error: "), result["stderr"])
                self.assertIn(expected, result["stderr"])

    def test_offline_dataset_names_the_offline_alternatives(self):
        index = [a for _, a, _ in USAGE_ERRORS].index(
            ["--dataset=cifar10", f"--data_dir={_EMPTY_DIR}"])
        line = self.errors[index]["stderr"]
        self.assertIn("--dataset=fashion_mnist", line)
        self.assertIn("--data_dir=DIR", line)


if __name__ == "__main__":
    absltest.main()
