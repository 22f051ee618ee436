"""meshviz.Cluster against bare ipyparallel: time to ready, event latency, tracing overhead on a DDP step."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import meshviz


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# -- 1. time to ready ---------------------------------------------------------------------------------------------
def _init_by_hand(rank, world, port):
    import datetime
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return tdist.get_rank()


def bare_ready(n, **opts):
    import ipyparallel as ipp

    from meshviz.runtime.rendezvous import free_port

    t0 = time.perf_counter()
    c = ipp.Cluster(n=n, log_level=40, **opts)
    rc = c.start_and_connect_sync()
    rc.wait_for_engines(n, timeout=120, interactive=False)
    ids = sorted(rc.ids)
    port = free_port()
    ars = [rc[e].apply_async(_init_by_hand, r, n, port) for r, e in enumerate(ids)]
    assert [a.get(timeout=120) for a in ars] == list(range(n))
    took = time.perf_counter() - t0
    rc.close()
    c.stop_cluster_sync()
    return took


def meshviz_ready(n):
    t0 = time.perf_counter()
    c = meshviz.Cluster(n=n)
    took = time.perf_counter() - t0
    c.stop()
    return took


# -- 2. event latency ---------------------------------------------------------------------------------------------
LATENCY_CELL = """
import time
from meshviz import trace
from meshviz.trace import Event
for i in range({count}):
    trace.emit(Event(kind="mark", step=i))
    if {gap}:
        time.sleep({gap})
"""

PUBLISH_CELL = """
import time
from ipyparallel.datapub import publish_data
for i in range({count}):
    publish_data({{f"k{{i}}": time.time()}})
    time.sleep({gap})
"""


def stream_latency(cluster, count, gap):
    cluster.events.clear()
    start = len(cluster.events)
    cluster.execute(LATENCY_CELL.format(count=count, gap=gap))
    arr = cluster.events.arrivals[start:]
    evs = list(cluster.events)[start:]
    return [(a - e.end) * 1e3 for a, e in zip(arr, evs)]


def publish_latency(cluster, count, gap):
    ar = cluster.view.execute(PUBLISH_CELL.format(count=count, gap=gap), block=False)
    seen: dict = {}
    lat = []

    def poll():
        while not ar.done() or len(seen) < count * len(cluster.ranks):
            now = time.time()
            for i, d in enumerate(ar.data if isinstance(ar.data, list) else [ar.data]):
                for k, v in (d or {}).items():
                    if (i, k) not in seen:
                        seen[(i, k)] = now
                        lat.append((now - v) * 1e3)
            if ar.done() and time.time() - now > 1:
                break
            time.sleep(0.0005)

    t = threading.Thread(target=poll)
    t.start()
    ar.get(timeout=120)
    t.join(5)
    return lat


# -- 3. DDP step with tracing + streaming on vs off ---------------------------------------------------------------
DDP_SETUP = """
import time, torch, torch.nn as nn, torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP
from meshviz import trace
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
            bucket_cap_mb=1)

def traced_allreduce(state, bucket):
    # what a traced data-parallel wrapper does: one collective event per gradient bucket
    t = bucket.buffer()
    with trace.span("collective", op="all_reduce", bytes=t.numel() * t.element_size(),
                    group=list(range(tdist.get_world_size()))) as ev:
        fut = tdist.all_reduce(t.div_(tdist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])

model.register_comm_hook(None, traced_allreduce)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

def steps(n):
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        with trace.span("compute", name="train_step", step=i):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        out.append(time.perf_counter() - t0)
    return out
"""


def _steps(n):
    from IPython import get_ipython

    return get_ipython().user_ns["steps"](n)


def _emit_cost(count):
    import time

    from meshviz import trace
    from meshviz.trace import Event

    t0 = time.perf_counter()
    for i in range(count):
        if trace.active():
            trace.emit(Event(kind="collective", op="all_reduce", step=i, bytes=4096, group=[0, 1, 2, 3]))
    return (time.perf_counter() - t0) / count


def emit_cost(cluster, count):
    """Seconds per event on a rank, stream on; and with tracing off (the check alone)."""
    on = statistics.median(cluster.apply(_emit_cost, count))
    cluster.set_tracing(False)
    off = statistics.median(cluster.apply(_emit_cost, count))
    cluster.set_tracing(True)
    return on, off


def ddp_overhead(cluster, n_steps, rounds):
    cluster.execute(DDP_SETUP)
    cluster.apply(_steps, 5)  # warm up
    on, off = [], []
    for _ in range(rounds):
        for flag, acc in ((True, on), (False, off)):
            cluster.set_tracing(flag)
            per_rank = cluster.apply(_steps, n_steps)
            acc.extend(max(ts) for ts in zip(*per_rank))  # a step ends when the slowest rank is done
    cluster.set_tracing(True)
    return statistics.median(on), statistics.median(off)


# -- 4. how fast a failing rank stops the others ------------------------------------------------------------------
FAIL_CELL = """
import torch, torch.distributed as tdist
if tdist.get_rank() == 1:
    raise ValueError("rank one fails")
