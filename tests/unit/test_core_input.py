"""What the core refuses by name (bad process ids, huge shapes), and a 256-rank reshard drawn small and legible."""

from __future__ import annotations

import numpy as np
import pytest

from meshviz.core import ProcessMesh, plan_reshard
from meshviz.core.layout import layout
from meshviz.core.placements import Partial, Replicate, Shard

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

# What Paddle 3.3.1 does with each (paddle.distributed.ProcessMesh): floats, strings, None, complex: AssertionError
# "All elements of the mesh must be integer"; a single value: ValueError "The mesh must be an instance of list or
# np.ndarray"; ragged rows: numpy's "inhomogeneous shape" ValueError; bools: accepted as the ids 1 and 0 (a mesh no
# one means), refused here.
ONE = "ProcessMesh: mesh must be a list of process ids (nested, one level per mesh axis), got the single value"
REFUSED = [
    ([0.0, 1.0], "process ids must be ints, got 0.0 (float) at mesh[0]"),
    ([[0, 1], [2, 3.0]], "process ids must be ints, got 3.0 (float) at mesh[1][1]"),
    (np.array([0.0, 1.0]), "process ids must be ints, got a float64 array (0.0 at mesh[0])"),
    (["0", "1"], "process ids must be ints, got '0' (str) at mesh[0]"),
    ([0, None], "process ids must be ints, got None (NoneType) at mesh[1]"),
    ([True, False], "process ids must be ints, got True (bool) at mesh[0]"),
    ([0, True], "process ids must be ints, got True (bool) at mesh[1]"),
    (np.array([True, False]), "process ids must be ints, got a bool array (True at mesh[0])"),
    (3, ONE + " 3; a mesh of one rank is ProcessMesh([3])"),
    (np.int64(3), ONE + " 3; a mesh of one rank is ProcessMesh([3])"),
    (np.array(3), ONE + " 3; a mesh of one rank is ProcessMesh([3])"),
    (2.0, ONE + " 2.0"),
    ("0,1", ONE + " '0,1'"),
    ([[0, 1], [2]], "ProcessMesh rows must all have the same length (a rectangular array of ids): mesh[0] = [0, 1] "
                    "has 2 entries, but mesh[1] = [2] has 1 entry"),
    ([[0, 1], [2, [3]]], "ProcessMesh rows must all have the same length (a rectangular array of ids): mesh[1][0] = 2 "
                         "is one id, but mesh[1][1] = [3] has 1 entry"),
    ([[[0, 1], [2, 3]], [[4, 5], [6, 7, 8]]], "ProcessMesh rows must all have the same length (a rectangular array of "
                                              "ids): mesh[1][0] = [4, 5] has 2 entries, but mesh[1][1] = [6, 7, 8] "
                                              "has 3 entries"),
    ([0, 0], "process ids must be distinct; repeated: [0]"),
    ([[3, 1], [-1, -2]], "process ids must be non-negative, got [-2, -1]"),
    ([0, 2**64], "process id 18446744073709551616 at mesh[1] is too large"),
    ([], "ProcessMesh needs a non-empty, rectangular array of ints, got []"),
]


@pytest.mark.parametrize("mesh, message", REFUSED, ids=[repr(m)[:30] for m, _ in REFUSED])
def test_a_bad_process_mesh_is_named(mesh, message):
    with pytest.raises(ValueError) as info:
        ProcessMesh(mesh)
    assert str(info.value) == message


def test_shape_and_process_ids_are_checked_alike():
    with pytest.raises(ValueError, match=r"^process ids must be ints, got 0.0 \(float\) at process_ids\[0\]$"):
        ProcessMesh(shape=[2], process_ids=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"^ProcessMesh: 2 process_ids do not fill the shape \[3\]$"):
        ProcessMesh(shape=[3], process_ids=[0, 1])
    with pytest.raises(ValueError, match=r"^ProcessMesh: process_ids must be a list of process ids, got 3$"):
        ProcessMesh(shape=[1], process_ids=3)
    with pytest.raises(ValueError, match=r"^ProcessMesh needs a shape of at least one axis, got \[\]$"):
        ProcessMesh(shape=[], process_ids=[3])  # Paddle refuses it too (its C++ mesh: size 0 != 1 id)


