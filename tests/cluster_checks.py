"""Checks every Cluster rank backend must pass (engines and ranks as threads): one body, called by each test file."""

import time

import pytest

from meshviz.cluster import RankError

CELL_WAITS = """
import os, time, torch
import torch.distributed as tdist
from meshviz import trace
from meshviz.trace import Event
r = tdist.get_rank()
for i in range(3):
    trace.emit(Event(kind="mark", name=f"early{i}", values=[r, i]))
x = torch.tensor([float(r)])
with trace.span("collective", op="all_reduce", group=list(range(tdist.get_world_size())), bytes=4) as ev:
    tdist.all_reduce(x)
    ev.values = x.tolist()
deadline = time.time() + 20
while not os.path.exists(FLAG) and time.time() < deadline:
    time.sleep(0.02)
trace.emit(Event(kind="mark", name="late"))
"""

RESHARD_CELL = """
import torch
import meshviz.distributed as dist
mesh = dist.ProcessMesh([2, 0, 1], dim_names=["x"])
a = torch.arange(12.0).reshape(6, 2)
s0 = dist.shard_tensor(a, mesh, [dist.Shard(0)])
plan = [(st.op, st.axis, st.bytes) for st in dist.plan_of(s0, mesh, [dist.Replicate()]).steps]
r = dist.reshard(s0, mesh, [dist.Replicate()])
print(s0._local_value().tolist(), r._local_value().tolist() == a.tolist())
"""


def fails(cluster, code, **kw) -> RankError:
    """The RankError that running ``code`` on every rank raises."""
    with pytest.raises(RankError) as info:
        cluster.execute(code, **kw)
    return info.value


def events_arrive_while_the_cell_runs(cluster, n: int, tmp_path) -> None:
    flag = str(tmp_path / "go")
    cluster.events.clear()
    seen = []
    cb = cluster.subscribe(seen.append)
    try:
        ar = cluster.view.execute(CELL_WAITS.replace("FLAG", repr(flag)), block=False)
        t0 = time.time()
        while len([e for e in cluster.events if e.kind == "collective"]) < n and time.time() - t0 < 20:
            time.sleep(0.01)
        assert not ar.done(), "the cell should still be running"
        early = list(cluster.events)
        assert len(early) == 4 * n
        open(flag, "w").close()
        ar.get(timeout=30)
        cluster._sync_events(list(range(n)))
    finally:
        cluster.unsubscribe(cb)
    events = list(cluster.events)
    assert len(events) == 5 * n and seen[: len(events)] == events
    total = float(sum(range(n)))
    for r, evs in cluster.events.by_rank().items():
        assert [e.name for e in evs] == ["early0", "early1", "early2", None, "late"]  # per-rank order kept
        assert [e.seq for e in evs] == sorted(e.seq for e in evs)
        assert [e.values for e in evs[:3]] == [[r, i] for i in range(3)]
        coll = evs[3]
        assert coll.op == "all_reduce" and coll.values == [total] and coll.group == list(range(n))
        assert coll.end >= coll.start


def reshard_events_carry_the_planners_steps(cluster, n: int) -> None:
    """On 3 ranks: the rank at mesh coordinate c holds block c, and its events say what the planner planned."""
    cluster.events.clear()
    ar = cluster.execute(RESHARD_CELL)
    blocks = {2: [[0.0, 1.0], [2.0, 3.0]], 0: [[4.0, 5.0], [6.0, 7.0]], 1: [[8.0, 9.0], [10.0, 11.0]]}
    assert ar.stdout == [f"{blocks[r]} True\n" for r in range(n)]
    plans = cluster.view.pull("plan", block=True)
    assert plans[0] == plans[1] == plans[2] and [p[0] for p in plans[0]] == ["all_gather"]
    by = cluster.events.by_rank()
    assert sorted(by) == list(range(n))
    for r, evs in by.items():
        placed = [e for e in evs if e.kind == "placed"]
        assert placed and placed[0].values == [v for row in blocks[r] for v in row]
        steps = [e for e in evs if e.kind == "reshard_step"]
        assert [(e.op, e.axis, e.bytes) for e in steps] == [tuple(p) for p in plans[r]]
        assert steps[0].placements_before == ["S(0)"] and steps[0].placements_after == ["R"]
        assert steps[0].values == [float(v) for v in range(12)]


def rank_raising_mid_collective_stops_every_rank(cluster, n: int) -> RankError:
    """Rank 1 raises while the others enter an all-reduce: the error names rank 1, every rank ends in error, and the
    next cell's all-reduce works. Returns the error."""
    cell = ("import torch, torch.distributed as tdist\n"
            "if tdist.get_rank() == 1:\n"
            "    raise ValueError('rank one broke')\n"
            "x = torch.ones(2)\n"
            "tdist.all_reduce(x)\n")
    with pytest.raises(RankError) as info:
        cluster.execute(cell, timeout=25)  # below the 30 s collective timeout: a rank still waiting shows "running"
    err = info.value
    assert err.ranks == [1], str(err)
    assert "rank 1 raised ValueError: rank one broke" in str(err)
    assert "rank one broke" in "\n".join(err.render_traceback())
    by = {o.rank: o for o in err.outcomes}
    assert all(by[r].status == "error" for r in range(n)), str(err)
    ar = cluster.execute("x = torch.ones(1); tdist.all_reduce(x); print(x.item())")
    assert ar.stdout == [f"{float(n)}\n"] * n
    assert cluster.state == "ready"
    return err


