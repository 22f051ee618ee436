"""DataParallel against one process: a parameter one rank uses with a gradient of exactly zero while others leave it
out, a deep copy of the wrapper (an EMA model), a reentrant checkpoint with find_unused_parameters=True."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

from .test_data_parallel_probe import _batch, _grads, _Net

# -- a parameter used with a gradient of exactly zero on one rank, left out on another -------------------------

# step -> each rank's use of b: "on", "zero" (its output gated to exactly zero: a gradient of zeros) or "off" (the
# data-dependent branch not taken); step 0 uses b everywhere, so the first synced step finds nothing unused
_PLAN = [("on", "on", "on"), ("zero", "off", "off"), ("off", "off", "off"), ("off", "zero", "on"),
         ("zero", "zero", "zero"), ("off", "off", "zero")]


def _use(step, r):
    return _PLAN[step][r]


class _Gated(_Net):
    def forward(self, x, use="on"):
        h = torch.tanh(self.a(x))
        if use != "off":
            gate = (x[:, :1] > 100).to(x.dtype) if use == "zero" else torch.ones_like(x[:, :1])
            h = h + self.b(h) * gate
        return self.c(h)


def _gated_loss(model, r, step):
    x, y = _batch(r, step)
    return nn.functional.mse_loss(model(x, use=_use(step, r)), y)


def _adamw(params):  # weight decay and moments: a parameter stepped on zeros instead of none moves away
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.5)


def _gated_ranks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    net = _Gated()
    dp = dist.DataParallel(net)
    opt = _adamw(net.parameters())
    out = []
    for step in range(len(_PLAN)):
        _gated_loss(dp, r, step).backward()
        grads = _grads(net)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((grads, {k: v.detach().clone() for k, v in net.state_dict().items()}))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_a_gradient_of_exact_zeros_on_one_rank_is_kept_on_every_rank(n):
    """b used on rank 0 with a gradient of exactly zero and left out on the others: one process keeps b's zeros
    (AdamW decays b and steps its moments). The ranks that left b out used to drop the averaged zeros (grad None)
    while rank 0 kept them, so AdamW moved b on rank 0 only and the replicas drifted apart. Used by no rank, b
    keeps no gradient on any rank; used with zeros everywhere, zeros everywhere."""
    res = run_ranks(_gated_ranks, n, timeout=50, collective_timeout=15)
    torch.manual_seed(0)
    net = _Gated()
    opt = _adamw(net.parameters())
    for step in range(len(_PLAN)):
        (sum(_gated_loss(net, r, step) for r in range(n)) / n).backward()
        grads = _grads(net)
        uses = {_use(step, r) for r in range(n)}
        assert (grads["b.weight"] is None) == (uses == {"off"}), step
        opt.step()
        opt.zero_grad(set_to_none=True)
        for r in range(n):
            for got, want in zip(res[r][step], (grads, net.state_dict())):
                assert got.keys() == want.keys()
                for k, v in want.items():
                    if v is None:
                        assert got[k] is None, (r, step, k)
                    else:
                        assert got[k] is not None, (r, step, k)
                        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6,
                                                   msg=lambda m: f"{r} {step} {k}: {m}")


# -- a deep copy of the wrapper (an EMA model, made on one rank or on all) --------------------------------------

def _loss(model, r, step):
    x, y = _batch(r, step)
    return nn.functional.mse_loss(model(x), y)


def _sgd_steps(model, r, steps, n=None):
    """SGD steps on rank r's batches (``n``: one process, on the mean of n ranks' losses)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        loss = _loss(model, r, step) if n is None else sum(_loss(model, q, step) for q in range(n)) / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _copied():
    import copy

    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    net = _Net()
    dp = dist.DataParallel(net)
    _sgd_steps(dp, r, [0])
    ema = None
    if r == 0:  # an EMA model is often made on one rank: nothing may wait for the others
        ema = copy.deepcopy(dp)
        with torch.no_grad():
            ema(_batch(r, 9)[0])
            for e, p in zip(ema.parameters(), dp.parameters()):
                e.mul_(0.5).add_(p, alpha=0.5)
        ema = _state(ema)
    twin = copy.deepcopy(dp)  # on every rank: trained data-parallel over the same group
    _sgd_steps(twin, r, [1, 2])
    _sgd_steps(dp, r, [3])
    # a parameter marked no_sync keeps its mark in the copy: its gradient stays this rank's own
    net.a.bias.no_sync = True
    marked = copy.deepcopy(dp)
    plain = copy.deepcopy(net)
    _loss(marked, r, 4).backward()
    _loss(plain, r, 4).backward()
    return {"twin": _state(twin), "dp": _state(dp), "ema": ema, "group": twin.group is dp.group,
            "own": (marked._layers.a.bias.grad, plain.a.bias.grad), "averaged": marked._layers.a.weight.grad}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_a_deep_copy_of_data_parallel_trains_over_the_same_group(n):
    """``copy.deepcopy(dp)`` used to raise "cannot pickle 'ThreadGroup' object" on rank threads ("cannot pickle
    ProcessGroup" on gloo processes; Paddle 3.3.1 raises so too): an EMA model that deep-copies the model it follows
    could not be made. Now the copy, made on rank 0 alone, sends nothing; made on every rank, it trains
    data-parallel as one process on parameters of its own (the original trains on unchanged), and a parameter
    marked no_sync keeps its own gradient in the copy."""
    import copy

    res = run_ranks(_copied, n, timeout=50, collective_timeout=15)
    torch.manual_seed(0)
    net = _Net()
    _sgd_steps(net, 0, [0], n)
    ema = copy.deepcopy(net)
    twin = copy.deepcopy(net)
    _sgd_steps(twin, 0, [1, 2], n)
    _sgd_steps(net, 0, [3], n)
    averaged = copy.deepcopy(net)
    (sum(_loss(averaged, q, 4) for q in range(n)) / n).backward()
    for r in range(n):
        got = res[r]
        assert got["group"]
        for name, want in (("twin", twin), ("dp", net)):
            for k, v in want.state_dict().items():
                torch.testing.assert_close(got[name][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{r} {name} {k}")
        torch.testing.assert_close(got["own"][0], got["own"][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["averaged"], averaged.a.weight.grad, rtol=1e-5, atol=1e-6)
    for k, v in ema.state_dict().items():
        torch.testing.assert_close(res[0]["ema"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"ema {k}: {m}")
    assert all(res[r]["ema"] is None for r in range(1, n))


# -- a reentrant checkpoint with find_unused_parameters=True ---------------------------------------------------

def _reentrant_ranks(plain, skip_at):
    import meshviz.distributed as dist

    from .test_dataparallel_edge_probe import _Recomputed, _sgd

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    model = _Recomputed(plain)
    dp = dist.DataParallel(model, find_unused_parameters=True)
    opt = _sgd(model.parameters())
    out = []
    for step in range(3):
        x, y = _batch(r, step)
        nn.functional.mse_loss(dp(x, use_b=not (r == 1 and step == skip_at)), y).backward()
        out.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("skip_at", [None, 0, 1])
def test_a_reentrant_checkpoint_with_find_unused_parameters_trains_as_one_process(skip_at, plain):
    """recompute(use_reentrant=True) under DataParallel(find_unused_parameters=True) used to raise torch DDP's
    "Expected to mark a variable ready only once" on every rank in the first backward (DDP's search cannot see the
    checkpoint's parameters and takes them for unused). Now it trains as one process, also where rank 1 leaves out
    a layer, inside the checkpoint or outside it (plain), at the first step (where rank 1 runs no checkpoint at all
    unless plain) or later."""
    from .test_dataparallel_edge_probe import _Recomputed, _sgd

    res = run_ranks(_reentrant_ranks, 2, plain, skip_at, timeout=50, collective_timeout=15)
    torch.manual_seed(0)
    model = _Recomputed(plain)
    opt = _sgd(model.parameters())
    for step in range(3):
        loss = 0
        for r in range(2):
            x, y = _batch(r, step)
            loss = loss + nn.functional.mse_loss(model(x, use_b=not (r == 1 and step == skip_at)), y) / 2
        loss.backward()
        grads = _grads(model)
        for r in range(2):
            assert res[r][step].keys() == grads.keys()
            for k, v in grads.items():
                if v is None:
                    assert res[r][step][k] is None, (r, step, k)
                else:
                    torch.testing.assert_close(res[r][step][k], v, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{r} {step} {k}: {m}")
        opt.step()
        opt.zero_grad(set_to_none=True)


# -- a forward with two outputs, one rank's loss using both ------------------------------------------------------

class _TwoHeads(_Gated):
    def forward(self, x, use="on"):
        h = torch.tanh(self.a(x))
        if use != "off":
            h = h + self.b(h) * (x[:, :1] > 100).to(x.dtype)  # a gradient of exactly zero
        return self.c(h), self.c(h * 2)


def _two_heads_ranks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    net = _TwoHeads()
    dp = dist.DataParallel(net)
    out = []
    for step in range(3):
        x, y = _batch(r, step)
        p, q = dp(x, use="on" if step == 0 else ("zero", "off")[r])
        (nn.functional.mse_loss(p, y) + (nn.functional.mse_loss(q, y) if r == 0 else 0)).backward()
        out.append(_grads(net))
        net.zero_grad(set_to_none=True)
    return out


@pytest.mark.timeout(60)
def test_ranks_whose_losses_use_different_outputs_settle_zero_gradients_alike():
    """The end-of-backward check runs once per backward, however many of the forward's outputs the loss uses: rank
    0's loss uses both heads, rank 1's one, and b's gradient is exactly zero on rank 0 and left out on rank 1. A
    check run once per output reached would send rank 0's flags twice and rank 1's once: rank 0 waits."""
    res = run_ranks(_two_heads_ranks, 2, timeout=50, collective_timeout=10)
    torch.manual_seed(0)
    net = _TwoHeads()
    for step in range(3):
        loss = 0
        for r in range(2):
            x, y = _batch(r, step)
            p, q = net(x, use="on" if step == 0 else ("zero", "off")[r])
            loss = loss + (nn.functional.mse_loss(p, y) + (nn.functional.mse_loss(q, y) if r == 0 else 0)) / 2
        loss.backward()
        for r in range(2):
            for k, v in _grads(net).items():
                torch.testing.assert_close(res[r][step][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{r} {step} {k}: {m}")
        net.zero_grad(set_to_none=True)


# -- sparse gradients (an embedding with sparse=True) ------------------------------------------------------------

class _SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 4, sparse=True)
        self.l = nn.Linear(4, 1)

    def forward(self, ids, gate=1.0):
        return self.l(self.e(ids) * gate).sum()


def _sparse_ids(r, step):
    return torch.tensor([r, step + 2, 7 - r])


def _sparse_ranks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(0)
    net = _SparseNet()
    dp = dist.DataParallel(net)
    out = []
    for step in range(3):
        dp(_sparse_ids(r, step), gate=0.0 if step == 1 else 1.0).backward()
        out.append({k: p.grad.to_dense().clone() for k, p in net.named_parameters()})
        net.zero_grad(set_to_none=True)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_sparse_gradients_are_averaged_as_one_process(n):
    """An embedding's sparse gradients: each rank used to keep its own rows divided by the number of ranks (the
    thread ranks' all-reduce wrote the sum into a detached alias of the sparse bucket, which a sparse copy_ leaves
    the tensor itself out of); gloo processes averaged them. Step 1 gates the embedding to a gradient of zeros."""
    res = run_ranks(_sparse_ranks, n, timeout=50, collective_timeout=15)
    torch.manual_seed(0)
    net = _SparseNet()
    for step in range(3):
        (sum(net(_sparse_ids(r, step), gate=0.0 if step == 1 else 1.0) for r in range(n)) / n).backward()
        for r in range(n):
            for k, p in net.named_parameters():
                torch.testing.assert_close(res[r][step][k], p.grad.to_dense(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{r} {step} {k}: {m}")
        net.zero_grad(set_to_none=True)
