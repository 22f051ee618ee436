"""The op layer's cost: ops on meshviz dist tensors against the same ops on torch DTensors, 2 gloo ranks (or 1:
the fixed cost of a call with nothing to wait for).

Run: .venv/bin/python bench/bench_ops.py [--size 256] [--repeat 30] [--rounds 5] [--ranks 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshviz.testing import run_ranks


def _time(fn, repeat):
    import torch.distributed as tdist

    fn()  # warm-up
    tdist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        fn()
    c1 = time.process_time()
    tdist.barrier()
    return (time.perf_counter() - t0) / repeat, (c1 - c0) / repeat  # wall, and this rank's CPU time


def run(size: int, repeat: int, rounds: int):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    import meshviz.distributed as dist
    from meshviz.runtime.groups import device_mesh

    dist.init_parallel_env()
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["x"])
    dm = device_mesh(mesh, "cpu")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)

    mx = dist.shard_tensor(x, mesh, [dist.Shard(0)]).requires_grad_()
    mw = dist.shard_tensor(w, mesh, [dist.Replicate()]).requires_grad_()
    tx = DTensor.from_local(mx._local_value().detach(), dm, [TS(0)]).requires_grad_()
    tw = DTensor.from_local(mw._local_value().detach(), dm, [TR()]).requires_grad_()

    ms = dist.shard_tensor(w, mesh, [dist.Shard(0)])
    ts = DTensor.from_local(ms._local_value(), dm, [TS(0)])
    mmask = dist.shard_tensor(x > 0, mesh, [dist.Shard(0)])
    tmask = DTensor.from_local(mmask._local_value(), dm, [TS(0)])

    def by_hand():  # DTensor has no rule for masked_select: gather both, select, Replicate (Paddle's default rule)
        out = tx.full_tensor().masked_select(tmask.full_tensor())
        return DTensor.from_local(out, dm, [TR()], run_check=False)

    def step(a, b):
        def f():
            a.grad = b.grad = None
            (a @ b).relu().mul(2.0).sum().backward()
        return f

    cases = {
        "add (S(0) + S(0))": (lambda: mx + mx, lambda: tx + tx),
        "matmul S(0) @ R": (lambda: mx @ mw, lambda: tx @ tw),
        "matmul S(0) @ S(0) (gathers w)": (lambda: mx @ ms, lambda: tx @ ts),
        "sum over the sharded dim": (lambda: mx.sum(0), lambda: tx.sum(0)),
        "fwd+bwd relu(x @ w).sum()": (step(mx, mw), step(tx, tw)),
        "masked_select (no torch rule)": (lambda: mx.masked_select(mmask), by_hand),
    }
    out = {}
    for name, (m, t) in cases.items():
        ratios, mt, tt, mc, tc = [], [], [], [], []
        with torch.no_grad() if "bwd" not in name else torch.enable_grad():
            for _ in range(rounds):
                (a, ac), (b, bc) = _time(m, repeat), _time(t, repeat)
                mt.append(a)
                tt.append(b)
                mc.append(ac)
                tc.append(bc)
                ratios.append(a / b)
        out[name] = (statistics.median(mt), statistics.median(tt), min(ratios), statistics.median(ratios), max(ratios),
                     statistics.median(mc), statistics.median(tc))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    import os

    res = run_ranks(run, a.ranks, a.size, a.repeat, a.rounds, ranks="processes", timeout=600)[0]
    print(f"{a.ranks} gloo ranks, {a.size}x{a.size} float32, load average {os.getloadavg()[0]:.1f}")
    print(f"{'op':30} {'meshviz us':>10} {'DTensor us':>10} {'ratio median (min-max)':>24}   CPU us, rank 0: "
          f"meshviz / DTensor, ratio")
    for name, (m, t, lo, med, hi, mc, tc) in res.items():
        print(f"{name:30} {m * 1e6:10.0f} {t * 1e6:10.0f} {med:10.2f} ({lo:.2f}-{hi:.2f})"
              f"   {mc * 1e6:6.0f} / {tc * 1e6:6.0f}, {mc / tc:.2f}")


if __name__ == "__main__":
    main()
