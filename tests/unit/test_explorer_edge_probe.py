"""The explorer at 65,536 ranks (work per redraw that does not grow with the blocks) and its cross-mesh targets."""

from __future__ import annotations

import colorsys

import numpy as np
import pytest

from meshviz.core import ProcessMesh, layout, simulate
from meshviz.core.layout import Layout, dense_to_local, local_block
from meshviz.widgets import Explorer, ReshardView, tensor_draw, tensor_state, tensor_view
from meshviz.widgets.tensor_draw import block_image

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

BIG = ProcessMesh(np.arange(65536)[::-1].reshape(256, 256).tolist(), ["x", "y"])  # ids not in coordinate order


def _count(monkeypatch, owner, name):
    calls = [0]
    real = getattr(owner, name)

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_redraw_at_256x256_does_no_work_per_rank_or_block_in_python(monkeypatch):
    """A redraw at 256x256 (a placement changed in the controls) took seconds: the layout of every state was built
    rank by rank (a Partial fill per summand: 65,536 of them for P(sum), P(max)), each of 65,536 blocks was cut out
    of the tensor picture with its own np.ix_, named with its ranks though at most 24 names are drawn, and its
    colour made again at every picture. What is drawn is unchanged: each rank's block and fill."""
    e = Explorer(mesh_shape="256,256", ids="reversed", dim_names="x,y", shape="64,64", src="S(0), S(1)",
                 dst="R, S(0)")
    assert e.error is None
    e.redraw()  # colours made once per process
    fills = _count(monkeypatch, Layout, "fill")
    ix = _count(monkeypatch, tensor_draw.np, "ix_")
    names = _count(monkeypatch, tensor_view, "_rank_list")
    hues = _count(monkeypatch, colorsys, "hsv_to_rgb")
    e.update(src="S(0), S(1)", dst="P(sum), P(max)")
    e.redraw()
    assert e.error is None and len(e.plan.steps) >= 2
    assert fills[0] <= 4 * (len(e.plan.steps) + 1) + 8, fills[0]  # per kind of fill, not per summand
    assert ix[0] == 0 and names[0] <= 2 * 24 * 4 and hues[0] == 0, (ix[0], names[0], hues[0])
    st = e.reshard_view.states[-1]  # every rank's block and fill as the layout says, rank by rank
    lay = layout((64, 64), BIG, st.placements)
    rng = np.random.default_rng(0)
    for c in [tuple(rng.integers(0, 256, 2)) for _ in range(64)] + [(0, 0), (0, 255), (255, 0), (255, 255)]:
        r = BIG.rank_at(c)
        assert r in st.blocks[lay.block(c)] and st.fills[r] == lay.fill(c), (c, r)
    assert sum(len(v) for v in st.blocks.values()) == 65536 and len(st.summands) == 65536
    rgb = st.cell_rgb()
    assert rgb.shape == (256, 256, 3) and np.allclose(rgb[0, 0], st.colours[st.order.index(lay.block((0, 0)))])
    assert st.fills[BIG.rank_at((1, 0))] == "zero"  # off coordinate 0 of the P(sum) axis: a pale cell
    assert np.allclose(rgb[1, 0], st.colours[st.order.index(lay.block((1, 0)))] * 0.3 + 0.7)


@pytest.mark.parametrize("shape", [(37,), (10, 7), (1000, 3), (3, 1000), (0, 4)])
def test_block_image_samples_every_pixel_from_the_block_that_holds_it(shape):
    """block_image (now two searches per block for tensors of up to 2 dims) against the element each sampled pixel
    shows: every pixel carries the index of the one block that holds it, -1 where no block does."""
    mesh = ProcessMesh([[3, 1, 2], [0, 5, 4]], ["x", "y"])
    pl = ["S(0)", "S(1)"] if len(shape) == 2 else ["S(0)", "S(0)"]
    blocks = sorted(set(layout(shape, mesh, pl).block_list()))[::-1]
    img, xe, ye = block_image(shape, blocks, maxs=16)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    for i in range(img.shape[0]):
        for j in range(img.shape[1]):
            r = int(np.floor((ye[i] + ye[i + 1]) / 2)) if rows > 16 else i
            c = int(np.floor((xe[j] + xe[j + 1]) / 2)) if shape[-1] > 16 else j
            at = (r, c)[-len(shape):]
            holds = [k for k, b in enumerate(blocks) if all(a <= x < z for x, (a, z) in zip(at, b))]
            assert img[i, j] == (holds[0] if holds else -1), (shape, i, j)


@pytest.mark.parametrize("pl", [["S(1)", "P(sum)", "S(0)"], ["P(max)", "P(sum)", "R"], ["S(0)", "S(0)", "P(prod)"],
                                ["R", "R", "R"], ["P(avg)", "S(1)", "S(1)"]])
