#!/usr/bin/env bash
# Set up (with test tools and a headless browser), lint and check the layer contract, then run every test once, in
# two lines of work side by side. The main one: the torch-free unit tests (marked torch_free: the pure core, the
# trace, the widgets) with torch blocked; the unit tier's others, the ranks tier (multi-rank semantics on thread
# ranks), the transport tier (real gloo processes, ipyparallel engines, launch, devices, the browser) and the
# notebooks with their ranks as threads (MESHVIZ_RANKS=threads, as on Binder; the transport tier's tests do not see
# it), on the torch of .venv; then the Binder check (01, 06 and 13 under a 2 GiB memory limit, in a fresh
# environment from binder/ that is built from the start, beside the tests) and the newest release's notebooks.
# Beside it, from as soon as .venv is made: every tier again on the oldest and then the newest supported torch
# (MESHVIZ_TORCH_MATRIX, default "2.11.0 2.15.0"), each in its own venv kept between runs (scripts/torch_venv.sh),
# all but the torch-free tests, the browser's, launch's and those on a Cluster's engines (marked launch, engines: they check
# what JupyterLab draws and meshviz's own process control, once; the Python they run runs on these releases in the
# other tiers, the hangs they name on spawn's and run_ranks' processes), then
# three notebooks on .venv again with ipyparallel engines as ranks (a Cluster's default). The parts are split so
# that both lines end at about the same time. One test run keeps under one core busy (it waits on ranks, kernels
# and the browser), so two go side by side, never more (three made a 2-core machine late enough to fail timed
# tests); then the table of torch version x tier (scripts/test_table.py). Every part runs even when an earlier one
# failed; the exit status says whether any did. MESHVIZ_TEST_ENGINES=0 / MESHVIZ_BINDER_CHECK=0 /
# MESHVIZ_TORCH_MATRIX= leave those out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test  # before the matrix's venvs: their editable installs write to this checkout too
export IPP_NONINTERACTIVE=1 PYTHONWARNINGS=ignore::FutureWarning
export MESHVIZ_STRICT_DEVICES="${MESHVIZ_STRICT_DEVICES:-1}"  # every tensor into a collective on its rank's device
OUT=artifacts/tests
rm -rf "$OUT" && mkdir -p "$OUT"
TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
MATRIX="${MESHVIZ_TORCH_MATRIX-2.11.0 2.15.0}"
LAST=$(echo $MATRIX | awk '{print $NF}')  # its notebooks run in front, after the Binder check
at() { echo "$((SECONDS / 60)) min $((SECONDS % 60)) s"; }  # since the command started
NBVAL="--nbval --nbval-kernel-startup-timeout=180"  # nbval's 60 s for a kernel to answer was once missed under load
matrix() {  # every tier on each release of $MATRIX in turn (in $OUT/torch-V.summary)
  local v venv notebooks rc=0
  for v in $MATRIX; do  # the venvs are made (downloads, mostly) at once
    bash scripts/torch_venv.sh "$v" > "$OUT/venv-$v.path" 2> "$OUT/venv-$v.log" &
    echo $! > "$OUT/venv-$v.pid"
  done
  for v in $MATRIX; do
    if ! wait "$(cat "$OUT/venv-$v.pid")"; then
      { echo "torch $v: its venv could not be made:"; tail -n 20 "$OUT/venv-$v.log"; } > "$OUT/torch-$v.summary"
      rc=1
      continue
    fi
    venv=$(cat "$OUT/venv-$v.path")
    if [ "$v" = "$LAST" ]; then notebooks=; else notebooks=notebooks; fi
    # launch and a Cluster's engines are meshviz's own process control, run once on .venv: torch enters them
    # through gloo's start, which the gloo, rendezvous and spawn's hang tests run on every release
    if CUDA_VISIBLE_DEVICES= MESHVIZ_RANKS=threads "$venv/bin/python" -m pytest tests/unit tests/ranks \
        tests/transport $notebooks $NBVAL -m "not browser and not torch_free and not engines and not launch" \
        -p no:cacheprovider -q --durations=10 \
        --junitxml="$OUT/torch-$v.xml" "$@" > "$OUT/torch-$v.log" 2>&1; then
      echo "torch $v: $(tail -n 1 "$OUT/torch-$v.log") (done at $(at))" > "$OUT/torch-$v.summary"
    else
      { echo "torch $v: tests failed ($OUT/torch-$v.log):"; tail -n 60 "$OUT/torch-$v.log"; } > "$OUT/torch-$v.summary"
      rc=1
    fi
  done
  if [ "${MESHVIZ_TEST_ENGINES:-1}" != "0" ]; then  # a Cluster's default ranks: one ipyparallel engine each
    if MESHVIZ_RANKS=engines .venv/bin/python -m pytest $NBVAL -p no:cacheprovider -q notebooks/00_quickstart.ipynb \
        notebooks/03_data_parallel.ipynb notebooks/11_debugging_hangs.ipynb \
        --junitxml="$OUT/torch-$TORCH-engines.xml" "$@" > "$OUT/engines.log" 2>&1; then
      echo "torch $TORCH, notebooks with engines: $(tail -n 1 "$OUT/engines.log") (done at $(at))" > "$OUT/engines.summary"
    else
      { echo "torch $TORCH, notebooks with engines: tests failed ($OUT/engines.log):"; tail -n 60 "$OUT/engines.log"; } \
        > "$OUT/engines.summary"
      rc=1
    fi
  fi
  return $rc
}
matrix "$@" &
MATRIX_PID=$!

