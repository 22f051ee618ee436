"""ownership events: one shape from shard_optimizer and group_sharded_parallel, read back with trace.Ownership."""

import pytest
import torch
import torch.nn as nn

from meshviz.testing import run_ranks
from meshviz.trace import Event, Ownership, Share, from_json, to_json

# what Paddle's levels split over the group (ShardingStage1/2/3 are os/os_g/p_g_os)
PARTS = {"os": ["state"], "os_g": ["grad", "state"], "p_g_os": ["param", "grad", "state"]}


def test_ownership_record_round_trips_through_json_and_says_what_it_holds():
    own = Ownership("w", "os_g", ("grad", "state"), (4, 3), group=(2, 5), held=(6, 12),
                    ranges=((0, 6), (6, 12)), mode="slice", local_shape=(6,), nbytes=24)
    e = from_json(to_json(own.to_event()))
    assert e.kind == "ownership" and e.op == "os_g" and e.name == "w" and e.group == [2, 5]
    assert e.shape_after == [4, 3] and e.local_shape == [6] and e.bytes == 24
    assert e.payload == Share(sharded=("grad", "state"), numel=12, mode="slice", ranges=((0, 6), (6, 12)),
                              holds={"param": [0, 12], "grad": [6, 12], "state": [6, 12]})
    assert Ownership.from_event(e) == own
    layout = Ownership("b", "p_g_os", ("param", "grad", "state"), (6,), group=(0, 1), mesh={"shape": [2]},
                       placements=("S(0)",), tensor_id=7)
    assert layout.holds() is None
    assert Ownership.from_event(from_json(to_json(layout.to_event()))) == layout
    with pytest.raises(ValueError, match="sharded parts"):
        Ownership("w", "os", ("optimizer",), (2,))
    with pytest.raises(ValueError, match="not an ownership event"):
        Ownership.from_event(Event(kind="placed"))


def _both_apis():
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    out = {}
    for stage, cls in ((1, dist.ShardingStage1), (2, dist.ShardingStage2), (3, dist.ShardingStage3)):
        w = dist.shard_tensor(nn.Parameter(torch.ones(4, 3)), mesh, [dist.Replicate()])
        w.name = "w"
        with trace.record() as mem:
            dist.shard_optimizer(torch.optim.SGD([w], lr=0.1), cls("dp", mesh))
        out[f"stage{stage}"] = [e.to_dict() for e in mem.events if e.kind == "ownership"]
    for level in ("os", "os_g", "p_g_os"):
        torch.manual_seed(0)
        model = nn.Linear(5, 3)  # weight: 15 elements, bias: 3
        with trace.record() as mem:
            group_sharded_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1), level, segment_size=4)
        out[level] = [e.to_dict() for e in mem.events if e.kind == "ownership"]
    return out


@pytest.mark.timeout(120)
def test_shard_optimizer_and_group_sharding_emit_one_shape():
    res = run_ranks(_both_apis, 2, timeout=100)
    for rank, out in enumerate(res):
        for stage, level in ((1, "os"), (2, "os_g"), (3, "p_g_os")):
            (e,) = out[f"stage{stage}"]
            own = Ownership.from_event(Event.from_dict(e))
            assert (own.name, own.level, list(own.sharded), own.shape) == ("w", level, PARTS[level], (4, 3))
            assert own.group == (0, 1) and own.mesh["process_ids"] == [0, 1]
            assert own.placements == ("S(0)",) and own.held is None  # a dist-tensor layout, not a flat range
        for level in ("os", "os_g", "p_g_os"):
            evs = out[level]
            assert [e["name"] for e in evs] == ["weight", "bias"]
            for e in evs:
                own = Ownership.from_event(Event.from_dict(e))
                assert own.level == level and list(own.sharded) == PARTS[level] and own.group == (0, 1)
                lo, hi = own.held
                assert own.ranges[rank] == (lo, hi) and own.local_shape == (hi - lo,) and own.nbytes == 4 * (hi - lo)
                n = 15 if own.name == "weight" else 3
                assert own.shape == ((3, 5) if own.name == "weight" else (3,))
                for part in ("param", "grad", "state"):
                    assert e["payload"]["holds"][part] == ([lo, hi] if part in PARTS[level] else [0, n])
            weight = Ownership.from_event(Event.from_dict(evs[0]))
            if level == "p_g_os":  # FSDP2 splits dim 0: 3 rows of 5 over 2 ranks -> rows 0-1 and row 2
                assert weight.mode == "fsdp" and weight.ranges == ((0, 10), (10, 15))
            else:  # elementwise chunks of ceil(15 / 2)
                assert weight.mode == "slice" and weight.ranges == ((0, 8), (8, 15))
    # the same keys are filled in by both APIs
    filled = {k for k, v in res[0]["stage1"][0].items() if v is not None} - {"start", "seq", "rank", "end"}
    assert {"name", "op", "group", "shape_after", "payload", "kind"} <= filled
    assert {"name", "op", "group", "shape_after", "payload", "kind"} <= {
        k for k, v in res[0]["os"][0].items() if v is not None}
