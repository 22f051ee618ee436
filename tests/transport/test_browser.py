"""A real browser: JupyterLab and Notebook 7 on loopback, headless Chromium: the views draw, at their own size, with
nothing but themselves under them; the explorer's controls stay on screen at 1280 and 1920 px; %px output in rank
order; the repo's notebooks' widgets."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from urllib.parse import quote

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = os.environ.get("MESHVIZ_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = os.path.join(ROOT, "artifacts")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
REPR = re.compile(r"<(MeshView|TensorView|ReshardView|PipelineView|Explorer|CommView|RollCallView|WhatIfView)\b")

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
    "cluster = meshviz.Cluster(n=4, ranks='threads')",
    "%%px --stream\nimport time\nimport torch.distributed as tdist\nr = tdist.get_rank()\n"
    "time.sleep(0.4 * (3 - r))\nprint('rank', r, 'done')",
    "cluster.stop()",
]
EXPLORER_CELLS = [
    "import meshviz\nmeshviz.explore(mesh_shape='4,4,4', ids='', dim_names='pp,dp,mp', shape='8,6',\n"
    "                src='S(0), P(sum), S(1)', dst='R, R, R')",
    "meshviz.explore(mesh_shape='32,32', ids='reversed', shape='64,64', src='P(sum), S(1)', dst='R, S(0)')",
]


def _need():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/install_browser.sh (apt chromium + pip playwright)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed: run scripts/install_browser.sh")


def _notebook(path, cells):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": src} for i, src in enumerate(cells)]}
    with open(path, "w") as fh:
        json.dump(nb, fh)


def _write_notebooks(folder):
    from meshviz import ProcessMesh
    from meshviz.trace import to_json
    from tests.unit.test_widgets import _reshard_events

    mesh = ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"])
    events = _reshard_events(mesh, (4, 6), ["S(0)", "S(1)"], ["R", "R"])
    with open(os.path.join(folder, "trace.jsonl"), "w") as fh:
        fh.writelines(to_json(e) + "\n" for e in events)
    _notebook(os.path.join(folder, "widgets.ipynb"), CELLS)
    _notebook(os.path.join(folder, "explorer.ipynb"), EXPLORER_CELLS)
    for name in ("00_quickstart.ipynb", "10_explorer.ipynb", "13_what_if.ipynb"):
        shutil.copy(os.path.join(ROOT, "notebooks", name), folder)


def _settings(state):
    for rel, body in (("@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                       {"fetchNews": "false", "checkForUpdates": False}),
                      ("@jupyterlab/docmanager-extension/plugin.jupyterlab-settings", {"autosave": False}),
                      ("@jupyterlab/notebook-extension/tracker.jupyterlab-settings", {"windowingMode": "none"})):
        path = os.path.join(state, "settings", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(body, fh)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _server(app: str):
    """JupyterLab ('lab') or Notebook 7 ('notebook') on a fresh folder with the test notebooks: (base url, token)."""
    _need()
    if app == "notebook":
        pytest.importorskip("notebook", reason="Notebook 7 is not installed (pip install notebook)")
    state = tempfile.mkdtemp(prefix="meshviz-lab-")
    folder = os.path.join(state, "nb")
    os.makedirs(folder)
    _write_notebooks(folder)
    _settings(state)
    port, token = _free_port(), secrets.token_hex(16)
    # %px streams as a user's notebook does (the test command's IPP_NONINTERACTIVE would print at the end)
    env = {k: v for k, v in os.environ.items() if k != "IPP_NONINTERACTIVE"}
    env.update(JUPYTER_RUNTIME_DIR=os.path.join(state, "runtime"), PYTHONPATH=ROOT, MESHVIZ_RANKS="threads")
    a = "LabApp" if app == "lab" else "JupyterNotebookApp"
    cmd = [sys.executable, "-m", "jupyter", app, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
           f"--{a}.expose_app_in_browser=True", f"--{a}.workspaces_dir={state}/ws",
           f"--{a}.user_settings_dir={state}/settings"]
    if app == "lab":
        cmd += ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly"]
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
            pytest.fail(f"jupyter {app} did not start:\n" + open(os.path.join(state, "lab.log")).read()[-3000:])
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


def _api(base, token, path, method="GET"):
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def _end_kernels(base, token):
    """Shut down every session and kernel of the server: a test starts with none left from the one before."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:  # a kernel takes a second or two to end: all at once
        list(pool.map(lambda s: _api(base, token, f"/api/sessions/{s['id']}", "DELETE"),
                      _api(base, token, "/api/sessions")))
        list(pool.map(lambda k: _api(base, token, f"/api/kernels/{k['id']}", "DELETE"),
                      _api(base, token, "/api/kernels")))
    assert not _api(base, token, "/api/kernels")


