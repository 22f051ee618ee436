"""The what-if report and its view, from a report made by hand (no torch): per-rank numbers, the ranks over the
limit, the tightest ranks, the comm table per module, and the picture."""

import pytest

from meshviz.trace import Collective, Event, ReshardStep
from meshviz.whatif import GB, WhatIf, comm_bytes, fmt_size
from meshviz.widgets import WhatIfView, show

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

PNG = b"\x89PNG\r\n\x1a\n"
MESH = {"shape": [2, 2, 2], "process_ids": list(range(8)), "dim_names": ["dp", "pp", "mp"]}


def _events(rank):
    return [
        Event(kind="placed", rank=rank, mesh=MESH, name="w"),
        Event(kind="collective", rank=rank, op="all_reduce", group=[rank, rank ^ 4], bytes=3 * GB,
              payload=Collective(module="Llama.layers.0.mlp", backward=True)),
        Event(kind="reshard_step", rank=rank, op="all_gather", mesh=MESH, axis=2, group=[rank, rank ^ 1],
              bytes=2 * GB, payload=ReshardStep(module="Llama.layers.0.self_attn")),
        Event(kind="send", rank=rank, op="send", group=[rank, rank + 2], bytes=0),
    ]


def _report(limit=80 * GB):
    # stage 0 (ranks 0, 1, 4, 5) is tighter than stage 1; rank 0 stands for its stage, rank 2 for the other
    like = {r: 0 if (r // 2) % 2 == 0 else 2 for r in range(8)}
    held = {0: dict(params=20 * GB, grads=20 * GB, optimizer=15 * GB, activations=30 * GB, peak=85 * GB),
            2: dict(params=10 * GB, grads=10 * GB, optimizer=8 * GB, activations=20 * GB, peak=48 * GB)}
    events = _events(0) + _events(2)
    per_rank = {r: {**held[like[r]], "comm_bytes": comm_bytes(events, like[r])} for r in range(8)}
    return WhatIf(8, per_rank, events, like, [0, 2], limit=limit)


def test_the_report_reads_its_numbers():
    rep = _report()
    assert rep.per_rank[5]["comm_bytes"] == 5 * GB  # 3 + 2 + the send's 0: what rank 0's events received
    assert rep.over() == [0, 1, 4, 5] and not rep.fits() and rep.fits(90 * GB)
    assert rep.tightest(2) == [0, 1] and rep.peak() == 85 * GB
    assert rep.classes() == {0: [0, 1, 4, 5], 2: [2, 3, 6, 7]}
    assert repr(rep) == "WhatIf(8 ranks, 2 simulated, peak 85.00 GB (rank 0), 4 over 80 GB)"
    assert rep.mesh().shape == [2, 2, 2] and rep.mesh().dim_names == ["dp", "pp", "mp"]
    rows = {(r.module, r.op): r.bytes for r in rep.comm_table()}
    assert rows == {("Llama.layers.0.mlp", "all_reduce"): 3 * GB, ("Llama.layers.0.self_attn", "all_gather"): 2 * GB,
                    ("(top level)", "send"): 0}
    assert rep.table().splitlines()[1].split()[:3] == ["0", "20.00", "GB"]
    assert fmt_size(512) == "512 B" and fmt_size(1.5e9) == "1.50 GB"


def test_the_view_draws_the_mesh_by_peak_the_rank_and_the_modules():
    rep = _report()
    v = show(rep)
    assert isinstance(v, WhatIfView) and v.rank == 0 and v.over() == [0, 1, 4, 5]
    assert v.peaks().tolist() == [[[85 * GB] * 2, [48 * GB] * 2]] * 2
    assert v.png().startswith(PNG)
    assert repr(v) == "<WhatIfView 8 ranks, rank 0: peak 85.00 GB, 4 over 80 GB>"
    v.set_rank(3)
    v.set_limit(None)
    assert repr(v) == "<WhatIfView 8 ranks, rank 3: peak 48.00 GB>" and v.png().startswith(PNG)
    assert v._modules[0] == ("Llama.layers.0.mlp", "backward", 3 * GB)
    with pytest.raises(ValueError, match="no rank 9"):
        v.set_rank(9)


def test_a_world_without_a_mesh_is_one_row_of_ranks():
    rep = WhatIf(3, {r: dict(params=1, grads=1, optimizer=1, activations=1, peak=4, comm_bytes=0) for r in range(3)},
                 [], {r: 0 for r in range(3)}, [0], limit=None)
    assert rep.mesh().shape == [3] and rep.over() == [] and repr(rep).endswith("peak 4 B (rank 0))")
    assert WhatIfView(rep).png().startswith(PNG)


def test_a_pipelines_stage_meshes_make_the_picture_s_mesh():
    # no event names the whole mesh: the stages' meshes (one shape, no rank shared) stacked, first ranks first
    stage = [{"shape": [2, 2], "process_ids": ids, "dim_names": ["dp", "mp"]} for ids in ([4, 5, 6, 7], [0, 1, 2, 3])]
    events = [Event(kind="placed", rank=r, mesh=m, name="w") for r, m in ((4, stage[0]), (0, stage[1]))]
    rows = {r: dict(params=1, grads=1, optimizer=1, activations=1, peak=4 + r, comm_bytes=0) for r in range(8)}
    rep = WhatIf(8, rows, events, {r: r for r in range(8)}, list(range(8)))
    mesh = rep.mesh()
    assert mesh.shape == [2, 2, 2] and mesh.dim_names == ["mesh", "dp", "mp"] and mesh.rank_at((1, 0, 1)) == 5
    assert WhatIfView(rep).png().startswith(PNG)
    lone = WhatIf(8, rows, events[:1], {r: r for r in range(8)}, list(range(8)))
    assert lone.mesh().shape == [8]


def test_fleets_topology_is_drawn_without_its_axes_of_one_rank():
    # fleet's hybrid topology names six axes: data x pipe x sharding x sep x context x model, most of one rank
    names = ["data", "pipe", "sharding", "sep", "context", "model"]
    topology = {"shape": [4, 2, 1, 1, 1, 1], "process_ids": list(range(8)), "dim_names": names}
    rows = {r: dict(params=1, grads=1, optimizer=1, activations=1, peak=4 + r, comm_bytes=0) for r in range(8)}
    rep = WhatIf(8, rows, [Event(kind="mark", rank=0, op="hybrid_topology", mesh=topology)], {r: r for r in range(8)},
                 list(range(8)))
    mesh = rep.mesh()
    assert mesh.shape == [4, 2] and mesh.dim_names == ["data", "pipe"] and mesh.rank_at((3, 0)) == 6
    assert WhatIfView(rep).png().startswith(PNG)
    lone = {"shape": [1, 1, 8], "process_ids": list(range(8)), "dim_names": ["dp", "pp", "mp"]}
    assert WhatIf(8, rows, [Event(kind="placed", rank=0, mesh=lone)], {r: r for r in range(8)},
                  list(range(8))).mesh().to_dict() == {"shape": [8], "process_ids": list(range(8)), "dim_names": ["mp"]}
    two = {"shape": [1, 8], "process_ids": list(range(8)), "dim_names": ["pp", "mp"]}  # two axes: kept as they are
    assert WhatIf(8, rows, [Event(kind="placed", rank=0, mesh=two)], {r: r for r in range(8)},
                  list(range(8))).mesh().shape == [1, 8]


def test_what_ifs_mark_is_read_by_no_number_and_survives_json():
    """what_if's events begin with a mark (op 'what_if') telling views the ranks were simulated one after another:
    it carries no bytes and no mesh, so the report reads as without it; through JSON it is the same mark."""
    from meshviz.trace import Mark, from_json, to_json
    from meshviz.widgets.what_if_view import by_module

    plain = _report()
    mark = Event(kind="mark", op="what_if", rank=0, seq=-1, payload=Mark(fields={"nranks": 8, "simulated": [0, 2]}))
    marked = WhatIf(8, plain.per_rank, [mark] + plain.events, plain.like, [0, 2])
    assert [comm_bytes(marked.events, r) for r in (0, 2)] == [comm_bytes(plain.events, r) for r in (0, 2)]
    assert comm_bytes(marked.events, 0) == 5 * GB
    assert list(marked.comm_table()) == list(plain.comm_table())
    assert marked.mesh().to_dict() == plain.mesh().to_dict()
    assert by_module(marked.events) == by_module(plain.events)
    assert WhatIfView(marked).png() == WhatIfView(plain).png()
    back = from_json(to_json(mark))
    assert (back.kind, back.op, back.seq, back.payload) == ("mark", "what_if", -1, mark.payload)
