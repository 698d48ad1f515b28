"""The command lines answer fast and fail fast (issue 52).

`--help` of every example binary and of the privacy command line takes at
most 3 s of CPU, and the privacy command line's answer at most 5 s: nothing
imports TensorFlow before it is needed. Without their data, and offline,
the example binaries exit with code 2 and one line naming --data_dir
(train_text's --preset given a keras-hub name: --preset) within 20 s,
instead of retrying a download for minutes.
"""

import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

import pytest
from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py")
                  if p.name != "__init__.py")
MAX_CPU_SECONDS = 3.0
# The privacy command line's answer composes 14,063 steps under PLD and
# RDP, after dp-accounting's imports (scipy: 2.1 s of the 3.1-3.3 s it takes
# on an idle 2-core Intel Xeon): its own cap.
MAX_ANSWER_CPU_SECONDS = 5.0
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def run(*args, timeout=120):
    """`python args` in the repository: (completed process, CPU seconds,
    wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, check=False,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime
           + after.ru_stime - before.ru_stime)
    return done, cpu, wall


def least_cpu(*args, tries=3, cap=MAX_CPU_SECONDS):
    """`run(*args)` up to `tries` times, until it takes at most `cap` CPU
    seconds: (the last completed process, the least CPU seconds).
    Two test workers on 2 cores make a CPU second cost more (shared caches,
    hyperthreads): the privacy command line's answer read 3.4 s in one
    suite run where it had passed in others, and load only ever adds, so
    the least of a few runs is the command's own cost."""
    least = float("inf")
    for _ in range(tries):
        done, cpu, _ = run(*args)
        least = min(least, cpu)
        if least <= cap:
            break
    return done, least


class HelpTest(absltest.TestCase):

    @pytest.mark.slow
    def test_help_of_the_examples_takes_little_cpu(self):
        for name in EXAMPLES:
            done, cpu = least_cpu("-m", f"examples.{name}", "--help")
            self.assertIn("--data_dir" if name != "multi_worker" else "--cpus",
                          done.stdout, name)
            self.assertLessEqual(cpu, MAX_CPU_SECONDS, name)

    @pytest.mark.slow
    def test_privacy_command_line_takes_little_cpu(self):
        for args, cap in ((["--help"], MAX_CPU_SECONDS), ([
                "--num_examples=60000", "--batch_size=256",
                "--noise_multiplier=1.1", "--epochs=60", "--delta=1e-5"],
                          MAX_ANSWER_CPU_SECONDS)):
            done, cpu = least_cpu("-m", "tf_dpadam.accounting.cli", *args,
                                  cap=cap)
            self.assertIn("noise_multiplier", done.stdout, args)
            self.assertLessEqual(cpu, cap, args)

    def test_adam_epsilon_and_its_deprecated_name(self):
        for name in ("train_image", "train_text"):
            done, _, _ = run("-m", f"examples.{name}", "--help")
            self.assertIn("--adam_epsilon", done.stdout)
            self.assertNotIn("--epsilon", done.stdout)  # Deprecated: hidden.
            done, cpu, _ = run("-m", f"examples.{name}", "--epsilon=1e-8",
                               "--adam_epsilon=1e-8")
            self.assertEqual(done.returncode, 2)
            self.assertEqual(done.stderr.splitlines(), [
                f"{name}.py: error: --epsilon is the deprecated name of"
                " --adam_epsilon; give --adam_epsilon only."])
            self.assertLessEqual(cpu, MAX_CPU_SECONDS)

    def test_the_examples_offer_every_dp_optimizer(self):
        from tf_dpadam.tools import run_ledger  # pylint: disable=g-import-not-at-top
        for name in ("train_image", "audit"):
            done, _, _ = run("-m", f"examples.{name}", "--help")
            for flag in run_ledger.OPTIMIZER_FLAGS.values():
                self.assertIn(flag, done.stdout, name)

    def test_samplings_agree_with_the_accounting(self):
        from tf_dpadam import accounting  # pylint: disable=g-import-not-at-top
        from tf_dpadam.accounting import cli  # pylint: disable=g-import-not-at-top
        self.assertEqual(cli.SAMPLINGS, accounting.SAMPLINGS)

    def test_audit_breaks_agree_with_the_library(self):
        from tf_dpadam.tools.audit import hooks  # pylint: disable=g-import-not-at-top
        source = (ROOT / "examples" / "audit.py").read_text()
        self.assertIn("BREAKS = " + repr(list(hooks.BREAKS)).replace("'", '"'),
                      source)


@pytest.mark.slow  # Each binary loads TensorFlow before it fails.
class OfflineTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        # Offline for tensorflow-datasets and Keras, whatever the machine:
        # an unreachable proxy (`command_line.unreachable` probes it).
        proxies = dict(https_proxy="http://127.0.0.1:9",
                       http_proxy="http://127.0.0.1:9")
        self.enter_context(mock.patch.dict(os.environ, proxies))
        self.empty = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.empty)

    def check_fails_fast(self, name, flags, flag):
        """Runs the binary: exit code 2 within 20 s, and one line of error
        that names `flag`. Returns the completed process."""
        done, _, wall = run("-m", f"examples.{name}", *flags)
        errors = [line for line in done.stderr.splitlines()
                  if ": error: " in line]
        self.assertEqual(done.returncode, 2, (name, done.stderr[-2000:]))
        self.assertLen(errors, 1, done.stderr[-2000:])
        self.assertIn(flag, errors[0])
        self.assertLessEqual(wall, 20.0, (name, flags))
        return done

    def test_without_data_each_binary_fails_fast_in_one_line(self):
        empty = f"--data_dir={self.empty}"
        for name, flags in (
                ("train_text", []), ("train_text", [empty]),
                ("train_image", ["--dataset=cifar10"]),
                ("train_image", [empty]), ("multi_worker", [empty]),
                ("audit", [empty]), ("membership", [empty]),
                ("finetune_applications", [empty])):
            self.check_fails_fast(name, flags, "--data_dir")

    def test_a_preset_name_fails_fast(self):
        # Not a folder: keras-hub would download it (and retry, offline).
        done = self.check_fails_fast(
            "train_text", ["--preset=bert_tiny_en_uncased"], "--preset")
        self.assertIn("--preset=bert_tiny_en_uncased: no such folder, and no"
                      " download (no network", done.stderr)
        self.assertIn("pass --preset=DIR, a local preset folder", done.stderr)

    @absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
    def test_without_imagenet_weights_finetuning_fails_fast(self):
        with mock.patch.dict(os.environ, {"KERAS_HOME": self.empty}):
            self.check_fails_fast("finetune_applications", [], "--weights")

    def test_the_old_epsilon_flag_warns(self):
        done = self.check_fails_fast(
            "train_image", ["--dataset=cifar10", f"--data_dir={self.empty}",
                            "--epsilon=1e-8"], "--data_dir")
        self.assertIn("warning: --epsilon is deprecated and will be removed;"
                      " use --adam_epsilon.", done.stderr)


if __name__ == "__main__":
    absltest.main()
