#!/usr/bin/env bash
# Install what tests/transport/test_browser.py needs: Debian's chromium (apt) and the playwright Python package (pip).
# Idempotent. Never runs `playwright install`: the tests drive /usr/bin/chromium through executable_path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

if [ -x /usr/bin/chromium ]; then
    echo "chromium: $(/usr/bin/chromium --version 2>/dev/null | grep -i chromium || echo present)"
else
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium
fi

if "$PY" -c "import playwright" >/dev/null 2>&1; then
    echo "playwright: already installed"
else
    "$PY" -m pip install --quiet playwright
fi
"$PY" -c "import playwright, sys; print('playwright ok for', sys.executable)"
