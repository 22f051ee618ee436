"""Widgets: pictures computed from the layout and the planner, static PNGs, live and replayed events."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, Replicate, Shard, layout, plan_reshard, simulate
from meshviz.trace import Event, ReshardPlan, to_json
from meshviz.widgets import (
    Explorer,
    MeshView,
    PipelineView,
    ReshardView,
    TensorView,
    bubble_formula,
    show,
    synthetic_schedule,
)
from meshviz.widgets.base import png_size
from meshviz.widgets.draw import block_image, mesh_panels

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

PNG = b"\x89PNG\r\n\x1a\n"
SEED = ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"])
MESH0 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
MESH1 = ProcessMesh([[4, 5], [6, 7]], ["x", "y"])

LAYOUTS = [
    ((4, 6), SEED, [Shard(0), Shard(1)]),
    ((4, 6), SEED, [Partial(), Shard(1)]),
    ((4, 6), SEED, [Shard(1), Partial("max")]),
    ((5, 6), ProcessMesh([0, 1, 2, 3], ["x"]), [Shard(0)]),  # uneven: 2,2,1,0
    ((4, 4), MESH0, [Shard(0), Shard(0)]),  # co-shard
    ((2, 4, 4), MESH0, [Shard(0), Shard(2)]),
    ((3,), SEED, [Replicate(), Shard(0)]),
]


@pytest.mark.parametrize("shape,mesh,placements", LAYOUTS)
def test_tensor_view_blocks_are_the_layouts(shape, mesh, placements):
    value = np.arange(1, np.prod(shape) + 1, dtype=float).reshape(shape)
    v = TensorView(shape, mesh, placements, value=value)
    lay = layout(shape, mesh, placements)
    assert v.blocks == {b: tuple(r) for b, r in lay.owners().items()}
    # each drawn cell is coloured by a block that contains it
    img, _, _ = block_image(shape, v.state.order)
    rows, cols = img.shape
    lead = shape[:-1]
    for i in range(rows):
        for j in range(cols):
            idx = np.unravel_index(i, lead) + (j,) if lead else (j,)
            k = img[i, j]
            assert k >= 0
            assert all(a <= x < b for x, (a, b) in zip(idx, v.state.order[k]))
    # the picture's value is the tensor (Partial summands reduced)
    np.testing.assert_array_equal(v.state.value(), value)
    assert v.png().startswith(PNG)


def test_partial_is_drawn_as_summands_not_replicate():
    value = np.arange(24, dtype=float).reshape(4, 6)
    v = TensorView((4, 6), SEED, [Partial(), Shard(1)], value=value)
    st = v.state
    assert st.reduce == "sum" and len(st.summands) == 2
    assert st.summand_ranks == [[2, 4, 5], [0, 1, 3]]  # coordinate 0 of axis x keeps the value
    np.testing.assert_array_equal(st.dense({2, 4, 5}), value)
    np.testing.assert_array_equal(st.dense({0, 1, 3}), np.zeros((4, 6)))
    assert {r for r, f in st.fills.items() if f == "zero"} == {0, 1, 3}
    assert "2 summands" in repr(v)
    rep = TensorView((4, 6), SEED, [Replicate(), Shard(1)], value=value)
    assert len(rep.summands) == 1 and rep.state.reduce is None


def test_uneven_and_empty_shards_are_reported():
    v = TensorView((5, 6), ProcessMesh([0, 1, 2, 3], ["x"]), [Shard(0)])
    assert v.state.empty == [3]
    assert v.blocks[((6 - 1, 5), (0, 6))] == (3,) or v.blocks[((5, 5), (0, 6))] == (3,)
    sizes = sorted(b[0][1] - b[0][0] for b in v.blocks)
    assert sizes == [0, 1, 2, 2]


CASES = [
    ((4, 6), SEED, ["P(sum)", "S(1)"], SEED, ["R", "R"]),  # P -> R
    ((4, 6), SEED, ["S(0)", "S(1)"], SEED, ["R", "R"]),  # S -> R
    ((6, 6), SEED, ["P(sum)", "R"], SEED, ["S(0)", "R"]),  # P -> S
    ((4, 6), SEED, ["S(0)", "S(1)"], SEED, ["S(1)", "S(0)"]),  # S(i) -> S(j)
    ((2, 4, 4), MESH0, ["S(0)", "R"], MESH1, ["S(0)", "S(2)"]),  # cross-mesh (seed 001, 4.4)
    ((4, 4), ProcessMesh([0, 1, 2, 3], ["x"]), ["R"], ProcessMesh([4, 5], ["x"]), ["S(0)"]),  # other shape
]


@pytest.mark.parametrize("shape,src_mesh,src,dst_mesh,dst", CASES)
def test_reshard_view_steps_are_the_planners(shape, src_mesh, src, dst_mesh, dst):
    v = ReshardView(shape, src_mesh, src, dst_mesh, dst)
    plan = plan_reshard(shape, src_mesh, src, dst_mesh, dst, 4)
    assert v.steps == list(plan.steps)
    assert len(v.states) == len(plan.steps) + 1
    for step, st in zip(plan.steps, v.states[1:]):
        assert st.placements == step.after
        assert st.mesh == (step.target_mesh if step.op == "send_recv" else step.mesh)
    value = np.arange(1, np.prod(shape) + 1, dtype=float).reshape(shape)
    final = simulate(plan, value)
    assert set(v.states[-1].locals) == set(final)
    for r, loc in final.items():
        np.testing.assert_array_equal(v.states[-1].locals[r], loc)
    np.testing.assert_array_equal(v.states[-1].value(), value)
    for f in range(v.n_frames):
        assert v.frame_png(f).startswith(PNG)
    assert v.png().startswith(PNG)


def test_reshard_repr_is_short_and_stable():
    v = ReshardView((4, 6), SEED, ["S(0)", "S(1)"], dst_placements=["R", "R"])
    assert repr(v) == "<ReshardView [S(0), S(1)] -> [R, R]: 2 steps>"
    assert [s.op for s in v.steps] == ["all_gather", "all_gather"]
    x = ReshardView((2, 4, 4), MESH0, ["S(0)", "R"], MESH1, ["S(0)", "S(2)"])
    assert repr(x) == "<ReshardView [S(0), R] -> [S(0), S(2)] mesh [2, 2] -> [2, 2]: 2 steps>"
    assert x.steps[-1].op == "send_recv" and x.steps[-1].groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_mesh_view_facets_greys_and_devices(tmp_path):
    m3 = ProcessMesh(np.arange(12).reshape(2, 2, 3), ["pp", "dp", "mp"])
    assert [p[0] for p in mesh_panels(m3)] == ["pp=0", "pp=1"]  # panels of dp x mp
    assert mesh_panels(m3)[1][2].tolist() == [[6, 7, 8], [9, 10, 11]]
    m4 = ProcessMesh(np.arange(24).reshape(2, 2, 2, 3), ["a", "b", "c", "d"])
    assert [p[0] for p in mesh_panels(m4)] == ["a=0, b=0", "a=0, b=1", "a=1, b=0", "a=1, b=1"]
    world = ProcessMesh(list(range(8)), ["world"])
    v = MeshView(world, within=ProcessMesh([0, 1, 2, 3], ["x"]), devices=[f"cuda:{i}" for i in range(8)])
    assert v.greyed == [4, 5, 6, 7]
    assert v.cells[5] == {"coord": (5,), "device": "cuda:5", "active": False}
    assert repr(v) == "<MeshView world=8: 8 ranks, 4 greyed>"
    assert repr(MeshView(SEED)) == "<MeshView x=2, y=3: 6 ranks>"
    path = v.save(tmp_path / "mesh.png")
    assert open(path, "rb").read().startswith(PNG)
    assert MeshView(m3).png().startswith(PNG)
    html = MeshView(SEED)._repr_html_()
    assert "data:image/png;base64," in html and "&lt;MeshView x=2, y=3: 6 ranks&gt;" in html


def test_big_mesh_draws():
    # how long it takes is bench/bench_widgets.py's to say (no test asserts a time)
    e = Explorer(mesh_shape="32,32", ids="reversed", dim_names="x,y", shape="64,64", src="S(0), S(1)",
                 dst="R, S(0)")
    assert e.error is None and e.plan.src_mesh.size == 1024
    assert [(s.op, s.axis) for s in e.plan.steps] == [("all_gather", 1), ("all_gather", 0), ("slice", 1)]
    e.redraw()
    assert e._repr_png_().startswith(PNG)


@pytest.mark.parametrize("schedule,v", [("FThenB", 1), ("1F1B", 1), ("VPP", 2)])
def test_pipeline_bubble_matches_formula_on_an_ideal_machine(schedule, v):
    pv = PipelineView.synthetic(stages=4, micro_batches=8, schedule=schedule, chunks=v)
    assert len(pv.blocks) == 2 * 4 * 8 * v
    assert pv.micro_batches == 8 and pv.chunks == v
    assert pv.bubble == pytest.approx(bubble_formula(4, 8, v))
    assert pv.formula == pytest.approx(3 / (8 * v + 3))
    # every stage-to-stage hop is one matched send/recv arrow
    assert len(pv.transfers) == 2 * 8 * (4 * v - 1)
    assert all(t["end"] >= t["start"] for t in pv.transfers)
    assert pv.png().startswith(PNG)


def test_pipeline_schedule_orders_respect_dependencies():
    evs = synthetic_schedule(3, 6, "1F1B", comm=0.25)
    done = {(e.payload.phase, e.payload.stage, e.payload.micro_batch): e for e in evs if e.kind == "compute"}
    for (ph, s, mb), e in done.items():
        if ph == "F" and s > 0:
            assert e.start >= done[("F", s - 1, mb)].end + 0.25 - 1e-9
        if ph == "B" and s < 2:
            assert e.start >= done[("B", s + 1, mb)].end + 0.25 - 1e-9
    pv = PipelineView(evs)
    assert pv.bubble > bubble_formula(3, 6)  # communication adds idle time
    with pytest.raises(ValueError):
        synthetic_schedule(3, 4, "VPP", chunks=2)


class FakeSource:
    """A Cluster-like source: calls subscribers from its own thread."""

    def __init__(self):
        self.subs = []
        self.events = []

    def subscribe(self, cb):
        self.subs.append(cb)
        return cb

    def unsubscribe(self, cb):
        self.subs.remove(cb)

    def push(self, events, delay=0.0):
        def run():
            for e in events:
                self.events.append(e)
                for cb in list(self.subs):
                    cb(e)
                if delay:
                    time.sleep(delay)
        t = threading.Thread(target=run)
        t.start()
        return t


def test_live_view_follows_a_source_thread_and_throttles():
    src = FakeSource()
    pv = PipelineView(source=src, interval=0.1)
    _ = pv.widget  # a live view redraws its widget's picture
    evs = synthetic_schedule(4, 16, "1F1B")
    t0 = time.monotonic()
    src.push(evs).join()
    assert pv.flush(10)
    elapsed = time.monotonic() - t0
    assert len(pv.blocks) == 2 * 4 * 16
    assert pv.bubble == pytest.approx(bubble_formula(4, 16))
    assert 1 <= pv.redraws <= elapsed / 0.1 + 2
    assert pv.redraws < len(evs) / 10
    pv.close()
    assert src.subs == []


def test_live_reshard_view_follows_steps():
    src = FakeSource()
    rv = ReshardView(source=src, interval=0.05)
    assert repr(rv) == "<ReshardView (waiting for a reshard)>"
    events = _reshard_events(SEED, (4, 6), ["P(sum)", "S(1)"], ["R", "R"])
    src.push(events[:1 + 6]).join()  # the reshard and step 0 on every rank
    assert rv.flush(5)
    assert rv.frame == 1 and rv.ran == {0}
    src.push(events[7:]).join()
    assert rv.flush(5)
    assert rv.frame == 2 and rv.ran == {0, 1} and not rv.mismatch
    assert repr(rv) == "<ReshardView [P(sum), S(1)] -> [R, R]: 2 steps, ran 2/2>"
    rv.close()


def _reshard_events(mesh, shape, src, dst, dst_mesh=None):
    """The events the runtime's run_plan emits, built from the planner's simulation (one process)."""
    dst_mesh = dst_mesh or mesh
    plan = plan_reshard(shape, mesh, src, dst_mesh, dst, 4)
    value = np.arange(1, np.prod(shape) + 1, dtype=float).reshape(shape)
    from meshviz.core.planner import apply_step, initial_locals

    locals_ = initial_locals(value, mesh, plan.src_placements)
    evs = [Event(kind="reshard", rank=0, plan_id=7, tensor_id=1, name="y", mesh=mesh.to_dict(),
                 placements_before=[repr(p) for p in plan.src_placements],
                 placements_after=[repr(p) for p in plan.dst_placements], shape_before=list(shape),
                 shape_after=list(shape), bytes=plan.total_bytes,
                 payload=ReshardPlan(target_mesh=dst_mesh.to_dict(), ops=tuple(plan.ops)))]
    for i, step in enumerate(plan.steps):
        locals_ = apply_step(step, locals_)
        for r in sorted(set(mesh.process_ids) | set(dst_mesh.process_ids)):
            part = step.group_of(r)
            if part is None:
                continue
            loc = locals_.get(r)
            evs.append(Event(kind="reshard_step", rank=r, op=step.op, plan_id=7, tensor_id=1, step=i,
                             mesh=step.mesh.to_dict(), axis=step.axis, bytes=step.bytes,
                             group=[list(p) for p in part] if step.op == "send_recv" else list(part),
                             placements_before=[repr(p) for p in step.before],
                             placements_after=[repr(p) for p in step.after],
                             local_shape=None if loc is None else list(loc.shape),
                             values=None if loc is None else loc.ravel().tolist()))
    return evs


def test_replay_from_jsonl(tmp_path):
    events = _reshard_events(MESH0, (2, 4, 4), ["S(0)", "R"], ["S(0)", "S(2)"], MESH1)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(to_json(e) + "\n" for e in events))
    rv = ReshardView(source=str(path))
    assert rv.steps == list(plan_reshard((2, 4, 4), MESH0, ["S(0)", "R"], MESH1, ["S(0)", "S(2)"]).steps)
    assert rv.ran == {0, 1} and rv.frame == 2
    value = np.arange(1, 33, dtype=float).reshape(2, 4, 4)
    np.testing.assert_array_equal(rv.states[-1].value(), value)
    # the cross-mesh transfer shows in the pipeline view as arrows 0->4, 1->5, 2->6, 3->7
    pv = PipelineView(str(path))
    assert sorted((t["src"], t["dst"]) for t in pv.transfers) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert all(t["how"] == "reshard" for t in pv.transfers)
    tv = TensorView(source=str(path))
    assert tv.state.mesh == MESH1 and tv.blocks == {b: tuple(r) for b, r in
                                                      layout((2, 4, 4), MESH1, ["S(0)", "S(2)"]).owners().items()}
    np.testing.assert_array_equal(tv.state.value(), value)
    assert isinstance(show(str(path)), ReshardView)


def test_explorer_controls_and_errors():
    e = Explorer()
    assert repr(e) == "<Explorer mesh [2, 3] x,y: [4, 6] [P(sum), S(1)] -> [R, R]: 2 steps, 96 B/rank>"
    assert e.plan.ops == ["all_reduce", "all_gather"]
    e.update(src="S(5), R")
    assert e.error is not None and "out of range" in e.error and repr(e).startswith("<Explorer error")
    e.update(src="S(0), S(1)", dst="S(1), S(0)")
    assert e.error is None and e.plan.ops == plan_reshard((4, 6), SEED, ["S(0)", "S(1)"], SEED,
                                                          ["S(1)", "S(0)"]).ops
    e.update(ids="1,2,3")
    assert "3 process ids" in e.error
    e.update(ids="", target_ids="reversed")
    assert e.error is None and e.plan.cross_mesh
    w = e.widget
    e._inputs["shape"].value = "8,8"
    assert e.plan.shape == (8, 8) and e.error is None
    assert w.children


def test_explorer_puts_every_bad_size_under_its_controls_and_draws_an_empty_tensor():
    e = Explorer()
    for bad, says in ((dict(shape="-4,6"), "tensor shape must be sizes of 0 or more"),
                      (dict(itemsize=0), "bytes per element must be 1 or more"),
                      (dict(itemsize=-4), "bytes per element must be 1 or more"),
                      (dict(dim_names="x"), "dim names: 1 (x) for a mesh of 2 axes")):
        e.update(**bad)
        assert e.error is not None and says in e.error, (bad, e.error)
        e.update(shape="4,6", itemsize=4, dim_names="x,y")
        assert e.error is None
    e.update(dim_names=["pp", "dp"])
    assert e.error is None and e.plan.src_mesh.dim_names == ["pp", "dp"]
    for shape in ("0,6", "4,0"):  # a 0-size tensor is drawn (an empty frame and a note), as the runtime runs it
        e.update(shape=shape)
        assert e.error is None and e.plan.total_bytes == 0, e.error
        assert e.redraw() > 0 and e.reshard_view.png().startswith(PNG) and e.widget.children
    with pytest.raises(ValueError, match="sizes are not negative"):
        plan_reshard((-4,), SEED, ["S(0)"], SEED, ["R"])
    assert TensorView((0, 6), SEED, ["S(0)", "S(1)"]).png().startswith(PNG)


def test_explorer_needs_no_torch_distributed():
    code = ("import sys, meshviz; e = meshviz.explore(mesh_shape='4,4', ids='', shape='8,8'); e.redraw(); "
            "assert e.error is None; print('torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_show_dispatch_and_display_bundle(monkeypatch):
    assert isinstance(show(SEED), MeshView)
    assert isinstance(show(layout((4, 6), SEED, ["S(0)", "R"])), TensorView)
    assert isinstance(show(plan_reshard((4, 6), SEED, ["S(0)", "R"], SEED, ["R", "R"])), ReshardView)
    assert isinstance(show(synthetic_schedule(2, 2)), PipelineView)
    shown = []
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    show(SEED)._ipython_display_()
    bundle = shown[0]
    assert bundle["text/plain"] == "<MeshView x=2, y=3: 6 ranks>"
    assert bundle["image/png"].startswith(PNG)
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_live_from_the_clusters_event_log():
    """The Cluster's client-side EventLog (subscribe/unsubscribe, iterable) works as a live source, backlog too."""
    from meshviz.trace.stream import EventLog

    log = EventLog()
    evs = synthetic_schedule(4, 8)
    log._extend(evs[:10], time.time())
    pv = PipelineView(source=log, interval=0.05)
    t = threading.Thread(target=lambda: log._extend(evs[10:], time.time()))
    t.start()
    t.join()
    assert pv.flush(10)
    assert len(pv.blocks) == 64 and pv.bubble == pytest.approx(bubble_formula(4, 8))
    pv.close()


