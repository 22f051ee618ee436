"""Run time and peak memory of each notebook: executed headless, its process tree sampled while it runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _sample(root: psutil.Process) -> dict:
    engines_rss = engines_pss = tree_pss = 0
    n = 0
    for p in [root] + root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            m = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        tree_pss += m.pss
        if "ipyparallel.engine" in cmd and "nanny" not in cmd:
            engines_rss += m.rss
            engines_pss += m.pss
            n += 1
    return {"engines": n, "engines_rss": engines_rss, "engines_pss": engines_pss, "tree_pss": tree_pss}


def run(path: str, interval: float = 0.25, timeout: float = 300) -> dict:
    """Execute ``path`` with nbconvert (into a temporary copy) and return wall time and peak memory."""
    out = os.path.join(tempfile.mkdtemp(), "out.ipynb")
    env = dict(os.environ, IPP_NONINTERACTIVE="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                             "--ExecutePreprocessor.timeout=300", "--output", out, path],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(proc.pid)
    peak = {"engines": 0, "engines_rss": 0, "engines_pss": 0, "tree_pss": 0}
    while proc.poll() is None:
        s = _sample(root)
        for k, v in s.items():
            peak[k] = max(peak[k], v)
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            break
        time.sleep(interval)
    err = proc.stderr.read().decode(errors="replace")
    wall = time.perf_counter() - t0
    return {"notebook": os.path.basename(path), "ok": proc.returncode == 0, "wall": wall, **peak,
            "error": "" if proc.returncode == 0 else err.strip().splitlines()[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("notebooks", nargs="*", help="default: every notebook in notebooks/")
    args = ap.parse_args()
    paths = args.notebooks or sorted(os.path.join("notebooks", f) for f in os.listdir(os.path.join(ROOT, "notebooks"))
                                     if f.endswith(".ipynb"))
    print("| notebook | ranks | wall s | engines RSS MiB | engines PSS MiB | kernel+cluster PSS MiB |")
    print("|---|---|---|---|---|---|")
    for p in paths:
        r = run(p)
        flag = "" if r["ok"] else f" FAILED {r['error']}"
        print(f"| {r['notebook']} | {r['engines']} | {r['wall']:.1f} | {r['engines_rss'] / MiB:.0f} | "
              f"{r['engines_pss'] / MiB:.0f} | {r['tree_pss'] / MiB:.0f} |{flag}", flush=True)


if __name__ == "__main__":
    main()
