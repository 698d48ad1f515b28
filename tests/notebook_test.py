"""examples/tpu_colab.ipynb runs on CPU (its TPU branch skipped) on a tiny
setting, and still shows Colab users the TPU path.

The notebook's code cells, less their shell lines (`!pip install ...`, which
sets up Colab), run as one script in a subprocess with
$TF_DPADAM_SMOKE_TEST=1: 2 DP steps on random CIFAR-shaped images.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
from absl.testing import absltest

pytestmark = pytest.mark.slow  # Runs the notebook in a subprocess.

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOTEBOOK = os.path.join(_ROOT, "examples", "tpu_colab.ipynb")


def notebook_script(notebook):
    """The code cells of a notebook (a dict) as one Python script, without
    IPython's shell and magic lines (`!...`, `%...`)."""
    cells = ["".join(cell["source"]) for cell in notebook["cells"]
             if cell["cell_type"] == "code"]
    lines = [line for cell in cells for line in cell.splitlines()
             if not line.lstrip().startswith(("!", "%"))]
    return "\n".join(lines) + "\n"


class NotebookTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with open(_NOTEBOOK, encoding="utf-8") as f:
            cls.notebook = json.load(f)

    def test_script_drops_only_the_shell_lines(self):
        script = notebook_script({"cells": [
            {"cell_type": "markdown", "source": ["# Title\n"]},
            {"cell_type": "code", "source": ["!pip install x\n", "a = 1\n"]},
            {"cell_type": "code", "source": ["%time b = a\n", "print(a)"]},
        ]})
        self.assertEqual(script, "a = 1\nprint(a)\n")

    def test_still_shows_the_tpu_path_for_colab(self):
        script = notebook_script(self.notebook)
        self.assertEqual(self.notebook["metadata"]["accelerator"], "TPU")
        for call in ("TPUClusterResolver()", "initialize_tpu_system(resolver)",
                     "tf.distribute.TPUStrategy(resolver)",
                     "with strategy.scope():", 'tfds.load("cifar10"'):
            self.assertIn(call, script)
        self.assertTrue(any(
            "!pip install" in "".join(c["source"])
            for c in self.notebook["cells"] if c["cell_type"] == "code"))

    def test_runs_on_cpu_on_a_tiny_setting(self):
        folder = tempfile.mkdtemp()
        path = os.path.join(folder, "tpu_colab.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(notebook_script(self.notebook))
        env = dict(os.environ, TF_DPADAM_SMOKE_TEST="1",
                   PYTHONPATH=os.pathsep.join(
                       p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        for variable in ("COLAB_TPU_ADDR", "TPU_NAME"):
            env.pop(variable, None)
        run = subprocess.run([sys.executable, path], cwd=folder, env=env,
                             capture_output=True, text=True, timeout=600,
                             check=False)
        self.assertEqual(run.returncode, 0, run.stderr[-3000:])
        self.assertIn("No TPU: default strategy, 1 replica", run.stdout)
        plain = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout)  # Bar colors.
        self.assertRegex(plain, r"(?m)^2/2 .*epsilon: \d")
        self.assertRegex(plain, r"test accuracy 0?\.\d+")


if __name__ == "__main__":
    absltest.main()
