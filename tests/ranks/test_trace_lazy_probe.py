"""A traced reshard's events made when they are read: the same records, field by field, as events made at the flush,
with the values and the user's line of the reshard's own time."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(300)

TIMES = ("seq", "start", "end", "plan_id")  # differ from run to run; checked for order below


def _issue(a, mesh, placements):
    import meshviz.distributed as dist

    return dist.reshard(a, mesh, placements), sys._getframe().f_lineno  # the line the events must name


def _run(eager: bool):
    """Every rank: a traced sequence of reshards (kept blocks, gathers, a sum, two steps, 128 values, other dtypes,
    a strided input, a bucket of all-reduces), the blocks changed in place afterwards; its events as dicts, the
    lines of the reshards, and the blocks' values right after each reshard."""
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.runtime.autograd import run_reshards

    dist.init_parallel_env()
    me = dist.get_rank()
    line = dist.ProcessMesh([0, 1], dim_names=["x"])
    grid = dist.ProcessMesh([[0], [1]], dim_names=["x", "one"])
    g = torch.Generator().manual_seed(7)
    dense = {
        "f32": torch.randn(4, 6, generator=g),
        "big": torch.randn(16, 8, generator=g),
        "i64": torch.arange(24).reshape(4, 6),
        "bool": torch.randn(4, 6, generator=g) > 0,
        "bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "f64": torch.randn(6, 4, generator=g, dtype=torch.float64),
    }
    cases = [
        ("f32", line, ["S0"], ["R"]), ("f32", line, ["P"], ["R"]), ("f32", line, ["S0"], ["S1"]),
        ("big", line, ["S0"], ["R"]), ("i64", line, ["S1"], ["R"]), ("bool", line, ["S0"], ["R"]),
        ("bf16", line, ["S0"], ["S1"]), ("f32", grid, ["S0", "R"], ["S0", "S1"]), ("f32", grid, ["P", "R"], ["R", "R"]),
        ("f64", line, ["S0"], ["R"]),
    ]

    def pl(names):
        return [dist.Partial() if n == "P" else dist.Replicate() if n == "R" else dist.Shard(int(n[1])) for n in names]

    ins = []
    for key, mesh, src, _ in cases:
        if "P" in src:
            a = dist.dtensor_from_local(dense[key] + 100 * me, mesh, pl(src))
        else:
            a = dist.shard_tensor(dense[key], mesh, pl(src))
        ins.append(a)
    strided = dist.dtensor_from_local(dense["f64"].t(), line, [dist.Partial()])  # a block that is not contiguous
    got, lines, values = [], [], []
    calls = []
    with trace.record() as rec:
        if eager:  # a sink that is not a MemorySink: every event is made at the flush
            trace.add_sink(calls.append)
        for a, (_key, mesh, _, dst) in zip(ins + [strided], cases + [("f64", line, ["P"], ["R"])]):
            out, at = _issue(a, mesh, pl(dst))
            lines.append(at)
            values.append((a._local.reshape(-1)[:64].tolist(), out._local.reshape(-1)[:64].tolist()))
            trace.emit(trace.Event(kind="mark", name=f"after {len(lines)}"))
            got.append(out)
        bucket = [dist.dtensor_from_local(torch.full((3,), float(me + i)), line, [dist.Partial()]) for i in range(3)]
        summed = run_reshards(bucket, [[dist.Replicate()]] * 3)
        for t in ins + got + [strided] + bucket:  # written in place afterwards: the events keep their time's values
            t._local.logical_not_() if t.dtype == torch.bool else t._local.add_(1)
        for t in got:
            t._local.data.mul_(-3) if t.dtype != torch.bool else None  # .data: a write no version counter sees
        events = [e.to_dict() for e in rec.events]
        if eager:
            trace.remove_sink(calls.append)
            assert [e.to_dict() for e in calls] == events
    return me, events, lines, values, [s._local.tolist() for s in summed]


def _normalized(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in TIMES} for e in events]