def _rank_records(rank, plan_id, mesh, src, dst, member=True):
    plan = plan_reshard((4, 2), mesh, src, mesh, dst)
    out = [Event(kind="reshard", rank=rank, plan_id=plan_id, tensor_id=100 + rank, mesh=mesh.to_dict(),
                 placements_before=[repr(p) for p in plan.src_placements],
                 placements_after=[repr(p) for p in plan.dst_placements], shape_before=[4, 2], shape_after=[4, 2],
                 bytes=plan.total_bytes, payload=ReshardPlan(ops=tuple(plan.ops), target_mesh=mesh.to_dict()))]
    if member:
        out += [Event(kind="reshard_step", rank=rank, plan_id=plan_id, step=i, op=s.op, axis=s.axis)
                for i, s in enumerate(plan.steps)]
    return out


def test_live_reshard_view_never_steps_back_to_a_slower_ranks_older_reshard():
    """Ranks stream on their own: rank 2's record of reshard 1 may arrive after ranks 0 and 1 ran reshard 2.
    Tensor ids also differ between ranks; the plan id is what names a reshard on every rank."""
    mesh = ProcessMesh([0, 1], ["x"])
    arrivals = (_rank_records(0, 1, mesh, ["P(sum)"], ["R"]) + _rank_records(1, 1, mesh, ["P(sum)"], ["R"])
                + _rank_records(0, 2, mesh, ["S(0)"], ["R"]) + _rank_records(1, 2, mesh, ["S(0)"], ["R"])
                + _rank_records(2, 1, mesh, ["P(sum)"], ["R"], member=False)
                + _rank_records(2, 2, mesh, ["S(0)"], ["R"], member=False))
    view = ReshardView(source=arrivals)
    assert [s.op for s in view.steps] == ["all_gather"]
    assert view.ran == {0} and not view.mismatch


