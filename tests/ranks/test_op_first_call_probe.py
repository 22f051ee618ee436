"""An op's first call on a layout (the one that decides) moves data as its later, cached calls do."""

import math

import pytest
import torch

from meshviz.testing import run_ranks

from .test_op_probe import _check, _place, _setup

# name -> (mesh shape, [(shape, layout) per input], the op): mostly a Partial input meeting a sharded one, where
# meshviz's rule makes it Replicate and torch's rule then shards it
_CASES = {
    "mul, P meets S(0) of a broadcast": ([2], [((4, 1), "P"), ((4, 8), "S(0)")], torch.mul),
    "add, S(0) meets P of a broadcast": ([2], [((4, 8), "S(0)"), ((4, 1), "P")], torch.add),
    "div by a Partial divisor": ([2], [((4, 8), "S(0)"), ((4, 1), "P")], torch.div),
    "where, P meets S(1)": ([2], [((4, 6), "S(1)"), ((1, 6), "P")], lambda a, b: torch.where(a > 0, a, b)),
    "in-place mul_ by P": ([2], [((4, 8), "S(0)"), ((4, 1), "P")], lambda a, b: a.clone().mul_(b)),
    "mul, [P,S(1)] meets [S(0),S(1)]": ([2, 2], [((4, 8, 1), "P,S(1)"), ((4, 8, 6), "S(0),S(1)")], torch.mul),
    "sub, [S(0),P] meets [S(0),S(1)]": ([2, 2], [((4, 1), "S(0),P"), ((4, 6), "S(0),S(1)")], torch.sub),
    # a dim split unevenly by both axes (made whole on the inner one first), or a Partial one summed, then torch's
    # rule moves it on: two reshards on the first call, one on the later ones
    "softmax over rows split unevenly twice": ([2, 2], [((5, 3), "S(0),S(0)")], lambda a: torch.softmax(a, 0)),
    "cumsum along the split dim of [P,S(1)]": ([2, 2], [((5, 3), "P,S(1)")], lambda a: torch.cumsum(a, -1)),
}


def _placed(dist, mesh, x, code):
    if code == "P,S(1)":  # Partial(sum) on the first axis: rank r's summand, the rest on the axis' first rank
        t = _place(dist, mesh, x, "P")
        return dist.reshard(t, mesh, [dist.Partial(), dist.Shard(1)])
    if code == "S(0),P":
        t = _place(dist, mesh, x, "P")
        return dist.reshard(t, mesh, [dist.Shard(0), dist.Partial()])
    return _place(dist, mesh, x, code)


def _moves(events) -> list:
    return [(e.kind, e.op, tuple(e.group or ()), e.bytes) for e in events.events
            if e.kind in ("reshard", "reshard_step", "collective")]


def first_and_later_calls(name):
    from meshviz import trace
    from meshviz.runtime.op_plan import clear_decisions

    mesh_shape, inputs, op = _CASES[name]
    dist, mesh = _setup(mesh_shape)
    if dist.get_rank() == 0:
        clear_decisions()
    dist.barrier()
    g = torch.Generator().manual_seed(3)
    dense = [torch.randn(*shape, generator=g) for shape, _ in inputs]
    want = op(*dense)
    calls = []
    for _ in range(2):
        ts = [_placed(dist, mesh, x, code) for x, (_, code) in zip(dense, inputs)]
        with trace.record() as events:
            out = op(*ts)
        calls.append(_moves(events))
        _check(dist, mesh, out, want)
    assert calls[0] == calls[1], f"{name}: the first call moved {calls[0]}, a later one {calls[1]}"
    assert calls[0], f"{name}: nothing moved"
    return calls[0]


@pytest.mark.parametrize("name", list(_CASES))
def test_the_first_call_moves_as_the_cached_calls_do(name):
    """A Partial(sum) ``[4, 1]`` times a row-split ``[4, 8]`` on 2 ranks: the first call all-reduced the Partial
    input (meshviz's rule: Replicate, 16 B per rank) and then sliced it (torch's rule: Shard(0)); every later call
    reduce-scattered it straight to Shard(0) (8 B), as Paddle does. The first (deciding) call now asks torch's rule
    about the layouts meshviz's moves would give without moving, and moves each input once, as the later ones do."""
    n = math.prod(_CASES[name][0])
    got = run_ranks(first_and_later_calls, n, name)
    assert all(any(step[0] == "reshard_step" for step in r) for r in got), got
    if name == "mul, P meets S(0) of a broadcast":  # Paddle's P -> S(0): one reduce-scatter, 8 B a rank
        assert got == [[("reshard", None, (), 8), ("reshard_step", "reduce_scatter", (0, 1), 8)]] * 2, got


def backward_calls():
    from meshviz import trace
    from meshviz.runtime.op_plan import clear_decisions

    dist, mesh = _setup([2])
    if dist.get_rank() == 0:
        clear_decisions()
    dist.barrier()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 1, generator=g), torch.randn(4, 8, generator=g)
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    (ra * rb).square().sum().backward()
    calls = []
    for _ in range(2):
        ta = _place(dist, mesh, a, "P").requires_grad_()
        tb = _place(dist, mesh, b, "S(0)").requires_grad_()
        with trace.record() as events:
            (ta * tb).square().sum().backward()
        calls.append(_moves(events))
        _check(dist, mesh, tb.grad, rb.grad)
        torch.testing.assert_close(dist.unshard_dtensor(ta.grad), ra.grad)
    assert calls[0] == calls[1], (calls[0], calls[1])
    return True


def test_forward_and_backward_move_alike_on_the_first_and_the_second_step():
    """One step of a Partial ``[4, 1]`` times a row-split ``[4, 8]``, squared, summed and differentiated: its
    events on the first step (decisions made) equal those on the second (decisions cached), on every rank."""
    assert run_ranks(backward_calls, 2) == [True, True]
