"""The ZeRO engine's gradient reductions: fleet's sharding optimizer under a plain torch GradScaler, and
group_sharded_parallel's os_g reducing each gradient during backward, in one order on every rank, against one
process."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks
from tests.ranks.test_fleet_audit import _init

# -- fleet sharding (HybridParallelOptimizer over OwnerZero) with a torch GradScaler not made distributed ------------
STEPS, INF_STEP = 4, 1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _batch(step, rank, b=3):
    """Rank ``rank``'s rows at ``step``; at INF_STEP rank 1 has an inf input, which makes NaN only in the gradient
    of ``0.weight``, a parameter rank 0 steps (greedy by size), so rank 1's own check of what it steps sees none."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(b, 6, generator=g), torch.randn(b, 3, generator=g)
    if step == INF_STEP and rank == 1:
        x[1, 2] = float("inf")
    return x, y


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _dense_scaled(world):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scaler, scales = _scaler(), []
    for s in range(STEPS):
        xs, ys = zip(*(_batch(s, r) for r in range(world)))
        scaler.scale(F.mse_loss(model(torch.cat(xs)), torch.cat(ys))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, scales


def _fleet_scaled(hybrid, unscale_first):
    fleet = _init(**hybrid)
    hcg = fleet.get_hybrid_communicate_group()
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1))
    model = fleet.distributed_model(model)
    scaler, scales, held = _scaler(), [], []  # a plain torch GradScaler: not through fleet.distributed_scaler
    rank = hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size() + hcg.get_sharding_parallel_rank()
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(step, rank)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if unscale_first:  # unscales the param_groups' gradients (this rank's) only: step unscales the rest
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        scales.append(scaler.get_scale())
        held.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    owners = {n: opt.owner[id(p)] for n, p in model.named_parameters()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, scales, held, owners


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
@pytest.mark.parametrize("hybrid,world", [({"sharding_degree": 2}, 2), ({"sharding_degree": 2, "dp_degree": 2}, 4)],
                         ids=["sharding2", "sharding2_dp2"])
def test_fleet_sharding_with_a_plain_grad_scaler_matches_one_process(hybrid, world, unscale_first):
    # every gradient is unscaled before it is reduced (not only those of the parameters the rank steps), and the
    # inf/NaN of rank 1's step 1 skips the step on every rank, whose scaler backs off alike
    want, want_scales = _dense_scaled(world)
    assert want_scales == [2.0**10, 2.0**9, 2.0**9, 2.0**10]
    for params, scales, held, owners in run_ranks(_fleet_scaled, world, hybrid, unscale_first, timeout=100):
        assert owners["0.weight"] == 0 and owners["2.weight"] == 1
        assert scales == want_scales
        assert held == [False, True, False, False]
        for k, v in want.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=k)


# -- group_sharded_parallel(level="os_g"): eager, ordered reductions ------------------------------------------------
class _Net(nn.Module):
    """Six layers in a row, and ``side`` after the third (rank 0 alone takes it where ``branch`` is on); each
    registered where the forward uses it, so backward makes the gradients in reverse registration order."""

    def __init__(self, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.side = nn.Linear(width, width)
        self.post = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, 2)

    def forward(self, x, take_side=False):
        for layer in self.pre:
            x = torch.tanh(layer(x))
        if take_side:
            x = x + self.side(x)
        for layer in self.post:
            x = torch.tanh(layer(x))
        return self.head(x)


def _rows(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 2, generator=g)


def _takes_side(step, rank, branch):
    return branch and rank == 0 and step >= 1  # side: no gradient anywhere at step 0, rank 0's alone after


def _micro(x, y, micro):
    return zip(x.chunk(micro), y.chunk(micro))


