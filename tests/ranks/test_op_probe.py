"""In-place ops on dist tensors and on their views, against the same ops on the dense tensor in one process."""

import math

import pytest
import torch

from meshviz.core.layout import local_block
from meshviz.core.placements import parse_placement
from meshviz.testing import run_ranks


def _setup(mesh_shape):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    n = math.prod(mesh_shape)
    ranks = torch.arange(n).reshape(mesh_shape).tolist()
    return dist, dist.ProcessMesh(ranks, dim_names=["x", "y"][:len(mesh_shape)])


def _place(dist, mesh, x, code):
    """``x`` laid out as ``code`` (one placement per mesh axis, e.g. "S(0),S(1)"); "P": Partial(sum) on every axis,
    rank r holding a seeded summand and rank 0 the rest, so the summands add up to ``x``."""
    if code == "P":
        n = dist.get_world_size()
        g = torch.Generator().manual_seed(7)
        parts = [torch.randn(x.shape, generator=g, dtype=x.dtype) for _ in range(n)]
        parts[0] = x - sum(parts[1:])
        return dist.dtensor_from_local(parts[dist.get_rank()].clone(), mesh, [dist.Partial()] * mesh.ndim,
                                       shape=list(x.shape))
    return dist.shard_tensor(x, mesh, [parse_placement(p) for p in code.split(",")])


def _check(dist, mesh, t, want, placements=None) -> None:
    """``t`` holds ``want``: its placements as before (when given), every rank's block that of ``want`` (a Partial
    one: the value), and the value gathered."""
    if placements is not None:
        assert t.placements == placements, (t.placements, placements)
    placements = t.placements
    if not any(p.is_partial() for p in placements):
        block = local_block(tuple(want.shape), mesh, placements, mesh.coordinate(dist.get_rank()))
        torch.testing.assert_close(t._local_value().detach(), want[tuple(slice(a, b) for a, b in block)])
    torch.testing.assert_close(dist.unshard_dtensor(t).detach(), want)


_WRITES = {
    "row": lambda t: t.__setitem__(1, 9.0),
    "column": lambda t: t.__setitem__((slice(None), 2), 9.0),
    "element": lambda t: t.__setitem__((3, 1), 9.0),
    "rows from a tensor": lambda t: t.__setitem__(slice(0, 2), torch.arange(8.0).reshape(2, 4)),
    "slice add_": lambda t: t[1:3].add_(1),
    "column mul_": lambda t: t[:, 1].mul_(3),
    "slice clamp_": lambda t: t[1:4].clamp_(max=0.1),
    "flat view relu_": lambda t: t.view(20)[3:9].relu_(),
    "transposed add_": lambda t: t.t().add_(torch.arange(5.0)),
    "unsqueezed add_": lambda t: t.unsqueeze(0).add_(1),
    "row copy_": lambda t: t[4].copy_(torch.arange(4.0)),
}


def writes_into_views(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    for name, write in _WRITES.items():
        t = _place(dist, mesh, x, code)
        placements = t.placements
        want = x.clone()
        write(t)
        write(want)
        try:
            _check(dist, mesh, t, want, placements)
        except AssertionError as e:
            raise AssertionError(f"{name} on {code}: {e}") from None
    return True


@pytest.mark.parametrize("mesh_shape,code", [
    ([2], "S(0)"), ([2], "S(1)"), ([2], "P"), ([4], "S(0)"), ([2, 2], "S(0),S(1)"), ([2, 2], "S(0),S(0)"),
    ([2, 2], "R,S(0)"), ([2, 2], "P"),
])
def test_an_in_place_op_on_a_view_writes_the_dist_tensor_as_on_the_dense_one(mesh_shape, code):
    # t[1] = 9 on a row-sharded tensor wrote into a gathered copy of the row: the tensor stayed as it was (as did
    # t[1:3].add_(1), and t[1] = 9 on a Partial tensor: its summed copy took the write)
    n = math.prod(mesh_shape)
    assert run_ranks(writes_into_views, n, mesh_shape, code) == [True] * n


def view_writes_gradient(code):
    dist, mesh = _setup([2])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    w = torch.linspace(-1, 1, 20).reshape(5, 4)

    def f(a, b):
        z = a * 1.0
        z[1:3].mul_(3)
        z[:, 0].add_(1)
        z[4].copy_(b[0])
        return z

    a = _place(dist, mesh, x, code).detach().requires_grad_()
    b = _place(dist, mesh, y, code).detach().requires_grad_()
    out = f(a, b)
    (out * w).sum().backward()
    ra, rb = x.clone().requires_grad_(), y.clone().requires_grad_()
    rout = f(ra, rb)
    (rout * w).sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(out).detach(), rout.detach())
    torch.testing.assert_close(dist.unshard_dtensor(a.grad), ra.grad)
    torch.testing.assert_close(dist.unshard_dtensor(b.grad), rb.grad)
    return True


