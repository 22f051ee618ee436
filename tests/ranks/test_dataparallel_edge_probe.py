"""DataParallel against one process: a parameter some ranks leave unused after the first synced step, a model that
returns a dataclass, a reentrant checkpoint."""

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

from .test_data_parallel_probe import _batch, _grads, _loss, _Net


def _sgd(params):  # momentum and decay: a parameter stepped on a zero gradient instead of none moves away
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _uses_b(r, step, first):
    """(rank, step) -> which of the step's two micro-batches (inside no_sync, synced) use b; ``first``: the plan
    starts at step 1 (the first synced step leaves b out on one rank, after a no_sync() step that used it)."""
    step += first
    if step == 1:  # one rank leaves b out (a data-dependent branch): the others wait in b's bucket
        return True, r != 1
    if step == 2:  # no rank uses b: one process keeps no gradient for it
        return False, False
    if step == 3:  # rank 0 uses b inside no_sync() only: its accumulated gradient is still averaged
        return True, r != 0
    return True, True


def _unused_later(traced, first):
    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    net = _Net()
    with trace.record() if traced else contextlib.nullcontext():
        dp = dist.DataParallel(net, comm_buffer_size=0.0001, last_comm_buffer_size=0.00005)  # several buckets
        opt = _sgd(net.parameters())
        out = []
        for step in range(5):
            early, synced = _uses_b(r, step, first)
            with dp.no_sync():
                _loss(dp, r, 10 * step, use_b=early).backward()
            _loss(dp, r, 10 * step + 1, use_b=synced).backward()
            grads = _grads(net)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append((grads, {k: v.detach().clone() for k, v in net.state_dict().items()}))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("n,first", [(2, 0), (3, 0), (2, 1)])
def test_a_parameter_one_rank_stops_using_trains_as_one_process(n, first, traced):
    """Without find_unused_parameters: b left out of one rank's loss is averaged with that rank's zeros; used by no
    rank, it keeps no gradient; used inside no_sync() only, its accumulated gradient is averaged. first=0: the first
    synced step used b everywhere (nothing is searched), and the rank that left b out later used to raise at the
    end of its backward while the others waited in b's bucket all-reduce until the timeout. first=1: the first
    synced step left b out on rank 1 after a no_sync() step, and its forward used to raise on every rank."""
    res = run_ranks(_unused_later, n, traced, first, timeout=50, collective_timeout=15)
    torch.manual_seed(0)
    net = _Net()
    opt = _sgd(net.parameters())
    for step in range(5):
        for r in range(n):
            early, synced = _uses_b(r, step, first)
            ((_loss(net, r, 10 * step, use_b=early) + _loss(net, r, 10 * step + 1, use_b=synced)) / n).backward()
        grads = _grads(net)
        assert (grads["b.weight"] is None) == (step + first == 2)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for r in range(n):
            for got, want in zip(res[r][step], (grads, net.state_dict())):
                assert got.keys() == want.keys()
                for k, v in want.items():
                    if v is None:
                        assert got[k] is None, (r, step, k)
                    else:
                        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6,
                                                   msg=lambda m: f"{r} {step} {k}: {m}")


# -- a model whose forward returns a dataclass (torch DDP looks inside one) --------------------------------------

@dataclasses.dataclass
class _Output:
    pred: torch.Tensor
    note: str = "a field that is no tensor"


class _DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _Net()

    def forward(self, x, use_b=True):
        return _Output(self.net(x, use_b))


def _dataclass_loss(model, r, step, use_b):
    x, y = _batch(r, step)
    return nn.functional.mse_loss(model(x, use_b=use_b).pred, y)


def _skipping_b(make_model, loss, skip_at):
    """Three DataParallel steps, rank 1 leaving b out of its loss at step ``skip_at``: each step's gradients."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    model = make_model()
    dp = dist.DataParallel(model)
    opt = _sgd(model.parameters())
    out = []
    for step in range(3):
        loss(dp, r, step, use_b=not (r == 1 and step == skip_at)).backward()
        out.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _check_skipping_b(make_model, loss, skip_at):
    """:func:`_skipping_b` on 2 rank threads against one process stepping on the mean of both ranks' losses."""
    res = run_ranks(_skipping_b, 2, make_model, loss, skip_at, timeout=50)
    torch.manual_seed(0)
    model = make_model()
    opt = _sgd(model.parameters())
    for step in range(3):
        sum(loss(model, r, step, use_b=not (r == 1 and step == skip_at)) for r in range(2)).div(2).backward()
        for r in range(2):
            for k, p in model.named_parameters():
                torch.testing.assert_close(res[r][step][k], p.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{r} {step} {k}: {m}")
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("skip_at", [0, 1, None])
def test_a_model_that_returns_a_dataclass_trains_as_one_process(skip_at):
    """The output's tensors are found inside a dataclass as torch DDP finds them: every parameter used (None), or
    b left out of rank 1's loss at the first synced step (0) or later (1). The first synced forward used to find no
    tensor in the output, take every parameter for unused and build DDP again to search for them: the backward
    then raised DDP's "Expected to mark a variable ready only once" on every rank."""
    _check_skipping_b(_DataclassNet, _dataclass_loss, skip_at)


# -- a reentrant checkpoint (recompute with use_reentrant=True, Paddle's default) --------------------------------

class _Recomputed(nn.Module):
    """b runs inside a reentrant checkpoint: its parameters are reached by the checkpoint's own backward only.
    ``use_b=False`` leaves out b, or with ``plain`` a layer d outside the checkpoint."""

    def __init__(self, plain):
        super().__init__()
        self.net = _Net()
        self.d = nn.Linear(4, 4)
        self.plain = plain

    def forward(self, x, use_b=True):
        from meshviz.distributed.fleet.utils import recompute

        h = torch.tanh(self.net.a(x))
        if use_b or self.plain:
            h = h + recompute(self.net.b, h, use_reentrant=True)
        if use_b or not self.plain:
            h = h + self.d(h)
        return self.net.c(h)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("skip_at", [None, 0, 1])
def test_a_reentrant_checkpoint_trains_as_one_process(skip_at, plain):
    """The first synced forward's search for unused parameters cannot see inside a reentrant checkpoint: it used to
    take b for unused on every rank and build DDP again to search at every step, whose backward then raised
    "Expected to mark a variable ready only once" on every rank. Now the reducer stays (as torch DDP trains such a
    model), and a layer rank 1 leaves out, at the first synced step or later, inside the checkpoint or outside it
    (plain), is averaged with its zeros."""
    _check_skipping_b(functools.partial(_Recomputed, plain), _loss, skip_at)
