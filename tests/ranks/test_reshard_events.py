"""A traced reshard's events on several ranks: values as they were, each run's events alike but their own."""

from __future__ import annotations

import pytest

from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(300)


def _recorded():
    import torch

    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    me = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    lines = dist.ProcessMesh([[0], [1]], dim_names=["x", "one"])  # axis "one": lines of one rank keep the block
    x = torch.arange(64.0).reshape(8, 8)
    a = dist.shard_tensor(x, mesh, [dist.Shard(0)])
    b = dist.shard_tensor(x, lines, [dist.Shard(0), dist.Replicate()])
    with trace.record() as rec:
        outs = [dist.reshard(a, mesh, [dist.Replicate()]) for _ in range(2)]
        kept = dist.reshard(b, lines, [dist.Shard(0), dist.Shard(1)])
        for o in outs + [kept]:
            o._local.add_(1000)  # changed afterwards: the events keep the values they had
        a._local.add_(1000)
    return me, [e.to_dict() for e in rec.events], [(id(e.values), id(e.local_shape)) for e in rec.events], \
        kept._local_value().tolist()


def test_events_hold_the_values_of_their_time_and_repeat_alike():
    for me, events, ids, block in run_ranks(_recorded, 2, ranks="threads"):
        first, second, kept = events[0:2], events[2:4], events[4:]
        assert [e["kind"] for e in events] == ["reshard", "reshard_step"] * 2 + ["reshard"]  # no step along "one"
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        assert first[0]["values"] == list(range(32 * me, 32 * me + 32))  # the block going in
        assert first[1]["values"] == [float(v) for v in range(64)]  # the block gathered
        for e1, e2 in zip(first, second):
            assert {k: v for k, v in e1.items() if k not in ("seq", "plan_id", "start", "end")} == \
                   {k: v for k, v in e2.items() if k not in ("seq", "plan_id", "start", "end")}
        assert second[0]["plan_id"] == first[0]["plan_id"] + 1 == second[1]["plan_id"]
        assert kept[0]["placements_after"] == ["S(0)", "S(1)"]
        assert kept[0]["values"] == list(range(32 * me, 32 * me + 32))
        assert block == [[1000.0 + v for v in range(8 * r, 8 * r + 8)] for r in range(4 * me, 4 * me + 4)]
        values = [i for i, _ in ids]
        assert len(set(values)) == len(values)  # each event its own list of values