def test_reshard_view_of_real_partial_summands_marks_none_as_zeros():
    """A Partial the ranks computed (a row-parallel output) has a summand on every rank: a reshard that ran draws
    no rank as a zero fill."""
    mesh = ProcessMesh([0, 1], ["mp"])
    plan = plan_reshard((2,), mesh, ["P(sum)"], mesh, ["R"])
    events = [Event(kind="reshard", rank=r, plan_id=1, mesh=mesh.to_dict(), placements_before=["P(sum)"],
                    placements_after=["R"], shape_before=[2], shape_after=[2], bytes=plan.total_bytes,
                    local_shape=[2], values=v, payload=ReshardPlan(ops=tuple(plan.ops), target_mesh=mesh.to_dict()))
              for r, v in ((0, [1.0, 2.0]), (1, [3.0, 4.0]))]
    view = ReshardView(source=events)
    assert view.states[0].fills == {0: "value", 1: "value"}
    np.testing.assert_array_equal(view.states[0].value(), [4.0, 6.0])
    for e in events:  # a block too large for an event to carry its values: still no zero fill drawn
        e.values = None
    assert ReshardView(source=events).states[0].fills == {0: "value", 1: "value"}
    assert ReshardView((2,), mesh, ["P(sum)"], dst_placements=["R"]).states[0].fills[1] == "zero"  # made up: zeros


