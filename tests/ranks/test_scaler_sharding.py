"""Loss scalers over sharded optimizers, the mp input broadcast's per-forward cost, and gradients that only some
ranks of a sharding group make (a branch one rank takes), against one process."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks
from tests.ranks.test_fleet_audit import TwoInputs


def _fleet(**hybrid):
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=s)
    return fleet


# -- fleet's mp input broadcast: no object exchange per forward ------------------------------------------------------
def _inputs(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3 + rank, 4, generator=g), torch.randn(6, generator=g)


def _forward_collectives():
    import meshviz.distributed as dist
    from meshviz import trace

    fleet = _fleet(dp_degree=1, mp_degree=2)
    model = fleet.distributed_model(TwoInputs())
    x, shift = _inputs(dist.get_rank())
    with trace.record() as mem:
        ys = [model(x, shift=shift).detach() for _ in range(3)]
    with trace.record() as bare:
        model.col(_inputs(0)[0]).detach()  # the layer's own collectives, without the broadcast
    return ([e.op for e in mem.of_kind("collective")], [e.op for e in bare.of_kind("collective")], ys)


def test_mp_input_broadcast_exchanges_no_objects_per_forward():
    torch.manual_seed(0)
    dense = nn.Linear(4, 6)
    x, shift = _inputs(0)
    for ops, bare, ys in run_ranks(_forward_collectives, 2, timeout=120):
        assert "all_gather_object" not in ops
        # per forward: one small fixed-size all-gather (layouts and shapes), a broadcast per tensor, the layer's own
        assert ops == (["all_gather", "broadcast", "broadcast"] + bare) * 3
        for y in ys:
            torch.testing.assert_close(y, (dense(x) + shift).detach(), rtol=1e-5, atol=1e-6)


def _broadcast_many():
    import meshviz.distributed as dist
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import broadcast_input_data

    fleet = _fleet(dp_degree=1, mp_degree=2)
    r = dist.get_rank()
    g = torch.Generator().manual_seed(r)
    # shapes too many for the all-gather's header (they follow in a broadcast), another dtype and shape on rank 1
    args = [torch.randn(*([1 + r] * 6), generator=g, dtype=torch.float64 if r == 0 else torch.float32)
            for _ in range(5)]
    kw = {"ids": torch.arange(4 + r), "scale": 2.0}
    out_args, out_kw = broadcast_input_data(fleet.get_hybrid_communicate_group(), *args, **kw)
    return out_args, out_kw, args, kw


def test_mp_input_broadcast_sends_shapes_that_do_not_fit_the_header():
    res = run_ranks(_broadcast_many, 2, timeout=120)
    _, _, src_args, src_kw = res[0]
    for out_args, out_kw, _, _ in res:
        assert len(out_args) == 5 and all(o.dtype == torch.float64 and o.shape == (1,) * 6 for o in out_args)
        for o, want in zip(out_args, src_args):
            torch.testing.assert_close(o, want)
        assert out_kw["ids"].tolist() == [0, 1, 2, 3] and out_kw["scale"] == 2.0


def _mismatched_layout():
    import meshviz.distributed as dist
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import broadcast_input_data

    fleet = _fleet(dp_degree=1, mp_degree=2)
    x, s = torch.ones(2), torch.zeros(2)
    args, kwargs = ((x,), {"shift": s}) if dist.get_rank() == 0 else ((x, s), {})
    try:
        broadcast_input_data(fleet.get_hybrid_communicate_group(), *args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def test_mp_input_broadcast_names_a_layout_mismatch_on_every_rank():
    want = ("fleet TensorParallel: the model-parallel ranks [0, 1] pass tensors in different places, "
            "[[('arg', 0), ('kw', 'shift')], [('arg', 0), ('arg', 1)]]; the inputs are broadcast from rank 0")
    assert run_ranks(_mismatched_layout, 2, timeout=120) == [want, want]


# -- shard_scaler and fleet.distributed_scaler modify the scaler they are given ------------------------------------
def _same_scaler():
    import meshviz.distributed as dist

    s = torch.amp.GradScaler("cpu", init_scale=8.0)
    shard = dist.shard_scaler(s)
    fleet = _fleet(dp_degree=1, mp_degree=2)
    t = torch.amp.GradScaler("cpu", init_scale=8.0)
    return (shard is s, dist.shard_scaler(s) is s, fleet.distributed_scaler(t) is t,
            isinstance(s, torch.amp.GradScaler), s.get_incr_ratio(), s.is_enable())


def test_shard_scaler_and_distributed_scaler_return_the_scaler_they_were_given():
    for got in run_ranks(_same_scaler, 2, timeout=120):
        assert got == (True, True, True, True, 2.0, True)


def _twice_errors():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    out = []
    for scaler in (dist.shard_scaler(), dist.shard_scaler(torch.amp.GradScaler("cpu"))):
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        scaler.scale(w.sum()).backward()
        scaler.unscale_(opt)
        for again in ("unscale_", "step", "step", "unscale_"):
            try:
                getattr(scaler, again)(opt)
                out.append(None)
            except RuntimeError as e:
                out.append(str(e))
    return out


def test_shard_scalers_raise_paddles_words_for_a_second_unscale_or_step():
    # Paddle 3.3.1's GradScaler (and torch's): the sentences end with a period
    want = ["unscale_() has already been called on this optimizer since the last update().", None,
            "step() has already been called since the last update().", "unscale_() is being called after step()."]
    for got in run_ranks(_twice_errors, 2, timeout=120):
        assert got == want + want


# -- a torch GradScaler over shard_optimizer's stages, against one process with the same scaler -----------------------
STEPS, INF_STEP = 4, 1


def _data(step):
    """The batch (an inf in a row of rank 1's half at ``INF_STEP``) and the starting weight."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(8, 4, generator=g), torch.randn(4, 3, generator=g)
    if step == INF_STEP:
        x[5, 0] = float("inf")
    return x, w


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _dense_scaled():
    w = nn.Parameter(_data(0)[1])
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.1)
    scaler, scales = _scaler(), []
    for s in range(STEPS):
        scaler.scale((_data(s)[0] @ w).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return w.detach(), scales


def _dist_scaled(stage, wrap):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    w = dist.shard_tensor(nn.Parameter(_data(0)[1]), mesh, [dist.Replicate()])
    shard_fn = None if stage is None else getattr(dist, f"ShardingStage{stage}")("dp", mesh)
    opt = dist.shard_optimizer(torch.optim.AdamW([w], lr=0.1, weight_decay=0.1), shard_fn)
    scaler, scales = _scaler(), []
    if wrap:
        dist.shard_scaler(scaler)  # the reference kept is the one used
    for s in range(STEPS):  # at INF_STEP only rank 1's rows hold an inf: every rank skips the step
        xs = dist.shard_tensor(_data(s)[0], mesh, [dist.Shard(0)])
        scaler.scale((xs @ w).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        scales.append(scaler.get_scale())
    return dist.unshard_dtensor(w).detach(), scales


@pytest.mark.parametrize("wrap", [False, True], ids=["torch", "shard_scaler"])
@pytest.mark.parametrize("stage", [None, 1, 2, 3])
def test_torch_grad_scaler_over_sharding_stages_matches_one_process(stage, wrap):
    want_w, want_scales = _dense_scaled()
    assert want_scales == [2.0**10, 2.0**9, 2.0**9, 2.0**10]
    for w, scales in run_ranks(_dist_scaled, 2, stage, wrap, timeout=120):
        assert scales == want_scales
        torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


# -- group_sharded_parallel: a gradient some ranks do not make ------------------------------------------------------
class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.extra = nn.Parameter(torch.randn(8, 8) * 0.3)  # rank 0 only, from step 1

    def forward(self, h, use_extra):
        h = h @ self.w
        return h + h @ self.extra if use_extra else h


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.side = nn.Linear(8, 8)  # a sublayer rank 0 alone runs (where ``side`` is on)
        self.inner = _Inner()
        self.b = nn.Linear(8, 3)

    def forward(self, x, use_side, use_extra):
        h = torch.tanh(self.a(x))
        if use_side:
            h = h + self.side(h)
        return self.b(torch.tanh(self.inner(h, use_extra)))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randn(3, 3, generator=g)


def _uses(step, rank, side, skip):
    """(runs a backward, takes the side branch, uses ``extra``) of ``rank`` at ``step``."""
    return not (skip and rank == 1 and step == 1), side and rank == 0, rank == 0 and step >= 1


def _dense_branchy(side, skip, world=2, steps=3):
    model = _Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for s in range(steps):
        loss = 0.0
        for r in range(world):
            back, use_side, use_extra = _uses(s, r, side, skip)
            if back:
                x, y = _batch(s, r)
                loss = loss + F.mse_loss(model(x, use_side, use_extra), y) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # as Paddle's clear_grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded_branchy(level, segment_size, side, skip, steps=3):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    rank = dist.get_rank()
    model = _Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=segment_size)
    for s in range(steps):
        back, use_side, use_extra = _uses(s, rank, side, skip)
        if back:
            x, y = _batch(s, rank)
            F.mse_loss(model(x, use_side, use_extra), y).backward()
        opt.step()
        opt.clear_grad()
    return {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}


CASES = [("os", 1, True, False), ("os", 1000, True, False), ("os_g", 1, True, False), ("os_g", 1000, True, False),
         ("p_g_os", 1, False, False), ("p_g_os", 1000, True, False),
         ("os", 1, True, True), ("os_g", 1, True, True), ("os_g", 1000, True, True)]


@pytest.mark.parametrize("level,segment_size,side,skip", CASES,
                         ids=[f"{c[0]}-{c[1]}{'-side' if c[2] else ''}{'-skip' if c[3] else ''}" for c in CASES])
def test_group_sharded_gradient_only_some_ranks_make_is_averaged_with_zeros(level, segment_size, side, skip):
    # ``extra`` has no gradient anywhere at step 0 (not stepped, no weight decay, as one process) and rank 0's alone
    # after; ``side`` runs on rank 0 only; ``skip``: rank 1 runs no backward at step 1 (its part counts as zeros)
    want = _dense_branchy(side, skip)
    for got in run_ranks(_sharded_branchy, 2, level, segment_size, side, skip, timeout=120):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _skipped_unit():
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.match import set_checking

    dist.init_parallel_env()
    set_checking(True)
    rank = dist.get_rank()
    model = _Branchy()
    model, opt, _ = group_sharded_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1), "p_g_os",
                                           segment_size=1)
    x, y = _batch(0, rank)
    try:
        F.mse_loss(model(x, rank == 0, False), y).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_p_g_os_sublayer_one_rank_skips_is_named_on_every_rank_with_checking_on():
    want = ("group_sharded_parallel (p_g_os): the ranks run different sharded sublayers here (rank 0 'side', "
            "rank 1 'inner'): every rank of the group must run the forward of each sublayer whose parameters are "
            "sharded (they are gathered for it); take the branch on every rank, or keep that sublayer whole "
            "(segment_size) or use level 'os_g'")
    assert run_ranks(_skipped_unit, 2, timeout=120) == [want, want]
