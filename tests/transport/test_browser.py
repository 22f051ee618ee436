"""A real browser: JupyterLab on loopback, a notebook with the explorer and event-fed views, headless Chromium."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from urllib.parse import quote

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = os.environ.get("MESHVIZ_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = os.path.join(ROOT, "artifacts")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

CELLS = [
    "import meshviz\nfrom meshviz.widgets import PipelineView, Replayer, ReshardView, TensorView, synthetic_schedule\n"
    "ex = meshviz.explore()\nex",
    "TensorView((4, 6), meshviz.ProcessMesh([[2, 4, 5], [0, 1, 3]], ['x', 'y']), ['P(sum)', 'S(1)'],\n"
    "           value=__import__('numpy').arange(24).reshape(4, 6))",
    "rv = ReshardView(source='trace.jsonl')\nrv",
    "player = Replayer(synthetic_schedule(4, 8, '1F1B'), speed=40)\nlive = PipelineView(source=player)\nlive",
    "player.start().join()\nlive.flush()\nprint('LIVE', live)",
    "import time\nt0 = time.perf_counter()\nex._inputs['mesh_shape'].value = '32,32'\n"
    "ex._inputs['ids'].value = 'reversed'\n"
    "print('BIG', ex, ex.error, f'{time.perf_counter() - t0:.2f}s')",
]


def _need():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/install_browser.sh (apt chromium + pip playwright)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed: run scripts/install_browser.sh")


def _write_notebook(folder):
    import numpy as np

    from meshviz import ProcessMesh
    from meshviz.trace import to_json
    from tests.unit.test_widgets import _reshard_events

    mesh = ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"])
    events = _reshard_events(mesh, (4, 6), ["S(0)", "S(1)"], ["R", "R"])
    with open(os.path.join(folder, "trace.jsonl"), "w") as fh:
        fh.writelines(to_json(e) + "\n" for e in events)
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": src} for i, src in enumerate(CELLS)]}
    with open(os.path.join(folder, "widgets.ipynb"), "w") as fh:
        json.dump(nb, fh)
    assert np is not None


def _settings(state):
    for rel, body in (("@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                       {"fetchNews": "false", "checkForUpdates": False}),
                      ("@jupyterlab/docmanager-extension/plugin.jupyterlab-settings", {"autosave": False})):
        path = os.path.join(state, "settings", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(body, fh)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab():
    _need()
    state = tempfile.mkdtemp(prefix="meshviz-lab-")
    folder = os.path.join(state, "nb")
    os.makedirs(folder)
    _write_notebook(folder)
    _settings(state)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=os.path.join(state, "runtime"), PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
           "--LabApp.expose_app_in_browser=True", f"--LabApp.workspaces_dir={state}/ws",
           f"--LabApp.user_settings_dir={state}/settings", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(os.path.join(state, "lab.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            req = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {token}"})
            if urllib.request.urlopen(req, timeout=2).status == 200:
                break
        except Exception:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.close()
            pytest.fail("JupyterLab did not start:\n" + open(os.path.join(state, "lab.log")).read()[-3000:])
        time.sleep(0.25)
    try:
        yield base, token
    finally:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=5)
            proc.wait(10)
        except Exception:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle'; }"""
RUN_DONE = """() => { if (!window.__mv_done) return false;
  const busy = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
    .some(p => p.textContent.includes('*'));
  const w = window.jupyterapp.shell.currentWidget; const k = w.sessionContext.session.kernel;
  return !busy && k.status === 'idle'; }"""
MODEL_OUTPUTS = """() => { const cells = window.jupyterapp.shell.currentWidget.content.widgets;
  let views = 0, errors = [], text = [];
  for (const c of cells) { if (!c.model.outputs) continue;
    for (const o of c.model.outputs.toJSON()) {
      if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
      if (o.data && o.data['application/vnd.jupyter.widget-view+json']) views += 1;
      if (o.text) text.push(Array.isArray(o.text) ? o.text.join('') : o.text); } }
  return {views, errors, text: text.join('')}; }"""
DOM_STATE = """() => { const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const views = outs.filter(o => o.querySelector(':scope > .jupyter-widgets')).length;
  const imgs = [...document.querySelectorAll('.jp-OutputArea-output img.widget-image')];
  return {views, images: imgs.length, drawn: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
          sliders: document.querySelectorAll('.jp-OutputArea-output .widget-slider').length,
          body: document.body.innerText}; }"""


def _screenshot(page, path):
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    h = page.evaluate("""() => { const o = document.querySelector('.jp-WindowedPanel-outer');
        return o ? Math.min(8000, innerHeight - o.clientHeight + o.scrollHeight) : innerHeight; }""")
    page.set_viewport_size({"width": 1280, "height": int(h)})
    page.wait_for_timeout(800)
    page.screenshot(path=path, full_page=True)


def test_explorer_and_event_views_draw_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    base, token = lab
    os.makedirs(ARTIFACTS, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=ARGS,
                                                       viewport={"width": 1280, "height": 1000})
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.set_default_timeout(90_000)
            console_errors = []
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{base}/lab/tree/{quote('widgets.ipynb')}?token={token}", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-NotebookPanel")
            page.wait_for_function(KERNEL_IDLE)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells')"
                          ".then(r => window.__mv_done = {ok: r}); return true; }")
            page.wait_for_function(RUN_DONE, timeout=150_000)
            model = page.evaluate(MODEL_OUTPUTS)
            assert not model["errors"], model["errors"]
            assert model["views"] >= 4
            page.wait_for_function(f"""() => {{ const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
                const v = outs.filter(o => o.querySelector(':scope > .jupyter-widgets')).length;
                const imgs = [...document.querySelectorAll('.jp-OutputArea-output img.widget-image')];
                return v >= {model['views']} && imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0);
                }}""")
            dom = page.evaluate(DOM_STATE)
            _screenshot(page, os.path.join(ARTIFACTS, "browser_widgets.png"))
            body = dom["body"].lower()
            assert "error displaying widget" not in body and "model not found" not in body
            assert dom["views"] >= model["views"]
            # explorer (mesh + reshard frame), tensor view, reshard view, live pipeline view: all drawn
            assert dom["images"] >= 5 and dom["drawn"] == dom["images"], dom
            assert dom["sliders"] >= 2  # the explorer's and the replayed reshard's step sliders
            assert "LIVE <PipelineView 4 ranks, 8 micro-batches: 64 blocks, 48 transfers>" in model["text"]
            big = [ln for ln in model["text"].splitlines() if ln.startswith("BIG")]
            assert big and "mesh [32, 32]" in big[0] and "None" in big[0], big
            # step the replayed reshard with its slider: the picture changes
            slider = page.locator(".jp-OutputArea-output .widget-slider").nth(1)
            img = page.locator(".jp-OutputArea-output img.widget-image").nth(3)
            before = img.get_attribute("src")
            slider.locator(".noUi-handle").focus()
            page.keyboard.press("Home")
            page.wait_for_function("(b) => { const i = [...document.querySelectorAll("
                                   "'.jp-OutputArea-output img.widget-image')][3]; return i && i.src !== b && "
                                   "i.complete && i.naturalWidth > 0; }", arg=before, timeout=30_000)
            page.screenshot(path=os.path.join(ARTIFACTS, "browser_reshard_step0.png"))
            ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert not [e for e in console_errors if "widget" in e.lower() and "error" in e.lower()], console_errors