def test_reshard_view_heading_names_the_reshard_on_show():
    mesh = ProcessMesh([0, 1], ["x"])
    first = _rank_records(0, 1, mesh, ["P(sum)"], ["R"])
    first[0].name = "w:output"
    view = ReshardView(source=first + _rank_records(0, 2, mesh, ["S(0)"], ["R"]))
    assert view.name is None and "w:output" not in view._heading()  # the unnamed reshard after it is on show
    assert ReshardView(source=first).name == "w:output"


def test_a_widget_shows_its_picture_at_its_size_and_no_repr_line():
    """The picture is shown one image pixel per CSS pixel (never stretched to the output's width, never shrunk:
    a wider one scrolls in its box); under it the widget says only what went wrong, not its repr."""
    v = MeshView(SEED)
    box = v.widget.children[-2]
    image = box.children[0]
    w, h = png_size(image.value)
    assert (image.layout.width, image.layout.height, image.layout.max_width) == (f"{w}px", f"{h}px", "none")
    assert box.layout.overflow == "auto" and box.layout.max_width == "100%"
    assert w < 400 and v.widget.children[-1].value == ""  # a 2 x 3 mesh stays small; no '<MeshView ...>' line
    v._error = "ValueError: boom"
    v._refresh()
    assert "boom" in v.widget.children[-1].value and "MeshView" not in v.widget.children[-1].value
    rv = ReshardView((4, 6), SEED, ["S(0)", "S(1)"], dst_placements=["R", "R"])
    _ = rv.widget
    rv.show_frame(1)
    assert png_size(rv._image.value) == (int(rv._image.layout.width[:-2]), int(rv._image.layout.height[:-2]))
    assert "ReshardView" not in rv._status.value


