"""Views taken before a write into their base, and attention masks per head or batch row, against one process."""

import math

import pytest
import torch

from meshviz.core.placements import parse_placement
from meshviz.testing import run_ranks

from .test_op_probe import _check, _place, _setup

# (make the view, then write): the write goes into the base or into another view of it, after the view was taken
_LATE_WRITES = {
    "row, base mul_": (lambda t: t[1], lambda t, v: t.mul_(2)),
    "row, base row set": (lambda t: t[1], lambda t, v: t.__setitem__(1, 5.0)),
    "column, base mul_": (lambda t: t[:, 1], lambda t, v: t.mul_(2)),
    "transpose, base add_": (lambda t: t.t(), lambda t, v: t.add_(1)),
    "narrow, base add_": (lambda t: t.narrow(1, 1, 2), lambda t, v: t.add_(1)),
    "unsqueeze, base add_": (lambda t: t.unsqueeze(0), lambda t, v: t.add_(1)),
    "view, base add_": (lambda t: t.view(2, 10), lambda t, v: t.add_(1)),
    "reshape, base zero_": (lambda t: t.reshape(20), lambda t, v: t.zero_()),
    "flat view, base row fill_": (lambda t: t.view(20), lambda t, v: t[2].fill_(7.0)),
    "row, column view fill_": (lambda t: t[1], lambda t, v: t[:, 0].fill_(3.0)),
    "rows, row view add_": (lambda t: t[1:3], lambda t, v: t[2].add_(100)),
    "row, base index_put_": (lambda t: t[1], lambda t, v: t.index_put_((torch.tensor([1, 3]),), torch.tensor(4.0))),
    "row of a row view, base mul_": (lambda t: t[1:4][1], lambda t, v: t.mul_(3)),
    "row, written itself": (lambda t: t[1], lambda t, v: v.mul_(10)),
}


def late_writes(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    for name, (view, write) in _LATE_WRITES.items():
        x = torch.arange(20.0).reshape(5, 4)
        t = _place(dist, mesh, x.clone(), code)
        dense_view, v = view(x), view(t)
        write(x, dense_view)
        write(t, v)
        try:
            _check(dist, mesh, v, dense_view)
            _check(dist, mesh, t, x)
            torch.testing.assert_close(dist.unshard_dtensor(v * 1), dense_view)  # read by an op, too
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([2], "S(1)"), ([2], "P"), ([2, 2], "S(0),S(1)")])
def test_a_view_taken_before_a_write_into_its_base_sees_the_write(mesh_shape, code):
    """``v = t[1]`` on a row-split tensor is a gathered copy; a later ``t.mul_(2)`` (or ``t[1] = 5``, a write into
    another view of ``t``) left ``v`` with the old values ([4, 5, 6, 7] where one process gives [8, 10, 12, 14]).
    A view whose base was written since its block was made now reads its base anew, as a torch view does."""
    assert run_ranks(late_writes, math.prod(mesh_shape), mesh_shape, code) == [True] * math.prod(mesh_shape)


def chained_late_writes():
    dist, mesh = _setup([2])
    x = torch.arange(24.0).reshape(6, 4)
    t = _place(dist, mesh, x.clone(), "S(0)")
    rows, dense_rows = t[1:5], x[1:5]
    row, dense_row = rows[2], dense_rows[2]
    t.mul_(2)
    x.mul_(2)
    _check(dist, mesh, row, dense_row)
    row.add_(1)  # a write into the view of a view, once it has read the base anew: reaches both
    dense_row.add_(1)
    _check(dist, mesh, rows, dense_rows)
    _check(dist, mesh, t, x)
    t[3] = -1.0
    x[3] = -1.0
    _check(dist, mesh, row, dense_row)
    return True


def test_a_chain_of_views_reads_its_base_anew_and_writes_it():
    assert run_ranks(chained_late_writes, 2) == [True] * 2


