"""Pipeline: measured bubble vs (p-1)/(m+p-1), step time vs torch.distributed.pipelining, peak activations.

    python bench/bench_pipeline.py [--cost-ms 20] [--steps 3] [--rounds 7]

1. Bubble: p stages of one block each whose forward sleeps ``cost`` and backward ``2 * cost`` (a fixed cost per
   block, so the 2-core machine's noise does not dominate); 1F1B and FThenB, p = 2, 4 and m = 4, 8; the measured
   bubble comes from the run's compute events (mean over the measured steps).
2. Step time: the same model and schedule (1F1B) through meshviz's ``train_batch`` (tracing off, and on) and through
   torch's ``PipelineStage`` + ``Schedule1F1B`` + ``optimizer.step()``; median of interleaved rounds, ratio.
3. Peak activation memory (bytes saved for backward, live): 1F1B vs FThenB, p = 4, m = 8, a 4x256 MLP stage.
"""

import argparse
import statistics
import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cost):
        ctx.cost = cost
        time.sleep(cost)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.cost)
        return g * 1.0, None


class SleepBlock(nn.Module):
    """A block with a fixed cost: forward sleeps ``cost`` s, backward ``2 * cost`` s."""

    def __init__(self, width=8, cost=0.02):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.cost = cost

    def forward(self, x):
        return _Sleep.apply(self.lin(x), self.cost)


class MlpBlock(nn.Module):
    def __init__(self, width=256, depth=4):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])

    def forward(self, x):
        return self.net(x)


def _fleet(p, m, mode, mbs):
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "pp_degree": p}
    s.pipeline_configs = {"micro_batch_size": mbs, "accumulate_steps": m, "schedule_mode": mode}
    fleet.init(is_collective=True, strategy=s)
    return fleet


