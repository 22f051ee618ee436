#!/usr/bin/env bash
# Set up (with test tools and a headless browser), lint and check the layer contract, then run every test once:
# the unit tier, the ranks tier (multi-rank semantics on thread ranks), the transport tier (real gloo processes,
# ipyparallel engines, launch, devices, the browser) and the notebooks with their ranks as threads
# (MESHVIZ_RANKS=threads, as on Binder; the transport tier's tests do not see it); then three notebooks again with
# ipyparallel engines as ranks, and the Binder check (a fresh environment from binder/, 01, 06 and 13 under a 2 GiB
# memory limit). MESHVIZ_TEST_ENGINES=0 / MESHVIZ_BINDER_CHECK=0 leave those out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
if [ -f scripts/install_browser.sh ]; then
  bash scripts/install_browser.sh
fi
export IPP_NONINTERACTIVE=1 PYTHONWARNINGS=ignore::FutureWarning
export MESHVIZ_STRICT_DEVICES="${MESHVIZ_STRICT_DEVICES:-1}"  # every tensor into a collective on its rank's device
.venv/bin/ruff check meshviz tests bench scripts examples  # lint (pyproject's [tool.ruff])
.venv/bin/lint-imports  # the layer contract (pyproject's [tool.importlinter])
.venv/bin/mypy  # types of the pure core and the trace (pyproject's [tool.mypy])
MESHVIZ_RANKS=threads .venv/bin/python -m pytest tests/unit tests/ranks tests/transport notebooks --nbval \
  -p no:cacheprovider --durations=25 "$@"
if [ "${MESHVIZ_TEST_ENGINES:-1}" != "0" ]; then  # a Cluster's default ranks: one ipyparallel engine each
  MESHVIZ_RANKS=engines .venv/bin/python -m pytest --nbval -p no:cacheprovider notebooks/00_quickstart.ipynb \
    notebooks/03_data_parallel.ipynb notebooks/11_debugging_hangs.ipynb "$@"
fi
if [ "${MESHVIZ_BINDER_CHECK:-1}" != "0" ]; then
  .venv/bin/python scripts/binder_check.py
fi
