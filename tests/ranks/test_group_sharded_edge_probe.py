"""group_sharded_parallel: loading the whole model's optimizer state into the sharded optimizer, and settings that
differ between ranks, against one process."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

LEVELS = ("os", "os_g", "p_g_os")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(7, 7)
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h + self.c(h)) * self.scale


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)


def _opt(net):
    """Two parameter groups of uneven sizes, with their own learning rates and weight decay."""
    return torch.optim.AdamW([{"params": [net.a.weight, net.a.bias, net.scale], "lr": 0.05},
                              {"params": [net.b.weight, net.b.bias, net.c.weight, net.c.bias], "lr": 0.02,
                               "weight_decay": 0.1}], lr=0.1)


def _dense(n, steps, snap_at):
    """One process on every rank's batch; the model and optimizer state before step ``snap_at`` (the second group's
    learning rate lowered there first, as a scheduler would)."""
    net = _Net()
    opt = _opt(net)
    snap = None
    for step in range(steps):
        if step == snap_at:
            opt.param_groups[1]["lr"] = 0.01
            snap = copy.deepcopy((net.state_dict(), opt.state_dict()))
        sum(F.mse_loss(net(_batch(step, r)[0]), _batch(step, r)[1]) for r in range(n)).div(n).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, snap


def _full(model):
    from meshviz.runtime.devices import full_tensor

    return {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}


# -- the whole model's optimizer state loaded into the sharded optimizer -------------------------------------------

def _resume(level, segment_size, snap, start, steps, how, out):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel, save_group_sharded_model

    dist.init_parallel_env()
    rank = dist.get_rank()
    if how == "saved":  # a sharded run wrote the checkpoint with save_group_sharded_model
        net = _Net()
        net, opt, _ = group_sharded_parallel(net, _opt(net), level, segment_size=segment_size)
        for step in range(start):
            F.mse_loss(net(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
            opt.step()
            opt.clear_grad()
        opt.param_groups[1]["lr"] = 0.01
        save_group_sharded_model(net, out, opt)
        snap = (torch.load(os.path.join(out, "model.pdmodel")), torch.load(os.path.join(out, "model.pdopt")))
    net = _Net()
    net.load_state_dict(snap[0])
    net, opt, _ = group_sharded_parallel(net, _opt(net), level, segment_size=segment_size)
    kernels = [g.get("foreach") for g in opt.param_groups]  # p_g_os: False where FSDP's DTensors meet whole ones
    (opt.set_state_dict if how == "saved" else opt.load_state_dict)(snap[1])
    assert [g.get("foreach") for g in opt.param_groups] == kernels
    for step in range(start, steps):
        F.mse_loss(net(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
        opt.step()
        opt.clear_grad()
    return _full(net), opt.get_lr(), float(opt.param_groups[-1]["lr"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("segment_size,how", [(1, "dense"), (30, "dense"), (30, "saved")])
def test_the_whole_models_optimizer_state_loads_into_the_sharded_optimizer_as_in_one_process(level, segment_size,
                                                                                           how, tmp_path):
    # segment_size 30: the small parameters are whole, each stepped by one rank (os, os_g), so each rank's
    # optimizer holds fewer parameters than the whole model's state; 1: every rank holds a part of each
    n, start, steps = 3, 2, 4
    ref, snap = _dense(n, steps, snap_at=start)
    results = run_ranks(_resume, n, level, segment_size, snap, start, steps, how, str(tmp_path / level), timeout=50)
    for rank, (params, lr0, lr1) in enumerate(results):
        assert (lr0, lr1) == (0.05, 0.01)  # the saved hyperparameters, as torch's load_state_dict takes them
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}")


def _own_shard(level, segment_size):
    """Each rank's own shard (``state_dict()``) loaded into a fresh sharded optimizer still works."""
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    rank = dist.get_rank()
    net = _Net()
    net, opt, _ = group_sharded_parallel(net, _opt(net), level, segment_size=segment_size)
    for step in range(2):
        F.mse_loss(net(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
        opt.step()
        opt.clear_grad()
    opt.param_groups[1]["lr"] = 0.01
    params, osd = _full(net), copy.deepcopy(opt.state_dict())
    net = _Net()
    net.load_state_dict(params)
    net, opt, _ = group_sharded_parallel(net, _opt(net), level, segment_size=segment_size)
    opt.load_state_dict(osd)
    for step in range(2, 4):
        F.mse_loss(net(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
        opt.step()
        opt.clear_grad()
    return _full(net)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("segment_size", [1, 30])
def test_each_ranks_own_shard_still_loads_as_before(level, segment_size):
    ref, _ = _dense(3, 4, snap_at=2)
    for rank, params in enumerate(run_ranks(_own_shard, 3, level, segment_size, timeout=50)):
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}")


# -- what the ranks' collectives follow from, different on one rank: a clear error on every rank, before any data
# moves (the collectives that followed would not match: other sizes, other kinds, or one rank waiting alone) -------

def _differs(case, level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.nn import ClipGradByGlobalNorm

    dist.init_parallel_env()
    odd = dist.get_rank() == 1
    net = _Net()
    if case == "shape" and odd:
        net.c = nn.Linear(7, 7, bias=False)
    if case == "frozen" and odd:
        net.a.bias.requires_grad_(False)
    with torch.no_grad():  # each rank its own values: a broadcast from the first rank would show
        for p in net.parameters():
            p.add_(dist.get_rank())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params[::-1] if case == "order" and odd else params, lr=0.05)
    kwargs = {}
    if case == "grad_clip" and odd:
        opt._grad_clip = ClipGradByGlobalNorm(0.1)
    if case == "buffer_max_size":
        kwargs["buffer_max_size"] = 64 if odd else 2**23
    if case == "exclude_layer":
        kwargs["exclude_layer"] = ["Linear"] if odd else None
    try:
        group_sharded_parallel(net, opt, level, segment_size=1, **kwargs)
    except ValueError as e:
        return str(e), all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    return None, None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,level,said", [
    ("shape", "os", "parameter and buffer names and shapes"),
    ("frozen", "os_g", "parameters that require grad"),
    ("order", "p_g_os", "optimizer parameter groups and order"),
    ("grad_clip", "os_g", "grad_clip"),
    ("buffer_max_size", "os", "rank 0: buffer_max_size 8388608; rank 1: buffer_max_size 64"),
    ("exclude_layer", "p_g_os", "exclude_layer"),
])
def test_what_the_collectives_follow_from_differing_on_one_rank_raises_on_every_rank_first(case, level, said):
    head = "group_sharded_parallel: the ranks were given different settings (every rank needs the same): "
    for rank, (msg, untouched) in enumerate(run_ranks(_differs, 2, case, level, timeout=50)):
        assert msg is not None and msg.startswith(head) and said in msg, (rank, msg)
        assert untouched, rank  # nothing was broadcast


# -- fleet's sharding (stage 1): a stepped optimizer and the whole model's optimizer state --------------------------

def _fleet(how, sharding, snap, start, steps):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    rank, n = dist.get_rank(), dist.get_world_size()
    net = _Net()
    opt = _opt(net)
    if how == "stepped":  # steps on every rank's batch (the one-process run's) before fleet wraps the optimizer
        for step in range(start):
            sum(F.mse_loss(net(_batch(step, r)[0]), _batch(step, r)[1]) for r in range(n)).div(n).backward()
            opt.step()
            opt.zero_grad()
        opt.param_groups[1]["lr"] = 0.01
    else:
        net.load_state_dict(snap[0])
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": n // sharding, "sharding_degree": sharding}
    fleet.init(is_collective=True, strategy=strategy)
    net, opt = fleet.distributed_model(net), fleet.distributed_optimizer(opt)
    if how == "whole":
        opt.set_state_dict(copy.deepcopy(snap[1]))
    for step in range(start, steps):
        F.mse_loss(net(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
        opt.step()
        opt.clear_grad()
        if how == "whole":  # this rank's own state_dict() loads back as before
            opt.set_state_dict(copy.deepcopy(opt.state_dict()))
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharding", [2, 4])
@pytest.mark.parametrize("how", ["whole", "stepped"])
def test_fleet_sharding_takes_the_whole_models_optimizer_state_and_a_stepped_optimizer_as_one_process(how, sharding):
    # Paddle's DygraphShardingOptimizer.set_state_dict keeps the entries of this rank's parameters, and an inner
    # optimizer that has stepped keeps the accumulators of the parameters the rank steps
    n, start, steps = 4, 2, 4
    ref, snap = _dense(n, steps, snap_at=start)
    for rank, params in enumerate(run_ranks(_fleet, n, how, sharding, snap, start, steps, timeout=50)):
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}")


# -- arguments refused on one rank only: every rank raises (the others no longer wait for it) ------------------------

def _refused_on_one(case):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    net = _Net()
    params = list(net.parameters())
    if dist.get_rank() == 1:
        opt = {"stranger": lambda: torch.optim.AdamW(params + [nn.Parameter(torch.ones(2))]),
               "whole-tensor update": lambda: torch.optim.LBFGS(params)}[case]()
    else:
        opt = torch.optim.AdamW(params)
    try:
        group_sharded_parallel(net, opt, "os_g", segment_size=1)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,said", [("stranger", "the optimizer holds a parameter that is not in the model"),
                                       ("whole-tensor update", "torch.optim.LBFGS updates each parameter from all")])
def test_arguments_refused_on_one_rank_raise_on_every_rank(case, said):
    mine, theirs = run_ranks(_refused_on_one, 2, case, timeout=50)[::-1]
    assert mine is not None and said in mine, mine
    head = "group_sharded_parallel: the ranks were given different settings (every rank needs the same): "
    assert theirs is not None and theirs.startswith(head + "rank 0: arguments accepted (a refusing rank raises why) "
                                                    "True"), theirs
    assert "rank 1: arguments accepted (a refusing rank raises why) False" in theirs, theirs
