"""In-place and out= ops whose written tensor overlaps what they read in ways torch runs, against one process."""

import math

import pytest
import torch

from meshviz.testing import run_ranks

from .test_op_probe import _check, _place, _setup

# each reads memory it writes in a way torch does not refuse: the result is what the dense op gives in the order it
# writes (a copy smeared along a row, zeros from a product written into its own factor)
_ORDERED = {
    "t[:, 1:].copy_(t[:, :-1])": lambda t: t[:, 1:].copy_(t[:, :-1]),
    "mm(t, t, out=t)": lambda t: torch.mm(t, t, out=t),
    "matmul(t, t.t(), out=t)": lambda t: torch.matmul(t, t.t(), out=t),
    "t.addmm_(t, t)": lambda t: t.addmm_(t, t),
    "t.add_(t[:, :1])": lambda t: t.add_(t[:, :1]),
    "t.sub_(t.diagonal())": lambda t: t.sub_(t.diagonal()),
    "t[0].copy_(t[:, 0])": lambda t: t[0].copy_(t[:, 0]),
}
# the same view read by a pointwise op, disjoint views: as usual
_PLAIN = {
    "t.mul_(t)": lambda t: t.mul_(t),
    "t[1:3].copy_(t[1:3])": lambda t: t[1:3].copy_(t[1:3]),
    "t[::2].add_(t[1::2])": lambda t: t[::2].add_(t[1::2]),
    "t[:, ::2].copy_(t[:, 1::2])": lambda t: t[:, ::2].copy_(t[:, 1::2]),
    "t[0].copy_(t[1:, 1])": lambda t: t[0, 1:].copy_(t[1:, 0]),
}
# a partial overlap one process refuses
_REFUSED = {
    "t.add_(t[0])": lambda t: t.add_(t[0]),
    "t[1:].copy_(t[:-1])": lambda t: t[1:].copy_(t[:-1]),
    "t.index_add_(0, i, t)": lambda t: t.index_add_(0, torch.arange(t.shape[0]).flip(0), t),
}


def overlapping_writes(mesh_shape, code, k):
    dist, mesh = _setup(mesh_shape)
    x = torch.arange(float(k * k)).reshape(k, k) / 4 + 1
    for name, f in {**_ORDERED, **_PLAIN}.items():
        want = x.clone()
        out = f(want)
        t = _place(dist, mesh, x.clone(), code)
        placements = t.placements
        got = f(t)
        try:
            _check(dist, mesh, t, want, placements)
            _check(dist, mesh, got, out)  # what the op hands back (a view of t) holds its part too
        except AssertionError as e:
            raise AssertionError(f"{name} on {code}: {e}") from None
    for f in _REFUSED.values():
        with pytest.raises(RuntimeError, match="memory location"):
            f(x.clone())
        t = _place(dist, mesh, x.clone(), code)
        with pytest.raises(ValueError, match="memory location"):
            f(t)
        _check(dist, mesh, t, x)
    return True


@pytest.mark.parametrize("mesh_shape,code,k", [
    ([2], "S(0)", 4), ([2], "S(1)", 4), ([2], "R", 4), ([2], "P", 4), ([4], "S(0)", 4), ([4], "S(1)", 3),
    ([2, 2], "S(0),S(1)", 4), ([2, 2], "S(1),S(0)", 3), ([2, 2], "S(0),S(0)", 4), ([2, 2], "P", 4),
])
def test_a_write_overlapping_what_it_reads_gives_what_one_process_gives(mesh_shape, code, k):
    """``t[:, 1:].copy_(t[:, :-1])`` on a column-split ``t`` gave [[1, 1, 3, 4], ...] where one process smears the
    first column along the row ([[1, 1, 1, 1], ...]) and on four row shards raised torch's RuntimeError from some
    blocks; ``mm(t, t, out=t)`` gave the product where one process gives zeros; ``t.add_(t[:, :1])`` and
    ``t.sub_(t.diagonal())`` added the column as it was before the write. Each now runs as one process runs it."""
    n = math.prod(mesh_shape)
    assert run_ranks(overlapping_writes, n, mesh_shape, code, k) == [True] * n


def overlap_on_a_sub_mesh():
    dist, _ = _setup([4])
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = torch.arange(16.0).reshape(4, 4) + 1
    t = dist.shard_tensor(x.clone(), mesh, [dist.Shard(1)])
    t[:, 1:].copy_(t[:, :-1])
    torch.mm(t, t.t(), out=t)
    want = x.clone()
    want[:, 1:].copy_(want[:, :-1])
    torch.mm(want, want.t(), out=want)
    assert t.placements == [dist.Shard(1)]
    if dist.get_rank() < 2:
        torch.testing.assert_close(t._local_value(), want[:, 2 * dist.get_rank():2 * dist.get_rank() + 2])
    else:
        assert t._local_value().numel() == 0
    return True


def test_an_overlapping_write_on_a_sub_mesh_leaves_the_other_ranks_empty():
    assert run_ranks(overlap_on_a_sub_mesh, 4) == [True] * 4


_STRIDED = {"rows": ((2, 4), (4, 1), 4), "transposed": ((4, 4), (1, 4), 0), "overlapping windows": ((3, 3), (1, 1), 0),
            "one row": ((4,), (1,), 8), "columns": ((2, 2), (1, 4), 5)}


