"""A traced reshard's events, field by field, against the planner's numpy simulation of the same reshards."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(300)

# (mesh ids, dim names, shape, source placements, target placements); "P" sources hold their block of x (a Partial
# axis counted as Replicate) + 100 * rank on each rank
CASES = {
    2: [
        ([0, 1], ["x"], (4, 6), ["S0"], ["R"]),
        ([0, 1], ["x"], (4, 6), ["P"], ["R"]),
        ([0, 1], ["x"], (4, 6), ["S0"], ["S1"]),
        ([0, 1], ["x"], (16, 8), ["S0"], ["R"]),  # 128 values gathered: the events carry the leading 64
        ([[0], [1]], ["x", "one"], (4, 6), ["S0", "R"], ["S0", "S1"]),  # an axis of one rank keeps the block
        ([[0], [1]], ["x", "one"], (4, 6), ["P", "R"], ["R", "R"]),
    ],
    4: [
        ([0, 1, 2, 3], ["x"], (5, 3), ["S0"], ["R"]),  # uneven: the last rank's block is empty
        ([0, 1, 2, 3], ["x"], (4, 8), ["P"], ["R"]),
        ([0, 1, 2, 3], ["x"], (4, 8), ["S0"], ["S1"]),
        ([[0, 1], [2, 3]], ["x", "y"], (4, 8), ["S0", "S1"], ["R", "R"]),
        ([[0, 1], [2, 3]], ["x", "y"], (4, 8), ["P", "S0"], ["R", "S1"]),
        ([[0, 1], [2, 3]], ["x", "y"], (4, 8), ["S0", "R"], ["R", "S0"]),
        ([[0, 1], [2, 3]], ["x", "y"], (4, 8), ["P", "P"], ["R", "R"]),
    ],
}


def _placements(names):
    from meshviz.core.placements import Partial, Replicate, Shard

    return [Partial() if n == "P" else Replicate() if n == "R" else Shard(int(n[1])) for n in names]


def _dense(shape):
    return np.arange(float(np.prod(shape)), dtype=np.float32).reshape(shape)


def _partial_blocks(x, mesh, names) -> dict:
    """rank -> the summand a Partial source holds there."""
    from meshviz.core.layout import local_block

    dense = _placements(["R" if n == "P" else n for n in names])
    out = {}
    for r in mesh.process_ids:
        blk = local_block(x.shape, mesh, dense, mesh.coordinate(r))
        out[r] = x[tuple(slice(a, b) for a, b in blk)] + 100 * r
    return out


def _recorded(cases, path):
    import torch

    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    me = dist.get_rank()
    sources = []
    for ids, names, shape, src, dst in cases:
        mesh = dist.ProcessMesh(ids, dim_names=names)
        if "P" in src:
            local = torch.from_numpy(_partial_blocks(_dense(shape), mesh, src)[me])
            sources.append((mesh, dist.dtensor_from_local(local, mesh, _placements(src)), dst))
        else:
            sources.append((mesh, dist.shard_tensor(torch.from_numpy(_dense(shape)), mesh, _placements(src)), dst))
    with trace.record(path) as rec:
        outs = []
        for mesh, a, dst in sources:
            outs.append((a, dist.reshard(a, mesh, _placements(dst))))
            trace.emit(trace.Event(kind="mark", name=f"after {len(outs)}"))  # behind the deferred events
        for a, out in outs:  # changed afterwards: the events keep the values of their time
            a._local.add_(1000)
            out._local.add_(1000)
        events = list(rec.events)
    return me, [e.to_dict() for e in events], [trace.to_json(e) for e in events]


def _expected(cases, me: int) -> list[dict]:
    """The events rank ``me`` must record, from the planner's plan and its numpy simulation of each step."""
    from meshviz.core.mesh import ProcessMesh
    from meshviz.core.planner import apply_step, initial_locals, plan_reshard
    from meshviz.core.traffic import step_received

    out = []
    for n, (ids, names, shape, src, dst) in enumerate(cases):
        mesh = ProcessMesh(ids, dim_names=names)
        plan = plan_reshard(shape, mesh, _placements(src), mesh, _placements(dst), itemsize=4)
        x = _dense(shape)
        if "P" in src:
            blocks = _partial_blocks(x, mesh, src)
        else:
            blocks = initial_locals(x, mesh, plan.src_placements)
        mine = blocks[me]
        out.append(dict(kind="reshard", plan=n, step=None, op=None, mesh=mesh.to_dict(), group=None,
                        placements_before=[repr(p) for p in plan.src_placements],
                        placements_after=[repr(p) for p in plan.dst_placements], bytes=plan.total_bytes,
                        local_shape=list(mine.shape), values=mine.reshape(-1)[:64].tolist()))
        for i, step in enumerate(plan.steps):
            blocks = apply_step(step, blocks)
            part = step.group_of(me)
            if part is None:
                continue
            mine = blocks[me]
            out.append(dict(kind="reshard_step", plan=n, step=i, op=step.op, mesh=step.mesh.to_dict(),
                            group=list(part), placements_before=[repr(p) for p in step.before],
                            placements_after=[repr(p) for p in step.after],
                            bytes=step_received(step, me, 4), local_shape=list(mine.shape),
                            values=mine.reshape(-1)[:64].tolist()))
        out.append(dict(kind="mark", name=f"after {n + 1}"))
    return out