def test_good_process_meshes_keep_their_ids():
    seed = [[2, 4, 5], [0, 1, 3]]
    for given in (seed, tuple(map(tuple, seed)), np.array(seed, dtype=np.int32), np.array(seed, dtype=np.uint8),
                  np.array(seed, dtype=object), [[np.int64(v) for v in row] for row in seed]):
        m = ProcessMesh(given, ["x", "y"])
        assert m.shape == [2, 3] and m.process_ids == [2, 4, 5, 0, 1, 3] and m.mesh.dtype == np.int64
    m = ProcessMesh(shape=[2, 2], process_ids=range(4), dim_names=["a", "b"])
    assert m.mesh.tolist() == [[0, 1], [2, 3]]
    assert ProcessMesh([0, 5]).process_ids == [0, 5]  # ids need not be consecutive, as in Paddle
    assert ProcessMesh(m) == m and ProcessMesh(m).dim_names == ["a", "b"]
    assert ProcessMesh(np.arange(256).reshape(4, 4, 4, 4)).shape == [4, 4, 4, 4]


# -- tensors too large for 64-bit counts -------------------------------------------------------------------------

TOO_LARGE = "is too large: meshviz counts elements and bytes in 64-bit integers and takes shapes of fewer than 2**62"


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 4], [2**63], [2**64], [2**62], [2**64, 0]])
def test_a_shape_past_64_bit_counts_is_refused_by_name(shape):
    """[2**32, 2**32] and [2**62, 4] planned with negative byte counts (the block sizes multiplied in int64);
    [2**63] and more raised OverflowError ('Python int too large to convert to C long') from numpy."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    for src, dst in (([Shard(0), Replicate()], [Replicate(), Replicate()]),
                     ([Partial(), Shard(0)], [Shard(0), Replicate()])):
        with pytest.raises(ValueError) as info:
            plan_reshard(shape, mesh, src, mesh, dst)
        assert str(info.value).startswith(f"a tensor of shape {shape} (") and TOO_LARGE in str(info.value)
    with pytest.raises(ValueError, match="is too large"):
        layout(shape, mesh, [Shard(0), Replicate()])


def test_large_shapes_below_the_limit_count_exactly():
    """Counts in Python ints, against the byte model worked by hand: 2**60 rows of 2 on two ranks."""
    mesh = ProcessMesh([0, 1], ["x"])
    n = 2**60
    gather = plan_reshard([n, 2], mesh, [Shard(0)], mesh, [Replicate()], itemsize=4)
    assert gather.ops == ["all_gather"] and gather.steps[0].bytes == (n // 2) * 2 * 4  # the other half, whole
    reduce = plan_reshard([n, 2], mesh, [Partial()], mesh, [Replicate()], itemsize=8)
    assert reduce.ops == ["all_reduce"] and reduce.steps[0].bytes == 2 * (n * 2 // 2) * 8  # the ring: 2 (k-1) chunks
    largest = 2**62 - 1  # the largest shape taken: a ring all-reduce counts up to twice it, still under 2**63
    ring = plan_reshard([largest], mesh, [Partial()], mesh, [Replicate()], itemsize=2)
    assert ring.steps[0].bytes == 2 * (-(-largest // 2)) * 2
    assert layout([largest], mesh, [Shard(0)]).blocks() == {0: ((0, 2**61),), 1: ((2**61, largest),)}


# -- a reshard on a 4 x 4 x 4 x 4 mesh -----------------------------------------------------------------------------


def _ids_drawn(fig) -> list[str]:
    from meshviz.widgets.sheet import text_boxes

    return [t.get_text() for t, _ in text_boxes(fig)]


def test_a_reshard_on_256_ranks_is_a_small_picture_with_every_rank_legible():
    """[S(0), S(1), R, R] -> R on a 4 x 4 x 4 x 4 mesh: its storyboard was 4588 px tall and 491 kB, a step 3073 px
    and 332 kB (16 panels of 4 x 4 ranks in two columns, each with its own axes). The panels now share their axes in
    4 columns (the mesh's second axis) and the PNG has a palette of 256 colours."""
    from meshviz.widgets import ReshardView
    from meshviz.widgets.base import png_size
    from meshviz.widgets.sheet import DPI, collisions

    mesh = ProcessMesh(np.arange(256).reshape(4, 4, 4, 4), ["a", "b", "c", "d"])
    view = ReshardView((64, 64), mesh, ["S(0)", "S(1)", "R", "R"], dst_placements=["R", "R", "R", "R"])
    assert [s.op for s in view.steps] == ["all_gather", "all_gather"]
    board = view.png()
    w, h = png_size(board)
    assert w < 8.8 * DPI and h < 1800 and len(board) < 200_000, (w, h, len(board))
    step = view.frame_png(1)
    frame = view.frame_figure(1)
    assert png_size(step) == tuple(round(v) for v in frame.get_size_inches() * DPI)
    assert png_size(step)[1] < 1200 and len(step) < 200_000, (png_size(step), len(step))
    assert not collisions(frame)  # no two texts overlap, none below 7 pt, none cut
    texts = _ids_drawn(frame)
    assert all(texts.count(str(r)) >= 2 for r in range(16, 256)), "every rank's id, before and after the step"
