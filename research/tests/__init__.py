"""Tests of the research harness (`python -m pytest -q research/tests`).

A package, so that its test modules are imported as `research.tests.<name>`
and cannot clash with the library's tests in tests/ of the same name.
"""
