"""Fixed per-call cost of shard_tensor and reshard against DTensor's distribute_tensor / redistribute, on CUDA.

Tiny tensors, so what is measured is the cost of a call, not of moving data: a 1-rank mesh (NCCL) and, with
``--ranks 2``, two ranks sharing the GPU (gloo). Also a recorded reshard against the same one untraced (its ratio),
the same pair with each reshard behind a matmul the GPU is still running (as in training), and again with an
all_reduce after each reshard (its event waits behind the deferred reshard events), and the price of tracing
switched off.
Run: .venv/bin/python bench/bench_gpu.py [--ranks 1 2] [--calls 2000] [--rounds 7] [--c10d]
Without CUDA it says so and exits; ``--device cpu`` measures the same calls on the CPU (gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch


def _rounds(fns: dict, calls: int, rounds: int, sync, around: dict | None = None, then: dict | None = None) -> dict:
    """Median microseconds per call of each ``fns`` entry (wall time, min-max over rounds, and the median CPU time
    of the calling thread: what a call costs the host, without the peer's latency), the entries run alternately
    round by round; ``around``:
    for some entries, a context manager each of their rounds (and their warm-up) runs in; ``then``: for some, what
    runs after their calls, inside the timing (the trace's flush: deferred events are made there)."""
    import torch.distributed as tdist

    around, then = around or {}, then or {}
    times: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    for k, f in fns.items():
        with around.get(k, contextlib.nullcontext)():
            for _ in range(20):  # warm-up: groups, DeviceMeshes, caches
                f()
    sync()
    for _ in range(rounds):
        for k, f in fns.items():
            if tdist.get_world_size() > 1:
                tdist.barrier()
            with around.get(k, contextlib.nullcontext)():
                sync()
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(calls):
                    f()
                if k in then:
                    then[k]()
                sync()
                times[k].append((time.perf_counter() - t0) / calls * 1e6)
                cpu[k].append((time.thread_time() - c0) / calls * 1e6)
    return {k: (statistics.median(v), min(v), max(v), statistics.median(cpu[k])) for k, v in times.items()}


def measure(calls: int, rounds: int, c10d: bool = False):
    """Run on every rank of the world; returns rank 0's table {name: (median us, min, max)}."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.compat import all_gather_single
    from meshviz.runtime.groups import device_mesh

    dist.init_parallel_env()
    dev = dist.device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = tdist.get_world_size()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])
    dm = device_mesh(mesh, dev.type)
    x = torch.arange(16.0, device=dev).reshape(4, 4)
    S0, S1, R, P = dist.Shard(0), dist.Shard(1), dist.Replicate(), dist.Partial()
    T = {"S(0)": [TShard(0)], "S(1)": [TShard(1)], "R": [TReplicate()], "P": [TPartial()]}
    M = {"S(0)": [S0], "S(1)": [S1], "R": [R], "P": [P]}
    # DTensor's functional collectives crash (SIGSEGV) on gloo with CUDA tensors (torch 2.11): there the baseline is
    # the c10d collective a reshard issues, on the same tensors
    raw = dev.type == "cuda" and tdist.get_backend() == "gloo"
    with_c10d = raw or (c10d and n > 1)
    fns = {"shard_tensor": lambda: dist.shard_tensor(x, mesh, [S0])}
    if not raw:
        fns["DTensor distribute_tensor"] = lambda: distribute_tensor(x, dm, [TShard(0)])
    for src, dst in [("S(0)", "R"), ("P", "R"), ("R", "S(1)"), ("S(0)", "S(1)")]:
        d = dist.shard_tensor(x, mesh, M[src])
        fns[f"reshard {src}->{dst}"] = (lambda d=d, dst=M[dst]: dist.reshard(d, mesh, dst))
        if not raw:
            t = DTensor.from_local(d._local_value().detach(), dm, T[src], run_check=False) if src == "P" else \
                distribute_tensor(x, dm, T[src])
            fns[f"DTensor redistribute {src}->{dst}"] = (lambda t=t, dst=T[dst]: t.redistribute(dm, dst))
    if with_c10d:
        blk = dist.shard_tensor(x, mesh, [S0])._local_value()
        out = torch.empty(16, device=dev)
        fns["c10d all_gather_into_tensor S(0)->R"] = lambda: all_gather_single(out, blk.reshape(-1))
        fns["c10d all_reduce P->R"] = lambda: tdist.all_reduce(x.clone())
    table = _rounds(fns, calls, rounds, sync)
    # traced: a round's reshards recorded (trace.record keeps every event of the round, as a user's would), the
    # events it defers made inside the round's time, rounds alternating with the same reshard untraced
    d = dist.shard_tensor(x, mesh, [S0])
    traced = {"reshard S(0)->R, untraced": lambda: dist.reshard(d, mesh, [R]),
              "reshard S(0)->R, traced": lambda: dist.reshard(d, mesh, [R])}
    table.update(_rounds(traced, calls, rounds, sync, around={"reshard S(0)->R, traced": trace.record},
                         then={"reshard S(0)->R, traced": trace.flush}))
    table.update(_rounds({"reshard S(0)->R, tracing off again": lambda: dist.reshard(d, mesh, [R])}, calls, rounds,
                         sync))
    if dev.type == "cuda":  # as in training: each reshard behind a layer's matmul the GPU is still running
        w = torch.randn(2048, 2048, device=dev)
        g = torch.ones(4, device=dev)
        busy = {"behind GPU work, untraced": lambda: (w @ w, dist.reshard(d, mesh, [R])),
                "behind GPU work, traced": lambda: (w @ w, dist.reshard(d, mesh, [R])),
                # a collective after the reshard, as in a step: its event is eager, and goes after the reshard's
                "behind GPU work + all_reduce, untraced": lambda: (w @ w, dist.reshard(d, mesh, [R]),
                                                                   dist.all_reduce(g)),
                "behind GPU work + all_reduce, traced": lambda: (w @ w, dist.reshard(d, mesh, [R]),
                                                                 dist.all_reduce(g)),
                "GPU work alone": lambda: w @ w}
        on = ("behind GPU work, traced", "behind GPU work + all_reduce, traced")
        table.update(_rounds(busy, max(calls // 4, 1), rounds, sync, around={k: trace.record for k in on},
                             then={k: trace.flush for k in on}))
    return {"table": table, "device": str(dev), "backend": tdist.get_backend(), "ranks": n,
            "torch": torch.__version__}


def _print(res: dict) -> None:
    t = res["table"]
    print(f"\n{res['ranks']} rank(s) on {res['device']} ({res['backend']}), torch {res['torch']}: us per call "
          f"(median, min-max over rounds)")
    print("| call | meshviz us | baseline us (DTensor, or the c10d collective) | ratio | CPU us, ratio |\n"
          "|---|---|---|---|---|")
    pairs = [("shard_tensor", "DTensor distribute_tensor")]
    pairs += [(k, k.replace("reshard", "DTensor redistribute")) for k in t
              if k.startswith("reshard ") and "traced" not in k and "again" not in k]
    pairs += [("reshard S(0)->R", "c10d all_gather_into_tensor S(0)->R"), ("reshard P->R", "c10d all_reduce P->R")]
    compared = set()
    for a, b in pairs:
        if b in t:
            ma, mb = t[a][0], t[b][0]
            print(f"| {a} | {ma:.1f} ({t[a][1]:.1f}-{t[a][2]:.1f}) | {mb:.1f} ({t[b][1]:.1f}-{t[b][2]:.1f}) | "
                  f"{ma / mb:.2f} | {t[a][3]:.1f} / {t[b][3]:.1f}, {t[a][3] / t[b][3]:.2f} |")
            compared.add(a)
    for a, _ in pairs:  # no baseline here (DTensor's crashes on gloo with CUDA)
        if a not in compared:
            compared.add(a)
            print(f"| {a} | {t[a][0]:.1f} ({t[a][1]:.1f}-{t[a][2]:.1f}) | | | {t[a][3]:.1f} |")
    k, u = "reshard S(0)->R, traced", "reshard S(0)->R, untraced"
    print(f"| {k} | {t[k][0]:.1f} ({t[k][1]:.1f}-{t[k][2]:.1f}) | untraced, same rounds: {t[u][0]:.1f} "
          f"({t[u][1]:.1f}-{t[u][2]:.1f}) | {t[k][0] / t[u][0]:.2f} | {t[k][3]:.1f} / {t[u][3]:.1f}, "
          f"{t[k][3] / t[u][3]:.2f} |")
    k = "reshard S(0)->R, tracing off again"
    print(f"| {k} | {t[k][0]:.1f} ({t[k][1]:.1f}-{t[k][2]:.1f}) | | | {t[k][3]:.1f} |")
    k, u, w = "behind GPU work, traced", "behind GPU work, untraced", "GPU work alone"
    if k in t:
        print(f"| S(0)->R behind a 2048^2 matmul, traced | {t[k][0]:.1f} ({t[k][1]:.1f}-{t[k][2]:.1f}) | untraced: "
              f"{t[u][0]:.1f} ({t[u][1]:.1f}-{t[u][2]:.1f}), the matmul alone: {t[w][0]:.1f} | "
              f"{t[k][0] / t[u][0]:.2f} | |")
        k, u = "behind GPU work + all_reduce, traced", "behind GPU work + all_reduce, untraced"
        print(f"| the same, then an all_reduce, traced | {t[k][0]:.1f} ({t[k][1]:.1f}-{t[k][2]:.1f}) | untraced: "
              f"{t[u][0]:.1f} ({t[u][1]:.1f}-{t[u][2]:.1f}) | {t[k][0] / t[u][0]:.2f} | |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--c10d", action="store_true", help="also time the bare c10d collectives (always on gloo+CUDA)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here; nothing measured (--device cpu measures the same calls on the CPU)")
        return 0
    from meshviz.testing import run_ranks

    for n in args.ranks:
        if args.device == "cpu":
            kw = dict(devices="cpu", backend="gloo")
        elif n == 1:
            kw = dict(devices="cuda", backend=None)  # NCCL
        else:
            kw = dict(devices="cuda", backend="gloo")  # the ranks share the GPU
        res = run_ranks(measure, n, args.calls, args.rounds, args.c10d, timeout=1800, collective_timeout=600,
                        env={"MESHVIZ_STRICT_DEVICES": "0"}, **kw)
        _print(res[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
