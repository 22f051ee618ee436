"""Per-rank memory of group_sharded_parallel levels against ZeRO theory, and step time against torch FSDP2."""

import argparse
import statistics
import time

import torch
import torch.nn as nn

from meshviz.testing import run_ranks

LEVELS = ("os", "os_g", "p_g_os")


def make_model(layers, hidden):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def _timed(model, opt, x, steps):
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        if i == steps + 1:
            break
        opt.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(layers, hidden, batch, steps, segment_size):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel, memory_stats

    dist.init_parallel_env()
    torch.manual_seed(dist.get_rank())
    x = torch.randn(batch, hidden)
    out = {}
    # plain data parallel (torch DDP) as the 16-psi baseline
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(make_model(layers, hidden))
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    t = _timed(m, o, x, steps)
    out["dp"] = {"time": t, **memory_stats(m, o)}
    for level in LEVELS:
        m = make_model(layers, hidden)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m, o, _ = group_sharded_parallel(m, o, level, segment_size=segment_size)
        t = _timed(m, o, x, steps)
        out[level] = {"time": t, **memory_stats(m, o)}
    # torch FSDP2 on the same model: fully_shard each layer, then the root
    from torch.distributed.fsdp import fully_shard

    m = make_model(layers, hidden)
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    t = _timed(m, o, x, steps)
    out["fsdp2"] = {"time": t, **memory_stats(m, o)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--segment-size", type=int, default=1024)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    psi = a.layers * (a.hidden * a.hidden + a.hidden)
    print(f"model: {a.layers} x Linear({a.hidden},{a.hidden}), psi = {psi} params, AdamW fp32, "
          f"segment_size={a.segment_size}")
    for n in a.ranks:
        res = run_ranks(_rank, n, a.layers, a.hidden, a.batch, a.steps, a.segment_size, timeout=600)
        theory = {"dp": 16 * psi, "os": 8 * psi + 8 * psi / n, "os_g": 4 * psi + 12 * psi / n,
                  "p_g_os": 16 * psi / n, "fsdp2": 16 * psi / n}
        print(f"\n{n} ranks: per-rank bytes of params+grads+states after backward+step (max over ranks)")
        print(f"{'level':8} {'params':>10} {'grads':>10} {'states':>10} {'total':>10} {'theory':>10} "
              f"{'ratio':>6} {'step ms':>8} {'vs fsdp2':>8}")
        t_fsdp = max(r["fsdp2"]["time"] for r in res)
        for lv in ("dp",) + LEVELS + ("fsdp2",):
            worst = max(res, key=lambda r: r[lv]["total"])[lv]
            t = max(r[lv]["time"] for r in res)
            print(f"{lv:8} {worst['params']:>10} {worst['grads']:>10} {worst['states']:>10} {worst['total']:>10} "
                  f"{theory[lv]:>10.0f} {worst['total'] / theory[lv]:>6.3f} {t * 1e3:>8.2f} {t / t_fsdp:>8.2f}")


if __name__ == "__main__":
    main()
