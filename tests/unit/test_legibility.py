"""Every view over a sweep of meshes, tensors and pipelines: no two texts overlap, none leaves its figure, none is
smaller than 7 pt (9.3 px as shown), and the figure is as large as it is shown."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.core import ProcessMesh, plan_reshard
from meshviz.trace import CommTable, RankStatus, RollCall
from meshviz.trace.commtable import CommRow
from meshviz.whatif import GB, WhatIf
from meshviz.widgets import (
    CommView,
    MeshView,
    PipelineView,
    ReshardView,
    RollCallView,
    TensorView,
    WhatIfView,
    synthetic_schedule,
)
from meshviz.widgets.base import png_size
from meshviz.widgets.draw import tensor_block
from meshviz.widgets.sheet import DPI, collisions, index_ticks, text_boxes, text_width
from meshviz.widgets.style import TICK

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

LONG = ["data_parallel_replicas", "tensor_model_parallel"]


def _mesh(shape, names=None, ids=None):
    n = int(np.prod(shape))
    ids = np.arange(n) if ids is None else np.asarray(ids)
    return ProcessMesh(ids.reshape(shape), names or [f"{a}" for a in "xyzw"[: len(shape)]])


MESHES = {
    "1d_4": _mesh((4,)),
    "1d_64": _mesh((64,)),
    "2d_seed": ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"]),
    "2d_4x4_long_names": _mesh((4, 4), LONG),
    "2d_8x8": _mesh((8, 8)),
    "2d_1x16": _mesh((1, 16)),
    "2d_32x32_reversed": _mesh((32, 32), ids=np.arange(1024)[::-1]),
    "3d_2x2x2": _mesh((2, 2, 2), ["pp", "dp", "mp"]),
    "3d_4x4x4": _mesh((4, 4, 4), ["pp", "dp", "mp"]),
    "3d_8x8x8": _mesh((8, 8, 8), ["pp", "dp", "mp"]),
    "4d_2x2x2x3": _mesh((2, 2, 2, 3), ["pp", "sp", "dp", "mp"]),
}

# (case, shape, mesh, placements): tensor ranks 1-4, uneven and empty shards, Partial summands, long names
TENSORS = [
    ("r1_uneven", (10,), "1d_4", ["S(0)"]),
    ("r1_partial", (6,), "1d_4", ["P(sum)"]),
    ("r2_seed_s0s1", (4, 6), "2d_seed", ["S(0)", "S(1)"]),
    ("r2_seed_partial", (4, 6), "2d_seed", ["P(sum)", "S(1)"]),
    ("r2_max_partial", (4, 6), "2d_seed", ["S(1)", "P(max)"]),
    ("r2_uneven_empty", (5, 6), "1d_4", ["S(0)"]),
    ("r2_coshard", (16, 16), "2d_4x4_long_names", ["S(0)", "S(0)"]),
    ("r2_wide", (4, 1000), "2d_8x8", ["R", "S(1)"]),
    ("r2_tall", (1000, 3), "2d_8x8", ["S(0)", "R"]),
    ("r2_big_partial", (64, 64), "2d_32x32_reversed", ["P(sum)", "S(1)"]),
    ("r3", (2, 4, 4), "3d_2x2x2", ["S(0)", "R", "S(2)"]),
    ("r3_partial_444", (8, 6, 4), "3d_4x4x4", ["S(0)", "P(sum)", "S(1)"]),
    ("r4", (2, 2, 3, 4), "4d_2x2x2x3", ["S(0)", "S(1)", "R", "S(3)"]),
    ("r2_888", (16, 16), "3d_8x8x8", ["S(0)", "R", "S(1)"]),
    ("scalar", (), "1d_4", ["R"]),
]

RESHARDS = [
    ("p_to_r", (4, 6), "2d_seed", ["P(sum)", "S(1)"], ["R", "R"]),
    ("s_to_s", (4, 6), "2d_seed", ["S(0)", "S(1)"], ["S(1)", "S(0)"]),
    ("reduce_scatter", (4, 16), "2d_4x4_long_names", ["R", "P(sum)"], ["R", "S(1)"]),
    ("uneven", (5, 6), "1d_4", ["S(0)"], ["S(1)"]),
    ("r1", (10,), "1d_4", ["P(max)"], ["S(0)"]),
    ("big_32x32", (64, 64), "2d_32x32_reversed", ["P(sum)", "S(1)"], ["R", "S(0)"]),
    ("3d_444", (8, 6), "3d_4x4x4", ["S(0)", "P(sum)", "S(1)"], ["R", "R", "R"]),
    ("3d_888", (16, 16), "3d_8x8x8", ["S(0)", "R", "S(1)"], ["R", "R", "R"]),
    ("r4", (2, 2, 3, 4), "4d_2x2x2x3", ["S(0)", "S(1)", "R", "S(3)"], ["R", "R", "R", "R"]),
]
CROSS = [
    ("stage_2x2", (2, 4, 4), ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), ["S(0)", "R"],
     ProcessMesh([[4, 5], [6, 7]], ["x", "y"]), ["S(0)", "S(2)"]),
    ("stage_64", (8, 64), _mesh((8, 8)), ["S(0)", "S(1)"], _mesh((8, 8), ids=np.arange(64, 128)), ["S(0)", "S(1)"]),
    ("stage_444_reversed", (8, 6), _mesh((4, 4, 4), ["pp", "dp", "mp"]), ["S(0)", "R", "S(1)"],
     _mesh((4, 4, 4), ["pp", "dp", "mp"], ids=np.arange(64)[::-1]), ["S(0)", "S(1)", "R"]),
]

PIPELINES = [(p, m, s, v) for p, m, s, v in [
    (2, 4, "1F1B", 1), (4, 8, "1F1B", 1), (4, 8, "FThenB", 1), (4, 8, "VPP", 2), (8, 16, "1F1B", 1),
    (8, 16, "VPP", 2), (8, 8, "VPP", 4), (3, 12, "1F1B", 1)]]


def _views():
    for name, mesh in MESHES.items():
        yield f"MeshView/{name}", lambda mesh=mesh: MeshView(mesh)
    yield "MeshView/devices", lambda: MeshView(list(range(8)), devices=[f"cuda:{i}" for i in range(8)],
                                               within=[0, 1, 2, 3], title="cluster: 8 ranks")
    yield "MeshView/explorer_title", lambda: MeshView(MESHES["3d_4x4x4"], title="mesh [4, 4, 4] ['pp', 'dp', 'mp']")
    for case, shape, mesh, pl in TENSORS:
        size = int(np.prod(shape)) if shape else 1
        value = np.arange(size, dtype=float).reshape(shape) if size <= 4096 else None
        yield f"TensorView/{case}", lambda shape=shape, mesh=mesh, pl=pl, value=value: TensorView(
            shape, MESHES[mesh], pl, value=value, name="llama.layers.0.self_attn.q_proj.weight")
    for case, shape, mesh, src, dst in RESHARDS:
        yield f"ReshardView/{case}", lambda shape=shape, mesh=mesh, src=src, dst=dst: ReshardView(
            shape, MESHES[mesh], src, dst_placements=dst, name="llama.layers.0.mlp:output")
    for case, shape, m0, src, m1, dst in CROSS:
        yield f"ReshardView/{case}", lambda shape=shape, m0=m0, src=src, m1=m1, dst=dst: ReshardView(
            shape, m0, src, m1, dst)
    for p, m, s, v in PIPELINES:
        yield f"PipelineView/{s}_p{p}_m{m}_v{v}", lambda p=p, m=m, s=s, v=v: PipelineView(
            synthetic_schedule(p, m, s, v, comm=0.05), schedule=s)
    yield "PipelineView/schedule_clock_dp2_pp2", lambda: PipelineView(_pipelines(2, 4, 2), clock="schedule")
    yield "PipelineView/pp8_dp16_first_pipelines", lambda: PipelineView(_pipelines(8, 4, 16), schedule="1F1B")
    yield "CommView/llama", _comm_view
    yield "RollCallView/hang_4", lambda: RollCallView(_rollcall(4))
    yield "RollCallView/hang_16", lambda: RollCallView(_rollcall(16))
    yield "WhatIfView/8_over", lambda: WhatIfView(_what_if(8, (2, 2, 2)))
    yield "WhatIfView/1024_pp", lambda: WhatIfView(_what_if(1024, (64, 2, 8)), rank=9)
    yield "WhatIfView/1024_no_limit", lambda: WhatIfView(_what_if(1024, (128, 8), limit=None))


def _pipelines(p, m, dp):
    """``dp`` pipelines of ``p`` stages (rank ``d + dp * s`` at stage s of pipeline d)."""
    return [e for d in range(dp) for e in synthetic_schedule(p, m, ranks=[d + dp * s for s in range(p)])]


def _what_if(n, shape, limit=80 * GB):
    """A report made by hand: the later half of the ranks tighter, long module names, forward and backward."""
    from meshviz.trace import Collective, Event

    mesh = {"shape": list(shape), "process_ids": list(range(n)), "dim_names": ["dp", "pp", "mp"][-len(shape):]}
    events = [Event(kind="placed", rank=0, mesh=mesh, name="w")]
    for i in range(14):
        events.append(Event(kind="collective", rank=0, op="all_reduce", group=[0, 1], bytes=(i + 1) * 117 * 10**6,
                            payload=Collective(module=f"LlamaForCausalLM.llama.layers.{i}.self_attn.o_proj",
                                               backward=bool(i % 2))))
    per_rank = {r: dict(params=9 * GB, grads=9 * GB, optimizer=GB, activations=(33 + 40 * (r >= n // 2)) * GB,
                        peak=(42 + 48 * (r >= n // 2)) * GB, comm_bytes=45 * GB) for r in range(n)}
    return WhatIf(n, per_rank, events, {r: 0 for r in range(n)}, [0], limit=limit)


def _comm_view():
    rows = [CommRow(cell=c, module=m, backward=b, op=op, axis=ax, count=n, bytes=nb, seconds=0.001 * n, ranks=(0, 1))
            for c, (m, b, op, ax, n, nb) in enumerate([
                ("llama.layers.0.self_attn.o_proj", False, "all_reduce", "mp", 2, 4096),
                ("llama.layers.0.mlp.down_proj", True, "reduce_scatter", "mp", 4, 1 << 20),
                ("llama.embed_tokens", False, "all_gather", "dp", 1, 12),
                ("lm_head", True, "all_to_all", "mp", 12, 300_000)])]
    return CommView(CommTable(rows))


def _rollcall(n):
    out = []
    for r in range(n):
        if r == n - 1:
            out.append(RankStatus(rank=r, state="running"))
        else:
            out.append(RankStatus(rank=r, state="in_collective", op="all_reduce", seq=7, group=list(range(n)),
                                  waiting_s=12.5))
    return RollCall(out)


VIEWS = dict(_views())


def _figures(view):
    """Every picture a view shows: its storyboard and, for a reshard, each frame of its slider."""
    yield "", view.figure()
    if isinstance(view, ReshardView):
        for f in range(view.n_frames):
            yield f"frame {f}", view.frame_figure(f)


@pytest.mark.parametrize("name", list(VIEWS))
def test_no_text_collides_or_leaves_its_figure(name):
    view = VIEWS[name]()
    drawn = 0
    for label, fig in _figures(view):
        problems = collisions(fig)
        assert not problems, f"{name} {label}: " + "\n".join(problems[:8])
        drawn += 1
    assert drawn >= 1


def test_the_check_finds_overlaps_cuts_and_small_text():
    from meshviz.widgets.sheet import new_figure

    fig = new_figure(2, 1)
    fig.text(0.1, 0.5, "first label", fontsize=9)
    fig.text(0.15, 0.5, "second label", fontsize=9)
    fig.text(0.9, 0.1, "cut at the edge", fontsize=9)
    fig.text(0.1, 0.9, "tiny", fontsize=5, va="top")
    problems = collisions(fig)
    assert any(p.startswith("overlap: 'first label' and 'second label'") for p in problems), problems
    assert any("leaves the figure" in p and "cut at the edge" in p for p in problems), problems
    assert any(p.startswith("5.0 pt, below 7.0 pt: 'tiny'") for p in problems), problems
    assert len(problems) == 3
    boxes = text_boxes(fig)
    assert len(boxes) == 4 and boxes[0][1].height == pytest.approx(9 * DPI / 72 * 1.17, rel=0.2)


def test_tick_labels_are_thinned_not_squeezed():
    """16 columns in 1.2 inches get a label every 4th (was '0123456789101112...' run together); each label has
    its own room: the pitch is at least the widest label and a gap."""
    assert index_ticks(16, 4.0, TICK, True) == list(range(16))
    assert index_ticks(16, 1.2, TICK, True) == [0, 4, 8, 12]
    assert index_ticks(1024, 3.2, TICK, True) == list(range(0, 1024, 100))
    assert 1.2 / 16 * 4 >= text_width("15", TICK) + 0.06 > 1.2 / 16 * 2
    assert index_ticks(8, 0.35, TICK, False) == [0, 4]  # 8 rows in 35 px: two labels, not eight squeezed
    # notebook 12's embedding, [32, 16] split by columns: its panel alone, 16 columns in 1.1 inches
    halves = [((0, 32), (0, 8)), ((0, 32), (8, 16))]
    panel = tensor_block((32, 16), halves, [(1, 0, 0), (0, 0, 1)], labels=["0,2", "1,3"])
    fig = panel.figure()
    assert not collisions(fig)
    xt = [int(t.get_text()) for t, _ in text_boxes(fig) if t.get_va() == "top" and t.get_text().isdigit()]
    assert xt == [0, 4, 8, 12], xt


def test_pictures_are_their_shown_size():
    """The PNG a widget shows is the figure at 96 px per inch: a small mesh is small (about 3 x 2 inches), a 3-D
    mesh's facets wrap to the output area's width, a 32 x 32 mesh stays under it."""
    small = MeshView(MESHES["2d_seed"])
    w, h = png_size(small.png())
    fw, fh = small.figure().get_size_inches() * DPI
    assert abs(w - fw) <= 1 and abs(h - fh) <= 1
    assert 150 <= w <= 330 and 100 <= h <= 260, (w, h)
    for name in ("3d_8x8x8", "2d_32x32_reversed", "1d_64"):
        w, _ = png_size(MeshView(MESHES[name]).png())
        assert w <= 8.8 * DPI, (name, w)


def test_sweep_size():
    """The sweep covers every view kind, meshes 1-D to 4-D up to 32 x 32 and 8 x 8 x 8, tensor ranks 0-4."""
    kinds = {n.split("/")[0] for n in VIEWS}
    assert kinds == {"MeshView", "TensorView", "ReshardView", "PipelineView", "CommView", "RollCallView",
                     "WhatIfView"}
    assert len(VIEWS) >= 50
    assert {len(shape) for _, shape, _, _ in TENSORS} == {0, 1, 2, 3, 4}
    assert {m.ndim for m in MESHES.values()} == {1, 2, 3, 4}
    assert {p for p, _, _, _ in PIPELINES} >= {2, 4, 8} and any(v > 1 for *_, v in PIPELINES)
    assert plan_reshard((4,), MESHES["1d_4"], ["S(0)"], MESHES["1d_4"], ["R"]).ops == ["all_gather"]
