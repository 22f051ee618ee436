#!/usr/bin/env python3
"""Run notebooks as Binder runs them, under Binder's memory limit, and report their peak memory and limit hits.

A fresh environment is built from ``binder/requirements.txt`` and ``binder/postBuild`` (as repo2docker builds
one), JupyterLab is started through ``binder/start`` inside a memory cgroup of ``--limit-mib`` (2048, Binder's;
cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, whichever this machine has; without either, the memory
is only watched), each notebook is opened as JupyterLab opens it (a session, its kernel started by the server) and
its cells run one by one. The outputs nbval checks are compared with the stored ones.

    .venv/bin/python scripts/binder_check.py                          # 01, 06 and 13, a fresh environment
    .venv/bin/python scripts/binder_check.py --notebooks 00_quickstart 05_pipeline --env /tmp/binder-env --reuse

The environment's files are dropped from the page cache before the server starts, so that reading torch's
libraries is charged to the notebook as in a fresh Binder container. Exit status 1 when a cell failed, a checked
output differs, or the limit was hit. Needs ``jupyter_client`` (and ``psutil``) in the Python that runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def log(*args) -> None:
    print("[binder-check]", *args, flush=True)


# -- the environment ---------------------------------------------------------------------------------------------

def _reachable(url: str, timeout: float = 3.0) -> bool:
    m = re.match(r"https?://([^/:]+)(?::(\d+))?", url)
    if not m:
        return True  # a file:// index
    host, port = m.group(1), int(m.group(2) or (443 if url.startswith("https") else 80))
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def requirements(tmp: str) -> str:
    """binder/requirements.txt, without index lines whose host cannot be reached from here (pip would retry them
    for minutes; the pinned wheels then come from the configured registry)."""
    src = os.path.join(ROOT, "binder", "requirements.txt")
    lines, dropped = [], []
    with open(src) as fh:
        for line in fh:
            m = re.match(r"\s*--(?:extra-)?index-url\s+(\S+)", line)
            if m and not _reachable(m.group(1)):
                dropped.append(m.group(1))
                continue
            lines.append(line)
    if not dropped:
        return src
    log(f"unreachable from here, left out: {', '.join(dropped)} (the pins are resolved by the configured index)")
    out = os.path.join(tmp, "requirements.txt")
    with open(out, "w") as fh:
        fh.writelines(lines)
    return out


def build_env(env: str, tmp: str) -> float:
    t0 = time.perf_counter()
    python = shutil.which("python3") or sys.executable
    subprocess.run([python, "-m", "venv", env], check=True)
    pip = [os.path.join(env, "bin", "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(pip + ["install", "-q", "-r", requirements(tmp)], check=True)
    subprocess.run(["bash", os.path.join(ROOT, "binder", "postBuild")], check=True, cwd=ROOT, env=env_vars(env))
    with open(os.path.join(env, ".binder-check-built"), "w") as fh:
        fh.write(time.ctime())
    return time.perf_counter() - t0


def env_vars(env: str, extra: dict | None = None) -> dict:
    out = dict(os.environ)
    for k in ("PYTHONPATH", "PYTHONHOME", "MESHVIZ_RANKS", "IPP_NONINTERACTIVE", "OMP_NUM_THREADS"):
        out.pop(k, None)  # only what binder/start sets
    out["PATH"] = os.path.join(env, "bin") + os.pathsep + out.get("PATH", "")
    out["VIRTUAL_ENV"] = env
    out.update(extra or {})
    return out


def drop_from_page_cache(folder: str) -> int:
    """Evict ``folder``'s files from the page cache (only theirs), so the next reads are charged to whoever
    reads them. Returns the bytes evicted."""
    n = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


# -- the memory limit --------------------------------------------------------------------------------------------

def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


class Limit:
    """A memory cgroup of ``limit`` bytes, made inside this process's own (so whatever accounts for this process
    still accounts for it): ``kind`` is "cgroup v2", "cgroup v1" or "watched" (no cgroup could be made)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.path = None
        self.kind = "watched"
        self.why = ""
        for make in (self._v2, self._v1):
            try:
                if make():
                    return
            except OSError as e:
                self.why += f"{make.__name__}: {e}; "
                self.path = None

    def _own(self, controller: str | None) -> str | None:
        for line in _read("/proc/self/cgroup").splitlines():
            hid, ctrls, path = line.split(":", 2)
            if (controller is None and hid == "0") or (controller and controller in ctrls.split(",")):
                return path
        return None

    def _mount(self, fstype: str, option: str | None) -> str | None:
        for line in _read("/proc/self/mountinfo").splitlines():
            left, right = line.split(" - ", 1)
            parts = right.split()
            if parts[0] == fstype and (option is None or option in parts[2].split(",")):
                return left.split()[4]
        return None

    def _v2(self) -> bool:
        mnt, own = self._mount("cgroup2", None), self._own(None)
        if mnt is None or own is None or "memory" not in _read(os.path.join(mnt, "cgroup.controllers")).split():
            return False
        parent = os.path.join(mnt, own.lstrip("/"))
        if "memory" not in _read(os.path.join(parent, "cgroup.subtree_control")).split():
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
        self.path = os.path.join(parent, f"meshviz-binder-{os.getpid()}")
        os.mkdir(self.path)
        _write(os.path.join(self.path, "memory.max"), str(self.limit))
        try:
            _write(os.path.join(self.path, "memory.swap.max"), "0")  # Binder has no swap
        except OSError:
            pass
        self.kind = "cgroup v2"
        return True

    def _v1(self) -> bool:
        mnt, own = self._mount("cgroup", "memory"), self._own("memory")
        if mnt is None or own is None:
            return False
        self.path = os.path.join(mnt, own.lstrip("/"), f"meshviz-binder-{os.getpid()}")
        os.mkdir(self.path)
        _write(os.path.join(self.path, "memory.limit_in_bytes"), str(self.limit))
        try:
            _write(os.path.join(self.path, "memory.memsw.limit_in_bytes"), str(self.limit))  # no swap either
        except OSError:
            pass
        self.kind = "cgroup v1"
        return True

    def join(self) -> None:
        """Put the calling process in the cgroup (a child's ``preexec_fn``)."""
        if self.path is not None:
            _write(os.path.join(self.path, "cgroup.procs"), str(os.getpid()))

    def usage(self) -> int | None:
        if self.kind == "cgroup v2":
            return int(_read(os.path.join(self.path, "memory.current")))
        if self.kind == "cgroup v1":
            return int(_read(os.path.join(self.path, "memory.usage_in_bytes")))
        return None

    def peak(self) -> int | None:
        try:
            if self.kind == "cgroup v2":
                return int(_read(os.path.join(self.path, "memory.peak")))
            if self.kind == "cgroup v1":
                return int(_read(os.path.join(self.path, "memory.max_usage_in_bytes")))
        except OSError:
            return None
        return None

    def counts(self) -> dict:
        """How often the limit was hit (reclaim forced at the limit) and how many processes the OOM killer took."""
        if self.kind == "cgroup v2":
            ev = dict(line.split() for line in _read(os.path.join(self.path, "memory.events")).splitlines())
            return {"limit_hits": int(ev.get("max", 0)), "oom_kills": int(ev.get("oom_kill", 0))}
        if self.kind == "cgroup v1":
            oom = dict(line.split() for line in _read(os.path.join(self.path, "memory.oom_control")).splitlines())
            hits = 0
            for f in ("memory.failcnt", "memory.memsw.failcnt"):
                try:
                    hits += int(_read(os.path.join(self.path, f)))
                except OSError:
                    pass
            return {"limit_hits": hits, "oom_kills": int(oom.get("oom_kill", 0))}
        return {"limit_hits": None, "oom_kills": None}

    def pids(self) -> list[int]:
        if self.path is None:
            return []
        return [int(p) for p in _read(os.path.join(self.path, "cgroup.procs")).split()]

    def close(self) -> None:
        """Remove the cgroup; what still runs in it (started by this check: engines orphaned by a killed kernel)
        is killed first."""
        if self.path is None:
            return
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.rmdir(self.path)
        except OSError as e:
            log(f"could not remove {self.path}: {e}")


