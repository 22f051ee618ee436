#!/usr/bin/env bash
# Set up (with test tools and a headless browser), lint and check the layer contract, then run every test: unit,
# multi-process, notebooks, browser;
# then the notebooks and the multi-rank tests again with ranks as threads (MESHVIZ_RANKS=threads, as on Binder),
# and the Binder check (a fresh environment from binder/, 01 and 06 under a 2 GiB memory limit).
# MESHVIZ_TEST_THREADS=0 / MESHVIZ_BINDER_CHECK=0 leave those out.
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
.venv/bin/python -m pytest tests notebooks --nbval -p no:cacheprovider "$@"
if [ "${MESHVIZ_TEST_THREADS:-1}" != "0" ]; then
  MESHVIZ_RANKS=threads .venv/bin/python -m pytest notebooks --nbval -p no:cacheprovider \
    tests/test_collective.py tests/test_runtime.py tests/test_shard_api.py tests/test_data_parallel.py \
    tests/test_fleet.py tests/test_group_sharded.py tests/test_pipeline.py tests/test_to_static.py \
    tests/test_checkpoint.py tests/test_ownership.py tests/test_rng_tracker.py tests/test_widgets.py tests/test_parallelize.py "$@"
fi
if [ "${MESHVIZ_BINDER_CHECK:-1}" != "0" ]; then
  .venv/bin/python scripts/binder_check.py
fi