status=0  # from here on a part that fails is counted, and the others still run (the matrix runs already)
if [ "${MESHVIZ_BINDER_CHECK:-1}" != "0" ]; then  # its environment is built (downloads, mostly) while tests run
  BINDER_ENV=$(mktemp -d -t meshviz-binder-XXXXXX)
  .venv/bin/python scripts/binder_check.py --build-only --env "$BINDER_ENV/env" > "$OUT/binder-build.log" 2>&1 &
  BINDER_PID=$!
fi
if [ -f scripts/install_browser.sh ]; then
  bash scripts/install_browser.sh || status=1
fi
.venv/bin/ruff check meshviz tests bench scripts examples || status=1  # lint (pyproject's [tool.ruff])
.venv/bin/lint-imports || status=1  # the layer contract (pyproject's [tool.importlinter])
.venv/bin/mypy || status=1  # types of the pure core and the trace (pyproject's [tool.mypy])
# the torch-free tests (the pure core, the trace, the widgets) once, torch blocked: no release can change them
.venv/bin/python -m pytest tests/unit -m torch_free -p tests.no_torch -p no:cacheprovider -q \
  --junitxml="$OUT/torch-free.xml" "$@" || [ $? -eq 5 ] || status=1  # 5: none selected (a -k of the caller's)
MESHVIZ_RANKS=threads .venv/bin/python -m pytest tests/unit tests/ranks tests/transport notebooks $NBVAL \
  -m "not torch_free" -p no:cacheprovider --durations=25 --junitxml="$OUT/torch-$TORCH.xml" "$@" || status=1
echo "torch $TORCH: done at $(at)"
if [ "${MESHVIZ_BINDER_CHECK:-1}" != "0" ]; then
  if wait "$BINDER_PID"; then
    cat "$OUT/binder-build.log"
    .venv/bin/python scripts/binder_check.py --env "$BINDER_ENV/env" --reuse || status=1
  else
    echo "the Binder check's environment could not be built:"; tail -n 30 "$OUT/binder-build.log"
    status=1
  fi
  rm -rf "$BINDER_ENV"
fi
if [ -n "$LAST" ]; then  # the last release's notebooks, in its venv (made by the chain, long done by now)
  while [ ! -s "$OUT/venv-$LAST.path" ] && kill -0 "$(cat "$OUT/venv-$LAST.pid" 2>/dev/null)" 2>/dev/null; do
    sleep 2
  done
  if [ ! -s "$OUT/venv-$LAST.path" ]; then
    echo "torch $LAST, notebooks: not run, its venv could not be made"
    status=1
  elif CUDA_VISIBLE_DEVICES= MESHVIZ_RANKS=threads "$(cat "$OUT/venv-$LAST.path")/bin/python" -m pytest notebooks \
      $NBVAL -p no:cacheprovider -q --junitxml="$OUT/torch-$LAST-notebooks.xml" "$@" \
      > "$OUT/torch-$LAST-notebooks.log" 2>&1; then
    echo "torch $LAST, notebooks: $(tail -n 1 "$OUT/torch-$LAST-notebooks.log") (done at $(at))"
  else
    echo "torch $LAST, notebooks: tests failed ($OUT/torch-$LAST-notebooks.log):"
    tail -n 60 "$OUT/torch-$LAST-notebooks.log"
    status=1
  fi
fi

# what ran beside the above (the oldest and the newest torch): their results
wait "$MATRIX_PID" || status=1
for part in $(for v in $MATRIX; do echo "torch-$v"; done) $([ "${MESHVIZ_TEST_ENGINES:-1}" != "0" ] && echo engines); do
  cat "$OUT/$part.summary" 2>/dev/null || { echo "$part: its run ended without a result"; status=1; }
done
.venv/bin/python scripts/test_table.py "$OUT"/torch-*.xml || status=1
echo "the test command took $(at)"
exit $status
