"""What a reader sees at every mesh size, 1 to 1,024 ranks: cells at least 6 px, block borders that leave their
colours visible, panels told apart, ranks counted where a list is cut, every picture cheap to store."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.image import BboxImage

from meshviz.core import ProcessMesh
from meshviz.trace import RankStatus, RollCall
from meshviz.widgets import MeshView, PipelineView, ReshardView, RollCallView, TensorView, synthetic_schedule
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


@pytest.mark.parametrize("shape,names", [((1,), ["data_parallel"]), ((2,), ["data_parallel"]),
                                         ((3,), ["a_very_long_dimension_name_for_the_data_parallel_axis"]),
                                         ((2, 3), ["a_very_long_name_for_the_data_parallel_axis",
                                                   "another_very_long_name_for_the_model_axis"]),
                                         ((1, 4, 1), ["pipeline_parallel_axis", "data_parallel_axis",
                                                      "a_very_long_name_for_the_model_parallel_axis"]),
                                         ((4, 4, 64), ["pp", "data_parallel", "mp"]),
                                         ((2, 2, 2), ["pipeline_parallel_axis", "data_parallel_axis",
                                                      "a_very_long_name_for_the_model_parallel_axis"]),
                                         ((4, 4, 64), ["x", "a_very_long_name_for_the_model_parallel_axis",
                                                       "data_parallel_axis"])],
                         ids=["1", "2", "3", "2x3", "1x4x1", "4x4x64", "2x2x2-titles", "4x4x64-long"])
def test_axis_names_longer_than_the_grid_stay_in_the_picture(shape, names):
    """'data_parallel (1)' under a one-rank mesh started 16 px left of the picture (a long name: 125 px, its start
    cut off); a 2-D mesh's long row-axis name ran down into the column axis's name, a faceted mesh's into the
    next row of panels. An x label wider than its grid now has the grid centred over it, and a y label reaches at
    most 0.2 in past its grid (cut with '…'); a panel's title sits above the y label's reach (the title
    'pipeline_parallel_axis=0', wider than its grid, crossed the label 'data_parallel_axis')."""
    mesh = _mesh(shape, names)
    for fig in (MeshView(mesh).figure(), TensorView((5, 6), mesh, ["S(0)"]).figure(),
                ReshardView((5, 6), mesh, ["S(0)"], dst_placements=["R"]).frame_figure(1)):
        assert not collisions(fig), collisions(fig)
        texts = _texts(fig)
        assert f"{names[-1]} ({shape[-1]})" in texts or any(t.startswith(names[-1][:8]) for t in texts)


@pytest.mark.parametrize("shape", [(8192,), (65536,), (2, 32768), (32768, 2), (16, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_a_long_row_of_ranks_wraps_into_a_bounded_picture(shape):
    """A row of ranks wrapped 64 to a row whatever its length: 65,536 ranks (the explorer's limit) were 1,024 rows,
    a PNG 12,057 px tall and 700 KB (the explorer's 1.3 MB); more ranks now go to a row (cells squeezed under
    6 px, said in a note) so that the rows stay within MAX_GRID_H."""
    from meshviz.widgets.base import png_size

    view = MeshView(_mesh(shape))
    data = view.png()
    assert png_size(data)[1] < 1800 and len(data) < 250_000, (png_size(data), len(data))
    fig = view.figure()
    assert not collisions(fig)
    if int(np.prod(shape)) >= 32768:
        assert any(t.startswith("squeezed: cells") for t in _texts(fig))
    one_d = MeshView(_mesh((65536,))).figure()
    rows = [int(t) for t in _texts(one_d) if t.isdigit() and int(t) > 250]  # each row's first rank
    assert "a (65536), 256 a row" in _texts(one_d) and rows and all(r % 256 == 0 for r in rows)


def test_a_partial_headline_counts_its_summands_and_nests_mixed_reductions():
    """Mixed reductions read 'the tensor is the mixed of 4 summands', and one summand '1 summands'."""
    mixed = TensorView((5, 6), _mesh((2, 2, 2), ["pp", "dp", "mp"]), ["P(sum)", "P(max)", "S(0)"])
    assert mixed._block() is not None
    head = _texts(mixed.figure())[0]
    assert head.endswith("— Partial: the tensor is the sum over pp of the max over dp of 4 summands"), head
    one = TensorView((2, 3), _mesh((1, 4, 1)), ["R", "S(1)", "P(sum)"])
    assert repr(one) == "<TensorView [2, 3] [R, S(1), P(sum)] on mesh [1, 4, 1]: 4 blocks, 1 summand>"
    assert _texts(one.figure())[0].endswith("Partial: the tensor is the sum of 1 summand")


def test_a_scalar_partial_is_drawn_with_its_summands():
    """A 0-D Partial(sum) raised TypeError ('numpy.float64' object does not support item assignment) from
    TensorView(value=...), from ReshardView and from the explorer's update (shape '' with 'P(sum)'): the zero
    fill wrote into a numpy scalar. Each rank now holds a 0-D array: 5 at the sum's coordinate 0, 0 elsewhere."""
    from meshviz.widgets import explore

    mesh = _mesh((2, 2, 2), ["a", "b", "c"])
    view = TensorView((), mesh, ["P(sum)", "P(max)", "R"], value=np.array(5.0))
    assert {r: float(v) for r, v in view.state.locals.items()} == {r: 5.0 if r < 4 else 0.0 for r in range(8)}
    assert all(np.ndim(v) == 0 for v in view.state.locals.values()) and float(view.state.value()) == 5.0
    assert not collisions(view.figure())
    rv = ReshardView((), mesh, ["P(sum)"] * 3, dst_placements=["R"] * 3, value=np.array(7.0))
    assert [{r: float(v) for r, v in st.locals.items()} for st in rv.states][0] == {0: 7.0, **{r: 0.0 for r in
                                                                                               range(1, 8)}}
    assert all(float(v) == 7.0 for v in rv.states[-1].locals.values())
    e = explore(mesh_shape="2", ids="", dim_names="x", shape="", src="P(sum)", dst="R")
    assert e.error is None and repr(e) == "<Explorer mesh [2] x: [] [P(sum)] -> [R]: 1 step, 8 B/rank>"


def test_an_empty_block_note_under_a_titled_panel_stays_in_the_picture():
    """Under a titled panel wider than its axes (a Partial's 'reduced value'), the red note was wrapped to the
    panel's width but drawn from the axes' left: 'empty blocks on 8 ranks:' ran 17 px past the picture's edge."""
    for shape, mesh, empty in [((0,), (2, 2, 2), "8 ranks: 0, 1, 2, 3, 4, 5, 6, 7"),
                               ((1,), (2, 2, 2), "4 ranks: 4, 5, 6, 7"),
                               ((0,), (1024,), "1024 ranks: 0, 1, 2, 3, 4, 5, …, 1023")]:
        placements = ["S(0)", "P(max)", "P(max)"] if len(mesh) == 3 else ["P(sum)"]
        fig = TensorView(shape, _mesh(mesh), placements).figure()
        assert not collisions(fig), collisions(fig)
        note = " ".join(t.get_text() for t in fig.texts if t.get_color() == "#a00")
        assert note.endswith(f"empty blocks on {empty}"), note


def test_a_reshard_that_ran_never_shows_made_up_numbers():
    """Events carry at most 64 values a rank: of a [12, 12] Partial(sum) all-reduced on 2 ranks each event's values
    were dropped, and the view drew the numbers it makes up for a plan (1..144 after the step, zeros for rank 1's
    summand) as the ranks' own. Without the ranks' numbers it now draws the blocks alone; with them, theirs."""
    from meshviz.core import plan_reshard
    from meshviz.trace import Event, ReshardPlan

    mesh = ProcessMesh([0, 1], ["mp"])
    rng = np.random.default_rng(0)
    for shape in ((12, 12), (4, 4)):
        plan = plan_reshard(shape, mesh, ["P(sum)"], mesh, ["R"])
        real = {r: rng.integers(0, 9, size=shape).astype(float) for r in (0, 1)}
        events = [Event(kind="reshard", rank=r, plan_id=1, mesh=mesh.to_dict(), placements_before=["P(sum)"],
                        placements_after=["R"], shape_before=list(shape), shape_after=list(shape),
                        bytes=plan.total_bytes, local_shape=list(shape), values=real[r].ravel()[:64].tolist(),
                        payload=ReshardPlan(ops=tuple(plan.ops), target_mesh=mesh.to_dict())) for r in (0, 1)]
        view = ReshardView(source=events)
        if shape == (12, 12):
            assert all(st.locals is None for st in view.states)
            texts = _texts(view.frame_figure(1))
            assert not {"144", "133", "100"} & set(texts), texts  # ticks and ids stop at 11
        else:  # the ranks' own blocks, and their sum after the all-reduce
            np.testing.assert_array_equal(view.states[0].locals[1], real[1])
            np.testing.assert_array_equal(view.states[1].value(), real[0] + real[1])


def test_a_roll_call_of_1024_ranks_has_a_short_text_repr():
    """The picture cut its lists of ranks, its text/plain repr did not: 10,242 characters for 1,024 ranks."""
    text = repr(RollCallView(_rollcall(1024)))
    assert len(text) < 400, len(text)
    assert text.splitlines() == [
        "<RollCallView 1024 ranks: 1023 in collective, 1 running>",
        "  ranks 0, 1, 2, 3, 4, 5, …, 1022 (1023 ranks) wait in all_reduce #7 on group [0, 1, 2, 3, 4, 5, …, 1023] "
        "(1024 ranks) for 12.5 s; rank 1023 is running at an unknown place: it never entered all_reduce #7"]
    assert repr(RollCallView(_rollcall(4))).splitlines()[1].startswith("  ranks 0, 1, 2 wait in all_reduce #7 on "
                                                                      "group [0, 1, 2, 3] for 12.5 s")


def test_explorer_ids_nested_for_another_shape_are_an_error_not_a_re_cut_mesh():
    """The explorer's ids '[[2,4,5],[0,1,3]]' (2 x 3) with mesh shape '3,2' were flattened and re-cut into
    [[2,4],[5,0],[1,3]]: every cell showed a rank the user did not put there. A nested list must now match the
    mesh shape; a flat one is reshaped as before."""
    from meshviz.widgets import explore

    e = explore(mesh_shape="3,2", ids="[[2,4,5],[0,1,3]]", dim_names="x,y", shape="4,6", src="S(0),S(1)", dst="R,R")
    assert e.error == ("process ids [[2,4,5],[0,1,3]] are 2 x 3, the mesh shape is 3 x 2; give a flat list to "
                       "reshape them") and e.plan is None
    e.update(ids="2,4,5,0,1,3")
    assert e.error is None and e.plan.src_mesh.ids.tolist() == [[2, 4], [5, 0], [1, 3]]
    e.update(mesh_shape="2,3", ids="[[2,4,5],[0,1,3]]")
    assert e.error is None and e.plan.src_mesh.ids.tolist() == [[2, 4, 5], [0, 1, 3]]
    e.update(target_ids="[[6,7],[8,9],[10,11]]")
    assert e.error is not None and e.error.startswith("process ids [[6,7],[8,9],[10,11]] are 3 x 2")


def test_explorer_save_before_any_input_worked_says_why(tmp_path):
    """An explorer opened on a bad input raised AttributeError ('NoneType' object has no attribute 'save')."""
    from meshviz.widgets import explore

    e = explore(shape="-1")
    with pytest.raises(ValueError, match=r"nothing to save: no input has worked yet \(tensor shape must be"):
        e.save(tmp_path / "x.png")
    e.update(shape="4,6")
    assert e.save(tmp_path / "x.png") == str(tmp_path / "x.png") and (tmp_path / "x.png").stat().st_size > 1000