def same_error_on_every_rank_keeps_the_process_group(cluster, n: int, settle: float = 0.0) -> None:
    """``settle``: seconds for late failure reports to arrive before the state is read."""
    cluster.execute("import torch, torch.distributed as tdist\ny = torch.ones(1); tdist.all_reduce(y)")
    with pytest.raises(RankError) as info:
        cluster.execute("undefined_name_xyz")
    assert "NameError" in str(info.value)
    time.sleep(settle)
    assert cluster.state == "ready"
    ar = cluster.execute("print(y.item())")  # no reset happened: the ranks' state is intact
    assert ar.stdout == [f"{float(n)}\n"] * n


def px_magic_names_the_rank(cluster):
    """On 3 ranks: a %%px cell that raises on rank 2 names it; the next cell runs. Returns the IPython shell."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    cluster.activate()
    res = shell.run_cell("%%px\nimport torch.distributed as tdist\n"
                         "if tdist.get_rank() == 2:\n    raise KeyError('two')\n")
    assert isinstance(res.error_in_exec, RankError)
    assert res.error_in_exec.ranks == [2]
    res = shell.run_cell("%%px\nz = tdist.get_rank() * 10\n")
    assert res.error_in_exec is None
    assert cluster.view.pull("z", block=True) == [0, 10, 20]
    return shell


PX_STAGGERED = ("%%px --stream\nimport time\nimport torch.distributed as tdist\nr = tdist.get_rank()\n"
                "time.sleep(0.3 * (tdist.get_world_size() - 1 - r))  # the last rank prints first\n"
                "print('rank', r, 'done')\n")


def px_output_in_rank_order(cluster, n: int) -> None:
    """%%px output comes rank by rank whatever order the ranks print in: at the end in a terminal, and in a
    notebook in one display updated while the cell runs, in rank order at every update."""
    import re

    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    cluster.activate()
    with capture_output() as cap:
        res = shell.run_cell(PX_STAGGERED)
    assert res.error_in_exec is None, res.error_in_exec
    assert re.findall(r"\[stdout:(\d+)\]", cap.stdout) == [str(r) for r in range(n)], cap.stdout
    assert [ln for ln in cap.stdout.splitlines() if ln.startswith("rank")] == [f"rank {r} done" for r in range(n)]
    shell.kernel = object()  # what a notebook's shell has: the output is shown live
    try:
        with capture_output() as cap:
            res = shell.run_cell(PX_STAGGERED)
    finally:
        del shell.kernel
    assert res.error_in_exec is None, res.error_in_exec
    texts = [o.data["text/plain"] for o in cap.outputs]
    assert len(texts) >= 2, texts  # shown while the ranks print, not only at the end
    for text in texts:
        seen = [int(r) for r in re.findall(r"\[stdout:(\d+)\]", text)]
        assert seen == sorted(seen), texts
    assert re.findall(r"rank (\d+) done", texts[-1]) == [str(r) for r in range(n)]
    assert cap.stdout == ""


def rollcall_shows_raw_waits(cluster, wait: float) -> None:
    """A raw ``tdist.all_reduce`` rank 0 waits in (a later cell of ranks 1 and 2 joins it), then a raw ``recv`` from
    rank 2: the roll-call shows each wait, with its culprits, until the peer comes; the values then arrive."""
    first = cluster.view.execute("x = torch.full((1,), 5.0)\nif r == 0:\n    tdist.all_reduce(x)\n", block=False)
    deadline = time.monotonic() + wait
    while (cluster.status()[0].waiting_s or 0) < 0.3:
        assert time.monotonic() < deadline and not first.ready()
        time.sleep(0.05)
    st = cluster.status()
    assert [s.state for s in st] == ["in_collective", "idle", "idle"] and st.culprits() == [1, 2]
    assert (st[0].op, st[0].group, st[0].where, st[0].shapes, st[0].dtypes) == (
        "all_reduce", (0, 1, 2), "line 3 of the cell", ((1,),), ("float32",))
    second = cluster.view.execute("tdist.all_reduce(x)", targets=[1, 2], block=False)
    first.get(timeout=wait)
    second.get(timeout=wait)
    assert cluster.view.pull("x.item()", block=True) == [15.0] * 3
    ar = cluster.view.execute("t = torch.zeros(1)\nif r == 0:\n    tdist.recv(t, src=2)\n", block=False)
    deadline = time.monotonic() + wait
    while cluster.status()[0].state != "in_collective":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    st = cluster.status()
    assert (st[0].op, st[0].group, st.culprits()) == ("recv", (0, 2), [2])
    cluster.view.execute("tdist.send(torch.full((1,), 7.0), dst=0)", targets=2, block=True)
    ar.get(timeout=wait)
    assert cluster.view.pull("t.item()", targets=0, block=True) == 7.0