x = torch.ones(4)
tdist.all_reduce(x)
"""


def failure_stop(cluster, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            cluster.execute(FAIL_CELL)
        except meshviz.cluster.RankError as e:
            assert e.ranks == [1]
        out.append(time.perf_counter() - t0)
        cluster.execute("pass")  # re-creates the process group
    return out


STUCK_CELL = """
import torch, torch.distributed as tdist
t = torch.zeros(1)
tdist.recv(t, src=(tdist.get_rank() + 1) % tdist.get_world_size())  # every rank waits: deadlock
"""


def interrupt_stop(cluster, reps):
    """Seconds from ``cluster.interrupt()`` to every rank stuck in a recv having stopped."""
    out = []
    for _ in range(reps):
        ar = cluster.view.execute(STUCK_CELL, block=False)
        time.sleep(1.0)  # let every rank reach the recv
        t0 = time.perf_counter()
        cluster.interrupt()
        try:
            ar.get(timeout=60)
        except Exception:
            pass
        out.append(time.perf_counter() - t0)
        cluster.execute("pass")  # re-creates the process group
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-start", action="store_true", help="skip the time-to-ready comparison")
    args = ap.parse_args()
    n = args.n

    bare, bare0, ours = [], [], []
    for _ in range(0 if args.skip_start else args.reps):
        bare.append(bare_ready(n))
        bare0.append(bare_ready(n, delay=0))
        ours.append(meshviz_ready(n))
    if ours:
        m, b, b0 = statistics.median(ours), statistics.median(bare), statistics.median(bare0)
        print(f"time to ready, {n} ranks: ipyparallel + init by hand {b:.2f} s (with delay=0: {b0:.2f} s), "
              f"meshviz.Cluster {m:.2f} s, ratio {m / b:.2f} ({m / b0:.2f} against delay=0)"
              f"  (runs: {[round(x, 2) for x in bare]}, {[round(x, 2) for x in bare0]}, {[round(x, 2) for x in ours]})")

    with meshviz.Cluster(n=n) as cluster:
        for label, gap in (("spaced 5 ms", 0.005), ("burst", 0)):
            lat = stream_latency(cluster, args.events, gap)
            print(f"event latency, meshviz stream, {label}: p50 {_pct(lat, .5):.2f} ms, p95 {_pct(lat, .95):.2f} ms, "
                  f"max {max(lat):.2f} ms ({len(lat)} events)")
        lat = publish_latency(cluster, args.events, 0.005)
        if lat:
            print(f"event latency, ipyparallel publish_data, spaced 5 ms: p50 {_pct(lat, .5):.2f} ms, "
                  f"p95 {_pct(lat, .95):.2f} ms ({len(lat)} of {args.events * n} messages seen; it keeps only the "
                  f"latest value per key)")
        stop = failure_stop(cluster, args.reps)
        print(f"one rank raises while {n - 1} wait in all_reduce: all stopped and reported after "
              f"{statistics.median(stop):.2f} s (collective timeout {cluster.timeout:.0f} s)")
        stuck = interrupt_stop(cluster, args.reps)
        print(f"interrupt with {n} ranks stuck in recv: all stopped after {statistics.median(stuck):.2f} s "
              f"(collective timeout {cluster.timeout:.0f} s)")
        on_e, off_e = emit_cost(cluster, 5000)
        print(f"cost of one event on a rank: {on_e * 1e6:.1f} us streamed, {off_e * 1e6:.2f} us with tracing off")
        on, off = ddp_overhead(cluster, args.steps, args.rounds)
        print(f"DDP step (MLP 256-512-512-10, batch 64, {n} ranks): tracing + live stream on {on * 1e3:.2f} ms, "
              f"off {off * 1e3:.2f} ms, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
