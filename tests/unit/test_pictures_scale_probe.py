"""Pictures at scale: the PNG's colours, the what-if peaks and the blocks of a tensor of 3+ dims worked out in
numpy (the same pixels and values as before), and what a picture says at odd mesh sizes (3x5x7, 1x1024, 1024x1,
empty and uneven blocks, Partial fills, panels left out)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from meshviz.core import ProcessMesh, layout
from meshviz.whatif import GB, WhatIf
from meshviz.widgets import Explorer, MeshView, ReshardView, TensorView, WhatIfView, reshard_view, tensor_draw
from meshviz.widgets.sheet import collisions, text_boxes
from meshviz.widgets.tensor_draw import block_image

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked


def _mesh(shape, names=None, ids=None):
    n = int(np.prod(shape))
    ids = np.arange(n) if ids is None else np.asarray(ids)
    return ProcessMesh(ids.reshape(shape), names or list("abcd"[: len(shape)]))


def _texts(fig) -> list[str]:
    return [t.get_text() for t, _ in text_boxes(fig)]


def _count(monkeypatch, owner, name):
    calls = [0]
    real = getattr(owner, name)

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return calls


# -- the PNG's colours ---------------------------------------------------------------------------------------------

def _png_before(fig) -> bytes:
    """The colour reduction as it was: np.unique with an inverse index per pixel (the reference of its pixels)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    size = canvas.get_width_height()
    im = Image.frombuffer("RGBA", size, canvas.buffer_rgba(), "raw", "RGBA", 0, 1).convert("RGB")
    rgb = np.asarray(im, dtype=np.int64)
    colours, where, counts = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2], return_inverse=True,
                                       return_counts=True)
    order = np.argsort(-counts, kind="stable")
    out = io.BytesIO()
    if len(colours) > 256 and counts[order[192]] * 1000 >= counts.sum():
        im.save(out, "PNG")
        return out.getvalue()
    unpacked = np.stack([colours >> 16, (colours >> 8) & 255, colours & 255], 1)
    palette = unpacked[order[:192]] if len(colours) > 256 else unpacked
    if len(colours) > 256:
        rest = np.asarray((im.quantize(64, method=2).getpalette() or [])[: 3 * 64])
        palette = np.concatenate([palette, rest.reshape(-1, 3)])
    u, q = unpacked.astype(np.float32), palette.astype(np.float32)
    nearest = np.argmin((q * q).sum(1)[None, :] - 2 * u @ q.T, axis=1)
    index = nearest[where.reshape(-1)].astype(np.uint8).reshape(size[1], size[0])
    picture = Image.frombytes("P", size, index.tobytes())
    picture.putpalette(palette.astype(np.uint8).ravel().tolist())
    picture.save(out, "PNG")
    return out.getvalue()


def _colours(fig) -> int:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return len(np.unique(np.frombuffer(canvas.buffer_rgba(), dtype="<u4") & 0xFFFFFF))


def test_the_png_is_the_same_picture_without_an_index_per_pixel(monkeypatch):
    """A 4-D mesh of 65,536 ranks spent most of its 2.8 s draw making the PNG's palette: np.unique with an inverse
    index per pixel (a stable argsort of 4.5 million pixels, then a cumulative sum). Now the pixels are counted
    by a plain sort and mapped through a table from colour to palette index: every pixel as before, for a
    picture of under 256 colours, one of more (192 exact and the octree's 64), and one kept in full colour."""
    big_inverse = []
    real_unique = np.unique

    def unique(ar, *a, **k):
        if k.get("return_inverse") and np.size(ar) > 10_000:
            big_inverse.append(np.size(ar))
        return real_unique(ar, *a, **k)

    from matplotlib.patches import Rectangle

    from meshviz.widgets.sheet import new_figure

    plain = new_figure(2, 1)  # no text: under 256 colours, each kept exactly
    for i, colour in enumerate(["#1f77b4", "#ff7f0e", "#2ca02c"]):
        plain.add_artist(Rectangle((0.1 + 0.3 * i, 0.2), 0.25, 0.6, color=colour, antialiased=False,
                                   transform=plain.transFigure))
    figures = [plain]
    for params, frames in ((dict(), (0, -1)),
                           (dict(mesh_shape="2,2,2,2", ids="reversed", dim_names="a,b,c,d", shape="4,4,4,4",
                                 src="S(0),S(1),S(2),S(3)", dst="R,S(0),R,R"), (0,)),
                           (dict(mesh_shape="16,16", ids="reversed", dim_names="x,y", shape="64,64",
                                 src="S(0), S(1)", dst="R, S(0)"), (0,))):
        view = Explorer(**params).reshard_view
        figures += [view.frame_figure(f % view.n_frames) for f in frames]
    seen = set()
    for fig in figures:
        before = Image.open(io.BytesIO(_png_before(fig)))
        with monkeypatch.context() as m:
            m.setattr(np, "unique", unique)
            now = Image.open(io.BytesIO(reshard_view._png(fig)))
        assert now.mode == before.mode and now.size == before.size
        assert np.array_equal(np.asarray(now.convert("RGB")), np.asarray(before.convert("RGB")))
        seen.add(now.mode + ("+" if _colours(fig) > 256 else ""))
    assert seen == {"P", "P+", "RGB+"}, seen  # each way the picture is kept
    assert not big_inverse, big_inverse


