"""Overlapping writes under autograd and in-place ops that change a shape, on dist tensors, against one process."""

import math

import pytest
import torch

from meshviz.testing import run_ranks

from .test_op_probe import _check, _place, _setup

# each writes memory it reads through another view; one process runs them under autograd (the value in the order
# it writes, the gradient of the op as autograd records it)
_OVERLAPPING = {
    "t[:, 1:].copy_(t[:, :-1])": lambda t: t[:, 1:].copy_(t[:, :-1]),
    "t.add_(t[:, :1])": lambda t: t.add_(t[:, :1]),
    "t.sub_(t.diagonal())": lambda t: t.sub_(t.diagonal()),
    "t[0].copy_(t[:, 0])": lambda t: t[0].copy_(t[:, 0]),
    "v = t[1:]; v[:, 1:].copy_(v[:, :-1])": lambda t: (lambda v: v[:, 1:].copy_(v[:, :-1]))(t[1:]),
    "t.narrow(1, 1, 2).copy_(t.narrow(1, 0, 2)) twice, then mul_": lambda t: (
        t.narrow(1, 1, 2).copy_(t.narrow(1, 0, 2)), t.narrow(1, 1, 2).copy_(t.narrow(1, 0, 2)), t.mul_(2)),
    "t.select(1, 0).copy_(t.select(0, 0))": lambda t: t.select(1, 0).copy_(t.select(0, 0)),
}
# one process's autograd refuses these; meshviz raises the same error on every rank
_AUTOGRAD_REFUSES = {
    "mm(t, t, out=t)": (lambda t: torch.mm(t, t, out=t), "don't support automatic differentiation"),
    "t.addmm_(t, t)": (lambda t: t.addmm_(t, t), "modified by an inplace operation"),
    "t[:, 1:].mul_(t[:, :-1])": (lambda t: t[:, 1:].mul_(t[:, :-1]), "modified by an inplace operation"),
}


def overlapping_writes_under_autograd(mesh_shape, code, k):
    dist, mesh = _setup(mesh_shape)
    g = torch.Generator().manual_seed(5)
    x, wt = torch.randn(k, k, generator=g), torch.randn(k, k, generator=g)
    for name, f in _OVERLAPPING.items():
        ref = x.clone().requires_grad_()
        t = ref * 1
        f(t)
        (t * wt).sum().backward()
        w = _place(dist, mesh, x, code).detach().requires_grad_()
        y = w * 1
        f(y)
        (y * _place(dist, mesh, wt, code)).sum().backward()
        try:
            _check(dist, mesh, y.detach(), t.detach())
            _check(dist, mesh, w.grad, ref.grad)
        except AssertionError as e:
            raise AssertionError(f"{name} on {code}: {e}") from None
    for f, msg in _AUTOGRAD_REFUSES.values():
        with pytest.raises(RuntimeError, match=msg):
            t = x.clone().requires_grad_() * 1
            f(t)
            t.sum().backward()
        with pytest.raises(RuntimeError, match=msg):
            y = _place(dist, mesh, x, code).detach().requires_grad_() * 1
            f(y)
            y.sum().backward()
    return True


@pytest.mark.parametrize("mesh_shape,code,k", [
    ([2], "S(1)", 4), ([2], "S(0)", 4), ([2], "P", 4), ([4], "S(1)", 3), ([2, 2], "S(0),S(1)", 4),
    ([2, 2], "S(1),S(1)", 3), ([2, 2], "R,S(0)", 3),
])
def test_an_overlapping_write_under_autograd_gives_one_process_values_and_gradients(mesh_shape, code, k):
    """``y[:, 1:].copy_(y[:, :-1])`` with ``y = w * 1`` and ``w`` requiring grad raised "not supported with
    autograd" on every rank, where one process runs it. It now gives one process's values and ``w.grad``; where one
    process's autograd refuses (``mm(t, t, out=t)``, a factor written in place), the same RuntimeError."""
    n = math.prod(mesh_shape)
    assert run_ranks(overlapping_writes_under_autograd, n, mesh_shape, code, k) == [True] * n


# each changes its tensor's shape or strides in place
_RESHAPING = {
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),
    "swapdims_": lambda t: t.swapdims_(0, 1),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "squeeze_ of a size-1 dim": lambda t: t.squeeze_(1),
    "resize_": lambda t: t.resize_(2, 12),
    "as_strided_": lambda t: t.as_strided_((2, 3), (6, 1)),
}


def reshaping_in_place(mesh_shape, code):
    dist, mesh = _setup(mesh_shape)
    x = torch.randn(4, 1, 6, generator=torch.Generator().manual_seed(2))
    for name, f in _RESHAPING.items():
        t = _place(dist, mesh, x.clone().reshape(4, 6) if name != "squeeze_ of a size-1 dim" else x.clone(), code)
        before = (t.placements, tuple(t.shape), t._local_value().clone())
        with pytest.raises(ValueError, match="in place"):
            f(t)
        assert (t.placements, tuple(t.shape)) == before[:2], name
        torch.testing.assert_close(t._local_value(), before[2])
    t = _place(dist, mesh, x.clone(), code)  # shape and strides kept: runs
    t.squeeze_(0)
    t.resize_(4, 1, 6)
    t.mul_(2)
    _check(dist, mesh, t, x * 2)
    return True


@pytest.mark.parametrize("mesh_shape,code", [([2], "S(0)"), ([2], "S(1)"), ([2], "P"), ([2, 2], "S(0),R")])
def test_an_in_place_op_that_changes_the_shape_raises_on_every_rank(mesh_shape, code):
    """``t.t_()`` on a [4, 6] row-split tensor left ``t.shape`` [4, 6] over a whole transposed [6, 4] block laid out
    [R] (``unsqueeze_``, ``resize_``, ``as_strided_`` alike; ``squeeze_`` kept the old shape over the new block): a
    dist tensor's shape is fixed when it is made. Each now raises a ValueError on every rank, the tensor untouched;
    one that keeps shape and strides (``squeeze_`` of a dim not of size 1, ``resize_`` to its own shape) runs."""
    n = math.prod(mesh_shape)
    assert run_ranks(reshaping_in_place, n, mesh_shape, code) == [True] * n
