#!/usr/bin/env bash
# A venv with one torch release and meshviz's test tools, kept between runs (one per version) and re-pointed at
# this checkout on every call; prints the venv's path. Usage: scripts/torch_venv.sh VERSION (e.g. 2.11.0, 2.15.0).
# torch 2.13.0 comes from a local CPU wheel where pip finds one; other releases are CUDA builds from the registry
# (about 5.5 GB installed). pip runs without the machine's configuration, whose constraint may cap torch below
# the newest release. MESHVIZ_VENV_CACHE: where the venvs live (default ~/.cache/meshviz).
set -euo pipefail
cd "$(dirname "$0")/.."
V="${1:?torch version, e.g. 2.15.0}"
PY=${PYTHON:-python3}
VENV="${MESHVIZ_VENV_CACHE:-$HOME/.cache/meshviz}/venv-torch-$V"
pip_() { PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$V')" 2>/dev/null; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip_ "torch==$V" >&2
fi
pip_ -e ".[test]" >&2  # the dependencies once; the editable link to this checkout every time
"$VENV/bin/python" -c "import torch, meshviz; assert torch.__version__.split('+')[0] == '$V', torch.__version__" >&2
echo "$VENV"