# -- the what-if peaks ---------------------------------------------------------------------------------------------

def _report(ids, seed):
    rng = np.random.default_rng(seed)
    ranks = np.asarray(ids).ravel().tolist()
    per_rank = {r: dict(params=1, grads=1, optimizer=1, activations=1, peak=int(rng.integers(0, 90 * GB)),
                        comm_bytes=0) for r in rng.permutation(ranks).tolist()}  # in no order
    mesh = {"shape": list(np.shape(ids)), "process_ids": ranks, "dim_names": list("abcd"[: np.ndim(ids)])}
    from meshviz.trace import Event

    return WhatIf(len(ranks), per_rank, [Event(kind="placed", rank=ranks[0], mesh=mesh, name="w")],
                  {r: ranks[0] for r in ranks}, [ranks[0]], limit=60 * GB)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (1, 16), (16, 1), (3, 5, 7), (2, 3, 2, 2)])
def test_what_if_peaks_are_each_cells_rank_in_numpy(monkeypatch, shape):
    """WhatIfView.peaks() looked every cell up in a Python loop (rank_at, a dict, a numpy item each): 65,536 of
    them per picture. Now one search of the ranks: the same value in every cell as the loop, ids in any order."""
    n = int(np.prod(shape))
    for seed, ids in enumerate([np.arange(n), np.random.default_rng(len(shape)).permutation(n) * 3 + 5]):
        view = WhatIfView(_report(ids.reshape(shape), seed))
        want = np.zeros(shape)
        for c in np.ndindex(*shape):
            want[c] = view.report.per_rank[int(ids.reshape(shape)[c])]["peak"]
        calls = _count(monkeypatch, ProcessMesh, "rank_at")
        got = view.peaks()
        assert calls[0] == 0, calls[0]
        assert got.shape == tuple(shape) and got.dtype == want.dtype and np.array_equal(got, want), (shape, seed)
    del view.report.per_rank[int(ids.ravel()[-1])]  # a rank the report lacks: named, as the loop's lookup did
    with pytest.raises(KeyError, match=str(int(ids.ravel()[-1]))):
        view.peaks()


# -- the blocks of a tensor of 3 or more dims ----------------------------------------------------------------------

def _brute_image(shape, blocks, maxs):
    """Each sampled element's block (the last that holds it, as block_image paints them in order), -1 for none."""
    _, xe, ye = block_image(shape, [], maxs)
    rows = int(np.prod(shape[:-1]))
    img = np.full((len(ye) - 1, len(xe) - 1), -1, dtype=np.int32)
    for i in range(img.shape[0]):
        r = int(np.floor((ye[i] + ye[i + 1]) / 2)) if rows > maxs else i
        lead = np.unravel_index(r, shape[:-1])
        for j in range(img.shape[1]):
            c = int(np.floor((xe[j] + xe[j + 1]) / 2)) if shape[-1] > maxs else j
            at = tuple(int(x) for x in lead) + (c,)
            holds = [k for k, b in enumerate(blocks) if all(a <= x < z for x, (a, z) in zip(at, b))]
            img[i, j] = holds[-1] if holds else -1
    return img


