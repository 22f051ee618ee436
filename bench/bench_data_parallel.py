"""DataParallel vs bare torch DDP, fused_allreduce_gradients vs its torch building block, comm_buffer_size 1/25/100 MB.

    python bench/bench_data_parallel.py [--ranks 2] [--steps 30] [--width 512] [--depth 4]

Each rank trains the same MLP on its own batch; times are medians over steps (barrier before each), rank 0's.
``no_sync`` + ``fused_allreduce_gradients`` is timed against the same step in torch: DDP's ``no_sync``, then the
gradients flattened into one buffer, one ``all_reduce``, divided and copied back (as the ratio to DDP, its
all-reduce starts after the whole backward, so both are slower than DDP's overlapped buckets).
"""

import argparse
import statistics
import time

import torch
from torch import nn


def _mlp(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _time_steps(step, steps, warmup=3):
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


def _bench(steps, width, depth, rounds):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import meshviz.distributed as dist
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    dist.init_parallel_env()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, width, generator=g), torch.randn(64, 1, generator=g)

    def trainer(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    def fused_trainer(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
            fused_allreduce_gradients(list(model.parameters()), None)
            opt.step()
            opt.zero_grad()

        return step

    def flat_trainer(model):  # torch's building block for the fused path
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        n = tdist.get_world_size()

        def step():
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
            grads = [p.grad for p in model.parameters()]
            flat = _flatten_dense_tensors(grads)
            tdist.all_reduce(flat)
            flat.div_(n)
            with torch.no_grad():
                for g_, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g_.copy_(v)
            opt.step()
            opt.zero_grad()

        return step

    ddp = trainer(DDP(_mlp(width, depth)))  # defaults: 25 MB buckets, 1 MB first bucket, like ours
    mv = trainer(dist.DataParallel(_mlp(width, depth), comm_buffer_size=25))
    fused = fused_trainer(dist.DataParallel(_mlp(width, depth)))
    flat = flat_trainer(DDP(_mlp(width, depth)))
    bufs = {mb: trainer(dist.DataParallel(_mlp(width, depth), comm_buffer_size=mb)) for mb in (1, 25, 100)}
    res = {k: [] for k in ("ddp", "meshviz", "fused", "flat", 1, 25, 100)}
    for _ in range(rounds):  # interleave so drift hits every variant alike
        res["ddp"].append(_time_steps(ddp, steps))
        res["meshviz"].append(_time_steps(mv, steps))
        res["fused"].append(_time_steps(fused, steps))
        res["flat"].append(_time_steps(flat, steps))
        for mb, fn in bufs.items():
            res[mb].append(_time_steps(fn, steps))
    nparams = sum(p.numel() for p in _mlp(width, depth).parameters())
    tdist.barrier()
    fused_flat = sorted(a / b for a, b in zip(res["fused"], res["flat"]))  # per round
    return {k: statistics.median(v) for k, v in res.items()}, nparams, (fused_flat[0], fused_flat[-1])


def main():
    from meshviz.testing import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    a = ap.parse_args()
    res, nparams, spread = run_ranks(_bench, a.ranks, a.steps, a.width, a.depth, a.rounds, timeout=900)[0]
    ms = {k: v * 1e3 for k, v in res.items()}
    print(f"MLP {a.depth}x{a.width} ({nparams / 1e6:.2f} M params, {nparams * 4 / 2**20:.1f} MB of gradients), "
          f"{a.ranks} gloo ranks, median step over {a.rounds}x{a.steps} steps")
    print(f"{'variant':44s} {'ms/step':>8s} {'ratio':>6s}")
    print(f"{'torch DDP (defaults: 25 MB, first 1 MB)':44s} {ms['ddp']:8.2f} {1.0:6.3f}")
    print(f"{'meshviz DataParallel (comm_buffer_size=25)':44s} {ms['meshviz']:8.2f} {ms['meshviz'] / ms['ddp']:6.3f}")
    print(f"{'no_sync + fused_allreduce_gradients':44s} {ms['fused']:8.2f} {ms['fused'] / ms['ddp']:6.3f}")
    print(f"{'torch: no_sync + one flat all_reduce':44s} {ms['flat']:8.2f} {ms['flat'] / ms['ddp']:6.3f}")
    print(f"fused_allreduce_gradients / torch's flat all_reduce: {ms['fused'] / ms['flat']:.3f} "
          f"(per round {spread[0]:.3f}-{spread[1]:.3f})")
    for mb in (1, 25, 100):
        print(f"{f'DataParallel comm_buffer_size={mb} MB':44s} {ms[mb]:8.2f} {ms[mb] / ms['ddp']:6.3f}")


if __name__ == "__main__":
    main()
