"""shard_layer + shard_optimizer at every ShardingStage against one dense process: tied weights, gradients left
to accumulate over steps or dropped by the model's zero_grad(), a parameter unfrozen after the optimizer was
sharded."""

import numpy as np
import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

STAGES = (None, 1, 2, 3)
V, H = 10, 6


def _stage(dist, stage, mesh):
    return None if stage is None else getattr(dist, f"ShardingStage{stage}")("dp", mesh)


class TiedLM(nn.Module):
    """An embedding tied to the output layer: one parameter held by two sublayers, used twice a forward."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = nn.Embedding(V, H)
        self.fc = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            for p in (self.emb.weight, self.fc.weight, self.fc.bias):
                p.copy_(torch.randn(p.shape, generator=g))
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.emb(ids))))


def _batches(steps=3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, V, (4, 3), generator=g), torch.randint(0, V, (4, 3), generator=g))
            for _ in range(steps)]


def _ce(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _dense_tied():
    m = TiedLM()
    opt = _adamw(m)
    for x, y in _batches():
        _ce(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in m.named_parameters()}


def _tied_run(stage, mesh_ids, split):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    nd = np.asarray(mesh_ids).ndim
    mesh = dist.ProcessMesh(mesh_ids, dim_names=["dp", "mp"][:nd])
    m = TiedLM()

    def shard_fn(name, layer, pm):
        # "emb": the head keeps the tied weight it was given, and follows; "both": each placed, the same way
        if name == split or (split == "both" and name in ("emb", "head")):
            layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Replicate()] * (nd - 1) + [dist.Shard(1)])

    dist.shard_layer(m, mesh, shard_fn)
    tied = m.emb.weight is m.head.weight
    opt = dist.shard_optimizer(_adamw(m), _stage(dist, stage, mesh))
    pl = [dist.Shard(0)] + [dist.Replicate()] * (nd - 1)
    for x, y in _batches():
        _ce(m(dist.shard_tensor(x, mesh, pl)), dist.shard_tensor(y, mesh, pl)).backward()
        opt.step()
        opt.clear_grad()
    return tied, {n: dist.unshard_dtensor(p).detach() for n, p in m.named_parameters()}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mesh_ids,split", [([0, 1], None), ([[0, 1], [2, 3]], "emb"), ([0, 1], "both")])
def test_shard_layer_keeps_a_tied_weight_one_parameter(stage, mesh_ids, split):
    """Paddle 3.3.1's shard_layer makes each holder of a tied weight a dist parameter of its own (two parameters,
    each stepped on its own gradient); here it stays one, and training matches the dense model's."""
    want = _dense_tied()
    for tied, got in run_ranks(_tied_run, int(np.asarray(mesh_ids).size), stage, mesh_ids, split, timeout=120):
        assert tied
        assert sorted(got) == sorted(want)  # head.weight is emb.weight: named once
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _tied_two_ways():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    m = TiedLM()

    def shard_fn(name, layer, pm):
        if name in ("emb", "head"):
            layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(0 if name == "emb" else 1)])

    with pytest.raises(ValueError) as e:
        dist.shard_layer(m, mesh, shard_fn)
    return str(e.value), m.emb.weight is m.head.weight, type(m.emb.weight).__name__


def test_a_tied_weight_placed_two_ways_raises_and_leaves_the_layer():
    for msg, tied, kind in run_ranks(_tied_two_ways, 2, timeout=60):
        assert msg == ("shard_layer: ['emb.weight', 'head.weight'] are one parameter (tied weights), and shard_fn "
                       "placed it in more than one way: ['[S(0)]', '[S(1)]']; place it once (a tied parameter is one "
                       "tensor)")
        assert tied and kind == "Parameter"


# -- gradients left to accumulate over steps, or dropped by the model ----------------------------------------------
def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _loss(x, a, b):
    return (torch.tanh(x @ a) @ b).pow(2).mean()


def _dense_accumulated(every, clip):
    a, b = nn.Parameter(_w(5, 6, seed=1)), nn.Parameter(_w(6, 3, seed=2))
    opt = _sgd([a, b])
    for i in range(4):
        _loss(_w(8, 5, seed=10 + i), a, b).backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_([a, b], 0.5) > 0.5  # it clips
        opt.step()
        if i % every == every - 1:
            opt.zero_grad()
    return a.detach(), b.detach()


def _accumulated_run(stage, every, clip):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    a = dist.shard_tensor(nn.Parameter(_w(5, 6, seed=1)), mesh, [dist.Replicate()])
    b = dist.shard_tensor(nn.Parameter(_w(6, 3, seed=2)), mesh, [dist.Replicate()])
    opt = dist.shard_optimizer(_sgd([a, b]), _stage(dist, stage, mesh))
    for i in range(4):
        _loss(dist.shard_tensor(_w(8, 5, seed=10 + i), mesh, [dist.Shard(0)]), a, b).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([a, b], 0.5)
        opt.step()
        if i % every == every - 1:
            opt.clear_grad()
    return dist.unshard_dtensor(a).detach(), dist.unshard_dtensor(b).detach()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("every,clip", [(2, False), (4, False), (4, True)])