def test_views_open_on_their_most_telling_frame():
    cross = ReshardView((2, 4, 4), MESH0, ["S(0)", "R"], MESH1, ["S(0)", "S(2)"])
    assert [s.op for s in cross.steps] == ["slice", "send_recv"] and cross.frame == 2  # the transfer
    one = ReshardView((4, 6), SEED, ["S(0)", "R"], dst_placements=["R", "R"])
    assert len(one.steps) == 1 and one.frame == 1
    many = ReshardView((4, 6), SEED, ["P(sum)", "S(1)"], dst_placements=["R", "R"])
    assert len(many.steps) == 2 and many.frame == 0  # the overview lists both


def test_a_live_view_keeps_the_last_reshard_that_moved_data():
    """A reshard with nothing to do (a loss already [R, R] made [R, R]) does not replace the picture."""
    mesh = ProcessMesh([0, 1], ["x"])
    events = _rank_records(0, 1, mesh, ["S(0)"], ["R"]) + _rank_records(0, 2, mesh, ["R"], ["R"])
    view = ReshardView(source=events)
    assert [s.op for s in view.steps] == ["all_gather"] and view.frame == 1 and view.ran == {0}
    alone = ReshardView(source=_rank_records(0, 2, mesh, ["R"], ["R"]))
    assert alone.steps == [] and alone.plan is not None  # a no-op alone is still shown