def masked_attention(mesh_shape, code, mask_shape, mask_code, boolean):
    import torch.nn.functional as F

    dist, mesh = _setup(mesh_shape)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    if boolean:
        mask = torch.rand(mask_shape, generator=g) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(mask_shape, generator=g)
    ds = [_place(dist, mesh, t, code).detach().requires_grad_() for t in (q, k, v)]
    dmask = mask if mask_code is None else _place(dist, mesh, mask, mask_code)
    out = F.scaled_dot_product_attention(*ds, attn_mask=dmask)
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * w).sum().backward()
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*dense, attn_mask=mask)
    (want * w).sum().backward()
    _check(dist, mesh, out.detach(), want.detach())
    for d, t in zip(ds, dense):
        _check(dist, mesh, d.grad, t.grad)
    return out.placements


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mesh_shape,code,mask_shape,mask_code,boolean", [
    ([2], "S(1)", (2, 4, 8, 8), None, True),
    ([2], "S(1)", (1, 4, 8, 8), None, False),
    ([2], "S(0)", (2, 1, 8, 8), None, True),
    ([2], "S(1)", (2, 4, 8, 8), "S(1)", False),
    ([2], "S(1)", (2, 4, 8, 8), "S(2)", True),
    ([2], "S(1)", (2, 4, 8, 8), "P", False),
    ([2, 2], "S(0),S(1)", (2, 4, 8, 8), None, True),
    ([2, 2], "S(0),S(1)", (2, 1, 8, 8), "S(0),R", False),
])
def test_attention_with_a_mask_per_head_or_batch_row_runs_on_each_ranks_heads(mesh_shape, code, mask_shape,
                                                                              mask_code, boolean):
    """scaled_dot_product_attention on q, k, v split by heads (or batch) with an attn_mask that has a heads or batch
    dim ([B, H, S, S], [1, H, S, S], [B, 1, S, S]; dense, or a dist tensor in any layout) went to torch's rule through
    the CPU kernel's decomposition: no result within 100 s. Each rank now attends over its own heads with its part
    of the mask; values and gradients as in one process."""
    n = math.prod(mesh_shape)
    want = [parse_placement(p) for p in code.split(",")]
    assert run_ranks(masked_attention, n, mesh_shape, code, mask_shape, mask_code, boolean, timeout=40) == [want] * n


def late_writes_gradient(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    for view, write in [(lambda t: t[1], lambda t: t.mul_(2)),
                        (lambda t: t[:, 1], lambda t: t.__setitem__((slice(None), 1), t[:, 2] * 3)),
                        (lambda t: t.view(2, 10), lambda t: t.mul_(3))]:
        x = torch.arange(20.0).reshape(5, 4)
        a = x.clone().requires_grad_()
        t = a * 1
        v = view(t)
        write(t)
        w = torch.linspace(-1, 1, v.numel()).reshape(v.shape)
        ((v * w).sum() + t.sum()).backward()
        da = _place(dist, mesh, x.clone(), code).requires_grad_()
        dt = da * 1
        dv = view(dt)
        write(dt)
        ((dv * w).sum() + dt.sum()).backward()
        _check(dist, mesh, dv.detach(), v.detach())
        _check(dist, mesh, da.grad, a.grad)
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([2], "S(1)"), ([2, 2], "S(0),S(1)")])
def test_a_view_taken_before_a_write_into_its_base_has_the_dense_value_and_gradient(mesh_shape, code):
    """A non-leaf's view taken before an in-place write into it: its value was the old one (``t[1]`` of a
    row-split ``t`` gave [4, 5, 6, 7], one process [8, 10, 12, 14] after ``t.mul_(2)``); value and gradient now
    as in one process."""
    n = math.prod(mesh_shape)
    assert run_ranks(late_writes_gradient, n, mesh_shape, code) == [True] * n


def relaid_view_writes():
    dist, mesh = _setup([2])
    x = torch.arange(20.0).reshape(5, 4)
    t = _place(dist, mesh, x.clone(), "S(1)")
    v, dense = t[1:3], x[1:3]
    v.cumsum_(1)  # the scanned dim made whole first: the view holds a block of its own from now on
    dense.cumsum_(1)
    v.add_(1)
    dense.add_(1)
    _check(dist, mesh, t, x)
    t.mul_(2)
    x.mul_(2)
    _check(dist, mesh, v, dense)
    return True


def test_a_view_laid_out_anew_by_an_in_place_op_keeps_writing_its_base():
    """``v = t[1:3]`` of a column-split ``t`` shares ``t``'s block; ``v.cumsum_(1)`` lays ``v`` out whole first, so
    ``v`` holds a block of its own. A later ``v.add_(1)`` was taken to have landed in ``t``'s block and ``t`` kept
    its old rows; it now reaches ``t``, and a write into ``t`` reaches ``v``."""
    assert run_ranks(relaid_view_writes, 2) == [True] * 2


def out_into_a_view(code):
    dist, mesh = _setup([2])
    x = torch.arange(20.0).reshape(5, 4)
    t = _place(dist, mesh, x.clone(), code)
    rows, dense_rows = t[0:3], x[0:3]
    a = dist.shard_tensor(torch.linspace(0, 1, 4), mesh, [dist.Replicate()])
    torch.add(a, a, out=t[1])
    torch.add(torch.linspace(0, 1, 4), torch.linspace(0, 1, 4), out=x[1])
    _check(dist, mesh, t, x)
    _check(dist, mesh, rows, dense_rows)
    return True


@pytest.mark.parametrize("code", ["S(0)", "S(1)"])
def test_an_out_argument_that_is_a_view_writes_its_base(code):
    """``torch.add(a, a, out=t[1])``: the out view held the sum, ``t`` kept its row ([4, 5, 6, 7] where one process
    gives [0, 0.67, 1.33, 2]); the write now reaches ``t`` and the views taken of it before."""
    assert run_ranks(out_into_a_view, 2, code) == [True] * 2