@pytest.fixture(scope="module")
def _lab_server():
    with _server("lab") as server:
        yield server


@pytest.fixture
def lab(_lab_server):
    """The module's one JupyterLab server (a start and a stop each took seconds), with no kernel or session left
    from another test; each test opens notebooks of its own."""
    _end_kernels(*_lab_server)
    yield _lab_server
    _end_kernels(*_lab_server)


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module; each test browses in a fresh context of its own (no cookies, storage
    or cache from another test)."""
    _need()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def _browser(chromium, width=1280, height=1000):
    ctx = chromium.new_context(viewport={"width": width, "height": height})
    try:
        page = ctx.new_page()
        page.set_default_timeout(90_000)
        page.console_errors = []
        page.on("console", lambda m: page.console_errors.append(m.text) if m.type == "error" else None)
        yield page
    finally:
        ctx.close()


KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle'; }"""
RUN_DONE = """() => { if (!window.__mv_done) return false;
  const busy = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
    .some(p => p.textContent.includes('*'));
  const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !busy && !!k && k.status === 'idle'; }"""
MODEL_OUTPUTS = """() => { const cells = window.jupyterapp.shell.currentWidget.content.widgets;
  let views = 0, errors = [], text = [];
  for (const c of cells) { if (!c.model.outputs) continue;
    for (const o of c.model.outputs.toJSON()) {
      if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
      if (o.data && o.data['application/vnd.jupyter.widget-view+json']) views += 1;
      if (o.text) text.push(Array.isArray(o.text) ? o.text.join('') : o.text);
      if (o.data && !o.data['application/vnd.jupyter.widget-view+json'] && o.data['text/plain'])
        text.push(o.data['text/plain'] + '\\n'); } }
  return {views, errors, text: text.join('')}; }"""
VIEWS_DRAWN = """(n) => { const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const v = outs.filter(o => o.querySelector(':scope > .jupyter-widgets')).length;
  const imgs = [...document.querySelectorAll('.jp-OutputArea-output img.widget-image')];
  return v >= n && imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0); }"""
# per widget output: its text, and every picture's shown width against its own
DOM_STATE = """() => { const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const widgets = outs.filter(o => o.querySelector(':scope > .jupyter-widgets'));
  const pics = [...document.querySelectorAll('.meshviz-picture img.widget-image')].filter(i => i.naturalWidth > 0)
    .map(i => ({natural: i.naturalWidth, shown: i.getBoundingClientRect().width,
                naturalH: i.naturalHeight, shownH: i.getBoundingClientRect().height}));
  const overflow = outs.filter(o => o.scrollWidth > o.clientWidth + 1).map(o => [o.scrollWidth, o.clientWidth]);
  return {views: widgets.length, widget_text: widgets.map(o => o.innerText), pics, overflow,
          images: document.querySelectorAll('.jp-OutputArea-output img.widget-image').length,
          sliders: document.querySelectorAll('.jp-OutputArea-output .widget-slider').length,
          body: document.body.innerText}; }"""
EXPLORER_LAYOUT = """() => { const W = document.documentElement.clientWidth;
  return [...document.querySelectorAll('.meshviz-explorer')].map(e => {
    const c = e.querySelector('.meshviz-explorer-controls').getBoundingClientRect();
    const p = e.querySelector('.meshviz-explorer-pictures').getBoundingClientRect();
    const labels = [...e.querySelectorAll('.meshviz-explorer-controls .widget-label')]
      .filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent);
    const inputs = [...e.querySelectorAll('.meshviz-explorer-controls input')]
      .filter(i => i.placeholder && i.scrollWidth > i.clientWidth + 1).map(i => i.placeholder);
    const out = e.closest('.jp-OutputArea-output');
    return {W, controls: [c.left, c.right, c.top], pictures: [p.left, p.right, p.top], cut_labels: labels,
            cut_placeholders: inputs, out: [out.clientWidth, out.scrollWidth],
            page: [document.documentElement.scrollWidth, W]}; }); }"""


