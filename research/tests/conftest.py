"""Test-process settings that must precede the first TensorFlow import, as
tests/conftest.py sets them for the library's tests (when research/tests
runs on its own)."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # As tests/conftest.py.


_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items):
    """Every research test is in the slow tier: `-m "not slow"` skips them."""
    for item in items:
        if os.path.abspath(str(item.fspath)).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.slow)
