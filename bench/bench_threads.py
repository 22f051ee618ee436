"""Ranks as threads of the kernel against ranks as ipyparallel engines: ready time, step time and memory, for the
quickstart's and the hybrid notebook's rank cells."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20

# notebook -> (ranks, the cell timed as a step, repeats of it)
CASES = {
    "00_quickstart": (4, None, 5),  # the step: the notebook's reshard cell (P -> R, S(0) -> R)
    "06_hybrid": (8, "logits = model(data)\nloss = torch.mean(logits)\nloss.backward()\nopt.step()\nopt.clear_grad()\n"
                     "dist.unshard_dtensor(loss).item() if dist.get_rank() >= 4 else None\n", 5),
}


def _px_cells(name: str) -> list[str]:
    with open(os.path.join(ROOT, "notebooks", f"{name}.ipynb")) as fh:
        nb = json.load(fh)
    out = []
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and src.startswith("%%px") and "--targets" not in src.splitlines()[0]:
            out.append(src.split("\n", 1)[1])
    return out


class _Sampler(threading.Thread):
    """Peak RSS and PSS summed over this process and its children (engines, controller), every ``every`` s."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        self.every, self.peak_rss, self.peak_pss, self.stop = every, 0, 0, threading.Event()

    def sample(self) -> tuple[int, int]:
        import psutil

        me = psutil.Process()
        rss = pss = 0
        for p in [me] + me.children(recursive=True):
            try:
                m = p.memory_full_info()
            except psutil.Error:
                continue
            rss += m.rss
            pss += m.pss
        return rss, pss

    def run(self) -> None:
        while not self.stop.wait(self.every):
            rss, pss = self.sample()
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)


def child(mode: str, name: str) -> dict:
    import meshviz

    n, step, reps = CASES[name]
    cells = _px_cells(name)
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    cluster = meshviz.Cluster(n=n, ranks=mode)
    ready = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        for c in cells:
            cluster.execute(c)
        first = time.perf_counter() - t1
        body = step or cells[-1]
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            cluster.execute(body)
            times.append(time.perf_counter() - t)
        rss, pss = sampler.sample()
    finally:
        cluster.stop()
        sampler.stop.set()
    return {"mode": mode, "notebook": name, "ranks": n, "ready_s": ready, "cells_s": first,
            "step_ms": 1000 * statistics.median(times), "step_spread_ms": 1000 * (max(times) - min(times)),
            "peak_rss_mib": max(sampler.peak_rss, rss) / MiB, "peak_pss_mib": max(sampler.peak_pss, pss) / MiB,
            "end_pss_mib": pss / MiB}


# -- the candidates: torch's threaded process group (threads run at once) against meshviz's (one at a time) ----