class Watch(threading.Thread):
    """Samples the cgroup's usage and the resident memory of the server's process tree every ``every`` s."""

    def __init__(self, limit: Limit, root_pid: int, every: float = 0.1):
        super().__init__(daemon=True, name="binder-check-watch")
        self.limit, self.root_pid, self.every = limit, root_pid, every
        self.stop_ev = threading.Event()
        self.reset()

    def reset(self) -> None:
        self.peak_usage = 0
        self.peak_rss = 0
        self.over = 0  # samples within 1% of the limit (the kernel's own count is not kept everywhere)

    def _rss(self) -> int:
        try:
            import psutil
        except ImportError:
            return 0
        try:
            root = psutil.Process(self.root_pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def run(self) -> None:
        while not self.stop_ev.wait(self.every):
            rss = self._rss()
            used = self.limit.usage()
            self.peak_rss = max(self.peak_rss, rss)
            if used is not None:
                self.peak_usage = max(self.peak_usage, used)
            if (used if used is not None else rss) >= 0.99 * self.limit.limit:
                self.over += 1


# -- the server and a notebook's cells ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, env: str, limit: Limit, state: str, extra_env: dict | None = None):
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.state = state
        self.runtime = os.path.join(state, "runtime")
        os.makedirs(self.runtime, exist_ok=True)
        cmd = [os.path.join(ROOT, "binder", "start"), os.path.join(env, "bin", "jupyter"), "lab", "--no-browser",
               "--ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={ROOT}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log_path = os.path.join(state, "server.log")
        env_ = env_vars(env, {"JUPYTER_RUNTIME_DIR": self.runtime, **(extra_env or {})})
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env_,
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     preexec_fn=limit.join, start_new_session=True)

    def api(self, method: str, path: str, body=None, timeout: float = 30):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        return json.loads(text) if text else None

    def wait_ready(self, timeout: float = 120) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                self.api("GET", "/api/status", timeout=2)
                return time.perf_counter() - t0
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.25)
        raise RuntimeError(f"the server did not answer within {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        try:
            self.api("POST", "/api/shutdown", timeout=10)
            self.proc.wait(15)
        except Exception:
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _ignored(cell) -> tuple[bool, bool]:
    """(skip the cell, do not check its outputs): nbval's markers and tags."""
    src = "".join(cell.get("source", ""))
    tags = set(cell.get("metadata", {}).get("tags", []))
    marks = {m for m in re.findall(r"#\s*(NBVAL_\w+)", src)}
    skip = "NBVAL_SKIP" in marks or "nbval-skip" in tags
    return skip, skip or "NBVAL_IGNORE_OUTPUT" in marks or "nbval-ignore-output" in tags


def _comparable(outputs: list) -> dict:
    """What nbval compares, by key: stream text per stream name (coalesced), each MIME type but images and
    widget models, in order."""
    out: dict = {}
    streams: dict = {}
    for o in outputs:
        if o["output_type"] == "stream":
            streams[o["name"]] = streams.get(o["name"], "") + "".join(o["text"])
        elif o["output_type"] in ("display_data", "execute_result"):
            for mime, data in o.get("data", {}).items():
                if mime in ("image/png", "image/jpeg", "application/vnd.jupyter.widget-view+json"):
                    continue
                out.setdefault(mime, []).append("".join(data) if isinstance(data, list) else data)
        elif o["output_type"] == "error":
            out.setdefault("error", []).append(f"{o['ename']}: {o['evalue']}")
    for name, text in streams.items():
        out[name] = [text]
    return out


def run_notebook(server: Server, name: str, cell_timeout: float) -> dict:
    from jupyter_client import BlockingKernelClient

    rel = f"notebooks/{name}.ipynb"
    with open(os.path.join(ROOT, rel)) as fh:
        nb = json.load(fh)
    t0 = time.perf_counter()
    session = server.api("POST", "/api/sessions", {"path": rel, "type": "notebook", "name": name,
                                                   "kernel": {"name": "python3"}})
    kid = session["kernel"]["id"]
    kc = BlockingKernelClient(connection_file=os.path.join(server.runtime, f"kernel-{kid}.json"))
    kc.load_connection_file()
    # no heartbeat: a kernel still starting on a loaded machine misses its 1 s and reads as dead; a kernel that
    # does die shows as no reply within the timeouts below
    kc.start_channels(hb=False)
    result = {"notebook": name, "cells": 0, "errors": [], "differ": [], "dead": False}
    try:
        try:
            kc.wait_for_ready(timeout=180)
        except RuntimeError as e:
            result["dead"] = True
            result["errors"].append(f"the kernel did not answer: {e}")
            nb["cells"] = []
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            skip, unchecked = _ignored(cell)
            if skip:
                continue
            outputs = _execute(kc, "".join(cell["source"]), cell_timeout)
            result["cells"] += 1
            if outputs is None:
                result["dead"] = True
                result["errors"].append(f"cell {i}: no reply within {cell_timeout} s (the kernel died?)")
                break
            errs = [o for o in outputs if o["output_type"] == "error"]
            if errs:
                result["errors"].append(f"cell {i}: {errs[0]['ename']}: {errs[0]['evalue']}"[:300])
                break
            if not unchecked and _comparable(outputs) != _comparable(cell.get("outputs", [])):
                result["differ"].append(i)
    finally:
        kc.stop_channels()
        try:
            server.api("DELETE", f"/api/sessions/{session['id']}")
        except Exception:
            pass
    result["seconds"] = time.perf_counter() - t0
    return result


def _execute(kc, code: str, timeout: float) -> list | None:
    msg_id = kc.execute(code, store_history=True)
    outputs = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            msg = kc.get_iopub_msg(timeout=min(left, 5))
        except Exception:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return outputs
        if kind == "stream":
            outputs.append({"output_type": "stream", "name": content["name"], "text": content["text"]})
        elif kind in ("display_data", "execute_result"):
            outputs.append({"output_type": kind, "data": content["data"]})
        elif kind == "error":
            outputs.append({"output_type": "error", "ename": content["ename"], "evalue": content["evalue"]})


# -- main --------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notebooks", nargs="+", default=["01_mesh_and_placements", "06_hybrid", "13_what_if"])
    ap.add_argument("--limit-mib", type=int, default=2048)
    ap.add_argument("--env", help="where to build the environment (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="use --env as it is when it was built before")
    ap.add_argument("--keep", action="store_true", help="keep the environment")
    ap.add_argument("--build-only", action="store_true", help="build --env and stop (a later --reuse runs it)")
    ap.add_argument("--warm", action="store_true", help="leave the environment's files in the page cache")
    ap.add_argument("--cell-timeout", type=float, default=600)
    ap.add_argument("--ranks", choices=["threads", "engines"],
                    help="MESHVIZ_RANKS for the server (default: what binder/start sets)")
    args = ap.parse_args(argv)
    if args.build_only and not args.env:
        ap.error("--build-only needs --env")

    tmp = tempfile.mkdtemp(prefix="binder-check-")
    env = args.env or os.path.join(tmp, "env")
    built = os.path.exists(os.path.join(env, ".binder-check-built"))
    if args.reuse and built:
        log(f"environment: {env} (reused)")
    else:
        if os.path.exists(env):
            shutil.rmtree(env)
        log(f"building {env} from binder/requirements.txt and binder/postBuild ...")
        log(f"built in {build_env(env, tmp):.0f} s")
    if args.build_only:
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    versions = subprocess.run([os.path.join(env, "bin", "python"), "-c",
                               "import torch, ipyparallel, jupyterlab, meshviz; print(torch.__version__, "
                               "ipyparallel.__version__, jupyterlab.__version__, meshviz.__file__)"],
                              capture_output=True, text=True, cwd=tmp).stdout.strip()
    log(f"torch, ipyparallel, jupyterlab, meshviz: {versions}")
    if not args.warm:
        log(f"dropped {drop_from_page_cache(env) / MIB:.0f} MiB of the environment from the page cache")
    limit = Limit(args.limit_mib * MIB)
    log(f"memory limit: {args.limit_mib} MiB ({limit.kind}{'; ' + limit.why if limit.kind == 'watched' else ''})")
    server = Server(env, limit, tmp, {"MESHVIZ_RANKS": args.ranks} if args.ranks else None)
    watch = Watch(limit, server.proc.pid)
    watch.start()
    results = []
    try:
        log(f"JupyterLab (through binder/start) answered in {server.wait_ready():.1f} s")
        base = limit.counts()
        for name in args.notebooks:
            watch.reset()
            before = limit.counts()
            r = run_notebook(server, name, args.cell_timeout)
            after = limit.counts()
            r["peak_mib"] = (watch.peak_usage or watch.peak_rss) / MIB
            r["peak_rss_mib"] = watch.peak_rss / MIB
            r["limit_hits"] = None if after["limit_hits"] is None else after["limit_hits"] - before["limit_hits"]
            r["at_limit"] = watch.over
            r["oom_kills"] = None if after["oom_kills"] is None else after["oom_kills"] - before["oom_kills"]
            results.append(r)
            log(f"{name}: {r['cells']} cells in {r['seconds']:.1f} s, peak {r['peak_mib']:.0f} MiB "
                f"(processes' resident {r['peak_rss_mib']:.0f} MiB), limit hits {r['limit_hits']}, samples at the "
                f"limit {r['at_limit']}, OOM kills {r['oom_kills']}, outputs differ in cells {r['differ'] or 'none'}"
                + (f", errors: {r['errors']}" if r["errors"] else ""))
        total = limit.counts()
        whole = limit.peak()
    finally:
        server.stop()
        watch.stop_ev.set()
        watch.join(10)  # a sample in progress reads the cgroup that close() removes
        limit.close()
        if not args.keep and not args.env:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not args.keep and args.env and not args.reuse:
            shutil.rmtree(tmp, ignore_errors=True)
    hits = None if total["limit_hits"] is None else total["limit_hits"] - base["limit_hits"]
    log(f"whole run: peak {whole / MIB if whole else max(r['peak_mib'] for r in results):.0f} MiB of "
        f"{args.limit_mib} MiB ({limit.kind}), limit hits {hits}, samples at the limit "
        f"{sum(r['at_limit'] for r in results)}, OOM kills {total['oom_kills']}")
    bad = [r for r in results
           if r["errors"] or r["differ"] or r["dead"] or r["limit_hits"] or r["at_limit"] or r["oom_kills"]]
    log("FAILED: " + ", ".join(r["notebook"] for r in bad) if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
