"""The version of tf_dpadam: its one source.

pyproject.toml reads it (`[tool.setuptools.dynamic]`, without importing the
package), `tf_dpadam.__version__` is this value, and
tests/packaging_test.py checks that MODULE.bazel and CHANGELOG.md agree.
"""

__version__ = "0.1.0"
