"""A plan step's headline bytes are the most any rank receives, counted from the blocks, and fast at 1,024 ranks."""

import random
import time

import numpy as np
import pytest

from meshviz.core import Partial, ProcessMesh, ReduceType, Replicate, Shard, plan_reshard
from meshviz.core.traffic import received, step_received
from meshviz.ranks.alike import Facts
from meshviz.trace import Event
from meshviz.trace.payloads import Compute, Mark, ReshardPlan

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked


# -- the dense truth, written here: nested ceil chunks (tail short or empty), each rank's elements as a set ----------


def _ceil_chunk(n, k, i):
    size = -(-n // k)
    start = min(i * size, n)
    return start, min(start + size, n)


def _elements(shape, mesh, placements, rank) -> set:
    """The flat indices of the global tensor that ``rank`` holds (Partial holds the whole block, as Replicate)."""
    coord = mesh.coordinate(rank)
    box = [(0, int(n)) for n in shape]
    for d in range(len(shape)):
        axes = sorted((p.co_shard_order, a) for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)
        for _, a in axes:
            lo, hi = box[d]
            s, e = _ceil_chunk(hi - lo, mesh.shape[a], coord[a])
            box[d] = (lo + s, lo + e)
    flat = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    return set(flat[tuple(slice(a, b) for a, b in box)].ravel().tolist())


def _ring_phase(n, k) -> int:
    """One phase of a ring over k ranks: every chunk of the ceil split but one arrives; the most is n - smallest."""
    return n - min(_ceil_chunk(n, k, i)[1] - _ceil_chunk(n, k, i)[0] for i in range(k))


def _brute(step, rank) -> int:
    """Elements ``rank`` receives in ``step``, from the blocks it and its line hold before and after."""
    if step.op == "send_recv":
        got = 0
        for j, (s, t) in enumerate(step.groups):
            if t == rank and s != rank:
                got += (int(np.prod([b - a for a, b in step.blocks[j]])) if step.blocks is not None else
                        len(_elements(step.shape, step.target_mesh, step.after, t)))
        return got
    if not step.mesh.contains(rank) or step.op in ("slice", "zero_fill"):
        return 0
    k = step.mesh.shape[step.axis]
    if k == 1:
        return 0
    before = _elements(step.shape, step.mesh, step.before, rank)
    after = _elements(step.shape, step.mesh, step.after, rank)
    if step.op in ("all_gather", "all_to_all"):  # blocks move whole: what the rank's block gains
        return len(after - before)
    if step.op == "all_reduce":
        return 2 * _ring_phase(len(before), k)
    if step.op == "reduce_scatter":  # k-1 pieces the size of the line's largest result chunk
        line = step.mesh.axis_group_of(rank, step.axis)
        return (k - 1) * max(len(_elements(step.shape, step.mesh, step.after, r)) for r in line)
    raise AssertionError(step.op)


def _check(plan, ranks):
    for step in plan.steps:
        truth = {r: _brute(step, r) * plan.itemsize for r in ranks}
        assert step.bytes == max(truth.values()), step
        assert {r: step_received(step, r, plan.itemsize) for r in ranks} == truth, step
    assert plan.total_bytes == sum(s.bytes for s in plan.steps)


# -- the audit's cases ------------------------------------------------------------------------------------------------


def test_uneven_all_to_all_shows_what_rank_0_receives():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    plan = plan_reshard((5, 6), mesh, ["S(0)", "S(1)"], mesh, ["S(0)", "S(0)"], itemsize=8)
    (step,) = plan.steps
    # rank 0 holds rows 0-2 x cols 0-2 and ends with rows 0-1 x cols 0-5: rows 0-1 x cols 3-5 arrive from rank 1
    assert _brute(step, 0) * 8 == 2 * 3 * 8
    assert step.bytes == 48 and plan.total_bytes == 48 and "48 B/rank" in plan.describe()
    _check(plan, range(4))


def test_all_gather_of_a_short_dim_on_32_by_32():
    mesh = ProcessMesh(np.arange(1024).reshape(32, 32).tolist(), ["x", "y"])
    plan = plan_reshard((7, 5), mesh, ["P(sum)", "S(1)"], mesh, ["R", "R"], itemsize=4)
    reduce, gather = plan.steps
    assert gather.op == "all_gather" and gather.bytes == 7 * 5 * 4  # a rank holding no column gets all of them
    # the all-reduce of at most 7 elements along 32 ranks: the ring moves no more than the tensor, twice
    assert reduce.op == "all_reduce" and reduce.bytes == 2 * 7 * 4
    assert plan.total_bytes == 56 + 140 and "140 B/rank" in plan.describe()
    _check(plan, [0, 1, 4, 5, 31, 32, 99, 1023])


@pytest.mark.parametrize("n, k, want", [(7, 32, 2 * 7), (5, 4, 2 * 5), (10, 4, 2 * 9), (12, 4, 2 * 9), (1, 2, 2)])
def test_ring_all_reduce_never_counts_more_than_the_tensor(n, k, want):
    assert 2 * _ring_phase(n, k) == want
    assert received("all_reduce", [(n, 4)], k, 0) == want * 4


def test_seeded_sweep_against_the_blocks():
    rng = random.Random(1234)
    seen = set()
    kinds = [lambda nd: Shard(rng.randrange(nd)), lambda nd: Shard(rng.randrange(nd), rng.randrange(3)),
             lambda nd: Replicate(),
             lambda nd: Partial(rng.choice([ReduceType.kRedSum, ReduceType.kRedMax]))]
    for _ in range(250):
        mesh_shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        ids = rng.sample(range(int(np.prod(mesh_shape)) + 2), int(np.prod(mesh_shape)))
        mesh = ProcessMesh(np.array(ids).reshape(mesh_shape))
        shape = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
        src = [rng.choice(kinds)(len(shape)) for _ in mesh_shape]
        dst = [rng.choice(kinds)(len(shape)) for _ in mesh_shape]
        if rng.random() < 0.25:  # between meshes, of the same shape or another
            other = ProcessMesh(np.array(ids).reshape(mesh_shape) + rng.randint(1, 3)) if rng.random() < 0.5 else \
                ProcessMesh(rng.sample(range(8), rng.randint(1, 4)))
            dst = [rng.choice(kinds)(len(shape)) for _ in other.shape]
            plan = plan_reshard(shape, mesh, src, other, dst, itemsize=rng.choice([1, 4]))
            _check(plan, sorted(set(ids) | set(other.process_ids)))
        else:
            plan = plan_reshard(shape, mesh, src, mesh, dst, itemsize=rng.choice([1, 4, 8]))
            _check(plan, ids)
        seen.update(plan.ops)
    assert seen >= {"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv"}


# -- speed at 1,024 ranks -----------------------------------------------------------------------------------------


def test_every_rank_of_a_long_uneven_line_in_a_blink():
    mesh = ProcessMesh(list(range(1024)), ["x"])
    plan = plan_reshard((1000, 8), mesh, ["S(0)"], mesh, ["R"], itemsize=4)
    t = time.perf_counter()
    got = [step_received(plan[0], r, 4) for r in range(1024)]
    assert time.perf_counter() - t < 1.0  # laid out once per line, not once per rank (was ~30 s)
    assert got == [(1000 - (r < 1000)) * 8 * 4 for r in range(1024)]  # a rank holding row r misses 999 rows
    assert plan[0].bytes == 1000 * 8 * 4


def test_deciding_which_ranks_are_alike_on_a_long_uneven_line():
    mesh = ProcessMesh(list(range(1024)), ["x"])
    event = Event(kind="reshard", rank=0, mesh=mesh.to_dict(), placements_before=["S(0)"], placements_after=["R"],
                  shape_before=[1000, 8], shape_after=[1000, 8], payload=ReshardPlan(ops=("all_gather",)))
    t = time.perf_counter()
    first, last = Facts(0, 1024, [event]), Facts(1023, 1024, [event])
    alike = first.alike(range(1024)), last.alike(range(1024))
    assert time.perf_counter() - t < 3.0
    assert alike == (list(range(1000)), list(range(1000, 1024)))  # one row each, or none


def test_a_pipeline_stage_is_the_rank_s_place_on_its_pipeline_line():
    topology = Event(kind="mark", rank=0, op="hybrid_topology",
                     mesh=ProcessMesh(shape=[2, 2], process_ids=range(4), dim_names=["data", "pipe"]).to_dict())

    def step(group, stage):
        return Event(kind="mark", rank=0, op="pipeline_step", group=group,
                     payload=Mark(schedule="1F1B", p=2, m=2, v=1, step=0, stage=stage))

    block = Event(kind="compute", rank=0, payload=Compute(stage=0, micro_batch=0, phase="F", chunk=0))
    # stage 0 of the pipeline [0, 1]: rank 2 sits at stage 0 of its own pipeline [2, 3]
    assert Facts(0, 4, [topology, step([0, 1], 0), block]).alike(range(4)) == [0, 2]
    assert Facts(1, 4, [topology, step([0, 1], 1)]).alike(range(4)) == [1, 3]
    # a stage that is not the rank's place in its pipeline, a group no mesh holds as a line, a block's stage with
    # no pipeline step naming its group: nothing shows another rank at the same stage
    for events in ([topology, step([1, 0], 0)], [step([0, 1], 0)], [topology, block]):
        assert Facts(0, 4, events).alike(range(4)) == [0], events
    assert Facts(0, 4, [topology, block]).alone == ["a compute event names pipeline stage 0"]


# -- a long row of ranks is drawn with every cell visible ---------------------------------------------------------


def _colours_seen(mesh, max_w):
    """How many of the mesh's ranks, each painted its own colour, show in the picture; and the picture's texts."""
    from matplotlib.text import Text

    from meshviz.widgets.draw import mesh_block

    r = np.arange(mesh.size)
    rgb = np.stack([r % 32 * 8, r // 32 % 32 * 8, np.full(mesh.size, 128)], -1) / 255  # exact bytes
    fig = mesh_block(mesh, rgb.reshape(tuple(mesh.shape) + (3,)), max_w=max_w).figure()
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].reshape(-1, 3)
    got = {tuple(c) for c in np.unique(img, axis=0).tolist()}
    want = {tuple(c) for c in (rgb * 255).round().astype(int).tolist()}
    return len(want & got), " ".join(t.get_text() for t in fig.findobj(Text))


@pytest.mark.parametrize("shape, max_w", [((1024,), 8.4), ((1, 1024), 8.4), ((1024,), 4.2)])
def test_a_row_of_1024_ranks_is_wrapped_with_every_cell_visible(shape, max_w):
    mesh = ProcessMesh(np.arange(1024).reshape(shape).tolist())
    seen, texts = _colours_seen(mesh, max_w)
    assert seen == 1024  # was 1: cells a third of a pixel wide
    assert "wrapped" in texts and " 64 " in f" {texts} "  # the picture says so; row starts label the rows
