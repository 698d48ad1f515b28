"""The `tf_dpadam.optimizers` package: its names, loaded on first use.

Importing the package (or its `registry`, for a binary's `--help`) loads
no Keras; each public name is the object of the submodule that defines it.
"""

import os
import subprocess
import sys

import keras  # pylint: disable=unused-import  # Before tf_dpadam, as usual.
from absl.testing import absltest

import tf_dpadam
from tf_dpadam import optimizers
from tf_dpadam.optimizers import base
from tf_dpadam.optimizers import disk
from tf_dpadam.optimizers import paper
from tf_dpadam.optimizers import scale_then_privatize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


class OptimizersPackageTest(absltest.TestCase):

    def test_each_name_is_its_modules(self):
        self.assertEqual(
            {name: getattr(optimizers, name) for name in optimizers.__all__},
            {"DPAdam": paper.DPAdam,
             "DPAdamCorrected": paper.DPAdamCorrected,
             "DPAdamDiSK": disk.DPAdamDiSK,
             "DPAdamScaleThenPrivatize":
                 scale_then_privatize.DPAdamScaleThenPrivatize,
             "DPOptimizerMixin": base.DPOptimizerMixin,
             "DPSGD": paper.DPSGD,
             "is_dp_optimizer": base.is_dp_optimizer})
        self.assertIs(tf_dpadam.DPAdamCorrected, optimizers.DPAdamCorrected)
        self.assertContainsSubset(optimizers.__all__, dir(optimizers))
        self.assertIs(optimizers.registry,
                      sys.modules["tf_dpadam.optimizers.registry"])

    def test_paper_no_longer_re_exports_the_mixin(self):
        self.assertEqual(paper.__all__, ["DPAdam", "DPAdamCorrected",
                                         "DPSGD"])

    def test_an_unknown_name(self):
        with self.assertRaisesRegex(AttributeError, "has no attribute 'x'"):
            optimizers.x  # pylint: disable=pointless-statement

    def test_the_package_loads_without_keras(self):
        code = ("import sys\n"
                "import tf_dpadam.optimizers\n"
                "assert 'keras' not in sys.modules, 'keras'\n"
                "assert 'tensorflow' not in sys.modules, 'tensorflow'\n")
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True,
            check=False, timeout=120,
            env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])


if __name__ == "__main__":
    absltest.main()