def strided_views(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.arange(16.0).reshape(4, 4)
    for name, (size, stride, offset) in _STRIDED.items():
        t = _place(dist, mesh, x.clone(), code)
        v = t.as_strided(size, stride, offset)
        try:
            _check(dist, mesh, v, x.as_strided(size, stride, offset))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    t = _place(dist, mesh, x.clone(), code)
    want = x.clone()
    v, dense_v = t.as_strided((2, 2), (1, 4), 5), want.as_strided((2, 2), (1, 4), 5)
    v.mul_(10)  # a write into the strided view reaches its base, and a later write into the base reaches the view
    dense_v.mul_(10)
    _check(dist, mesh, t, want)
    t.add_(1)
    want.add_(1)
    _check(dist, mesh, v, dense_v)
    for bad in (lambda t: t[1:].as_strided((2, 4), (4, 1), 4), lambda t: t.t().as_strided((4, 4), (1, 4))):
        with pytest.raises(ValueError, match="as_strided of a dist tensor that is a view"):
            bad(t)
    with pytest.raises(RuntimeError, match="out of bounds"):
        t.as_strided((4, 4), (4, 2))
    _check(dist, mesh, t, want)
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([2], "S(1)"), ([2], "P"), ([2, 2], "S(0),S(1)")])
def test_as_strided_views_the_whole_tensor_or_raises_a_clear_error(mesh_shape, code):
    """``t.as_strided(...)`` raised torch's internal "as_strided not supported with DTensor". It now runs on the whole
    tensor (Paddle's default rule: the output Replicate), as a view the writes reach both ways; of a view or a
    non-contiguous tensor (whose strides name a storage no rank holds) it raises a ValueError on every rank."""
    n = math.prod(mesh_shape)
    assert run_ranks(strided_views, n, mesh_shape, code) == [True] * n


def vocab_split_lookups(mesh_shape, cases):
    import torch.nn.functional as F

    dist, mesh = _setup(mesh_shape)
    w, ids = torch.arange(24.0).reshape(6, 4), torch.tensor([[0, 5, 2], [3, 1, 4]])
    wt = torch.arange(24.0).reshape(2, 3, 4)
    ref = w.clone().requires_grad_()
    want = F.embedding(ids, ref)
    (want * wt).sum().backward()
    for icode, wcode, layout in cases:
        dw = _place(dist, mesh, w, wcode).detach().requires_grad_()
        out = F.embedding(_place(dist, mesh, ids, icode), dw)
        (out * wt).sum().backward()
        try:
            assert [repr(p) for p in out.placements] == layout, (out.placements, layout)
            _check(dist, mesh, out, want.detach())
            _check(dist, mesh, dw.grad, ref.grad)
            assert all(g == p for g, p in zip(dw.grad.placements, dw.placements) if p.is_shard())  # split as the weight
        except AssertionError as e:
            raise AssertionError(f"indices {icode}, weight {wcode}: {e}") from None
    return True


@pytest.mark.parametrize("mesh_shape,cases", [
    ([2], [("R", "S(0)", ["R"]), ("S(0)", "S(0)", ["S(0)"]), ("S(1)", "S(0)", ["S(1)"])]),
    ([2, 2], [("R,R", "S(0),R", ["R", "R"]), ("R,S(0)", "S(0),R", ["R", "S(0)"]),
              ("S(0),R", "R,S(0)", ["S(0)", "R"])]),
])
def test_a_lookup_into_a_vocab_split_weight_is_laid_out_as_paddle_lays_it_out(mesh_shape, cases):
    """``F.embedding`` with a vocab-split weight gave a Partial(sum) output (``[P(sum)]`` for replicated indices on
    two ranks) where Paddle 3.3.1's eager ``F.embedding`` gathers the weight's vocab dim and lays the output out as
    the indices (``[R]``; ``[R, S(0)]`` for indices [R, S(0)] and a weight [S(0), R] on 2x2). Now as Paddle; the
    weight's gradient stays split as the weight, each rank's rows those of one process."""
    n = math.prod(mesh_shape)
    assert run_ranks(vocab_split_lookups, n, mesh_shape, cases) == [True] * n


def mixed_outs(code):
    dist, mesh = _setup([2])
    x = torch.arange(16.0).reshape(4, 4).flip(1) + 1
    t = _place(dist, mesh, x.clone(), code)
    values, indices = _place(dist, mesh, torch.zeros(4), "R"), _place(dist, mesh, torch.zeros(4, dtype=torch.long), "R")
    torch.max(t, 1, out=(values, indices))
    want = torch.max(x, 1)
    _check(dist, mesh, values, want.values)
    _check(dist, mesh, indices, want.indices)
    with pytest.raises(ValueError, match="both dist and plain"):
        torch.max(t, 1, out=(t[:, 0], torch.zeros(4, dtype=torch.long)))
    _check(dist, mesh, t, x)
    return True


@pytest.mark.parametrize("code", ["S(0)", "S(1)", "P"])
def test_out_tensors_dist_and_plain_together_raise_a_clear_error(code):
    """``torch.max(t, 1, out=(t[:, 0], plain))`` raised torch's "min() arg is an empty sequence" from its sharding
    propagation. A ValueError now says what is wrong, on every rank before anything moves."""
    assert run_ranks(mixed_outs, 2, code) == [True, True]
