"""group_sharded_parallel and fleet's sharding: arguments refused on one rank before the process group starts,
layouts that differ between ranks, and offload / segment_size / sync_comm / grad clip on a subgroup against one
process."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

LEVELS = ("os", "os_g", "p_g_os")
HEAD = "the ranks were given different settings (every rank needs the same): "


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


def _opt(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 0.02, "weight_decay": 0.1}],
                             lr=0.05)


# -- an argument refused on one rank before the process group started: every rank raises, naming it ----------------

def _refused_before_init(case):
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.rank_context import getenv

    net = _Net()
    params = list(net.parameters())
    opt, kwargs = torch.optim.AdamW(params), {}
    if getenv("RANK") == "1":
        if case == "stranger":
            opt = torch.optim.AdamW(params + [nn.Parameter(torch.ones(2))])
        elif case == "whole-tensor update":
            opt = torch.optim.LBFGS(params)
        else:
            kwargs[case] = -1
    try:
        group_sharded_parallel(net, opt, "os_g", **kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(40)
@pytest.mark.parametrize("case,said", [("stranger", "the optimizer holds a parameter that is not in the model"),
                                       ("whole-tensor update", "torch.optim.LBFGS updates each parameter from all"),
                                       ("segment_size", "segment_size must be an int >= 0, got -1")])
def test_an_argument_refused_on_one_rank_before_the_process_group_starts_raises_on_every_rank(case, said):
    mine, theirs = run_ranks(_refused_before_init, 2, case, timeout=15)[::-1]
    assert mine is not None and said in mine, mine
    assert theirs is not None and theirs.startswith("group_sharded_parallel: " + HEAD), theirs
    assert "rank 1: arguments accepted (a refusing rank raises why) False" in theirs, theirs


# -- fleet's sharding: parameter layouts that differ between the ranks of a sharding group --------------------------

def _fleet_differs(case, with_model):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    odd = dist.get_rank() % 2 == 1
    net = _Net()
    if case == "shape" and odd:
        net.c = nn.Linear(7, 7, bias=False)
    if case == "dtype" and odd:
        net.c.double()
    with torch.no_grad():  # each rank its own values: a broadcast or a step would show
        for p in net.parameters():
            p.add_(dist.get_rank())
    params = list(net.parameters())
    if case == "frozen" and odd:
        net.a.bias.requires_grad_(False)
    if case == "order" and odd:
        params = params[::-1]
    if case == "groups" and odd:
        opt = torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 0.02}], lr=0.05)
    else:
        opt = _opt(params)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": dist.get_world_size() // 2, "sharding_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    try:
        before = {k: v.clone() for k, v in net.state_dict().items()}
        if with_model:
            net = fleet.distributed_model(net)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        fleet.distributed_optimizer(opt)
    except ValueError as e:
        return str(e), all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    return None, None


MODEL, OPT = "fleet.distributed_model", "fleet.distributed_optimizer"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,with_model,who,said", [
    ("shape", True, MODEL, "parameter and buffer names and shapes"),
    ("dtype", True, MODEL, "dtypes"),
    ("frozen", True, MODEL, "parameters that require grad"),
    ("order", True, OPT, "optimizer parameter groups and order"),
    ("groups", True, OPT, "optimizer parameter groups and order"),
    ("order", False, OPT, "parameter and buffer names and shapes"),  # the optimizer's alone: by place
    ("frozen", False, OPT, "parameters that require grad"),
])
def test_fleet_sharding_layouts_that_differ_raise_on_every_rank_before_anything_moves(case, with_model, who, said):
    # sharding groups [0, 1] and [2, 3]: the odd ranks were given another layout; each group names its own ranks
    for rank, (msg, untouched) in enumerate(run_ranks(_fleet_differs, 4, case, with_model, timeout=30)):
        first = rank - rank % 2
        assert msg is not None and msg.startswith(f"{who}: {HEAD}rank {first}: "), (rank, msg)
        assert f"; rank {first + 1}: " in msg and said in msg, (rank, msg)
        assert untouched, rank  # nothing was broadcast


# -- offload, segment_size, sync_comm and a global-norm clip on a subgroup, against one process -----------------------

CLIP = 0.05


def _dense(ranks, steps, need_clip):
    """One process on the batches of ``ranks``: AdamW, Paddle's global-norm clip over the parameters to clip."""
    net = _Net()
    net.scale.need_clip = need_clip
    opt = _opt(net.parameters())
    for step in range(steps):
        sum(F.mse_loss(net(_batch(step, r)[0]), _batch(step, r)[1]) for r in ranks).div(len(ranks)).backward()
        clipped = [p for p in net.parameters() if getattr(p, "need_clip", True)]
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in clipped))
        for p in clipped:
            p.grad.mul_(CLIP / max(float(norm), CLIP))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _sharded_on_subgroup(level, offload, segment_size, sync_comm, how_clip, steps):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.nn import ClipGradByGlobalNorm
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([3, 1])]
    group = groups[rank % 2]
    net = _Net()
    net.scale.need_clip = False
    with torch.no_grad():  # the group's first rank's values are the ones every rank starts from
        for p in net.parameters():
            p.add_(0.0 if rank in (0, 1) else 1.0)
    opt = _opt(net.parameters())
    kwargs = {"grad_clip": ClipGradByGlobalNorm(CLIP)} if how_clip == "argument" else {}
    if how_clip == "optimizer":
        opt._grad_clip = ClipGradByGlobalNorm(CLIP)
    net, opt, _ = group_sharded_parallel(net, opt, level, group=group, offload=offload, segment_size=segment_size,
                                         sync_comm=sync_comm, **kwargs)
    for step in range(steps):
        x, y = _batch(step, rank)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.clear_grad()
    return {k: full_tensor(v).detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("offload,segment_size,sync_comm,how_clip", [(True, 1, False, "argument"),
                                                                      (True, 2**20, True, "optimizer"),
                                                                      (False, 20, True, "argument")])
def test_offload_segment_size_sync_comm_and_clip_on_a_subgroup_train_as_one_process(level, offload, segment_size,
                                                                                     sync_comm, how_clip):
    steps = 3
    res = run_ranks(_sharded_on_subgroup, 4, level, offload, segment_size, sync_comm, how_clip, steps, timeout=45)
    for ranks in ([0, 2], [1, 3]):
        ref = _dense(ranks, steps, need_clip=False)
        for rank in ranks:
            for k, v in ref.items():
                torch.testing.assert_close(res[rank][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, r=rank: f"{level} rank {r} {k}: {m}")


# -- save_group_sharded_model: an argument refused on one rank, and saving each subgroup's model ----------------------

def _save_refused(case, tmp):
    import os

    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel, save_group_sharded_model

    dist.init_parallel_env()
    net = _Net()
    raw = _opt(net.parameters())
    net, opt, _ = group_sharded_parallel(net, raw, "os_g", segment_size=1)
    F.mse_loss(net(_batch(0, dist.get_rank())[0]), _batch(0, dist.get_rank())[1]).backward()
    opt.step()
    out = os.path.join(tmp, "out")
    if dist.get_rank() == 1:
        if case == "file":
            out = os.path.join(tmp, "a file")
            open(out, "w").close()
        elif case == "no optimizer":
            opt = None
        elif case == "torch optimizer":
            opt = raw
    try:
        save_group_sharded_model(net, out, opt)
    except ValueError as e:
        return str(e), os.path.exists(os.path.join(tmp, "out"))
    return None, None


@pytest.mark.timeout(40)
@pytest.mark.parametrize("case,said", [("file", "must be a directory, not a file"),
                                       ("torch optimizer", "optimizer must be the one"), ("no optimizer", None)])
def test_save_refused_on_one_rank_raises_on_every_rank_before_anything_is_gathered(case, said, tmp_path):
    head = "save_group_sharded_model: " + HEAD
    theirs, mine = run_ranks(_save_refused, 2, case, str(tmp_path), timeout=15)
    for msg, written in (theirs, mine):
        assert msg is not None and not written, (msg, written)
    if said is None:  # one rank gathers no optimizer: both say so
        for msg, _ in (theirs, mine):
            assert msg == head + "rank 0: optimizer given True; rank 1: optimizer given False", msg
    else:
        assert said in mine[0], mine
        assert theirs[0] == head + ("rank 0: arguments accepted (a refusing rank raises why) True; "
                                    "rank 1: arguments accepted (a refusing rank raises why) False"), theirs


def _save_subgroups(level, tmp, steps):
    import os

    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel, save_group_sharded_model

    dist.init_parallel_env()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    net = _Net()
    net, opt, _ = group_sharded_parallel(net, _opt(net.parameters()), level, group=groups[rank % 2], segment_size=8)
    for step in range(steps):
        F.mse_loss(net(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
        opt.step()
        opt.clear_grad()
    save_group_sharded_model(net, os.path.join(tmp, f"group{rank % 2}"), opt)  # each group its own
    save_group_sharded_model(net, os.path.join(tmp, f"model{rank % 2}"))  # the model's group writes
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
def test_each_subgroup_saves_its_own_model_and_optimizer_as_one_process(level, tmp_path):
    steps = 3
    run_ranks(_save_subgroups, 4, level, str(tmp_path), steps, timeout=45)
    for g, ranks in enumerate(([0, 2], [1, 3])):
        net = _Net()
        opt = _opt(net.parameters())
        for step in range(steps):
            sum(F.mse_loss(net(_batch(step, r)[0]), _batch(step, r)[1]) for r in ranks).div(2).backward()
            opt.step()
            opt.zero_grad()
        for where in (f"group{g}", f"model{g}"):
            saved = torch.load(tmp_path / where / "model.pdmodel")
            for k, v in net.state_dict().items():
                torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{where} {k}: {m}")
        saved = torch.load(tmp_path / f"group{g}" / "model.pdopt")["state"]
        for i, st in opt.state_dict()["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(saved[i][k], st[k], rtol=1e-5, atol=1e-7, msg=lambda m, i=i: f"{i}: {m}")


# -- the sharded optimizer's load_state_dict: a state refused on one rank --------------------------------------------

def _load_refused(level, case):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    rank = dist.get_rank()
    net = _Net()
    net, opt, _ = group_sharded_parallel(net, _opt(net.parameters()), level, segment_size=8)
    F.mse_loss(net(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
    opt.step()
    opt.clear_grad()
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.5  # would show where it loaded
    if rank == 1:
        state = {"weights": state["state"]} if case == "not a state dict" else \
            {"state": {}, "param_groups": state["param_groups"][:1]}
    try:
        opt.set_state_dict(state)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}", opt.param_groups[0]["lr"]
    return None, opt.param_groups[0]["lr"]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case,said", [
    ("not a state dict", "TypeError: GroupShardedOptimizer.load_state_dict: expected an optimizer state dict"),
    ("one group", "ValueError: GroupShardedOptimizer.load_state_dict: the state's parameter groups hold [3] "
                  "parameters; this rank's shard's hold [3, "),
])
def test_a_state_refused_on_one_rank_raises_on_every_rank_and_none_loads(level, case, said):
    (theirs, lr0), (mine, lr1) = run_ranks(_load_refused, 2, level, case, timeout=15)
    assert mine is not None and mine.startswith(said), mine
    assert theirs == ("ValueError: GroupShardedOptimizer.load_state_dict: rank 1 of the group [0, 1] refused the "
                      "state given there (each says why); nothing was loaded"), theirs
    assert lr0 == lr1 == 0.05


# -- a scaler on a subgroup: an overflow skips that group's step only ------------------------------------------------

def _scaled_on_subgroup(level, steps):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    net = _Net()
    net, opt, scaler = group_sharded_parallel(net, _opt(net.parameters()), level, group=groups[rank % 2],
                                              segment_size=8, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    for step in range(steps):
        x, y = _batch(step, rank)
        if step == 1 and rank == 0:
            x = x * float("inf")
        scaler.scale(F.mse_loss(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
    return {k: full_tensor(v).detach().clone() for k, v in net.state_dict().items()}, scaler.get_scale()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
def test_an_overflow_on_one_subgroup_skips_its_step_alone(level):
    steps = 3
    res = run_ranks(_scaled_on_subgroup, 4, level, steps, timeout=45)
    for ranks, skipped, scale in (([0, 2], 1, 2.0**7), ([1, 3], None, 2.0**8)):
        net = _Net()
        opt = _opt(net.parameters())
        for step in range(steps):
            if step == skipped:
                continue
            sum(F.mse_loss(net(_batch(step, r)[0]), _batch(step, r)[1]) for r in ranks).div(2).backward()
            opt.step()
            opt.zero_grad()
        for rank in ranks:
            assert res[rank][1] == scale, (rank, res[rank][1])
            for k, v in net.state_dict().items():
                torch.testing.assert_close(res[rank][0][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}")
