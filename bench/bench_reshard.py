"""Reshard speed on 2 gloo ranks: meshviz against the raw torch collective doing the same move, and the planner's time.

Run: .venv/bin/python bench/bench_reshard.py [--mib 64] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _pair(a, b, repeat):
    """Median times of ``a`` and ``b``, run alternately so that drifting load hits both alike."""
    import torch.distributed as tdist

    times = {0: [], 1: []}
    fns = [f for f in (a, b) if f is not None]
    for f in fns:
        f()  # warm-up
    for _ in range(repeat):
        for i, f in enumerate(fns):
            tdist.barrier()
            t0 = time.perf_counter()
            f()
            tdist.barrier()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(times[i]) if times[i] else None for i in (0, 1)]


def run(mib: int, repeat: int):
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor import Shard as TShard

    import meshviz.distributed as dist
    from meshviz.runtime.groups import device_mesh

    dist.init_parallel_env()
    r = dist.get_rank()
    n = mib * 2**20 // 4
    side = int(n**0.5)
    full = torch.randn(side, side)
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    res = {}

    p = dist.shard_tensor(full, mesh, [dist.Partial()])
    raw = full.clone()
    res["P->R"] = (*_pair(lambda: dist.reshard(p, mesh, [dist.Replicate()]), lambda: tdist.all_reduce(raw), repeat),
                   "all_reduce")

    s = dist.shard_tensor(full, mesh, [dist.Shard(0)])
    local = s._local_value().detach().contiguous()
    out = torch.empty_like(full)
    res["S(0)->R"] = (*_pair(lambda: dist.reshard(s, mesh, [dist.Replicate()]),
                             lambda: tdist.all_gather_into_tensor(out, local), repeat), "all_gather_into_tensor")

    pieces = list(local.chunk(2, dim=1))
    send = torch.cat([q.contiguous().reshape(-1) for q in pieces])
    recv = torch.empty_like(send)

    def raw_a2a():
        tdist.all_to_all_single(recv, send)
        a, b = recv.chunk(2)
        torch.cat([a.view(pieces[0].shape), b.view(pieces[0].shape)], dim=0)

    dm = device_mesh(mesh)
    dt = distribute_tensor(full, dm, [TShard(0)])
    res["S(0)->S(1)"] = (*_pair(lambda: dist.reshard(s, mesh, [dist.Shard(1)]), raw_a2a, repeat),
                         "all_to_all_single")
    res["S(0)->S(1) vs DTensor"] = (*_pair(lambda: dist.reshard(s, mesh, [dist.Shard(1)]),
                                           lambda: dt.redistribute(dm, [TShard(1)]), repeat), "DTensor.redistribute")

    m0, m1 = dist.ProcessMesh([0], dim_names=["x"]), dist.ProcessMesh([1], dim_names=["x"])
    c = dist.shard_tensor(full, m0, [dist.Replicate()])
    buf = torch.empty_like(full)

    def raw_p2p():
        if r == 0:
            tdist.send(full, 1)
        else:
            tdist.recv(buf, 0)

    res["cross-mesh R->R"] = (*_pair(lambda: dist.reshard(c, m1, [dist.Replicate()]), raw_p2p, repeat),
                              "send/recv")
    assert isinstance(dt, DTensor)
    return res


def planner_time():
    import numpy as np

    from meshviz.core import Partial, ProcessMesh, Replicate, Shard
    from meshviz.core.planner import plan_reshard

    big = ProcessMesh(np.arange(1024).reshape(32, 32), ["x", "y"])
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        plan_reshard([8192, 8192], big, [Shard(0), Partial()], big, [Replicate(), Shard(1)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    from meshviz.testing import run_ranks

    res = run_ranks(run, 2, args.mib, args.repeat, timeout=900, collective_timeout=300,
                    env={"MESHVIZ_THREADS": "1"})[0]
    print(f"reshard of {args.mib} MiB float32 on 2 gloo ranks, median of {args.repeat}")
    print(f"{'move':<24}{'meshviz ms':>12}{'torch ms':>12}  {'torch building block':<24}{'ratio':>7}")
    for k, (mv, raw, what) in res.items():
        print(f"{k:<24}{mv * 1e3:>12.1f}{raw * 1e3:>12.1f}  {what:<24}{mv / raw:>7.2f}")
    print(f"planner, 32x32 mesh (1024 ranks), [S(0), P] -> [R, S(1)]: {planner_time() * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