def test_tensor_state_matches_the_layout_rank_by_rank(pl):
    """The numpy-wide tensor_state against the layout asked one coordinate at a time: owners in mesh order,
    summands, fills, empty ranks, and the colours of the cells."""
    ids = np.random.default_rng(3).permutation(24).reshape(2, 3, 4)
    mesh = ProcessMesh(ids.tolist(), ["a", "b", "c"])
    st = tensor_state((5, 3), mesh, pl)
    lay = layout((5, 3), mesh, pl)
    owners, fills, empty = {}, {}, []
    for c in np.ndindex(2, 3, 4):
        r, blk = int(ids[c]), local_block((5, 3), mesh, lay.placements, c)
        owners.setdefault(blk, []).append(r)
        fills[r] = lay.fill(c)
        if any(a >= b for a, b in blk):
            empty.append(r)
    assert st.blocks == {b: tuple(r) for b, r in owners.items()} and list(st.blocks) == list(owners)
    assert st.order == sorted(owners) and st.fills == fills and st.empty == empty
    assert sorted(r for rs in st.summand_ranks for r in rs) == list(range(24))
    for j, rs in enumerate(st.summand_ranks):
        assert {b: tuple(r for r in st.blocks[b] if r in rs) for b in st.summands[j]} == st.summands[j]
    rgb = st.cell_rgb()
    for c in np.ndindex(2, 3, 4):
        r = int(ids[c])
        col = st.colours[st.order.index(lay.block(c))]
        assert np.allclose(rgb[c], col if fills[r] == "value" else col * 0.3 + 0.7)


def _ran(e: Explorer, value):
    """The target ranks' blocks after the explorer's plan, against the dense truth."""
    p = e.plan
    got = simulate(p, value)
    for c in np.ndindex(*p.dst_mesh.shape):
        want = dense_to_local(value, p.dst_mesh, p.dst_placements, c)
        np.testing.assert_array_equal(got[p.dst_mesh.rank_at(c)], want)


@pytest.mark.parametrize("src_shape,src,target,dst,names", [
    ("2,2", "R, S(0)", "[0,1]", "S(0)", ["y"]),  # a slice along x, the axis dropped (Paddle's sub mesh)
    ("2,2", "S(1), R", "[[1],[3]]", "S(1), R", ["x", "y"]),  # a slice along y, the axis kept as 1
    ("2", "S(0)", "[[0,1],[2,3]]", "R, S(0)", ["d0", "x"]),  # the source one slice of the target
    ("4", "S(0)", "[7]", "R", ["x"]),  # a 1-D mesh gathered onto one rank
    ("1", "R", "[3,4,5]", "S(1)", ["x"]),  # one rank spread over a 1-D mesh
])
def test_explorer_takes_the_cross_mesh_targets_paddle_takes(src_shape, src, target, dst, names):
    """target ids had to be the source mesh's shape ('2 process ids for a mesh of shape [2, 2]'), though Paddle
    reshards to a slice of the mesh (Replicate along the sliced axis), from a slice to the whole, and between a
    1-D mesh and a single rank. Now a nested or differently long list of target ids is a mesh of its own shape."""
    e = Explorer(mesh_shape=src_shape, ids="", dim_names="x,y"[:2 * src_shape.count(",") + 1], shape="4,6",
                 src=src, dst=dst, target_ids=target)
    assert e.error is None, e.error
    assert e.plan.dst_mesh.ids.tolist() == eval(target) and e.plan.dst_mesh.dim_names == names
    _ran(e, np.arange(24.0).reshape(4, 6))
    assert e.redraw() > 0 and e.reshard_view.png()[:4] == b"\x89PNG"
    assert ReshardView(e.plan).plan.dst_mesh == e.plan.dst_mesh


@pytest.mark.parametrize("src_shape,src,target,dst,says", [
    ("2,2", "S(0), R", "[0,1]", "S(0)", "Paddle reshards to a slice of the mesh only from Replicate along the sliced "
                                        "axis x; the source is [S(0)] there"),
    ("2", "S(0)", "[[2,3],[0,1]]", "S(0), R", "Paddle reshards from a slice of the mesh only to Replicate along the "
                                              "axis it grows d0; the target is [S(0)] there"),
    ("4", "S(0)", "[7]", "S(0)", "between a 1-D mesh and a single rank only with the single rank's placements "
                                 "Replicate; the target is [S(0)]"),
    ("2,3", "S(0), S(1)", "[[6,7],[8,9],[10,11]]", "R, R", "process ids [[6,7],[8,9],[10,11]] are 3 x 2, the mesh "
                                                           "shape is 2 x 3: Paddle reshards between meshes of one "
                                                           "shape, from a mesh to one slice of it along an axis (such "
                                                           "as [0,1,2])"),
    ("2,2", "R, R", "[4,5]", "R", "process ids [4,5] are 2, the mesh shape is 2 x 2"),
])
def test_explorer_names_the_cross_mesh_reshards_paddle_refuses(src_shape, src, target, dst, says):
    e = Explorer(mesh_shape=src_shape, ids="", dim_names="x,y"[:2 * src_shape.count(",") + 1], shape="4,6",
                 src=src, dst=dst, target_ids=target)
    assert e.error is not None and says in e.error and e.plan is None, e.error
    e.update(target_ids="", dst=src)  # the same mesh again: the last error goes
    assert e.error is None and not e.plan.cross_mesh
