"""The byte model of every event: what a rank receives in each collective, and in each reshard step against the
blocks the ranks hold before and after the step (counted element by element)."""

import numpy as np
import pytest
from hypothesis import given, settings

from meshviz.core import Partial, ProcessMesh, Replicate, Shard, plan_reshard
from meshviz.core.layout import local_block
from meshviz.core.traffic import received, step_received
from tests.unit.test_core import layouts

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

F32 = 4


@pytest.mark.parametrize("op, sizes, k, me, root, want", [
    # a ring all-reduce: k-1 chunks of ceil(n / k) arrive twice (reduce-scatter, then all-gather)
    ("all_reduce", [(12, F32)], 4, 1, None, 2 * 3 * 3 * F32),
    ("all_reduce", [(3, F32)], 4, 3, None, 2 * 3 * 1 * F32),  # chunks of 1: the same on every rank
    ("all_reduce", [(3, F32)], 4, 0, None, 2 * 3 * 1 * F32),
    ("all_reduce", [(8, F32), (2, 8)], 2, 0, None, 2 * (4 * F32 + 1 * 8)),
    ("all_reduce", [(12, F32)], 1, 0, None, 0),
    ("all_gather", [(5, F32)], 4, 2, None, 3 * 5 * F32),  # the other three inputs
    ("reduce_scatter", [(12, F32)], 3, 0, None, 8 * F32),  # two chunks of 4
    ("reduce_scatter", [(3, F32), (3, F32), (3, F32)], 3, 1, None, 6 * F32),  # k pieces: one input of 9
    ("all_to_all", [(12, F32)], 4, 3, None, 9 * F32),
    ("alltoall", [(1, F32), (1, F32)], 2, 0, None, 1 * F32),
    ("broadcast", [(6, F32)], 4, 2, 2, 0),  # the root receives nothing
    ("broadcast", [(6, F32)], 4, 1, 2, 6 * F32),
    ("reduce", [(6, F32)], 4, 0, 0, 3 * 6 * F32),  # the root gets every other rank's tensor
    ("reduce", [(6, F32)], 4, 1, 0, 0),
    ("gather", [(2, F32)], 3, 2, 2, 2 * 2 * F32),
    ("scatter", [(2, F32)], 3, 1, 0, 2 * F32),
    ("scatter", [(2, F32)], 3, 0, 0, 0),
    ("recv", [(7, F32)], 2, 1, None, 7 * F32),
    ("send", [(7, F32)], 2, 0, None, 0),
    ("barrier", [(0, 1)], 4, 0, None, 0),
])
def test_what_a_rank_receives(op, sizes, k, me, root, want):
    assert received(op, sizes, k, me, root) == want


def _box(shape, mesh, placements, rank):
    coord = mesh.coordinate(rank)
    return local_block(shape, mesh, [Replicate() if isinstance(p, Partial) else p for p in placements], coord)


def _numel(box) -> int:
    return int(np.prod([b - a for a, b in box], dtype=np.int64)) if box else 1


def _common(a, b) -> int:
    return _numel([(max(x0, y0), max(max(x0, y0), min(x1, y1))) for (x0, x1), (y0, y1) in zip(a, b)])


def _truth(step, rank) -> int:
    """Elements ``rank`` receives in ``step``, counted from the blocks it holds before and after."""
    if step.op == "send_recv":
        got = 0
        for j, (s, t) in enumerate(step.groups):
            if t == rank and s != rank:
                box = step.blocks[j] if step.blocks is not None else _box(step.shape, step.target_mesh, step.after, t)
                got += _numel(box)
        return got
    if not step.mesh.contains(rank) or step.op in ("slice", "zero_fill") or step.mesh.shape[step.axis] == 1:
        return 0
    before = _box(step.shape, step.mesh, step.before, rank)
    after = _box(step.shape, step.mesh, step.after, rank)
    if step.op == "all_gather":
        return _numel(after) - _numel(before)
    if step.op == "reduce_scatter":  # its chunk of the line's sum: k - 1 pieces the size of the largest chunk
        k = step.mesh.shape[step.axis]
        line = step.mesh.axis_group_of(rank, step.axis)
        return (k - 1) * max(_numel(_box(step.shape, step.mesh, step.after, r)) for r in line)
    if step.op == "all_to_all":
        return _numel(after) - _common(before, after)
    raise AssertionError(step.op)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_reshard_steps_receive_what_the_blocks_gain(case):
    mesh, shape, src, dst = case
    plan = plan_reshard(shape, mesh, src, mesh, dst, itemsize=F32)
    for step in plan.steps:
        if step.op == "all_reduce":
            continue  # no block changes: the ring's count is checked above
        for r in mesh.process_ids:
            assert step_received(step, r, F32) == _truth(step, r) * F32, (step, r)


@settings(max_examples=100, deadline=None)
@given(layouts(max_mesh_dims=2), layouts(max_mesh_dims=2))
def test_transfers_between_meshes_receive_the_target_block(a, b):
    mesh, shape, src, _ = a
    other = ProcessMesh(np.array(b[0].process_ids).reshape(b[0].shape) + 3)
    dst = [Shard(0) if shape else Replicate()] + [Replicate()] * (other.ndim - 1)
    plan = plan_reshard(shape, mesh, src, other, dst, itemsize=F32)
    for step in (s for s in plan.steps if s.op == "send_recv"):
        for r in set(mesh.process_ids) | set(other.process_ids):
            assert step_received(step, r, F32) == _truth(step, r) * F32


def test_an_even_all_reduce_step_receives_what_the_planner_counts():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    plan = plan_reshard((8, 4), mesh, [Partial(), Replicate()], mesh, [Replicate(), Replicate()], itemsize=F32)
    (step,) = plan.steps
    # an 8 x 4 block on a line of two: one chunk of half of it arrives twice
    assert [step_received(step, r, F32) for r in range(4)] == [2 * 8 * 4 * F32 // 2] * 4
