"""tf_dpadam's setup script, for the tools that want one.

Everything (name, version, dependencies, extras) is in pyproject.toml; the
version is tf_dpadam/version.py's. `pip install -e ".[tests,examples,docs]"`
builds with the setuptools that pyproject.toml asks for; running this script
directly needs setuptools >= 77 (for the SPDX `license` of PEP 639).
"""

import setuptools

if int(setuptools.__version__.split(".")[0]) < 77:
    raise SystemExit(
        f"setup.py: setuptools {setuptools.__version__} cannot read"
        " pyproject.toml's license; run `python -m pip install -U setuptools`"
        " first, or install with `python -m pip install .`.")

setuptools.setup()