def _mlp_step(steps: int) -> tuple[list, list]:
    """Every rank seeds and builds the same MLP, then trains with gradients averaged by hand; returns the first
    weights (are they the same on every rank?) and the step times."""
    import torch
    import torch.distributed as tdist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    w = model[0].weight.detach().clone()
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(tdist.get_rank()))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(100 + tdist.get_rank()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            tdist.all_reduce(p.grad)
            p.grad /= tdist.get_world_size()
        opt.step()
        opt.zero_grad()
        tdist.barrier()
        times.append(time.perf_counter() - t)
    return w, times


def candidate(kind: str, n: int, steps: int) -> dict:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    if kind == "meshviz":
        from meshviz.ranks.threads import run

        def fn():
            import meshviz.distributed as dist

            dist.init_parallel_env()
            return _mlp_step(steps)

        res = run(fn, n)
    else:  # torch's, as its own tests start it
        import importlib

        from meshviz import compat

        importlib.import_module("torch.testing._internal.distributed.multi_threaded_pg")  # registers "threaded"

        compat.install_thread_worlds()
        store = tdist.HashStore()
        res = [None] * n

        def rank(r):
            tdist.init_process_group("threaded", rank=r, world_size=n, store=store)
            res[r] = _mlp_step(steps)

        ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    same = all(torch.equal(w, res[0][0]) for w, _ in res)
    step = statistics.median(max(times[i] for _, times in res) for i in range(1, steps))
    return {"kind": kind, "same_weights": same, "step_ms": 1000 * step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--notebooks", nargs="+", default=list(CASES))
    ap.add_argument("--candidates", action="store_true",
                    help="torch's threaded process group against meshviz's (8 ranks, an MLP step)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "NOTEBOOK"), help=argparse.SUPPRESS)
    ap.add_argument("--candidate", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    if args.candidate:
        print(json.dumps(candidate(args.candidate, 8, 12)))
        return
    if args.candidates:
        res: dict = {}
        for _ in range(args.repeat):
            for kind in ("torch", "meshviz"):
                out = subprocess.run([sys.executable, __file__, "--candidate", kind], cwd=ROOT, capture_output=True,
                                     text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
                if out.returncode != 0:
                    raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
                res.setdefault(kind, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"load average {os.getloadavg()[0]:.1f}; 8 ranks, MLP 256-512-10, batch 64, median of 11 steps")
        print("| process group | ranks run | same weights after torch.manual_seed(0) on every rank | step ms |")
        print("|---|---|---|---|")
        for kind, how in (("torch", "all at once"), ("meshviz", "one at a time (baton)")):
            rs = res[kind]
            steps = [r["step_ms"] for r in rs]
            print(f"| {kind} | {how} | {sum(r['same_weights'] for r in rs)}/{len(rs)} runs | "
                  f"{statistics.median(steps):.1f} ({min(steps):.1f}-{max(steps):.1f}) |")
        return
    env = dict(os.environ, IPP_NONINTERACTIVE="1", PYTHONWARNINGS="ignore")
    env.pop("MESHVIZ_RANKS", None)
    rows: dict = {}
    for name in args.notebooks:
        for _ in range(args.repeat):
            for mode in ("engines", "threads"):  # interleaved: drifting load hits both
                out = subprocess.run([sys.executable, __file__, "--child", mode, name], env=env, cwd=ROOT,
                                     capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"{mode} {name} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.setdefault((name, mode), []).append(r)
                print(f"  {name} {mode}: ready {r['ready_s']:.1f} s, step {r['step_ms']:.0f} ms, "
                      f"peak PSS {r['peak_pss_mib']:.0f} MiB, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    print(f"\nload average: {os.getloadavg()[0]:.1f}; medians of {args.repeat} runs (min-max)\n")
    print("| notebook | ranks as | ready s | step ms | peak PSS MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|")

    def cell(rs, key, fmt):
        vals = [r[key] for r in rs]
        return f"{fmt % statistics.median(vals)} ({fmt % min(vals)}-{fmt % max(vals)})"

    for name in args.notebooks:
        for mode in ("engines", "threads"):
            rs = rows[(name, mode)]
            print(f"| {name} | {mode} ({rs[0]['ranks']}) | {cell(rs, 'ready_s', '%.1f')} | "
                  f"{cell(rs, 'step_ms', '%.0f')} | {cell(rs, 'peak_pss_mib', '%.0f')} | "
                  f"{cell(rs, 'peak_rss_mib', '%.0f')} |")
        e, t = rows[(name, "engines")], rows[(name, "threads")]
        ratio = {k: statistics.median(r[k] for r in t) / statistics.median(r[k] for r in e)
                 for k in ("ready_s", "step_ms", "peak_pss_mib", "peak_rss_mib")}
        print(f"| {name} | threads / engines | {ratio['ready_s']:.2f} | {ratio['step_ms']:.2f} | "
              f"{ratio['peak_pss_mib']:.2f} | {ratio['peak_rss_mib']:.2f} |")


if __name__ == "__main__":
    main()
