"""What a reader sees at every mesh size, 1 to 1,024 ranks: cells at least 6 px, block borders that leave their
colours visible, panels told apart, ranks counted where a list is cut, every picture cheap to store."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.image import BboxImage

from meshviz.core import ProcessMesh
from meshviz.trace import RankStatus, RollCall
from meshviz.widgets import MeshView, PipelineView, RollCallView, TensorView, synthetic_schedule
from meshviz.widgets.draw import MIN_CELL, mesh_block, tensor_block
from meshviz.widgets.rollcall_view import short_lists
from meshviz.widgets.sheet import DPI, collisions, wrap
from meshviz.widgets.style import TITLE

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked


def _mesh(shape, names=None):
    return ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape), names or list("abcdefghij"[: len(shape)]))


SHAPES = [(1,), (1, 1), (1024,), (1, 1024), (1024, 1), (2, 512), (512, 2), (4, 256), (256, 4), (16, 64), (32, 32),
          (8, 8, 16), (2, 2, 256), (4, 4, 64), (2,) * 10]


def _cells(fig):
    """(smallest cell side in px, cells drawn) over the pictures of a mesh's panels."""
    sides, n = [], 0
    for a in fig.artists:
        if isinstance(a, BboxImage):
            rows, cols = np.asarray(a.get_array()).shape[:2]
            box = a.get_window_extent()
            sides.append(min(box.width / cols, box.height / rows))
            n += rows * cols
    return min(sides), n


def _texts(fig):
    return [t.get_text() for t in fig.texts]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_mesh_up_to_1024_ranks_has_cells_a_reader_can_see(shape):
    """2 x 512 was one strip of 0.6 px cells, 1024 x 1 a black line 0.3 px a cell: a long side is now wrapped
    (its rows, or its columns, each a panel of rows of cells), every cell at least 6 px, every rank drawn."""
    mesh = _mesh(shape)
    view = MeshView(mesh)
    fig = view.figure()
    side, n = _cells(fig)
    assert side >= MIN_CELL * DPI - 0.01, (shape, side)
    assert n >= mesh.size or any("more panels" in t for t in _texts(fig)), (shape, n)
    assert not any("squeezed" in t for t in _texts(fig))
    assert not collisions(fig)
    assert fig.bbox.width <= 8.8 * DPI
    assert len(view.png()) < 150_000


def test_a_long_mesh_is_wrapped_in_panels_that_say_so():
    fig = MeshView(_mesh((2, 512), ["dp", "mp"])).figure()
    texts = _texts(fig)
    assert "dp=0" in texts and "dp=1" in texts
    assert "mp (512), 64 a row" in texts
    assert any(t.startswith("each panel: mp (512): wrapped 64 ranks to a row") for t in texts)
    fig = MeshView(_mesh((512, 2), ["dp", "mp"])).figure()
    assert "mp=0" in _texts(fig) and "dp (512), 64 a row" in _texts(fig)
    # a step's groups: along the wrapped axis, a line through each wrapped row; across panels, said in words
    from matplotlib.lines import Line2D

    along = mesh_block(_mesh((2, 512)), groups_axis=1).figure()
    assert sum(isinstance(a, Line2D) for a in along.artists) == 2 * 8  # 2 panels of 8 rows of 64
    across = mesh_block(_mesh((2, 512)), groups_axis=0).figure()
    assert "groups: the same cell across panels" in _texts(across)
    assert not any(isinstance(a, Line2D) for a in across.artists)


def test_facets_of_a_many_axis_mesh_are_told_apart():
    """A 2^10 mesh's 16 panels shown were all titled 'a=0, b=0…'; now the shared axes are said once and each
    panel is titled by the indices that differ."""
    fig = mesh_block(_mesh((2,) * 10)).figure()
    titles = [t.get_text() for t in fig.texts if t.get_fontsize() == TITLE]
    assert len(titles) == 16 and len(set(titles)) == 16, titles
    assert titles[:3] == ["0,0,0,0", "0,0,0,1", "0,0,1,0"]
    assert "every panel shown: a=0, b=0, c=0, d=0; panel titles: (e, f, g, h)" in _texts(fig)
    assert not collisions(fig)
    # titles that fit are kept as they were
    fig = mesh_block(_mesh((2, 2, 2), ["pp", "dp", "mp"])).figure()
    assert [t.get_text() for t in fig.texts if t.get_fontsize() == TITLE] == ["pp=0", "pp=1"]


