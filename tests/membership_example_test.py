"""A capped run of examples/membership.py (slow: it loads TensorFlow and data).

One DP setting (the non-private one runs the same code with Keras' Adam),
two shadows, one epoch, models trained with random mirrors and shifts
(--augment), LiRA with 10 views of each image. The script's own static
checks (at most 200 lines, public imports only) are in
tests/examples_test.py. Here: the table has a row per model, the DP model's
printed sigma meets its epsilon (an independent dp-accounting PLD
computation: epsilon(sigma) <= 7 < epsilon(sigma / 1.01), up to the printed
rounding), and the ROC plot is a PNG.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

from tests import examples_test

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST),
                    reason="needs Debian's Fashion-MNIST files")
def test_a_capped_run():
    with tempfile.TemporaryDirectory() as folder:
        png = os.path.join(folder, "roc.png")
        done = subprocess.run(
            [sys.executable, "-m", "examples.membership", "--num_members=128",
             "--num_shadows=2", "--epochs=1", "--batch_size=32",
             "--epsilons=7", "--max_test_examples=128", f"--plot={png}",
             "--queries=flip_shift", "--augment"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(png, "rb") as f:
            assert f.read(4) == b"\x89PNG"
    rows = re.findall(r"^\| (non-private|DP, ε = 7) \| (\S+) \| (0\.\d+) \|"
                      r"((?: [^|]+ \|){6})$", done.stdout, re.M)
    assert [row[0] for row in rows] == ["DP, ε = 7"], done.stdout
    sigma = float(rows[0][1])
    steps = 4  # ceil(1 epoch * 128 / 32).
    pld_epsilon = examples_test.pld_epsilon
    assert pld_epsilon(steps, 128, 32, sigma + 0.005, 1e-5) <= 7.0
    assert pld_epsilon(steps, 128, 32, (sigma - 0.005) / 1.01, 1e-5) > 7.0
    for row in rows:
        auc = float(row[3].split("|")[0])
        assert 0.0 <= auc <= 1.0
