"""The live stream in one process: single-event latency, and the cost of emitting with no receiver listening.

Run: .venv/bin/python bench/bench_trace.py [--events 200]
"""

from __future__ import annotations

import argparse
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


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=200)
    args = ap.parse_args()
    lat = single_event_latency(args.events)
    p50, p95 = lat[len(lat) // 2], lat[int(0.95 * (len(lat) - 1))]
    print(f"single-event latency, in-process stream: p50 {p50:.2f} ms, p95 {p95:.2f} ms, max {lat[-1]:.2f} ms "
          f"(aim: p95 under 50 ms{'' if p95 < 50 else ' -- MISSED'})")
    took = emit_without_receiver(20000)
    print(f"20000 events into a sink with no receiver: {took:.3f} s "
          f"(aim: under 2 s, never blocking{'' if took < 2 else ' -- MISSED'})")


if __name__ == "__main__":
    main()
