"""Explorer redraw time (8, 64, 1024 ranks) and live view update rate, beside the plain-matplotlib way."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from matplotlib.patches import Rectangle

from meshviz.widgets import Explorer, PipelineView, synthetic_schedule
from meshviz.widgets.base import fig_png, new_figure

MESHES = {8: (2, 4), 64: (8, 8), 1024: (32, 32)}


def naive_mesh_png(shape) -> bytes:
    """The obvious way: one Rectangle and one label per rank."""
    rows, cols = shape
    fig = new_figure(6, 6)
    ax = fig.add_subplot()
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=(0.74, 0.84, 0.95), edgecolor="white"))
            ax.text(j + 0.5, i + 0.5, str(i * cols + j), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    return fig_png(fig)


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def bench_explorer(repeat: int):
    print("explorer redraw (parse, plan, layout, mesh picture + first reshard frame as PNG):")
    print(f"{'ranks':>6} {'meshviz best/median s':>24} {'naive mesh only s':>18} {'ratio':>6}")
    for n, shape in MESHES.items():
        ex = Explorer(mesh_shape=f"{shape[0]},{shape[1]}", ids="reversed", dim_names="x,y", shape="64,64",
                      src="S(0), S(1)", dst="R, S(0)")
        b, med = best(ex.redraw, repeat)
        nb, _ = best(lambda: naive_mesh_png(shape), repeat)
        print(f"{n:>6} {b:>11.3f} / {med:<10.3f} {nb:>18.3f} {nb / b:>6.1f}x")


class _Source:
    def __init__(self):
        self.subs = []

    def subscribe(self, cb):
        self.subs.append(cb)

    def unsubscribe(self, cb):
        self.subs.remove(cb)


def bench_live(n_events: int, interval: float, rate: float):
    events = synthetic_schedule(8, n_events // 16 + 1, "1F1B")[:n_events]
    one = best(lambda: PipelineView(events).png(), 3)[0]
    print(f"live PipelineView (8 stage rows, {len(events)} compute/send/recv events; one full redraw "
          f"{one:.3f} s, so redrawing on every event caps at {1 / one:.1f} events/s):")
    for label, pace in (("burst", None), (f"paced {rate:,.0f}/s", rate)):
        src = _Source()
        view = PipelineView(source=src, interval=interval)
        _ = view.widget  # redraws go to the widget's image, as in a notebook
        t0 = time.perf_counter()

        def push():
            for i, e in enumerate(events):
                if pace and i % 50 == 0:
                    lag = t0 + i / pace - time.perf_counter()
                    if lag > 0:
                        time.sleep(lag)
                for cb in src.subs:
                    cb(e)

        th = threading.Thread(target=push)
        th.start()
        th.join()
        view.flush(120)
        t_drawn = time.perf_counter()
        lat = sorted(view._live.latencies) if view._live else []
        view.close()
        assert len(view.blocks) == sum(e.kind == "compute" for e in events)
        took = t_drawn - t0
        p95 = lat[int(0.95 * (len(lat) - 1))] if lat else float("nan")
        print(f"  {label:>12}: {len(events) / took:>9,.0f} events/s taken in, {view.redraws} redraws in {took:.2f} s "
              f"({view.redraws / took:.1f}/s), arrival-to-picture p95 {p95:.2f} s, "
              f"{len(events) / took * one:,.0f}x the redraw-per-event rate")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--interval", type=float, default=0.15)
    ap.add_argument("--rate", type=float, default=1000.0, help="events/s for the paced run")
    args = ap.parse_args()
    bench_explorer(args.repeat)
    bench_live(args.events, args.interval, args.rate)


if __name__ == "__main__":
    main()
