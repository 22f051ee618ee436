"""Explorer redraw time (8 to 65,536 ranks, 1-D to 4-D meshes, peak memory) and live view update rate."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

from matplotlib.patches import Rectangle

from meshviz.widgets import Explorer, PipelineView, synthetic_schedule
from meshviz.widgets.base import fig_png, new_figure

MESHES = {8: (2, 4), 64: (8, 8), 1024: (32, 32)}
SCALE = [(4096, (4096,)), (4096, (64, 64)), (4096, (16, 16, 16)), (4096, (8, 8, 8, 8)),
         (16384, (16384,)), (16384, (128, 128)), (16384, (32, 32, 16)), (16384, (16, 16, 8, 8)),
         (65536, (65536,)), (65536, (256, 256)), (65536, (64, 32, 32)), (65536, (16, 16, 16, 16))]


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


def _scale_params(shape, tensor=None):
    nd = len(shape)
    src = ["S(0)", "S(1)"][:nd] + ["R"] * (nd - 2) if nd > 1 else ["S(1)"]
    dst = ["R", "S(0)"][:nd] + ["R"] * (nd - 2) if nd > 1 else ["S(0)"]
    if tensor is not None:  # one tensor dim per mesh axis: a block per rank
        src = [f"S({i})" for i in range(nd)]
    return dict(mesh_shape=",".join(map(str, shape)), ids="reversed", dim_names=",".join("abcd"[:nd]),
                shape=tensor or "64,64", src=", ".join(src), dst=", ".join(dst))


def _one(spec: str, repeat: int) -> dict:
    """One mesh in this process: a redraw ``repeat`` times (the first after a warm-up), the peak resident memory."""
    shape, tensor = json.loads(spec)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ex = Explorer(**_scale_params(shape, tensor))
    assert ex.error is None, ex.error
    ex.redraw()  # warm: fonts, colours made once per process
    times, cpu = [], []
    for _ in range(repeat):
        c0 = time.process_time()
        times.append(ex.redraw())
        cpu.append(time.process_time() - c0)  # the CPU it took: less of the machine's load in it than wall time
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(times=times, cpu=cpu, peak_mb=peak / 1024, grew_mb=(peak - base) / 1024)


def bench_scale(repeat: int):
    """Each mesh in a fresh process, so its peak memory is its own."""
    print(f"explorer redraw at scale (tensor 64x64 unless said, [S(0), S(1), R..] -> [R, S(0), R..], ids reversed;"
          f" {repeat} redraws after a warm-up, each mesh in its own process; load {os.getloadavg()[0]:.1f}):")
    print(f"{'ranks':>6} {'mesh':>16} {'tensor':>12} {'min s':>7} {'median s':>9} {'max s':>7} {'CPU s':>12} "
          f"{'peak RSS MB':>12} {'over import MB':>15}")
    rows = [(n, shape, None) for n, shape in SCALE] + [(65536, (16, 16, 16, 16), "64,64,64,64")]
    for n, shape, tensor in rows:
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps([shape, tensor]), "--repeat",
                              str(repeat)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        t, c = r["times"], r["cpu"]
        print(f"{n:>6} {'x'.join(map(str, shape)):>16} {tensor or '64x64':>12} {min(t):>7.2f} "
              f"{statistics.median(t):>9.2f} {max(t):>7.2f} {f'{min(c):.2f}-{max(c):.2f}':>12} {r['peak_mb']:>12.0f} "
              f"{r['grew_mb']:>15.0f}")
    print(f"  (load after: {os.getloadavg()[0]:.1f})")


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
    ap.add_argument("--scale-repeat", type=int, default=3, help="redraws per mesh of 4,096 ranks and more")
    ap.add_argument("--skip", default="", help="parts to leave out: explorer,scale,live")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.repeat)))
        return
    skip = set(args.skip.split(","))
    if "explorer" not in skip:
        bench_explorer(args.repeat)
    if "scale" not in skip:
        bench_scale(args.scale_repeat)
    if "live" not in skip:
        bench_live(args.events, args.interval, args.rate)


if __name__ == "__main__":
    main()
