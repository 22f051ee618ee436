"""DistModel train step against a plain torch loop, and with fused_passes (torch.compile) on this machine."""

import argparse
import statistics
import time

import torch
import torch.nn as nn

from meshviz.distributed.auto_parallel import Strategy, to_static


def make_model(hidden, layers):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(hidden, 8))


def timed(step, steps):
    t0 = time.perf_counter()
    step()  # first call: DistModel records its per-rank program (torch.compile waits for the next call)
    step()  # second call: compilation
    first = time.perf_counter() - t0
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return first, statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    x, y = torch.randn(a.batch, a.hidden), torch.randn(a.batch, 8)
    loss_fn = nn.MSELoss()

    m = make_model(a.hidden, a.layers)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def plain():
        loss_fn(m(x), y).backward()
        opt.step()
        opt.zero_grad()

    rows = [("torch loop", *timed(plain, a.steps))]
    for name, fused in (("DistModel", False), ("DistModel+compile", True)):
        m2 = make_model(a.hidden, a.layers)
        s = Strategy({"return_numpy": False})
        s.fused_passes.enable = fused
        dm = to_static(m2, None, loss_fn, torch.optim.AdamW(m2.parameters(), lr=1e-3), s)
        rows.append((name, *timed(lambda: dm(x, y), a.steps)))
    base = rows[0][2]
    print(f"MLP {a.layers} x {a.hidden}, batch {a.batch}, AdamW, 1 thread, median of {a.steps} steps")
    print(f"{'':20} {'warm-up s':>12} {'step ms':>8} {'vs torch':>8}")
    for name, first, t in rows:
        print(f"{name:20} {first:>12.2f} {t * 1e3:>8.2f} {t / base:>8.2f}")


if __name__ == "__main__":
    main()
