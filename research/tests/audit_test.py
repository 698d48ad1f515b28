"""Tests of the audit binaries (research/audit.py, research/audit_table.py).

The end-to-end tests train the paper's CNN on a Fashion-MNIST subset (a
short run; skipped where Debian's dataset-fashion-mnist is not installed):
the real privatizer must give L <= E and a privatizer without noise L > E.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from absl import app

import tf_dpadam

from research import audit
from research import audit_table
from research import datasets
from tf_dpadam.tools import audit as audit_lib

HAVE_FASHION_MNIST = datasets.fashion_mnist_files() is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
LAST_LINE = re.compile(
    r"^audit: epsilon lower bound (\d+\.\d+) \(95% confidence\) vs claimed"
    r" epsilon (\d+\.\d+)$")

# A short run: q = 0.05, T = 80, so each included canary is in ~4 steps.
SMALL = audit.AuditConfig(train_size=500, batch_size=25, steps=80,
                          num_canaries=400, num_guesses=80, canary_seed=0)


def test_last_line_is_exactly_as_documented():
    line = audit.last_line(0.1234, 0.95, 1.5)
    assert line == ("audit: epsilon lower bound 0.123 (95% confidence) vs"
                    " claimed epsilon 1.500")
    assert LAST_LINE.match(line)


@pytest.mark.parametrize("changes, flag", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(batch_size=5000), "batch_size"),
    (dict(num_guesses=2000), "num_guesses"),
    (dict(canary_norm=0.5), "canary_norm"),
    (dict(train_size=10**6), "train_size"),
    (dict(canaries="input", num_canaries=20000), "num_canaries"),
])
def test_bad_settings_name_the_flag(changes, flag):
    config = dataclasses.replace(audit.AuditConfig(), **changes)
    with pytest.raises(app.UsageError, match=f"--{flag}:"):
        audit._check(config, 60000, 10000)


def test_claimed_epsilon_is_the_accountants():
    config = audit.AuditConfig()
    assert audit.claimed_epsilon(config, 2000) == tf_dpadam.epsilon_after_steps(
        steps=400, num_examples=2000, batch_size=50, noise_multiplier=2.0,
        delta=1e-5, accountant="pld")
    no_noise = dataclasses.replace(config, noise_multiplier=0.0)
    assert audit.claimed_epsilon(no_noise, 2000) == float("inf")


def test_table_has_a_row_per_setting_and_flags_l_above_e():
    def fake_run(config, data_dir, verbose):
        del data_dir, verbose
        included = [True, False] * 50
        if config.broken == "no_noise":  # scores that give inclusion away
            scores = [float(i) for i in included]
        else:  # scores that say nothing about it
            scores = [float(i) for i in range(100)]
        return {
            "result": audit_lib.audit_result(scores, included, 100, 1e-5),
            "claimed_epsilon": 1.0 / config.noise_multiplier,
        }

    rows = audit_table.table_rows(["1", "2"], ["no_noise"], 2.0,
                                  ["gradient", "input"], audit.AuditConfig(),
                                  run_fn=fake_run)
    assert [(r["sigma"], r["break"]) for r in rows] == [
        (1.0, "none"), (2.0, "none"), (2.0, "no_noise")]
    text = audit_table.markdown(rows, ["gradient", "input"])
    lines = text.splitlines()
    assert len(lines) == 2 + 3
    assert "**broken: no_noise**" in lines[-1] and "**> E**" in lines[-1]
    assert "**> E**" not in lines[2]


@pytest.mark.skipif(not HAVE_FASHION_MNIST, reason="needs Fashion-MNIST")
def test_binary_prints_the_documented_last_line():
    result = subprocess.run(
        [sys.executable, "-m", "research.audit", "--train_size=300",
         "--batch_size=30", "--steps=5", "--num_canaries=50",
         "--num_guesses=10"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )
    match = LAST_LINE.match(result.stdout.strip().splitlines()[-1])
    assert match, result.stdout[-500:]
    assert float(match.group(1)) <= float(match.group(2))


@pytest.mark.skipif(not HAVE_FASHION_MNIST, reason="needs Fashion-MNIST")
def test_real_privatizer_passes_and_breaks_are_caught():
    real = audit.run(SMALL, verbose=0, max_test_examples=100)
    claimed = real["claimed_epsilon"]
    assert real["result"].epsilon_lower_bound <= claimed
    for broken in ("no_noise", "no_clipping"):
        out = audit.run(dataclasses.replace(SMALL, broken=broken), verbose=0,
                        max_test_examples=100)
        assert out["claimed_epsilon"] == claimed  # the claim is the same
        assert out["result"].epsilon_lower_bound > claimed, (
            broken, out["result"].describe(claimed))
