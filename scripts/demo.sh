#!/usr/bin/env bash
# Set up, then run the main demo: 6 CPU ranks run the seed's sharding and reshard examples.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m meshviz.demo "$@"
