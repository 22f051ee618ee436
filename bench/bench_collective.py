"""Per-call cost of dist.* collectives against the bare torch call, and all-to-all: torch's list form vs packed.

    python bench/bench_collective.py [--ranks 2] [--calls 2000] [--rounds 5]

Tracing is off. Each variant runs ``calls`` times between barriers; medians over rounds (variants interleaved),
rank 0's. The list form of all_to_all is skipped where gloo refuses it (torch 2.11).
"""

import argparse
import statistics
import time

import torch


def _timed(fn, calls):
    import torch.distributed as tdist

    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    tdist.barrier()
    return (time.perf_counter() - t0) / calls


def _bench(calls, rounds):
    import torch.distributed as tdist

    import meshviz.distributed as dist

    try:
        from meshviz.runtime import comm
    except ImportError:  # an older meshviz: per-call costs only
        comm = None
    dist.init_parallel_env()
    n = tdist.get_world_size()
    small = torch.ones(4)
    variants = {
        "torch all_reduce": lambda: tdist.all_reduce(small),
        "dist.all_reduce": lambda: dist.all_reduce(small),
        "torch broadcast": lambda: tdist.broadcast(small, 0),
        "dist.broadcast": lambda: dist.broadcast(small, 0),
    }
    for numel in (16, 1 << 14, 1 << 20) if comm is not None else ():
        ins = [torch.full((numel,), float(j)) for j in range(n)]
        outs = [torch.empty(numel) for _ in range(n)]
        pg = tdist.group.WORLD

        def listed(ins=ins, outs=outs):
            tdist.all_to_all(outs, ins)

        def packed(ins=ins, outs=outs):
            work, unpack = comm.all_to_all_flat(outs, ins, pg)
            work.wait()
            unpack()

        try:
            listed()
            variants[f"all_to_all list {numel * 4} B/peer"] = listed
        except RuntimeError:
            pass
        variants[f"all_to_all packed {numel * 4} B/peer"] = packed
    res = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            big = "1048576" in k or "4194304" in k
            res[k].append(_timed(fn, max(5, calls // 200) if big else calls))
    return {k: statistics.median(v) for k, v in res.items()}


def main():
    from meshviz.testing import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    res = run_ranks(_bench, a.ranks, a.calls, a.rounds, timeout=900)[0]
    print(f"torch {torch.__version__}, {a.ranks} gloo ranks, tracing off, median of {a.rounds} rounds")
    for k, v in res.items():
        print(f"{k:40s} {v * 1e6:10.1f} us/call")


if __name__ == "__main__":
    main()
