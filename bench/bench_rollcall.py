"""What keeping the roll-call costs: a DataParallel step with it and without it (tracing off), side by side.

    python bench/bench_rollcall.py [--ranks 2] [--steps 30] [--rounds 7] [--width 512] [--depth 4]

Part 1 (one process): the roll-call's work per collective (``Record.enter`` + ``leave``), per DataParallel forward
(``begin_region``) and per answer (``snapshot``), in microseconds.
Part 2 (gloo ranks, rank 0's medians, variants interleaved round by round so drifting load hits all alike):
- a DataParallel step (DDP's C++ bucket hook: the roll-call's only work is one ``begin_region`` per forward) with
  the roll-call kept and with it stubbed out, next to bare torch DDP;
- the same step with a scripts' watchdog running (two threads per rank: one wakes 4 times a second to look at
  the record, one blocks in the store) and without;
- ``no_sync`` + ``fused_allreduce_gradients`` (its bucket all-reduces pass ``comm.run``) with and without;
- one 4-float ``dist.all_reduce``: with the roll-call, without it, and with the gloo match check on.
- the DataParallel and fused steps once more, kept and stubbed alternating every step.
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _mlp(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _per_call(fn, n=200_000):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def micro():
    """Microseconds per roll-call operation, in this process."""
    from meshviz.runtime import rollcall

    rec = rollcall.Record(rank=0)
    key = (0, 1)
    t = torch.ones(4)

    def enter_leave():
        prev = rec.enter("all_reduce", key, (t,), None)
        rec.leave(prev, None)

    def nothing():
        pass

    base = _per_call(nothing)
    out = {
        "enter + leave (one collective)": _per_call(enter_leave) - base,
        "begin_region (one DataParallel forward)": _per_call(
            lambda: rec.begin_region("all_reduce", key, "DataParallel gradients")) - base,
    }
    rec.enter("all_reduce", key, (t,), None)
    out["snapshot (one answer, on the side thread)"] = _per_call(lambda: rollcall.snapshot(rec), 2000)
    return {k: v * 1e6 for k, v in out.items()}


def _time(step, steps, warmup=3):
    import torch.distributed as tdist

    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        tdist.barrier()
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _paired(step, steps, warmup=3):
    """(median with the roll-call, median stubbed out), alternating the two every step so load drift cancels."""
    import torch.distributed as tdist

    for _ in range(warmup):
        step()
    on, off = [], []
    for i in range(2 * steps):
        stub = i % 2 == 1
        ctx = _Off() if stub else None
        if ctx:
            ctx.__enter__()
        tdist.barrier()
        t0 = time.perf_counter()
        step()
        (off if stub else on).append(time.perf_counter() - t0)
        if ctx:
            ctx.__exit__(None, None, None)
    return statistics.median(on), statistics.median(off)


class _Off:
    """Stubs the roll-call out (Record.enter/leave/begin_region do nothing) while inside."""

    def __enter__(self):
        from meshviz.runtime import rollcall

        R = rollcall.Record
        self.saved = (R.enter, R.leave, R.begin_region)
        R.enter = lambda self, *a, **k: None
        R.leave = lambda self, *a, **k: None
        R.begin_region = lambda self, *a, **k: None

    def __exit__(self, *exc):
        from meshviz.runtime import rollcall

        R = rollcall.Record
        R.enter, R.leave, R.begin_region = self.saved


def _ranks(steps, width, depth, rounds, calls):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients
    from meshviz.runtime import match, watchdog

    dist.init_parallel_env()
    assert not trace.active()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, width, generator=g), torch.randn(64, 1, generator=g)

    def trainer(model, fused=False):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            if fused:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
                fused_allreduce_gradients(list(model.parameters()), None)
            else:
                nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    ddp = trainer(DDP(_mlp(width, depth)))
    dp = trainer(dist.DataParallel(_mlp(width, depth)))
    fused = trainer(dist.DataParallel(_mlp(width, depth)), fused=True)
    t = torch.ones(4)

    def small():
        for _ in range(calls):
            dist.all_reduce(t)

    res = {k: [] for k in ("ddp", "dp", "dp_off", "dp_watch", "fused", "fused_off", "ar", "ar_off", "ar_check",
                           "dp_pair", "dp_pair_off", "fused_pair", "fused_pair_off")}
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    for _ in range(rounds):
        res["ddp"].append(_time(ddp, steps))
        res["dp"].append(_time(dp, steps))
        with _Off():
            res["dp_off"].append(_time(dp, steps))
        w = watchdog._RankWatch(host, port, dist.get_rank(), dist.get_world_size(), 5.0)
        res["dp_watch"].append(_time(dp, steps))
        w.close()
        tdist.barrier()
        res["fused"].append(_time(fused, steps))
        with _Off():
            res["fused_off"].append(_time(fused, steps))
        for name, fn in (("dp_pair", dp), ("fused_pair", fused)):
            a, b = _paired(fn, steps)
            res[name].append(a)
            res[name + "_off"].append(b)
        res["ar"].append(_time(small, 1) / calls)
        with _Off():
            res["ar_off"].append(_time(small, 1) / calls)
        match.set_checking(True)
        res["ar_check"].append(_time(small, 1) / calls)
        match.set_checking(False)
    tdist.barrier()
    return {k: statistics.median(v) for k, v in res.items()}


def main():
    from meshviz.testing import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    print("roll-call work per operation, one process:")
    for k, us in micro().items():
        print(f"  {k:44s} {us:7.2f} us")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    r = run_ranks(_ranks, a.ranks, a.steps, a.width, a.depth, a.rounds, a.calls, timeout=1800,
                  env={"MESHVIZ_CHECK_COLLECTIVES": "0"})[0]
    ms = {k: v * 1e3 for k, v in r.items()}
    print(f"\n{a.ranks} gloo ranks, MLP {a.depth}x{a.width}, batch 64, tracing off, median of {a.rounds} rounds x "
          f"{a.steps} steps (load average {load:.1f} at the start)")
    rows = [
        ("torch DDP", ms["ddp"], None),
        ("DataParallel, roll-call kept", ms["dp"], ms["dp_off"]),
        ("DataParallel, roll-call stubbed out", ms["dp_off"], None),
        ("DataParallel, roll-call + scripts' watchdog", ms["dp_watch"], ms["dp_off"]),
        ("no_sync + fused_allreduce_gradients, kept", ms["fused"], ms["fused_off"]),
        ("no_sync + fused_allreduce_gradients, stubbed", ms["fused_off"], None),
    ]
    print(f"  {'variant':46s} {'ms/step':>8s} {'vs stubbed':>10s}")
    for name, v, ref in rows:
        print(f"  {name:46s} {v:8.2f} {'' if ref is None else f'{v / ref:10.3f}'}")
    print("  alternating kept / stubbed every step (drift cancels):")
    for name, key in (("DataParallel", "dp_pair"), ("no_sync + fused_allreduce_gradients", "fused_pair")):
        print(f"  {name:46s} {ms[key]:8.2f} {ms[key] / ms[key + '_off']:10.3f}  (stubbed {ms[key + '_off']:.2f})")
    us = {k: r[k] * 1e6 for k in ("ar", "ar_off", "ar_check")}
    print(f"\none dist.all_reduce of 4 floats ({a.calls} calls a round): roll-call kept {us['ar']:.0f} us, "
          f"stubbed {us['ar_off']:.0f} us, with the gloo match check {us['ar_check']:.0f} us "
          f"({us['ar_check'] / us['ar']:.2f}x)")


if __name__ == "__main__":
    main()