def _dense_net(branch, micro, world=2, steps=3):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for s in range(steps):
        loss = 0.0
        for r in range(world):
            for x, y in _micro(*_rows(s, r), micro):
                loss = loss + F.mse_loss(model(x, _takes_side(s, r, branch)), y) / (world * micro)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # as Paddle's clear_grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _live_grad_bytes(params):
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def _os_g_run(branch, segment_size, micro, steps=3):
    """os_g training (``micro`` backwards per step); the peak bytes of the full gradients the model's parameters
    hold during each step's backwards, read by hooks that run before the engine's on each parameter and at the end
    of each backward."""
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    rank = dist.get_rank()
    model = _Net()
    params = list(model.parameters())
    peak, queued = [0], [False]

    def measure():
        peak[0] = max(peak[0], _live_grad_bytes(params))

    def end():
        measure()
        queued[0] = False

    def on_grad(p):
        measure()
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(end)

    for p in params:  # registered first, so each runs before the engine's hook on its parameter
        p.register_post_accumulate_grad_hook(on_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    model, opt, _ = group_sharded_parallel(model, opt, "os_g", segment_size=segment_size)
    peaks, ops = [], []
    for s in range(steps):
        peak[0] = 0
        with trace.record() as mem:
            for x, y in _micro(*_rows(s, rank), micro):
                (F.mse_loss(model(x, _takes_side(s, rank, branch)), y) / micro).backward()
        peaks.append(peak[0])
        ops.append([e.op for e in mem.of_kind("collective")])
        opt.step()
        opt.clear_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    modes = {names[id(s.param)]: s.piece.mode for s in opt._slots}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, peaks, ops, modes


def _layer_bytes(layer):
    return sum(p.numel() * p.element_size() for p in layer.parameters())


# (branch, segment_size: 100 slices the weights and keeps the rest whole, backwards per step)
OS_G = [(False, 1, 1), (True, 1, 1), (False, 100, 1), (True, 100, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("branch,segment_size,micro", OS_G,
                         ids=[f"{'branch' if b else 'plain'}-segment{s}-x{m}" for b, s, m in OS_G])
def test_os_g_reduces_during_backward_in_one_order_and_matches_one_process(branch, segment_size, micro):
    want = _dense_net(branch, micro)
    ref = _Net()
    layer, total = _layer_bytes(ref.pre[0]), sum(p.numel() * 4 for p in ref.parameters())
    names = [n for n, _ in ref.named_parameters()]
    results = run_ranks(_os_g_run, 2, branch, segment_size, micro, timeout=100)
    for rank, (got, peaks, ops, modes) in enumerate(results):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
        # the full gradients held at once during backward: one layer's at most (each is reduced and freed as
        # backward makes it), not every one of them; a parameter this rank's backward does not reach (side, where
        # it is not taken) is reduced as zeros at its turn, without waiting for the end of the backward
        assert 0 < max(peaks) <= layer < total / 6, (rank, peaks)
        # one reduction per parameter, in reverse registration order, then the agreement on which were made
        want_ops = [("reduce_scatter" if modes[n] == "slice" else "reduce") for n in reversed(names)] + ["all_reduce"]
        assert ops == [want_ops * micro] * 3
        assert any(m == "slice" for m in modes.values()) and (segment_size == 1) == all(
            m == "slice" for m in modes.values())


def _os_g_bare(branch):
    got, peaks, _, _ = _os_g_run(branch, 1, 1)
    return got, peaks


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_os_g_with_a_branch_one_rank_takes_matches_one_process_on_gloo_processes():
    want = _dense_net(True, 1)
    for got, _ in run_ranks(_os_g_bare, 2, True, timeout=240, ranks="processes"):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


# -- os_g with gradients a nested backward makes (a reentrant checkpoint) and a weight used twice ---------------------
class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, reentrant):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.a(x))
        # b's gradients come from the checkpoint's own backward, run inside this one: its graph does not reach them
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=reentrant)
        return self.c(h) + (x @ self.a.weight.t()).sum(-1, keepdim=True)


def _ck_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g).requires_grad_(), torch.randn(4, 3, generator=g)


def _ck_run(reentrant, sharded):
    model = _Checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ranks = [0, 1]  # one process: both ranks' rows
    if sharded:
        import meshviz.distributed as dist
        from meshviz.distributed.sharding import group_sharded_parallel

        dist.init_parallel_env()
        ranks = [dist.get_rank()]
        model, opt, _ = group_sharded_parallel(model, opt, "os_g", segment_size=1)
    for step in range(3):
        xs, ys = zip(*(_ck_batch(step, r) for r in ranks))
        F.mse_loss(model(torch.cat(xs), reentrant), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_os_g_with_a_checkpoint_and_a_weight_used_twice_matches_one_process(reentrant):
    want = _ck_run(reentrant, False)
    for got in run_ranks(_ck_run, 2, reentrant, True, timeout=100):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