def _open(page, base, token, app, name):
    path = f"/lab/tree/{quote(name)}?reset&" if app == "lab" else f"/notebooks/{quote(name)}?"  # reset: this one only
    page.goto(f"{base}{path}token={token}", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel")
    page.wait_for_function(KERNEL_IDLE)


def _run_all(page, timeout=240_000):
    page.evaluate("() => { window.__mv_done = undefined; window.jupyterapp.commands.execute("
                  "'notebook:run-all-cells').then(r => window.__mv_done = {ok: r}); return true; }")
    page.wait_for_function(RUN_DONE, timeout=timeout)
    model = page.evaluate(MODEL_OUTPUTS)
    assert not model["errors"], model["errors"]
    page.wait_for_function(VIEWS_DRAWN, arg=model["views"])
    page.wait_for_timeout(500)
    return model


def _screenshot(page, path, width=1280):
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    h = page.evaluate("""() => { const o = document.querySelector('.jp-WindowedPanel-outer');
        return o ? Math.min(8000, innerHeight - o.clientHeight + o.scrollHeight) : innerHeight; }""")
    page.set_viewport_size({"width": width, "height": int(h)})
    page.wait_for_timeout(800)
    page.screenshot(path=path, full_page=True)


def _check_views(dom, views):
    """Every widget shows only itself, every picture at its own size, nothing wider than the output area."""
    body = dom["body"].lower()
    assert "error displaying widget" not in body and "model not found" not in body
    assert dom["views"] >= views > 0
    strays = [t for t in dom["widget_text"] if REPR.search(t)]
    assert not strays, f"repr text under a widget: {strays}"
    assert dom["pics"], dom
    for pic in dom["pics"]:
        assert abs(pic["shown"] - pic["natural"]) <= 1 and abs(pic["shownH"] - pic["naturalH"]) <= 1, pic
    assert not dom["overflow"], dom["overflow"]


def test_views_draw_at_their_size_with_nothing_under_them(lab, chromium):
    os.makedirs(ARTIFACTS, exist_ok=True)
    base, token = lab
    with _browser(chromium) as page:
        _open(page, base, token, "lab", "widgets.ipynb")
        model = _run_all(page)
        assert model["views"] >= 4
        dom = page.evaluate(DOM_STATE)
        _check_views(dom, model["views"])
        # explorer (mesh + reshard frame), tensor view, reshard view, live pipeline view: all drawn
        assert dom["images"] >= 5
        assert dom["sliders"] >= 2  # the explorer's and the replayed reshard's step sliders
        assert "LIVE <PipelineView 4 ranks, 8 micro-batches: 64 blocks, 48 transfers>" in model["text"]
        big = [ln for ln in model["text"].splitlines() if ln.startswith("BIG")]
        assert big and "mesh [32, 32]" in big[0] and "None" in big[0], big
        # %%px: the last rank printed first; the output is rank by rank
        px = re.findall(r"\[stdout:(\d)\]\s*\nrank (\d) done", model["text"])
        assert px == [(str(r), str(r)) for r in range(4)], model["text"]
        shown = page.locator(".jp-Cell").nth(7).locator(".jp-OutputArea-output").inner_text()
        assert re.findall(r"rank (\d) done", shown) == ["0", "1", "2", "3"], shown
        # step the replayed reshard with its slider: the picture changes
        slider = page.locator(".jp-OutputArea-output .widget-slider").nth(1)
        img = page.locator(".jp-OutputArea-output img.widget-image").nth(3)
        before = img.get_attribute("src")
        slider.locator(".noUi-handle").focus()
        page.keyboard.press("Home")
        page.wait_for_function("(b) => { const i = [...document.querySelectorAll("
                               "'.jp-OutputArea-output img.widget-image')][3]; return i && i.src !== b && "
                               "i.complete && i.naturalWidth > 0; }", arg=before, timeout=30_000)
        _check_views(page.evaluate(DOM_STATE), model["views"])
        _screenshot(page, os.path.join(ARTIFACTS, "browser_widgets.png"))
        errors = page.console_errors
    assert not [e for e in errors if "widget" in e.lower() and "error" in e.lower()], errors


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_explorer_keeps_its_controls_on_screen(app, chromium, request):
    """The explorer on a 4x4x4 and a 32x32 mesh, at 1920, 1280 (JupyterLab: the file browser open) and 900 px:
    the controls inside the window, uncut, the pictures beside them (below them at 900 px), nothing wider than the
    output area or the page; scrolling through the pictures leaves the controls in the window."""
    server = _server("notebook") if app == "notebook" else nullcontext(request.getfixturevalue("lab"))
    with server as (base, token), _browser(chromium, 1920) as page:
        _open(page, base, token, app, "explorer.ipynb")
        _run_all(page)
        if app == "lab":
            page.evaluate("() => window.jupyterapp.commands.execute('filebrowser:activate')")
        for width in (1920, 1280, 900):
            page.set_viewport_size({"width": width, "height": 1000})
            page.wait_for_timeout(800)
            layouts = page.evaluate(EXPLORER_LAYOUT)
            assert len(layouts) == 2, layouts
            for lay in layouts:
                (cl, cr, ct), (pl, _, pt) = lay["controls"], lay["pictures"]
                assert 0 <= cl < cr <= lay["W"], (width, lay)
                assert not lay["cut_labels"] and not lay["cut_placeholders"], (width, lay)
                assert lay["out"][1] <= lay["out"][0] + 1 and lay["page"][0] <= lay["page"][1] + 1, (width, lay)
                room = lay["out"][0]
                if room >= 270 + 480:
                    assert pl >= cr - 1 and abs(pt - ct) < 2, (width, "beside", lay)
                else:
                    assert pt > ct + 100, (width, "below", lay)
            # looking through the pictures (they scroll inside their column) keeps the controls in the window
            kept = page.evaluate("""() => { const e = document.querySelector('.meshviz-explorer');
                e.scrollIntoView({block: 'start'});
                const p = e.querySelector('.meshviz-explorer-pictures'); p.scrollTop = p.scrollHeight;
                const c = e.querySelector('.meshviz-explorer-controls').getBoundingClientRect();
                return {top: c.top, bottom: c.bottom, H: innerHeight, scrolled: p.scrollTop,
                        tall: p.clientHeight <= 0.85 * innerHeight + 1}; }""")
            assert kept["scrolled"] > 0 and kept["tall"] and 0 <= kept["top"] < kept["bottom"] <= kept["H"], kept
            if width == 1280:
                os.makedirs(ARTIFACTS, exist_ok=True)
                page.screenshot(path=os.path.join(ARTIFACTS, f"browser_explorer_{app}_1280.png"))


def test_notebooks_widgets_show_only_themselves(lab, chromium):
    """The repo's quick start (ranks as threads) and explorer notebooks: every widget drawn at its own size, no
    repr line under any, nothing wider than the output area."""
    base, token = lab
    with _browser(chromium) as page:
        for name in ("00_quickstart.ipynb", "10_explorer.ipynb"):
            _open(page, base, token, "lab", name)
            model = _run_all(page)
            _check_views(page.evaluate(DOM_STATE), model["views"])


@pytest.mark.timeout(600)
def test_what_if_notebook_draws_its_report(lab, chromium):
    """The what-if notebook (1,024 simulated ranks, then 4 real ones): its WhatIfView drawn at its own size with
    nothing under it and nothing wider than the output area; the view's picture is kept in artifacts/ (the README's
    docs/img/what_if.png is that picture)."""
    base, token = lab
    with _browser(chromium) as page:
        _open(page, base, token, "lab", "13_what_if.ipynb")
        model = _run_all(page, timeout=480_000)
        assert model["views"] == 1, model["views"]
        dom = page.evaluate(DOM_STATE)
        _check_views(dom, model["views"])
        assert "C: dp 64 x pp 2 x mp 8, stage 1  True" in model["text"], model["text"][-2000:]
        view = page.locator(".meshviz-view").first
        view.scroll_into_view_if_needed()
        os.makedirs(ARTIFACTS, exist_ok=True)
        view.screenshot(path=os.path.join(ARTIFACTS, "browser_what_if.png"))
        errors = page.console_errors
    assert not [e for e in errors if "widget" in e.lower() and "error" in e.lower()], errors
