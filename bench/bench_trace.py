"""The live stream in one process: single-event latency, the cost of emitting with no receiver listening, and a
traced reshard against the same reshard untraced (issue 28's aim: at most 1.2x).

Run: .venv/bin/python bench/bench_trace.py [--events 200] [--reshard --ranks 1 2 --calls 300 --rounds 15]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from meshviz import trace
from meshviz.trace import Event
from meshviz.trace.stream import StreamReceiver, StreamSink


def single_event_latency(count: int, gap: float = 0.015) -> list[float]:
    """ms from an event's end to its arrival at the receiver, one event at a time."""
    rx = StreamReceiver()
    sink = StreamSink(rx.address)
    trace.add_sink(sink)
    lat = []
    try:
        for i in range(count):
            trace.emit(Event(kind="mark", rank=0, step=i))
            assert rx.log.wait_for(i + 1, timeout=5)
            lat.append((rx.log.arrivals[-1] - rx.log[-1].end) * 1e3)
            time.sleep(gap)
    finally:
        trace.remove_sink(sink)
        rx.close()
    return sorted(lat)


def emit_without_receiver(count: int) -> float:
    """Seconds to emit ``count`` events into a sink whose receiver is not there (it must drop, never block)."""
    from meshviz.runtime.world import free_port

    sink = StreamSink(f"tcp://127.0.0.1:{free_port()}", hwm=100)
    t0 = time.perf_counter()
    for i in range(count):
        sink(Event(kind="mark", rank=0, step=i))
    took = time.perf_counter() - t0
    sink.flush(2.0)
    sink.close()
    return took


RESHARDS = {"S(0)->R": ("S0", "R"), "P->R": ("P", "R"), "S(0)->S(1)": ("S0", "S1")}


def reshard_cost(calls: int, rounds: int) -> dict:
    """On every rank of the world: per reshard of ``RESHARDS`` (4x4 float32 on a 1-D mesh of the world), the
    median over rounds of (traced / untraced) of the calling thread's CPU time, and the medians of each in us, and
    of making a traced round's events when its recorder is read (after the round's time). A traced round runs
    under ``trace.record`` (its events kept, as a user's are) and its flush is inside its time;
    the two run alternately, round by round, so drifting load hits both alike, and each round's pair gives one
    ratio (the CPU time leaves out the peer's latency, which only adds the same to both)."""
    import torch
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    n = tdist.get_world_size()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])
    pl = {"S0": dist.Shard(0), "S1": dist.Shard(1), "R": dist.Replicate(), "P": dist.Partial()}
    out = {}
    for name, (src, dst) in RESHARDS.items():
        d = dist.shard_tensor(torch.arange(16.0).reshape(4, 4), mesh, [pl[src]])
        target = [pl[dst]]
        cpu: dict = {False: [], True: []}
        reads = []
        for traced in (False, True):  # warm-up: plans, groups, templates
            with trace.record() if traced else contextlib.nullcontext():
                for _ in range(20):
                    dist.reshard(d, mesh, target)
        for _ in range(rounds):
            for traced in (False, True):
                if n > 1:
                    tdist.barrier()
                with trace.record() if traced else contextlib.nullcontext() as rec:
                    c0 = time.thread_time()
                    for _ in range(calls):
                        dist.reshard(d, mesh, target)
                    trace.flush()
                    c1 = time.thread_time()
                    cpu[traced].append((c1 - c0) / calls * 1e6)
                    if traced:
                        assert len(rec.events) >= calls
                        reads.append((time.thread_time() - c1) / calls * 1e6)
        ratios = sorted(t / u for t, u in zip(cpu[True], cpu[False]))
        out[name] = (statistics.median(ratios), ratios[len(ratios) // 4], ratios[-(len(ratios) // 4) - 1],
                     statistics.median(cpu[True]), statistics.median(cpu[False]), statistics.median(reads))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--reshard", action="store_true", help="only the traced reshard against the untraced one")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="gloo processes, with --reshard")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if args.reshard:
        from meshviz.testing import run_ranks

        print("| ranks | reshard | traced / untraced CPU time, median (quartiles) | traced us | untraced us | "
              "events read, us a reshard |\n|---|---|---|---|---|---|")
        for n in args.ranks:
            res = run_ranks(reshard_cost, n, args.calls, args.rounds, timeout=1800, collective_timeout=600,
                            ranks="processes")[0]
            for name, (r, lo, hi, t, u, read) in res.items():
                print(f"| {n} | {name} | {r:.2f} ({lo:.2f}-{hi:.2f}) | {t:.1f} | {u:.1f} | {read:.1f} |")
        return
    lat = single_event_latency(args.events)
    p50, p95 = lat[len(lat) // 2], lat[int(0.95 * (len(lat) - 1))]
    print(f"single-event latency, in-process stream: p50 {p50:.2f} ms, p95 {p95:.2f} ms, max {lat[-1]:.2f} ms "
          f"(aim: p95 under 50 ms{'' if p95 < 50 else ' -- MISSED'})")
    took = emit_without_receiver(20000)
    print(f"20000 events into a sink with no receiver: {took:.3f} s "
          f"(aim: under 2 s, never blocking{'' if took < 2 else ' -- MISSED'})")


if __name__ == "__main__":
    main()