def test_events_read_later_are_the_events_made_at_the_flush():
    lazy = run_ranks(_run, 2, False, ranks="threads")
    eager = run_ranks(_run, 2, True, ranks="threads")
    here = os.path.basename(__file__)
    for (me, events, lines, values, summed), (me2, events2, lines2, values2, summed2) in zip(lazy, eager):
        assert me == me2 and lines == lines2 and values == values2 and summed == summed2
        assert _normalized(events) == _normalized(events2)
        assert summed == [[1.0] * 3, [3.0] * 3, [5.0] * 3]
        for evs in (events, events2):
            assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
            assert len({e["seq"] for e in evs}) == len(evs)
            assert all(e["end"] >= e["start"] for e in evs)
        by_plan: dict = {}  # per reshard, in order: its reshard event and its step events
        for e in events:
            if e["kind"] in ("reshard", "reshard_step"):
                by_plan.setdefault(e["plan_id"], []).append(e)
        reshard_events = list(by_plan.values())
        assert len(reshard_events) == len(lines) + 3
        tail = [e["kind"] for e in events[-6:]]  # the bucket's: its plans' events, then its steps' after the all-reduce
        assert tail == ["reshard"] * 3 + ["reshard_step"] * 3
        assert [e["name"] for e in events if e["kind"] == "mark"] == [f"after {k + 1}" for k in range(len(lines))]
        for k, (evs, at, (before, after)) in enumerate(zip(reshard_events, lines, values)):
            head, *steps = evs
            assert head["values"] == before, k  # the block going in, as it was then
            if not steps:  # along a mesh axis of one rank: no step, the block kept
                assert after == before, k
                continue
            assert steps[-1]["values"] == after, k  # the block the reshard made, as it was then
            for s in steps:
                assert s["payload"]["where"] == f"{here}:{at} in _issue()"
                assert s["payload"].get("module") is None and not s["payload"].get("backward")
        for k, evs in enumerate(reshard_events[len(lines):]):  # the bucket: one all-reduce each, summed values
            assert [e["kind"] for e in evs] == ["reshard", "reshard_step"]
            assert evs[0]["values"] == [float(me + k)] * 3 and evs[1]["values"] == [float(2 * k + 1)] * 3
        ids = [id(v) for v in events if v["values"] is not None]
        assert len(set(ids)) == len(ids)


def _long_cell():
    """A reshard from deep inside a long function: the events name its line."""
    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])  # a mesh of one rank would reshard with no step
    a = dist.shard_tensor(torch.arange(6.0).reshape(2, 3), mesh, [dist.Shard(0)])
    src = "def cell(dist, a, mesh, pl):\n    x = 0\n" + "".join(f"    x += {i}\n" for i in range(400)) + \
        "    return dist.reshard(a, mesh, pl)\n"
    scope: dict = {}
    exec(compile(src, "<rank cell 3>", "exec"), scope)
    with trace.record() as rec:
        for _ in range(3):
            scope["cell"](dist, a, mesh, [dist.Replicate()])
    return [e.payload.where for e in rec.of_kind("reshard_step")], [e.values for e in rec.of_kind("reshard_step")]


def test_a_reshard_deep_in_a_long_cell_names_its_line():
    for where, values in run_ranks(_long_cell, 2, ranks="threads"):
        assert where == ["line 403 of the cell in cell()"] * 3
        assert values == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 3


@pytest.mark.parametrize("t", [
    torch.arange(16.0).reshape(4, 4), torch.randn(100), torch.tensor(3.5), torch.ones(2, 3, dtype=torch.bool),
    torch.randn(4, 4).to(torch.bfloat16), torch.randn(5).half(), torch.arange(70), torch.arange(9, dtype=torch.int32),
    torch.arange(9, dtype=torch.int16), torch.arange(9, dtype=torch.int8), torch.arange(9, dtype=torch.uint8),
    torch.randn(3, 3, dtype=torch.float64), torch.tensor([1 + 2j]).conj().imag, torch.empty(0), torch.randn(0, 3),
    torch.randn(8, 8).t(), torch.randn(8, 8)[2:5], torch.randn(4, 4, requires_grad=True),
    torch.randn(3, 3, dtype=torch.complex64), torch.randn(2, 2, device="meta"), torch.nn.Parameter(torch.randn(2, 2)),
    torch.tensor([float("nan"), -0.0, float("inf")]),
], ids=lambda t: f"{type(t).__name__}{list(t.shape)}{t.dtype}{t.device.type}")
def test_a_snapshot_reads_back_as_the_values_read_then(t):
    from meshviz.runtime.reshard_events import _values, snapshot, values_of
    from meshviz.trace.state import TraceState

    want = values_of(t)
    dtype, what = snapshot(TraceState(), t)
    with torch.no_grad():
        t.data.add_(1) if t.numel() and not t.is_meta and t.dtype != torch.bool else None  # later writes change nothing
    got = _values(dtype, what)
    assert repr(got) == repr(want) and [type(v) for v in got or []] == [type(v) for v in want or []]