def bubble_rank(p, m, mode, cost, steps):
    from meshviz import trace
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer
    from meshviz.distributed.pipeline import measured_bubble

    fleet = _fleet(p, m, mode, 1)
    layer = PipelineLayer([LayerDesc(SleepBlock, 8, cost) for _ in range(p)], loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    x, y = torch.randn(m, 8), torch.randn(m, 8)
    model.train_batch((x, y), opt)  # warm-up: shape inference, group set-up
    with trace.record() as mem:
        for _ in range(steps):
            model.train_batch((x, y), opt)
    import torch.distributed as tdist

    evs = [None] * tdist.get_world_size()
    tdist.all_gather_object(evs, [e for e in mem.events if e.kind == "compute"])
    return measured_bubble([e for es in evs for e in es])


def _time(fn, steps, traced=False):
    """Median seconds of ``steps`` calls of ``fn``; ``traced``: under one recorder that stays on for them all (as
    a user's does), each step timed with the making of its deferred events."""
    import contextlib

    import torch.distributed as tdist

    from meshviz import trace

    out = []
    with trace.record() if traced else contextlib.nullcontext():
        for _ in range(steps):
            tdist.barrier()
            t0 = time.perf_counter()
            fn()
            if traced:
                trace.flush()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def step_time_rank(p, m, kind, rounds, steps, cost):
    import torch.distributed as tdist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from meshviz import trace
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    fleet = _fleet(p, m, "1F1B", 8)
    hcg = fleet.get_hybrid_communicate_group()
    make = (lambda: LayerDesc(SleepBlock, 64, cost)) if kind == "sleep" else (lambda: LayerDesc(MlpBlock, 256, 4))
    width = 64 if kind == "sleep" else 256
    layer = PipelineLayer([make() for _ in range(p)], loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    # torch's own: the same stage module, stage and schedule, loss scaled the same way
    ref_layer = PipelineLayer([make() for _ in range(p)], loss_fn=nn.MSELoss())
    ref_opt = torch.optim.SGD(ref_layer.parameters(), lr=1e-3)
    stage = PipelineStage(ref_layer._chunks[0], hcg.get_stage_id(), p, torch.device("cpu"),
                          group=hcg.get_pipe_parallel_group().process_group)
    sched = Schedule1F1B(stage, m, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / m, scale_grads=False)
    x, y = torch.randn(8 * m, width), torch.randn(8 * m, width)
    first, last = hcg.get_stage_id() == 0, hcg.get_stage_id() == p - 1

    def torch_step():
        losses = []
        if first:
            sched.step(x, target=None)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        ref_opt.step()
        ref_opt.zero_grad()

    def ours():
        model.train_batch((x, y), opt)

    for f in (torch_step, ours):
        f()
        f()
    with trace.record():
        ours()
        ours()
    res = {"torch": [], "meshviz": [], "meshviz traced": []}
    for _ in range(rounds):
        res["torch"].append(_time(torch_step, steps))
        res["meshviz"].append(_time(ours, steps))
        res["meshviz traced"].append(_time(ours, steps, traced=True))
    tdist.barrier()
    return {k: statistics.median(v) for k, v in res.items()}


def memory_rank(p, m, mode):
    from meshviz import trace
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer
    from meshviz.distributed.pipeline import peak_activation_bytes

    fleet = _fleet(p, m, mode, 8)
    layer = PipelineLayer([LayerDesc(MlpBlock, 256, 4) for _ in range(p)], loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    x, y = torch.randn(8 * m, 256), torch.randn(8 * m, 256)
    model.train_batch((x, y), opt)
    with trace.record() as mem:
        model.train_batch((x, y), opt)
    return peak_activation_bytes(mem.events), model.meter.peak


def main():
    from meshviz.distributed.pipeline import bubble_formula
    from meshviz.testing import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: bubble,time,memory")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    cost = a.cost_ms / 1e3
    if "bubble" not in skip:
        print(f"## bubble (fixed cost: forward {a.cost_ms:g} ms, backward {2 * a.cost_ms:g} ms per block)")
        print("| schedule | p | m | measured | formula (p-1)/(m+p-1) | measured - formula |")
        print("|---|---|---|---|---|---|")
        for mode in ("1F1B", "FThenB"):
            for p in (2, 4):
                for m in (4, 8):
                    got = run_ranks(bubble_rank, p, p, m, mode, cost, a.steps, timeout=300)[0]
                    f = bubble_formula(p, m)
                    print(f"| {mode} | {p} | {m} | {got:.3f} | {f:.3f} | {got - f:+.3f} |", flush=True)
    if "time" not in skip:
        print("\n## step time, 1F1B, vs torch.distributed.pipelining Schedule1F1B (median ms/step, rank 0)")
        print("| model | p | m | torch | meshviz | ratio | meshviz traced | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for kind, p, m in (("sleep", 2, 8), ("sleep", 4, 8), ("mlp", 2, 8)):
            r = run_ranks(step_time_rank, p, p, m, kind, a.rounds, a.steps, cost / 4, timeout=600)[0]
            t, o, ot = r["torch"] * 1e3, r["meshviz"] * 1e3, r["meshviz traced"] * 1e3
            label = f"sleep {a.cost_ms / 4:g}/{a.cost_ms / 2:g} ms" if kind == "sleep" else "4x256 MLP, 8 rows"
            print(f"| {label} | {p} | {m} | {t:.1f} | {o:.1f} | {o / t:.3f} | {ot:.1f} | {ot / t:.3f} |", flush=True)
    if "memory" not in skip:
        print("\n## peak activation memory (bytes saved for backward, live), p=4, m=8, 8 rows x 4x256 MLP per stage")
        print("| rank | FThenB | 1F1B | 1F1B / FThenB |")
        print("|---|---|---|---|")
        fb = run_ranks(memory_rank, 4, 4, 8, "FThenB", timeout=300)
        ob = run_ranks(memory_rank, 4, 4, 8, "1F1B", timeout=300)
        for r in range(4):
            print(f"| {r} | {fb[r][1]} | {ob[r][1]} | {ob[r][1] / fb[r][1]:.3f} |")


if __name__ == "__main__":
    main()