@pytest.mark.parametrize("code", ["S(0)", "P"])
def test_writes_into_views_give_the_dense_values_and_gradients(code):
    assert run_ranks(view_writes_gradient, 2, code) == [True, True]


def index_add_in_place(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.arange(20.0).reshape(5, 4)
    t = _place(dist, mesh, x, code)
    out = t.index_add_(0, torch.tensor([1, 3]), torch.ones(2, 4))
    assert out is t
    _check(dist, mesh, t, x.index_add(0, torch.tensor([1, 3]), torch.ones(2, 4)), t.placements)
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([2, 2], "S(0),S(1)"), ([2, 2], "R,S(0)")])
def test_index_add_in_place_on_a_row_sharded_tensor_adds(mesh_shape, code):
    # torch DTensor's rule gathers self for it: DTensor wrote the sum into that copy and relabelled the rank's old
    # block Replicate (3 rows called the whole 5x4 tensor); on a 2x2 mesh a later gather then crashed
    n = math.prod(mesh_shape)
    assert run_ranks(index_add_in_place, n, mesh_shape, code) == [True] * n


def index_select_backward():
    dist, mesh = _setup([2])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    t = _place(dist, mesh, x, "S(0)").detach().requires_grad_()
    out = torch.index_select(t, 1, torch.tensor([3, 0]))
    w = torch.linspace(-1, 1, 10).reshape(5, 2)
    (out * w).sum().backward()
    ref = x.clone().requires_grad_()
    (torch.index_select(ref, 1, torch.tensor([3, 0])) * w).sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(out).detach(), ref.detach()[:, [3, 0]])
    torch.testing.assert_close(dist.unshard_dtensor(t.grad), ref.grad)
    return True


def test_index_select_along_an_unsharded_dim_of_a_row_sharded_tensor_has_its_gradient():
    # its backward (index_add_ into zeros) crashed in an all-gather: "shape '[6, 4]' is invalid for input of size 40"
    assert run_ranks(index_select_backward, 2) == [True, True]


def mask_writes(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    mask = x > 0.2
    t = _place(dist, mesh, x, code)
    t[mask] = 3.0
    want = x.clone()
    want[mask] = 3.0
    _check(dist, mesh, t, want, t.placements)  # torch's rule for index_put_ gathers self (so does Paddle's)
    t = _place(dist, mesh, x, code)
    torch.testing.assert_close(dist.unshard_dtensor(t[mask]).detach(), x[mask])
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(1)"), ([4], "S(1)"), ([2, 2], "S(1),R"), ([2], "S(0)")])
def test_a_boolean_mask_index_on_a_column_sharded_tensor(mesh_shape, code):
    # t[mask] = 3.0 raised IndexError on each rank: torch DTensor's rule reads a 2-D mask as an index of dim 0
    # and kept dim 1 sharded, which the [5, 4] mask does not fit
    n = math.prod(mesh_shape)
    assert run_ranks(mask_writes, n, mesh_shape, code) == [True] * n


def out_arguments(code):
    dist, mesh = _setup([2])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    t = _place(dist, mesh, x, code)
    out = _place(dist, mesh, torch.zeros(5, 4), code)
    assert torch.add(t, 1.0, out=out) is out
    torch.testing.assert_close(dist.unshard_dtensor(out), x + 1)
    values = dist.shard_tensor(torch.zeros(4), mesh, [dist.Replicate()])
    indices = dist.shard_tensor(torch.zeros(4, dtype=torch.long), mesh, [dist.Replicate()])
    torch.max(t, 0, out=(values, indices))
    torch.testing.assert_close(dist.unshard_dtensor(values), x.max(0).values)
    assert dist.unshard_dtensor(indices).tolist() == x.max(0).indices.tolist()
    wide = _place(dist, mesh, torch.zeros(5, 4, dtype=torch.float64), code)
    torch.mul(t, 2, out=wide)
    torch.testing.assert_close(dist.unshard_dtensor(wide), (x * 2).double())
    small = dist.shard_tensor(torch.zeros(3, 4), mesh, [dist.Replicate()])
    with pytest.raises(ValueError, match="has shape"):
        torch.add(t, 1.0, out=small)
    return True


@pytest.mark.parametrize("code", ["P", "S(0)"])
def test_out_arguments_hold_the_result(code):
    # torch.add(p, 1, out=o) with a Partial p raised torch's "min() arg is an empty sequence" from DTensor's rule
    assert run_ranks(out_arguments, 2, code) == [True, True]


def random_draws(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    draws = {
        "rand_like": torch.rand_like,
        "randn_like": torch.randn_like,
        "randint_like": lambda t: torch.randint_like(t, 0, 100),
        "bernoulli": lambda t: torch.bernoulli(t * 0.5),
        "exponential_": lambda t: t.clone().exponential_(),
        "random_": lambda t: t.clone().random_(0, 10),
    }
    for name, draw in draws.items():
        torch.manual_seed(11)
        want = draw(torch.ones(7, 6))
        after = torch.rand(2)
        torch.manual_seed(11)
        t = _place(dist, mesh, torch.ones(7, 6), code)
        got = draw(t)
        assert got.placements == t.placements, name
        _check(dist, mesh, got, want, t.placements)
        torch.testing.assert_close(torch.rand(2), after, msg=name)  # the generator moved as the dense run's
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([4], "S(1)"), ([2, 2], "R,S(0)")])
def test_random_draws_on_a_dist_tensor_are_the_dense_runs_blocks(mesh_shape, code):
    # rand_like, randn_like, randint_like, bernoulli, exponential_ and random_ drew each block on its own: the
    # blocks were not the dense run's draw, and on R,S(0) the replicas disagreed
    n = math.prod(mesh_shape)
    assert run_ranks(random_draws, n, mesh_shape, code) == [True] * n