def test_plans_and_pictures_count_steps_from_one():
    plan = plan_reshard((4, 6), SEED, ["P(sum)", "S(1)"], SEED, ["R", "R"])
    lines = plan.describe().splitlines()
    assert lines[1].startswith("  1. all_reduce") and lines[2].startswith("  2. all_gather")
    from meshviz.widgets.reshard_view import step_caption, step_verb

    assert step_caption(plan.steps[0], 0, 2).startswith("step 1/2: all_reduce")
    rs = plan_reshard((4, 4), MESH0, ["R", "P(sum)"], MESH0, ["R", "S(1)"])
    assert step_verb(rs.steps[0]) == "reduce-scatter: each rank gets its chunk (dim 1) of the sum"  # sum == 0
    assert repr(TensorView((2, 3), ProcessMesh([0, 1], ["x"]), ["P(sum)"])).endswith("1 block, 2 summands>")


def test_explorer_greys_what_a_bad_input_left_and_keeps_its_controls_in_a_column():
    e = Explorer(mesh_shape="4,4,4", ids="", dim_names="pp,dp,mp", shape="8,6", src="S(0), P(sum), S(1)",
                 dst="R, R, R")
    w = e.widget
    controls, pictures = w.children[1].children
    assert controls.layout.width == "270px" and controls.layout.flex == "0 0 270px"  # never squeezed
    assert w.children[1].layout.flex_flow == "row wrap"  # the pictures go below when there is no room beside
    assert "meshviz-stale" not in pictures._dom_classes
    before = e._mesh_img.value
    e._inputs["mesh_shape"].value = "4,4,0"
    assert "must be positive" in e._err.value and "last input that worked" in e._err.value
    assert "meshviz-stale" in pictures._dom_classes and e._mesh_img.value == before
    e._inputs["mesh_shape"].value = "2,2,2"
    assert e.error is None and "meshviz-stale" not in pictures._dom_classes and e._err.value == ""
    assert png_size(e._mesh_img.value)[0] <= 5.4 * 96 + 20