def test_block_image_of_3_or_more_dims_is_the_element_each_pixel_shows():
    """Random blocks (overlapping, empty, out of order) of tensors of 3-5 dims, some sampled: each pixel the last
    block that holds its element, as the block-by-block loop painted it."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        shape = tuple(int(s) for s in rng.integers(0, 7, int(rng.integers(3, 6))))
        blocks = []
        for _ in range(int(rng.integers(0, 9))):
            blk = []
            for s in shape:
                a = int(rng.integers(0, s + 1))
                blk.append((a, int(rng.integers(a, s + 1)) if rng.random() < 0.9 else int(rng.integers(0, s + 1))))
            blocks.append(tuple(blk))
        maxs = int(rng.choice([4, 384]))
        img, _, _ = block_image(shape, blocks, maxs)
        assert img.dtype == np.int32 and np.array_equal(img, _brute_image(shape, blocks, maxs)), (shape, blocks)


def test_a_4d_tensor_on_65536_ranks_is_cut_without_a_step_per_block(monkeypatch):
    """[64, 64, 64, 64] on a 16x16x16x16 mesh, [S(0), S(1), S(2), S(3)]: 65,536 blocks, each cut out of the
    picture with its own np.ix_ (about a second a picture). Now the blocks' bounds make one grid: no np.ix_, the
    same picture (each sampled element in the block that holds it, -1 nowhere)."""
    mesh = _mesh((16, 16, 16, 16), ids=np.arange(65536)[::-1])
    blocks = sorted(set(layout((64, 64, 64, 64), mesh, ["S(0)", "S(1)", "S(2)", "S(3)"]).block_list()))
    ix = _count(monkeypatch, tensor_draw.np, "ix_")
    img, xe, ye = block_image((64, 64, 64, 64), blocks)
    assert ix[0] == 0
    rows = np.floor((ye[:-1] + ye[1:]) / 2).astype(int)
    cols = np.floor((xe[:-1] + xe[1:]) / 2).astype(int)
    a, b, c = np.unravel_index(rows, (64, 64, 64))
    want = (((a // 4)[:, None] * 16 + (b // 4)[:, None]) * 16 + (c // 4)[:, None]) * 16 + (cols // 4)[None, :]
    assert np.array_equal(img, want)  # blocks sorted: block k is (k // 4096, k // 256 % 16, k // 16 % 16, k % 16)


# -- what a picture says at odd sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, shape", [(64, (64,)), (1024, (1024,)), (1024, (32, 32)), (1024, (1, 1024))])
def test_pale_cells_are_said_when_their_cells_cannot_say_it(n, shape):
    """A P(sum) tensor: ranks off coordinate 0 hold zeros, drawn pale. Up to 64 ranks each pale cell said
    'zeros'; past that (or cells too small to hold it: 64 ranks in a row) nothing in the picture told what the
    pale cells hold. Now a line under the mesh counts them; where the cells say it, no line."""
    texts = _texts(TensorView((3, 5), _mesh(shape), ["P(sum)"] * len(shape)).figure())
    assert f"pale cells: {n - 1} ranks hold zeros (an identity of the reduction)" in texts, texts
    small = _texts(TensorView((3, 5), _mesh((4,)), ["P(sum)"]).figure())
    assert "1\nzeros" in small and not any(t.startswith("pale cells") for t in small)
    prod = _texts(TensorView((3, 5), _mesh((32, 32)), ["P(sum)", "P(prod)"]).figure())
    assert "pale cells: 992 ranks hold zeros, 31 ranks hold ones (an identity of the reduction)" in prod
    frames = ReshardView((3, 5), _mesh((1024,)), ["P(sum)"], dst_placements=["R"])
    assert "pale cells: 1023 ranks hold zeros (an identity of the reduction)" in _texts(frames.frame_figure(0))


def _over_half(n, shape, limit=80 * GB):
    mesh = {"shape": list(shape), "process_ids": list(range(n)), "dim_names": list("abcd"[: len(shape)])}
    from meshviz.trace import Event

    per_rank = {r: dict(params=GB, grads=GB, optimizer=GB, activations=GB, peak=(42 + 48 * (r >= n // 2)) * GB,
                        comm_bytes=0) for r in range(n)}
    return WhatIf(n, per_rank, [Event(kind="placed", rank=0, mesh=mesh, name="w")], {r: 0 for r in range(n)}, [0],
                  limit=limit)


@pytest.mark.parametrize("shape", [(16, 16, 16), (16, 16, 16, 16)])
def test_what_if_says_where_the_ranks_over_the_limit_are_when_their_panels_are_left_out(shape):
    """4,096 ranks (16x16x16) with the later half over 80 GB: the picture draws 8 of 16 panels, all under the
    limit; not one cell was hatched and rank 2048, whose bytes it showed, was nowhere, beside '2048 over 80 GB'.
    Now a line under the mesh names the ranks over the limit and the rank shown that are in panels not drawn."""
    n = int(np.prod(shape))
    view = WhatIfView(_over_half(n, shape))
    assert view.rank == n // 2
    texts = _texts(view.figure())
    note = " ".join(t for t in texts if t.startswith("in the ") or "whose bytes" in t or t.startswith("["))
    panels = n // 256 - 8
    assert note.startswith(f"in the {panels} panels not drawn (peaks up to 90.00 GB): {n // 2} of the {n // 2} "
                           f"ranks over the limit [{n // 2}, {n // 2 + 1},"), note
    assert note.endswith(f"{n - 1}]; rank {n // 2}, whose bytes are shown above"), note
    assert not collisions(view.figure())
    low = WhatIfView(_over_half(n, shape), rank=0)  # the rank shown drawn, the ranks over the limit not
    assert any("ranks over the limit" in t for t in _texts(low.figure()))
    assert not any("whose bytes" in t for t in _texts(low.figure()))
    unlimited = WhatIfView(_over_half(n, shape, limit=None), rank=0)  # nothing over, the rank shown drawn
    assert unlimited.limit is None and not any(t.startswith("in the ") for t in _texts(unlimited.figure()))
    small = WhatIfView(_over_half(8 * 16, (8, 4, 4)))  # every panel drawn: the hatching tells
    assert not any(t.startswith("in the ") for t in _texts(small.figure()))


ODD = [  # (case, mesh, tensor shape, placements)
    ("3x5x7", (3, 5, 7), (9, 10, 11), ["S(0)", "S(1)", "S(2)"]),
    ("3x5x7_fewer_rows", (3, 5, 7), (2, 3, 4), ["S(0)", "S(1)", "S(2)"]),
    ("3x5x7_partial", (3, 5, 7), (2, 3), ["S(0)", "P(sum)", "S(1)"]),
    ("1x1024", (1, 1024), (5, 7), ["R", "S(0)"]),
    ("1024x1", (1024, 1), (5, 7), ["S(1)", "R"]),
    ("1024_uneven", (1024,), (1000, 3), ["S(0)"]),
    ("7_uneven", (7,), (10, 3), ["S(0)"]),
    ("3x5x7x2", (3, 5, 7, 2), (13,), ["S(0)", "S(0)", "R", "P(max)"]),
]


@pytest.mark.parametrize("case, mshape, shape, pl", ODD, ids=[c[0] for c in ODD])
def test_odd_sizes_say_what_each_rank_holds(case, mshape, shape, pl):
    """Meshes of odd sizes, tensors with fewer rows than ranks (empty blocks), uneven shards: no crash, no text
    over another or out of the picture, and each rank's holding told: its block named with its ranks (up to 24
    blocks), the empty ones listed, the pale ones counted."""
    mesh = _mesh(mshape)
    view = TensorView(shape, mesh, pl)
    fig = view.figure()
    assert not collisions(fig), collisions(fig)[:4]
    texts = _texts(fig)
    st = view.state
    if st.empty:
        assert any(t.startswith("empty block") for t in texts), texts
    if any(f != "value" for f in st.fills.values()):
        assert any(t.startswith("pale cells:") for t in texts) or any(t.endswith("zeros") for t in texts), texts
    png = view.png()
    assert png.startswith(b"\x89PNG")
    frames = ReshardView(shape, mesh, pl, dst_placements=["R"] * len(mshape))
    for f in range(frames.n_frames):
        assert not collisions(frames.frame_figure(f)), (case, f)
    assert frames.png().startswith(b"\x89PNG")
    assert not collisions(MeshView(mesh).figure())
