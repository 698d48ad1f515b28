"""The package's lazy loading (`src/tf_dpadam/__init__.py`, PEP 562).

`import tf_dpadam` loads no TensorFlow (the command lines answer fast); the
first use of a public name binds them all (registering the DP optimizers
with Keras); importing it after Keras binds them at once. Each case runs in
a fresh interpreter, since this one has TensorFlow loaded already.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

from absl.testing import absltest
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_python(source):
    """Runs `source` in a fresh interpreter; returns its stdout's lines."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], cwd=ROOT, text=True,
        capture_output=True, timeout=300, check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"),
                 TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


class LazyLoadingTest(absltest.TestCase):

    @pytest.mark.slow
    def test_import_loads_no_tensorflow_until_a_name_is_used(self):
        self.assertEqual(run_python("""
            import sys
            import tf_dpadam
            print("tensorflow" in sys.modules, "keras" in sys.modules)
            print(tf_dpadam.__version__)
            from tf_dpadam.accounting import cli
            from tf_dpadam.common import command_line
            print("tensorflow" in sys.modules)
            print(tf_dpadam.DPAdamCorrected.__name__)
            print(sorted(set(tf_dpadam.__all__) - set(vars(tf_dpadam))))
            import keras
            print(keras.saving.get_registered_object(
                "tf_dpadam>DPAdamCorrected") is tf_dpadam.DPAdamCorrected)
        """), ["False False", tf_dpadam_version(), "False", "DPAdamCorrected",
               "[]", "True"])

    @pytest.mark.slow
    def test_a_module_of_all_loads_alone(self):
        self.assertEqual(run_python("""
            import sys
            import tf_dpadam
            print(tf_dpadam.accounting.__name__, "tensorflow" in sys.modules)
        """), ["tf_dpadam.accounting False"])

    @pytest.mark.slow
    def test_a_stage_module_imported_first_loads(self):
        # Its Keras import must not load every public name while the module
        # itself is half-made (a circular ImportError before the fix).
        for module in ("tf_dpadam.optimizers.paper",
                       "tf_dpadam.training.private_model",
                       "tf_dpadam.tools.fixer"):
            self.assertEqual(run_python(f"""
                import {module}
                import tf_dpadam
                print(tf_dpadam.make_private.__name__)
            """), ["make_private"], module)

    @pytest.mark.slow
    def test_after_keras_every_name_is_bound_at_import(self):
        self.assertEqual(run_python("""
            import keras
            import tf_dpadam
            print(sorted(set(tf_dpadam.__all__) - set(vars(tf_dpadam))))
        """), ["[]"])

    @pytest.mark.slow
    def test_keras_imported_later_loads_them_for_load_model(self):
        # import tf_dpadam, then keras, then load a saved private model
        # without naming anything of tf_dpadam: its classes are registered.
        self.assertEqual(run_python("""
            import os, tempfile
            import tf_dpadam
            import keras
            import numpy as np
            print(keras.saving.get_registered_object(
                "tf_dpadam>PrivateModel") is not None)
            private = tf_dpadam.make_private(
                keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
            private.compile(optimizer=tf_dpadam.DPSGD(
                l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=4),
                loss="mse")
            path = os.path.join(tempfile.mkdtemp(), "m.keras")
            private.save(path)
            print(type(keras.models.load_model(path)).__name__)
        """), ["True", "PrivateModel"])

    @pytest.mark.slow
    def test_a_name_set_before_the_loading_stays(self):
        # As a test's patch: `tf_dpadam.calibrate_steps = fake`, then a use.
        self.assertEqual(run_python("""
            import tf_dpadam
            fake = object()
            tf_dpadam.calibrate_steps = fake
            tf_dpadam.make_private
            print(tf_dpadam.calibrate_steps is fake)
        """), ["True"])

    def test_dir_and_unknown_names(self):
        self.assertEqual(run_python("""
            import tf_dpadam
            print(set(tf_dpadam.__all__) <= set(dir(tf_dpadam)))
            try:
                tf_dpadam.no_such_name
            except AttributeError as error:
                print(error)
        """), ["True", "module 'tf_dpadam' has no attribute 'no_such_name'"])


def tf_dpadam_version():
    namespace = {}
    exec((ROOT / "src" / "tf_dpadam" / "version.py").read_text(), namespace)  # pylint: disable=exec-used
    return namespace["__version__"]


if __name__ == "__main__":
    absltest.main()
