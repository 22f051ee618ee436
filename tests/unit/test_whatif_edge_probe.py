"""The explorer's pure core and pictures at 1,024 ranks and odd sizes, against blocks and bytes worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.patches import Patch

from meshviz.core import ProcessMesh, Replicate, Shard
from meshviz.widgets import TensorView

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked


def _mesh(shape):
    return ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist())


def _ceil_chunk(n, k, i):
    """Paddle's split: chunks of ceil(n / k), the tail short or empty."""
    size = -(-n // k)
    start = min(i * size, n)
    return start, min(start + size, n)


def _hatched_cells(fig, mesh) -> tuple[int, set]:
    """(how many hatched artists, the ranks whose cells they cover): cell centres read off the artists' paths."""
    artists = [a for a in fig.findobj(Patch) if a.get_hatch()]
    ranks = set()
    for a in artists:
        path = a.get_path().transformed(a.get_patch_transform()) if hasattr(a, "get_patch_transform") else a.get_path()
        squares = path.vertices.reshape(-1, 5, 2) if len(path.vertices) % 5 == 0 else path.vertices[None, :4]
        for sq in squares:
            x, y = np.round(sq[:4].mean(0)).astype(int)
            ranks.add(int(mesh.ids[y, x]))
    return len(artists), ranks


def test_empty_blocks_of_1024_ranks_hatch_their_cells_in_one_artist():
    """7 rows co-sharded [S(0), S(0)] over 32x32: axis 0 gives rows 0-6 one row each, axis 1 then gives that row to
    column 0, so 1,017 ranks hold empty blocks. Their cells are hatched, all in one artist (one per cell took
    seconds per thousand cells to render: a 32x32 reshard's picture of a size-0 tensor drew for 12 s)."""
    mesh = _mesh((32, 32))
    nonempty = set()
    for c in np.ndindex(32, 32):
        lo, hi = _ceil_chunk(7, 32, c[0])
        a, b = _ceil_chunk(hi - lo, 32, c[1])
        if b > a:
            nonempty.add(int(mesh.ids[c]))
    assert nonempty == {32 * i for i in range(7)}
    view = TensorView((7,), mesh, [Shard(0), Shard(0)])
    n, ranks = _hatched_cells(view.figure(), mesh)
    assert ranks == set(range(1024)) - nonempty
    assert n == 1
    view.png()  # and it renders

    small = _mesh((8, 8))  # uneven both ways: 7 rows, 5 columns on 8 x 8 -> row 7 and columns 5-7 empty
    n, ranks = _hatched_cells(TensorView((7, 5), small, [Shard(0), Shard(1)]).figure(), small)
    assert ranks == {r for r in range(64) if r // 8 == 7 or r % 8 >= 5} and len(ranks) == 29
    assert n == 1
    n, ranks = _hatched_cells(TensorView((7, 5), small, [Replicate(), Replicate()]).figure(), small)
    assert (n, ranks) == (0, set())


def test_explorer_reads_placements_as_paddle_code_spells_them():
    """Placements pasted from Paddle code (``[dist.Shard(0), dist.Replicate()]``) plan as their short spelling;
    on 4 x 256 a [7, 1023] tensor [S(0), S(1)] -> [S(1), S(0)] moves what the blocks gain, worked out by hand."""
    from meshviz.widgets.explorer import Explorer

    short = Explorer(mesh_shape="4,256", ids="", dim_names="dp,mp", shape="7,1023", src="S(0), S(1)", dst="S(1), S(0)")
    pasted = Explorer(mesh_shape="4,256", ids="", dim_names="dp,mp", shape="7,1023",
                      src="[dist.Shard(0), paddle.distributed.Shard(1)]",
                      dst="[dist.Shard(1), dist.Shard(0)]")
    assert short.error is None and pasted.error is None, pasted.error
    assert pasted.plan.ops == short.plan.ops and pasted.plan.total_bytes == short.plan.total_bytes
    assert [p.dim for p in pasted.plan.dst_placements] == [1, 0]
    # rows 7 on dp 4: 2,2,2,1; columns 1023 on mp 256: 255 of 4, then 3. All-gather along mp: the busiest rank (2
    # rows, the 3 last columns) receives its rows' other 1020 columns; all-to-all along dp to columns of 256,256,256,
    # 255: dp rank 3 (1 row) receives the other 6 rows of its last 255 columns; the slice moves nothing
    assert pasted.plan.ops == ["all_gather", "all_to_all", "slice"]
    assert [s.bytes for s in pasted.plan.steps] == [2 * 1020 * 4, 6 * 255 * 4, 0]
    part = Explorer(mesh_shape="2", ids="", dim_names="x", shape="5", src="[dist.Partial(dist.ReduceType.kRedMax)]",
                    dst="[dist.Shard(0)]")
    assert part.error is None and part.plan.ops == ["reduce_scatter"]
    # 5 on 2 -> chunks of 3: the busiest rank receives ceil(5 / 2) = 3 float32s
    assert part.plan.total_bytes == 3 * 4


def test_blocks_of_65536_ranks_are_the_hand_split_worked_out_a_mesh_axis_at_a_time(monkeypatch):
    """The explorer takes meshes of up to 65,536 ranks. Every rank's block of a [4099, 7] tensor [S(0), S(1)] on
    256 x 256 (rows: 241 chunks of 17, one of 2, 14 empty; columns: 7 of 1, 249 empty) is the hand split, and the
    pictures' tensor state takes them from the layout's table, not one ``local_block`` per rank (which took seconds
    per picture: the explorer built 4 of them in 15 s)."""
    import importlib

    core_layout = importlib.import_module("meshviz.core.layout")  # (the package names a function layout)
    from meshviz.widgets.tensor_view import tensor_state

    mesh = ProcessMesh(np.arange(65536)[::-1].reshape(256, 256).tolist())  # ids not in coordinate order
    want = {int(mesh.ids[i, j]): (_ceil_chunk(4099, 256, i), _ceil_chunk(7, 256, j))
            for i in range(256) for j in range(256)}
    lay = core_layout.layout((4099, 7), mesh, [Shard(0), Shard(1)])
    assert lay.blocks() == want
    assert want[int(mesh.ids[241, 6])] == ((4097, 4099), (6, 7)) and want[int(mesh.ids[242, 0])][0] == (4099, 4099)

    calls = []
    real = core_layout.local_block
    monkeypatch.setattr(core_layout, "local_block", lambda *a: calls.append(a) or real(*a))
    st = tensor_state((4099, 7), mesh, ["S(0)", "S(1)"])
    assert len(calls) <= 4
    assert st.rank_block() == want
    assert sorted(st.empty) == sorted(r for r, (a, b) in want.items() if a[0] == a[1] or b[0] == b[1])
    assert len(st.empty) == 65536 - 242 * 7
    small = tensor_state((7, 3), _mesh((4, 2)), ["P(sum)", "S(1)"])  # Partial summands and fills as before
    assert small.fills == {0: "value", 1: "value", 2: "zero", 3: "zero", 4: "zero", 5: "zero", 6: "zero", 7: "zero"}
    assert small.summands[0] == {((0, 7), (0, 2)): (0,), ((0, 7), (2, 3)): (1,)}
