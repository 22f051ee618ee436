"""Placements typed as text, byte counts at unit boundaries, mesh axes of one rank, Partial rows within width."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, ReduceType, Replicate, Shard, parse_placement, plan_reshard
from meshviz.core.layout import dense_to_local, local_block
from meshviz.core.planner import assemble, initial_locals, simulate
from meshviz.widgets import ReshardView, TensorView
from meshviz.widgets.explorer import RESHARD_W, Explorer, plan_table
from meshviz.widgets.sheet import collisions
from meshviz.widgets.style import fmt_bytes, parse_placements
from meshviz.widgets.tensor_view import tensor_state, tensor_state_block

torch_free = pytest.mark.torch_free


def _mesh(shape, names=None):
    return ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape), names or list("abcdefghij"[: len(shape)]))


# -- 1. Partial without a reduce type ---------------------------------------------------------------------------


@torch_free
@pytest.mark.parametrize("text", ["P", "P()", "Partial", "Partial()", " P ", "Partial(reduce_type=kRedSum)"])
def test_partial_without_reduce_type_reads_as_sum(text):
    assert parse_placement(text) == Partial(ReduceType.kRedSum)
    assert parse_placements(f"[{text}, S(1)]") == [Partial(ReduceType.kRedSum), Shard(1)]
    assert parse_placement("P(max)") == Partial(ReduceType.kRedMax)
    assert parse_placement("Replicate") == Replicate()


@torch_free
@pytest.mark.parametrize("text", ["P(foo)", "Partial(foo)", "P(sum", "PP", "Q"])
def test_nonsense_placement_is_a_clear_error(text):
    with pytest.raises(ValueError, match=r"cannot read placement"):
        parse_placement(text)
    e = Explorer(mesh_shape="2", ids="", dim_names="x", shape="4", src=text, dst="R")
    assert e.error is not None and "cannot read placement" in e.error and e.plan is None


@torch_free
def test_explorer_takes_bare_partial():
    e = Explorer(mesh_shape="2,3", ids="[[2,4,5],[0,1,3]]", dim_names="x,y", shape="4,6", src="P, S(1)", dst="R, R")
    assert e.error is None
    want = plan_reshard([4, 6], _mesh([2, 3]), [Partial(), Shard(1)], None, [Replicate(), Replicate()])
    assert e.plan.src_placements == (Partial(ReduceType.kRedSum), Shard(1))
    assert e.plan.ops == want.ops == ["all_reduce", "all_gather"]
    assert [s.bytes for s in e.plan.steps] == [s.bytes for s in want.steps] == [32, 64]


# -- 2. byte counts at each unit boundary ------------------------------------------------------------------------


@torch_free
@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1023.4, "1023 B"), (1023.6, "1.0 KiB"),
                                     (1024, "1.0 KiB"), (1048524, "1023.9 KiB"), (1048525, "1.0 MiB"),
                                     (1048575, "1.0 MiB"), (2**30 - 1, "1.0 GiB"), (2**30 - 52429, "1023.9 MiB"),
                                     (2**40, "1024.0 GiB"), (-1048575, "-1.0 MiB")])
def test_byte_counts_never_round_up_to_1024_of_a_unit(n, text):
    assert fmt_bytes(n) == text
    step = plan_reshard([8], _mesh([2]), [Shard(0)], None, [Replicate()]).steps[0]
    assert step.describe().endswith(", 16 B/rank")
    if n >= 0:
        assert replace(step, bytes=n).describe().endswith(f", {text}/rank")


# -- 3. mesh axes of one rank ------------------------------------------------------------------------------------


@torch_free
@pytest.mark.parametrize("mshape, shape, src, dst", [
    ([1], [4], ["S(0)"], ["R"]),
    ([1], [4], ["P(avg)"], ["S(0)"]),
    ([1], [4], ["R"], ["P(sum)"]),
    ([1, 2], [4, 6], ["S(0)", "R"], ["R", "R"]),
    ([1, 2], [4, 6], ["R", "S(0)"], ["S(0)", "S(0)"]),  # was: all-gather 48 B, then two slices
    ([1, 2], [4, 6], ["P(max)", "P(sum)"], ["R", "P(sum)"]),  # was: all-reduce 96 B, all-reduce, fill
    ([2, 1], [4, 6], ["S(0)", "S(1)"], ["S(0)", "R"]),
])
def test_move_along_axes_of_one_rank_is_no_communication(mshape, shape, src, dst):
    mesh = _mesh(mshape)
    plan = plan_reshard(shape, mesh, src, None, dst)
    assert plan.steps == () and plan.total_bytes == 0
    assert "no communication" in plan.describe()
    value = np.random.default_rng(0).integers(1, 9, size=shape).astype(float)
    got = simulate(plan, value)
    for c in np.ndindex(*mesh.shape):  # each rank's block is the target's slice of the value
        blk = local_block(shape, mesh, plan.dst_placements, c)
        want = dense_to_local(value, mesh, plan.dst_placements, c)
        np.testing.assert_array_equal(got[mesh.rank_at(c)], want)
        assert want.shape == tuple(b - a for a, b in blk)
    e = Explorer(mesh_shape=",".join(map(str, mshape)), ids="", dim_names=",".join("ab"[: len(mshape)]),
                 shape=",".join(map(str, shape)), src=", ".join(src), dst=", ".join(dst))
    assert e.error is None and ": 0 steps, 0 B/rank>" in repr(e)
    assert "no communication" in plan_table(e.plan)
    e.redraw()


@torch_free
def test_axis_of_one_rank_does_not_break_an_all_to_all():
    mesh = _mesh([2, 1, 1])
    plan = plan_reshard([5, 5], mesh, ["S(1)", "R", "P(sum)"], None, ["S(0)", "S(0)", "P(sum)"])
    assert plan.ops == ["all_to_all"] and plan.total_bytes == 24  # was: all-gather 60 B, then a slice
    assert plan.steps[-1].after == plan.dst_placements
    value = np.arange(25.0).reshape(5, 5)
    got = simulate(plan, value)
    np.testing.assert_array_equal(got[0], value[:3])
    np.testing.assert_array_equal(got[1], value[3:])


def _random_placement(rng, ndim):
    c = rng.random()
    if c < 0.45:
        return Shard(rng.randrange(ndim), rng.choice([0, 0, 1]))
    if c < 0.7:
        return Replicate()
    return Partial(rng.choice(list(ReduceType)))


@torch_free
def test_plans_on_meshes_with_axes_of_one_rank():
    """Random layouts on meshes with axes of one rank (same mesh, another mesh of the same or another shape): no
    step runs along such an axis, each step starts where the last ended, the last ends at the target, every rank's
    final block is the target's and the value is the source's."""
    rng = random.Random(7)
    checked = 0
    for it in range(400):
        ms = [rng.choice([1, 1, 2, 3]) for _ in range(rng.randint(1, 3))]
        md = ms if rng.random() < 0.6 else [rng.choice([1, 2]) for _ in ms]
        if 1 not in ms + md:
            continue
        a = _mesh(ms)
        off = rng.choice([0, 0, 1, 5])
        b = ProcessMesh((np.arange(int(np.prod(md))) + off).reshape(md), list("abcdefghij"[: len(md)]))
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 2))]
        src = [_random_placement(rng, len(shape)) for _ in ms]
        dst = [_random_placement(rng, len(shape)) for _ in md]
        plan = plan_reshard(shape, a, src, b, dst)
        assert all(s.axis is None or s.mesh.shape[s.axis] > 1 for s in plan.steps), plan
        for s, t in zip(plan.steps, plan.steps[1:]):
            assert s.after == t.before or t.op == "send_recv" or s.op == "send_recv", plan
        if plan.steps and plan.steps[-1].mesh == b:
            assert plan.steps[-1].after == plan.dst_placements, plan
        value = np.random.RandomState(it).randint(1, 4, size=shape).astype(float)
        got = simulate(plan, value)
        start = assemble(initial_locals(value, a, plan.src_placements), shape, a, plan.src_placements)
        np.testing.assert_allclose(assemble(got, shape, b, plan.dst_placements), start, err_msg=repr(plan))
        for c in np.ndindex(*b.shape):
            blk = local_block(shape, b, plan.dst_placements, c)
            assert got[b.rank_at(c)].shape == tuple(hi - lo for lo, hi in blk), plan
        checked += 1
    assert checked > 200


# -- 4. a Partial row within its width ---------------------------------------------------------------------------


@torch_free
@pytest.mark.parametrize("mshape", [(4, 4, 64), (16, 64), (1024,), (4, 4), (8,), (2, 2, 256)])
def test_partial_row_stays_within_its_width(mshape):
    mesh = _mesh(mshape)
    src = ["P(sum)"] + ["R"] * (len(mshape) - 1)
    rv = ReshardView((4, 64), mesh, src, dst_placements=["R"] * len(mshape), max_width=RESHARD_W)
    for f in range(len(rv.steps) + 1):
        fig = rv.frame_figure(f)
        assert fig.get_size_inches()[0] <= RESHARD_W + 0.2 + 1e-6, (mshape, f)  # 0.1 in margins either side
        assert not collisions(fig), (mshape, f)
    st = tensor_state((4, 64), mesh, ["P(max)"] + ["P(sum)"] * (len(mshape) - 1))
    for max_w in (8.4, 10.0):
        row = tensor_state_block(st, max_w=max_w)
        assert row.w <= max_w + 1e-6, (mshape, max_w, row.w)
    fig = TensorView((4, 64), mesh, src).figure()
    assert fig.get_size_inches()[0] <= 10.0 + 0.2 + 1e-6 and not collisions(fig)


@torch_free
def test_partial_row_that_fits_is_unchanged():
    st = tensor_state((4, 6), ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"]), ["P(sum)", "S(1)"],
                      value=np.arange(24).reshape(4, 6))
    assert round(tensor_state_block(st, max_w=10.0).w, 2) == 6.89  # as it was drawn: it fits
    assert tensor_state_block(st, max_w=6.0).w <= 6.0


def _reshard_on_axes_of_one_rank():
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    me = dist.get_rank()
    x = torch.arange(30.0).reshape(5, 6)
    out = {}
    row = dist.ProcessMesh([[0, 1]], dim_names=["a", "b"])  # axis a of one rank
    t = dist.reshard(dist.shard_tensor(x, row, [dist.Replicate(), dist.Shard(0)]), row, [dist.Shard(0), dist.Shard(0)])
    out["row"] = (t._local_value().clone(), [repr(p) for p in t.placements])
    col = dist.ProcessMesh([[0], [1]], dim_names=["a", "b"])  # axis b of one rank
    t = dist.reshard(dist.shard_tensor(x, col, [dist.Shard(1), dist.Replicate()]), col, [dist.Shard(0), dist.Shard(0)])
    out["col"] = (t._local_value().clone(), [repr(p) for p in t.placements])
    summand = torch.full((2, 3), float(me + 1))
    t = dist.dtensor_from_local(summand, row, [dist.Partial(dist.ReduceType.kRedMax), dist.Partial()], shape=[2, 3])
    t = dist.reshard(t, row, [dist.Replicate(), dist.Partial()])
    out["partial"] = t._local_value().clone()
    out["full"] = dist.reshard(t, row, [dist.Replicate(), dist.Replicate()])._local_value().clone()
    return out


def test_runtime_reshards_along_axes_of_one_rank():
    import torch

    from meshviz.testing import run_ranks

    x = torch.arange(30.0).reshape(5, 6)
    res = run_ranks(_reshard_on_axes_of_one_rank, 2)
    for r, got in enumerate(res):
        rows = x[:3] if r == 0 else x[3:]
        torch.testing.assert_close(got["row"][0], rows)
        torch.testing.assert_close(got["col"][0], rows)
        torch.testing.assert_close(got["partial"], torch.full((2, 3), float(r + 1)))  # its own summand, kept
        torch.testing.assert_close(got["full"], torch.full((2, 3), 3.0))


# -- 7. split panels say their index once, in their title ------------------------------------------------------


@torch_free
def test_a_split_panel_has_no_y_axis_of_its_own():
    """16 x 64 in a tensor view: 16 one-row panels titled dp=0 ... dp=15 each read 'dp (16)' with the tick '0'
    beside them (panel dp=5 read as dp 0); now the title alone gives the row. Wrapped panels keep their labels."""
    from meshviz.widgets import MeshView
    from meshviz.widgets.sheet import text_boxes

    mesh = ProcessMesh(np.arange(1024).reshape(16, 64), ["dp", "mp"])
    fig = TensorView((16, 64), mesh, [Shard(0), Shard(1)]).figure()
    texts = [t for t, _ in text_boxes(fig)]
    titles = [t.get_text() for t in texts if t.get_text().startswith("dp=")]
    assert titles == [f"dp={i}" for i in range(16)]
    assert not [t.get_text() for t in texts if t.get_rotation() == 90 and t.get_text().startswith("dp")]
    y_ticks = [t.get_text() for t in texts if t.get_ha() == "right" and t.get_va() == "center"]
    assert y_ticks.count("0") == 1, y_ticks  # the tensor's own grid's first row, not one beside each panel
    assert not collisions(fig)
    wrapped = [t.get_text() for t, _ in text_boxes(MeshView(ProcessMesh(np.arange(1024).reshape(4, 256),
                                                                         ["dp", "mp"])).figure())]
    assert wrapped.count("dp=0") == 1 and wrapped.count("192") == 4  # each row's first index, beside each panel