def _dense_target(case, me: int):
    """This rank's block of the reshard's result, cut from the whole tensor."""
    from meshviz.core.layout import local_block
    from meshviz.core.mesh import ProcessMesh
    from meshviz.core.planner import assemble

    ids, names, shape, src, dst = case
    mesh = ProcessMesh(ids, dim_names=names)
    x = _dense(shape)
    if "P" in src:  # the whole tensor the summands stand for
        x = assemble(_partial_blocks(x, mesh, src), shape, mesh, _placements(src))
    blk = local_block(shape, mesh, _placements(dst), mesh.coordinate(me))
    return x[tuple(slice(a, b) for a, b in blk)]


@pytest.mark.parametrize("n", [2, 4])
def test_traced_reshards_record_the_planned_steps_with_the_simulated_values(n, tmp_path):
    from meshviz.trace import from_json, load_events

    cases = CASES[n]
    path = str(tmp_path / "ev-{rank}.jsonl")
    for me, events, lines in run_ranks(_recorded, n, cases, path, ranks="threads"):
        want = _expected(cases, me)
        assert [e["kind"] for e in events] == [w["kind"] for w in want]
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)  # sink order is emission order
        assert len({e["seq"] for e in events}) == len(events)
        plan_ids = {}
        for e, w in zip(events, want):
            assert e["rank"] == me
            if w["kind"] == "mark":
                assert e["name"] == w["name"]
                continue
            assert plan_ids.setdefault(w["plan"], e["plan_id"]) == e["plan_id"]
            got = {k: e[k] for k in w if k != "plan"}
            if w["kind"] == "reshard_step":
                got["step"], got["op"] = e["step"], e["op"]
            assert got == {k: v for k, v in w.items() if k != "plan"}, (me, w["plan"], w["step"])
            assert e["end"] >= e["start"]
        assert sorted(plan_ids.values()) == list(range(plan_ids[0], plan_ids[0] + len(cases)))
        # the simulation ends where the dense truth says: each rank's last event of a reshard holds its block
        for k, case in enumerate(cases):
            last = [w for w in want if w.get("plan") == k][-1]
            block = _dense_target(case, me)
            assert last["local_shape"] == list(block.shape) and last["values"] == block.reshape(-1)[:64].tolist()
        # replayed from JSON (memory and the JSONL file alike) the events are the same records
        assert [from_json(line).to_dict() for line in lines] == events
        assert [e.to_dict() for e in load_events(path.format(rank=me))] == sorted(
            events, key=lambda e: (e["start"], e["rank"], e["seq"]))
