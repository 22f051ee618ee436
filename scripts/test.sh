#!/usr/bin/env bash
# Set up (with test tools and a headless browser), then run every test: unit, multi-process, notebooks, browser.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
if [ -f scripts/install_browser.sh ]; then
  bash scripts/install_browser.sh
fi
export IPP_NONINTERACTIVE=1 PYTHONWARNINGS=ignore::FutureWarning
export MESHVIZ_STRICT_DEVICES="${MESHVIZ_STRICT_DEVICES:-1}"  # every tensor into a collective on its rank's device
.venv/bin/python -m pytest tests notebooks --nbval -p no:cacheprovider "$@"