def embedding_empty_vocab_block():
    import torch.nn.functional as F

    dist, mesh = _setup([4])
    g = torch.Generator().manual_seed(5)
    w = torch.randn(5, 3, generator=g)
    ids = torch.tensor([[0, 4, 2], [3, 3, 1]])
    dw = _place(dist, mesh, w, "S(0)").detach().requires_grad_()
    out = F.embedding(ids, dw)
    wt = torch.linspace(-1, 1, 18).reshape(2, 3, 3)
    (out * wt).sum().backward()
    ref = w.clone().requires_grad_()
    (F.embedding(ids, ref) * wt).sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(out).detach(), ref.detach()[ids])
    torch.testing.assert_close(dist.unshard_dtensor(dw.grad), ref.grad)
    return list(dw.grad.placements)


def test_embedding_with_a_vocab_split_some_rank_holds_no_rows_of():
    # 5 rows on 4 ranks (2, 2, 1, 0): rank 3 raised "index_select(): self indexing axis dim should be positive"
    # alone and the others waited in a collective
    res = run_ranks(embedding_empty_vocab_block, 4)
    assert [[repr(p) for p in r] for r in res] == [["S(0)"]] * 4


def tolist_of(code):
    dist, mesh = _setup([2])
    t = _place(dist, mesh, torch.arange(4.0), code)
    if code != "R":
        with pytest.raises(RuntimeError, match="unshard_dtensor"):
            t.tolist()
        return [round(v, 4) for v in dist.unshard_dtensor(t).tolist()]
    return t.tolist()


@pytest.mark.parametrize("code", ["S(0)", "P", "R"])
def test_tolist_of_a_dist_tensor_gives_the_value_or_says_how_to_get_it(code):
    # it raised torch's ".tolist() is not supported for tensor subclasses" on every layout; as item(): the value of a
    # Replicate tensor, and a pointer to unshard_dtensor for a split or Partial one
    assert run_ranks(tolist_of, 2, code) == [[0.0, 1.0, 2.0, 3.0]] * 2


def masked_attention(mesh_shape, code):
    import torch.nn.functional as F

    dist, mesh = _setup(mesh_shape)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    mask[0, 0] = False  # a row with nothing to attend to: what the kernel makes of it, on every rank as in one
    ds = [_place(dist, mesh, t, code).detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ds, attn_mask=mask)
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * w).sum().backward()
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*dense, attn_mask=mask)
    (want * w).sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(out).detach(), want.detach(), equal_nan=True)
    for d, t in zip(ds, dense):
        torch.testing.assert_close(dist.unshard_dtensor(d.grad), t.grad, equal_nan=True)
    return out.placements


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mesh_shape,code", [([2], "S(1)"), ([2, 2], "S(0),S(1)")])
def test_attention_with_a_mask_on_split_heads_runs_on_each_ranks_heads(mesh_shape, code):
    """scaled_dot_product_attention with an attn_mask on q, k, v split by heads (and batch): torch's rule propagated
    through the CPU kernel's decomposition and did not return within 100 s. Each rank now attends over its own heads,
    the mask read whole; values and gradients as in one process."""
    n = math.prod(mesh_shape)
    want = [parse_placement(p) for p in code.split(",")]
    assert run_ranks(masked_attention, n, mesh_shape, code, timeout=50) == [want] * n
