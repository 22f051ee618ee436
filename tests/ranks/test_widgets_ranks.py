"""Widgets drawing what the runtime ran on 4 ranks (split from tests/unit/test_widgets.py)."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, Replicate, Shard, plan_reshard
from meshviz.trace import Event
from meshviz.widgets import PipelineView, ReshardView

PNG = b"\x89PNG\r\n\x1a\n"


def _traced_reshards():
    """On 4 ranks: a Partial on [[0,1],[2,3]] all-reduced, then a stage transfer from mesh [0,1] to mesh [2,3]."""
    import torch

    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    mesh = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    m0, m1 = ProcessMesh([0, 1], ["pp"]), ProcessMesh([2, 3], ["pp"])
    x = torch.arange(0, 240, 10, dtype=torch.float32).reshape(4, 6)  # not the 1..N a view makes up
    with trace.record() as rec:
        a = dist.shard_tensor(x, mesh, [Partial(), Shard(1)])
        dist.reshard(a, mesh, [Replicate(), Replicate()])
        b = dist.shard_tensor(x, m0, [Shard(0)])
        dist.reshard(b, m1, [Shard(0)])
    return [e.to_dict() for e in rec.events]


@pytest.mark.timeout(180)
def test_views_draw_what_the_runtime_ran():
    from meshviz.testing import run_ranks

    per_rank = run_ranks(_traced_reshards, 4, timeout=150)
    events = sorted((Event.from_dict(d) for evs in per_rank for d in evs), key=lambda e: (e.start, e.rank, e.seq))
    reshards = [e for e in events if e.kind == "reshard"]
    first, second = sorted({e.plan_id for e in reshards if e.rank == 0})[:2]
    mesh = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    rv = ReshardView(source=events, plan_id=first)
    assert rv.steps == list(plan_reshard((4, 6), mesh, ["P(sum)", "S(1)"], mesh, ["R", "R"]).steps)
    assert rv.ran == set(range(len(rv.steps))) and not rv.mismatch
    x = np.arange(0, 240, 10, dtype=float).reshape(4, 6)
    for r in range(4):  # the values the ranks reported after the last step are the full tensor
        np.testing.assert_array_equal(rv.states[-1].locals[r], x)
    # every frame shows the ranks' real numbers, the ones before the reshard and the ones in between too
    np.testing.assert_array_equal(rv.states[0].value(), x)
    np.testing.assert_array_equal(rv.states[1].locals[2], x[:, :3])
    m0, m1 = ProcessMesh([0, 1], ["pp"]), ProcessMesh([2, 3], ["pp"])
    xv = ReshardView(source=[e for e in events if e.kind != "reshard" or e.rank in (0, 1)], plan_id=second)
    assert xv.steps == list(plan_reshard((4, 6), m0, ["S(0)"], m1, ["S(0)"]).steps)
    np.testing.assert_array_equal(xv.states[-1].value(), x)
    pv = PipelineView(events)
    assert sorted((t["src"], t["dst"]) for t in pv.transfers if t["how"] == "reshard") == [(0, 2), (1, 3)]
    assert pv.png().startswith(PNG)
