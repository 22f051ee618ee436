"""In-place ops that read what they write, and views of weights an optimizer step writes, against one process."""

import math

import pytest
import torch

from meshviz.testing import run_ranks

from .test_op_probe import _check, _place, _setup

# each partly overlaps what it writes: one process refuses it (torch's "unsupported operation")
_OVERLAPS = {
    "t[1:].add_(t[:-1])": lambda t: t[1:].add_(t[:-1]),
    "t.add_(t.t())": lambda t: t.add_(t.t()),
    "t.add_(t[0])": lambda t: t.add_(t[0]),
    "t.copy_(t.t())": lambda t: t.copy_(t.t()),
    "t[1:] = t[:-1]": lambda t: t.__setitem__(slice(1, None), t[:-1]),
    "t.index_add_(0, i, t[2:])": lambda t: t.index_add_(0, torch.tensor([0, 1]), t[2:]),
    "add(t[1:], 1, out=t[:-1])": lambda t: torch.add(t[1:], 1, out=t[:-1]),
}
# each reads a part of ``t`` it does not write, or all of it: torch defines the result
_DEFINED = {
    "t.copy_(t.flip(0))": lambda t: t.copy_(t.flip(0)),
    "t[::2].mul_(t[1::2])": lambda t: t[::2].mul_(t[1::2]),
    "t[:2].copy_(t[2:])": lambda t: t[:2].copy_(t[2:]),
    "t[:, :2].add_(t[:, 2:])": lambda t: t[:, :2].add_(t[:, 2:]),
    "t[0].add_(t[3])": lambda t: t[0].add_(t[3]),
    "t.mul_(t)": lambda t: t.mul_(t),
    "cumsum(t, 0, out=t)": lambda t: torch.cumsum(t, 0, out=t),
    "t[1:].clamp_(min=t[0])": lambda t: t[1:].clamp_(min=t[0]),
    "t.view(-1)[:8].add_(t.view(-1)[8:])": lambda t: t.view(-1)[:8].add_(t.view(-1)[8:]),
}


def self_aliasing(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.arange(16.0).reshape(4, 4) + 1
    refused = []
    for name, f in _OVERLAPS.items():
        with pytest.raises(RuntimeError, match="memory location"):
            f(x.clone())
        t = _place(dist, mesh, x.clone(), code)
        with pytest.raises(ValueError, match="memory location"):
            f(t)
        _check(dist, mesh, t, x)  # untouched, and the ranks still agree on what comes next
        refused.append(name)
    for name, f in _DEFINED.items():
        want = x.clone()
        f(want)
        t = _place(dist, mesh, x.clone(), code)
        f(t)
        try:
            _check(dist, mesh, t, want)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    return refused


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([2], "S(1)"), ([2], "P"), ([2, 2], "S(0),S(1)")])
def test_an_in_place_op_partly_overlapping_what_it_reads_raises_on_every_rank(mesh_shape, code):
    """``t[1:].add_(t[:-1])`` on a row-split ``t`` gave [[1, 2, 3, 4], [6, 8, 10, 12], [14, 16, 18, 20], ...] (each
    row plus the row before it as it was) and ``t.add_(t.t())`` the symmetric sum, where one process refuses both;
    on a column split or a Partial ``t`` the same ops raised torch's RuntimeError from the blocks, or not, by layout.
    Each now raises a ValueError on every rank before anything moves; what torch defines is as in one process."""
    n = math.prod(mesh_shape)
    assert run_ranks(self_aliasing, n, mesh_shape, code) == [list(_OVERLAPS)] * n


_VIEWS = {"row": lambda w: w[1], "column": lambda w: w[:, 1], "transpose": lambda w: w.t(),
          "flat": lambda w: w.view(-1), "rows": lambda w: w[1:3], "narrow": lambda w: w.narrow(1, 1, 2)}