def test_gradients_not_cleared_accumulate_into_the_next_step(stage, every, clip):
    """No clear_grad between steps: the next backward adds to the gradient, as in one process (and as Paddle 3.3.1's
    stages 1-3 on 2 CPU ranks do), and a clip between backward and step reads the whole of it."""
    want = _dense_accumulated(every, clip)
    for got in run_ranks(_accumulated_run, 2, stage, every, clip, timeout=90):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# -- a parameter frozen when the optimizer was sharded, unfrozen later, under a loss scaler ---------------------------
def _train_unfrozen_at_step_2(w, v, x, opt, scaler, clear):
    """Four scaled steps of ``(x @ w @ v)^2``; ``v`` (frozen before) takes part from step 2 on."""
    for i in range(4):
        if i == 2:
            v.requires_grad_(True)
        scaler.scale((x @ w @ v).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        clear()


def _unfrozen_dense():
    w, v, x = nn.Parameter(_w(4, 3)), nn.Parameter(_w(3, 2, seed=1)), _w(4, 4, seed=2)
    v.requires_grad_(False)
    opt = torch.optim.SGD([w, v], lr=0.1)
    _train_unfrozen_at_step_2(w, v, x, opt, torch.amp.GradScaler("cpu", init_scale=8.0), opt.zero_grad)
    return w.detach(), v.detach()


def _unfrozen_run(stage, shard_scaler):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    w = dist.shard_tensor(nn.Parameter(_w(4, 3)), mesh, [dist.Replicate()])
    v = dist.shard_tensor(nn.Parameter(_w(3, 2, seed=1)), mesh, [dist.Replicate()])
    v.requires_grad_(False)
    opt = dist.shard_optimizer(torch.optim.SGD([w, v], lr=0.1), _stage(dist, stage, mesh))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler = dist.shard_scaler(scaler) if shard_scaler else scaler
    x = dist.shard_tensor(_w(4, 4, seed=2), mesh, [dist.Shard(0)])
    _train_unfrozen_at_step_2(w, v, x, opt, scaler, lambda: opt.clear_grad(set_to_zero=False))
    return dist.unshard_dtensor(w).detach(), dist.unshard_dtensor(v).detach()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("shard_scaler", [False, True])
def test_a_parameter_unfrozen_after_sharding_is_unscaled(stage, shard_scaler):
    """A torch GradScaler unscales the gradients of the optimizer's param_groups: at stages 1 and 2 those are
    sharded stand-ins, lent the parameter's gradient as backward leaves it, also for a parameter that was frozen
    when the optimizer was sharded and is unfrozen later (it was stepped on its scaled gradient)."""
    want = _unfrozen_dense()
    for got in run_ranks(_unfrozen_run, 2, stage, shard_scaler, timeout=90):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _c_in_even_steps(x, a, b, c, i):
    h = torch.tanh(x @ a) @ b
    return (h @ c if i % 2 == 0 else h).pow(2).mean()


def _dense_model_zero_grad():
    a, b, c = nn.Parameter(_w(5, 6, seed=1)), nn.Parameter(_w(6, 3, seed=2)), nn.Parameter(_w(3, 3, seed=3))
    opt = torch.optim.AdamW([a, b, c], lr=0.05, weight_decay=0.1)
    for i in range(4):
        _c_in_even_steps(_w(8, 5, seed=10 + i), a, b, c, i).backward()
        opt.step()
        for p in (a, b, c):  # what nn.Module.zero_grad() does
            p.grad = None
    return a.detach(), b.detach(), c.detach()


def _model_zero_grad_run(stage):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = nn.Module()
    model.a = nn.Parameter(_w(5, 6, seed=1))
    model.b = nn.Parameter(_w(6, 3, seed=2))
    model.c = nn.Parameter(_w(3, 3, seed=3))
    dist.shard_layer(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt = dist.shard_optimizer(opt, _stage(dist, stage, mesh))
    for i in range(4):
        x = dist.shard_tensor(_w(8, 5, seed=10 + i), mesh, [dist.Shard(0)])
        _c_in_even_steps(x, model.a, model.b, model.c, i).backward()
        opt.step()
        model.zero_grad()
    return tuple(dist.unshard_dtensor(p).detach() for p in (model.a, model.b, model.c))


@pytest.mark.parametrize("stage", STAGES)
def test_a_gradient_the_model_dropped_is_not_stepped(stage):
    """torch's ``model.zero_grad()`` drops the gradients the optimizer does not hold at stages 1 and 2 (it steps
    sharded stand-ins): a parameter unused in the next step (``c``) is not stepped, as in one process. Stage 1 had
    stepped it on its stale gradient shard."""
    want = _dense_model_zero_grad()
    for got in run_ranks(_model_zero_grad_run, 2, stage, timeout=90):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