def _dark_share(fig, image) -> float:
    """The share of near-black pixels in ``image``'s box, as the figure is drawn."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    px = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)
    b = image.get_window_extent()
    h = px.shape[0]
    box = px[int(h - b.y1) + 2: int(h - b.y0) - 2, int(b.x0) + 2: int(b.x1) - 2]
    return float((box.sum(-1) < 150).mean())


@pytest.mark.parametrize("shape,placements,mesh", [((4096, 64), ["S(0)"], (1024,)), ((1024, 1024), ["S(0)", "S(1)"],
                                                                                     (2, 512)),
                                                   ((256, 512), ["R", "S(1)"], (4, 256))])
def test_many_thin_blocks_keep_their_colours(shape, placements, mesh):
    """1,024 blocks of a [4096, 64] tensor in 2.2 inches were 1,024 black borders 0.2 px apart: a black square.
    Borders closer than 3 px are left out (the colours alone tell the blocks), closer than 8 px drawn thin."""
    view = TensorView(shape, _mesh(mesh), placements)
    fig = view.figure()
    panels = [a for a in fig.artists if isinstance(a, BboxImage)]
    tensor = panels[-1]  # the mesh's panels first, then the tensor's
    assert _dark_share(fig, tensor) < 0.1
    assert len(np.unique(np.asarray(tensor.get_array()).reshape(-1, 3), axis=0)) > 50
    assert not collisions(fig)


def test_borders_of_few_blocks_stay():
    """Two or four blocks keep their full black borders."""
    halves = [((0, 8), (0, 4)), ((0, 8), (4, 8))]
    fig = tensor_block((8, 8), halves, [(1, 0, 0), (0, 0, 1)]).figure()
    lines = [a for a in fig.artists if type(a).__name__ == "LineCollection"]
    assert len(lines) == 1 and lines[0].get_linewidths()[0] == 1.2


def test_a_narrow_block_gets_a_shorter_list_of_its_ranks():
    """Two halves of a [1024, 1024] tensor: the second's '512,513,514,515,516,517,…' did not fit and it went
    unlabelled while the first had its ranks."""
    halves = [((0, 1024), (0, 512)), ((0, 1024), (512, 1024))]
    fig = tensor_block((1024, 1024), halves, [(1, 0, 0), (0, 0, 1)],
                       labels=["0,1,2,3,4,5,…", "512,513,514,515,516,517,…"], max_w=2.2).figure()
    labels = [t for t in _texts(fig) if "," in t]
    assert len(labels) == 2 and labels[0].startswith("0,1,") and labels[1].startswith("512,513,"), labels
    assert not collisions(fig)


def test_empty_blocks_are_counted_and_the_note_wraps_between_ids():
    """[10, 10] over 1,024 ranks: 1,014 hold an empty block; the note said 'ranks 10,11,...,17,…' (no count) and
    a narrow picture broke it inside a number ('70\\n,71')."""
    fig = TensorView((10, 10), _mesh((1024,)), ["S(0)"]).figure()
    note = " ".join(t.get_text() for t in fig.texts if t.get_color() == "#a00")
    assert note == "empty blocks on 1014 ranks: 10, 11, 12, 13, 14, 15, …, 1023"
    fig = TensorView((2, 64), _mesh((1024,)), ["S(1)"]).figure()
    lines = [t.get_text() for t in fig.texts if t.get_color() == "#a00"]
    assert len(lines) > 1 and " ".join(lines) == "empty blocks on 960 ranks: 64, 65, 66, 67, 68, 69, …, 1023"
    assert TensorView((3,), _mesh((4,)), ["S(0)"]).figure() is not None  # one empty block: 'on rank 3'


def _rollcall(n):
    return RollCall([RankStatus(rank=r, state="running") if r == n - 1 else
                     RankStatus(rank=r, state="in_collective", op="all_reduce", seq=7, group=list(range(n)),
                                waiting_s=12.5) for r in range(n)])


def test_a_roll_call_of_1024_ranks_lists_them_cut_and_counted():
    """Its lines listed all 1,023 waiting ranks and the group of 1,024: 2,000 numbers in 60 lines of text under the
    mesh (and minutes to lay out); now a list of more than 8 ranks is its first six, its last and its length."""
    fig = RollCallView(_rollcall(1024)).figure()
    text = "\n".join(_texts(fig))
    assert len(text) < 1500, len(text)
    assert "ranks 0, 1, 2, 3, 4, 5, …, 1022 (1023 ranks) wait in all_reduce #7" in text.replace("\n", " ")
    assert "the cell in row r, column c is rank r × 32 + c" in text
    assert fig.bbox.height < 600
    assert not collisions(fig)
    assert short_lists("group [0, 1, 2, 3, 4, 5, 6, 7]") == "group [0, 1, 2, 3, 4, 5, 6, 7]"
    assert short_lists("group [3, 4, 5, 6, 7, 8, 9, 10, 11]; ranks 1, 2") == \
        "group [3, 4, 5, 6, 7, 8, …, 11] (9 ranks); ranks 1, 2"


def test_wrapping_a_long_line_costs_its_length(monkeypatch):
    """Wrapping re-measured the whole line for each word added and each character cut: 600 ids and a bracketed
    group of 150 took 138 glyph look-ups a character (a roll call of 1,024 ranks: minutes); now about 2."""
    from meshviz.widgets import sheet

    calls = [0]
    extent = sheet._extent

    def counted(*args):
        calls[0] += 1
        return extent(*args)

    monkeypatch.setattr(sheet, "_extent", counted)
    ids, group = ", ".join(map(str, range(600))), ", ".join(map(str, range(150)))
    text = f"ranks {ids} wait; group [{group}]"
    lines = wrap(text, 7.5, 8.0, "monospace")
    assert calls[0] <= 4 * len(text), calls[0]
    assert "".join(lines).replace(" ", "") == text.replace(" ", "") and len(lines) == 29
    assert all(sheet.text_width(ln, 7.5, "monospace") <= 8.0 for ln in lines)
    assert wrap("abc def", 7.5, 10.0) == ["abc def"]
    assert wrap("abcdefghij", 7.5, 0.2, indent="  ")[0] == "abc"


def test_headlines_count_one_in_the_singular():
    view = PipelineView(synthetic_schedule(1, 1), schedule="1F1B")
    assert view._headline().startswith("1F1B · 1 stage rank, 1 micro-batch ·")
    assert PipelineView(synthetic_schedule(2, 4))._headline().startswith("2 stage ranks, 4 micro-batches")


def test_a_long_comm_table_draws_its_largest_rows_and_counts_the_rest():
    """200 rows were 200 bars, 4,301 px tall and a PNG of 890 KB; now the 24 largest, and one line for the rest."""
    from meshviz.trace import CommTable
    from meshviz.trace.commtable import CommRow
    from meshviz.widgets import CommView

    rows = [CommRow(cell=c % 3, module=f"model.layers.{c}.self_attention.dense", backward=bool(c % 2),
                    op=["all_reduce", "all_gather", "reduce_scatter"][c % 3], axis="mp", count=c + 1,
                    bytes=(c + 1) * 1000, seconds=0.001, ranks=(0, 1)) for c in range(200)]
    view = CommView(CommTable(rows))
    fig = view.figure()
    bars = [t for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert len(bars) == 24 and bars[0].get_text().startswith("[1] model.layers.199.")
    left_out = sum((c + 1) * 1000 for c in range(176))
    assert any(t.startswith(f"the 24 largest of 200 rows; the other 176 move {left_out / 2**20:.1f} MiB per rank")
               for t in _texts(fig))
    assert fig.bbox.height < 800 and len(view.png()) < 200_000
    assert not collisions(fig)
    assert len(CommView(CommTable(rows[:24])).figure().axes[0].get_yticklabels()) == 24  # a short table: every row


def test_a_long_pipeline_keeps_its_colours_and_says_which_transfers_it_draws():
    """4 stages x 600 micro-batches: 4,800 blocks under a pixel wide each had black edges (rows all but black), and
    only the first 2,000 of 3,600 transfers were drawn (the first half of the run), without a word."""
    from matplotlib.collections import LineCollection, PolyCollection

    view = PipelineView(synthetic_schedule(4, 600, "1F1B", comm=0.05), schedule="1F1B")
    fig = view.figure()
    ax = fig.axes[0]
    bars = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert bars and all(max(c.get_linewidths()) == 0 for c in bars)
    n = len(view.transfers)
    assert n == 3600 and f"send/recv (1 in 2 of {n} drawn)" in _texts(fig)
    lines = [c for c in ax.collections if isinstance(c, LineCollection)]
    ends = np.concatenate([np.asarray(seg)[:, 0] for c in lines for seg in c.get_segments()])
    assert len(lines) == 1 and len(lines[0].get_segments()) == 1800 and ends.max() > 0.95 * ax.get_xlim()[1] / 1.01
    assert not collisions(fig)
    few = PipelineView(synthetic_schedule(4, 8, "1F1B"), schedule="1F1B").figure()
    assert all(max(c.get_linewidths()) == 0.5 for c in few.axes[0].collections
               if isinstance(c, PolyCollection))
    assert "send/recv" in _texts(few)