def views_across_a_step(stage, code, detached):
    dist, mesh = _setup([2])
    g = torch.Generator().manual_seed(0)
    w0, x = torch.randn(4, 6, generator=g), torch.randn(3, 4, generator=g)
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    want = {k: f(ref.detach()) for k, f in _VIEWS.items()}
    p = torch.nn.Parameter(_place(dist, mesh, w0.clone(), code))
    views = {k: f(p.detach() if detached else p) for k, f in _VIEWS.items()}
    stages = {0: None, 1: dist.ShardingStage1("x", mesh), 2: dist.ShardingStage2("x", mesh),
              3: dist.ShardingStage3("x", mesh)}
    dopt = dist.shard_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9), stages[stage])
    dx = dist.shard_tensor(x, mesh, [dist.Replicate()])
    for _ in range(2):
        (torch.matmul(x, ref) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        (torch.matmul(dx, p) ** 2).sum().backward()
        dopt.step()
        dopt.clear_grad()
    _check(dist, mesh, p.detach(), ref.detach())
    for k, v in views.items():
        try:
            _check(dist, mesh, v.detach(), want[k])
        except AssertionError as e:
            raise AssertionError(f"{k}: {e}") from None
    return True


@pytest.mark.parametrize("stage,code,detached", [
    (0, "S(0)", True), (0, "S(1)", False), (1, "R", True), (1, "S(0)", False), (2, "R", False), (2, "S(1)", True),
    (3, "R", False), (3, "S(0)", True),
])
def test_a_view_of_a_weight_taken_before_a_step_reads_the_stepped_weight(stage, code, detached):
    """A view of a parameter taken before ``opt.step()`` read the old weight after it: ``w[1]`` of a row-split
    weight (a gathered copy) under a plain ``shard_optimizer``, and every view of a Replicate weight under
    ShardingStage1/2 (the step's gather hands the weight a new block: ``_hold`` was no write). The step on the
    blocks and a new block now count as writes: each view reads the stepped weight, as in one process."""
    assert run_ranks(views_across_a_step, 2, stage, code, detached) == [True, True]


def view_of_a_shared_view(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.arange(20.0).reshape(4, 5)
    t = _place(dist, mesh, x.clone(), code)
    flat, dense_flat = t.view(-1), x.view(-1)
    part, dense_part = flat.narrow(0, 1, 2), dense_flat.narrow(0, 1, 2)
    t.add_(1.5)
    x.add_(1.5)
    _check(dist, mesh, part, dense_part)
    t[0] = -1.0
    x[0] = -1.0
    _check(dist, mesh, part, dense_part)
    _check(dist, mesh, flat, dense_flat)
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(1)"), ([2, 2], "S(1),P(sum)")])
def test_a_view_of_a_view_sharing_its_base_block_reads_a_write_into_the_base(mesh_shape, code):
    """``flat = t.view(-1)`` of a column-split ``t`` shares ``t``'s block; ``flat.narrow(0, 1, 2)`` gathers a copy.
    After ``t.add_(1.5)`` the copy kept [1, 2] where one process gives [2.5, 3.5]: only writes into ``flat`` itself
    were looked for. A write into any tensor whose block the base shares now makes the copy read anew."""
    n = math.prod(mesh_shape)
    assert run_ranks(view_of_a_shared_view, n, mesh_shape, code) == [True] * n


def dist_masks(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.arange(20.0).reshape(4, 5)
    t = _place(dist, mesh, x.clone(), code)
    picked = t[t > 5]
    torch.testing.assert_close(dist.unshard_dtensor(picked), x[x > 5])
    t[t > 12] = -1.0
    x[x > 12] = -1.0
    _check(dist, mesh, t, x)
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(1)"), ([2], "S(0)"), ([2, 2], "S(0),S(1)")])
def test_a_dist_boolean_mask_indexes_and_writes_as_one_process(mesh_shape, code):
    """``t[t > 12] = -1`` on a column-split ``t`` (the mask a dist tensor too) raised IndexError on every rank ("the
    shape of the mask [4, 5] ... does not match the indexed tensor [4, 3]"): only a dense mask was read as the indices
    of its nonzero elements. A dist mask now is too."""
    n = math.prod(mesh_shape)
    assert run_ranks(dist_masks, n, mesh_shape, code) == [True] * n


def out_from_dense_inputs(code):
    dist, mesh = _setup([2])
    x = torch.arange(20.0).reshape(4, 5)
    t = _place(dist, mesh, x.clone(), code)
    rows = t[1:3]
    torch.add(torch.ones(4, 5), 2.0, out=t)
    want = torch.full((4, 5), 3.0)
    _check(dist, mesh, t, want)
    _check(dist, mesh, rows, want[1:3])
    torch.mul(torch.arange(5.0), 2.0, out=t[0])
    want[0] = torch.arange(5.0) * 2
    _check(dist, mesh, t, want)
    return True


@pytest.mark.parametrize("code", ["S(0)", "S(1)", "P"])
def test_an_out_argument_that_is_dist_takes_a_result_of_dense_inputs(code):
    """``torch.add(dense, 2.0, out=t)`` with ``t`` a dist tensor raised IndexError (list index out of range): the op
    layer looked for a dist input. The result is now the dense one, replicated on ``t``'s mesh, as one process gives."""
    assert run_ranks(out_from_dense_inputs, 2, code) == [True, True]
