#!/usr/bin/env bash
# Create .venv and install meshviz into it: torch first (pinned), then the package. Idempotent.
# Usage: scripts/setup.sh [--test]   (--test also installs the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
else
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
.venv/bin/python -c "import torch, meshviz; assert torch.__version__.startswith('2.13.0'), torch.__version__"
