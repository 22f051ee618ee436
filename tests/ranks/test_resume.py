"""Runs resumed after wrapping: what is loaded into, or edited in, a model and optimizer is what the next step uses."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

LR, WD, B, STEPS = 0.05, 0.01, 2, 5
SAVE, LOAD = 2, 3  # the checkpoint is taken before step SAVE, which is then lost: LOAD resumes from it


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def batch(step, world):
    """The global batch of ``step``: ``B`` rows for each of ``world`` data-parallel ranks."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B * world, 6, generator=g), torch.randn(B * world, 6, generator=g)


def rows(t, rank):
    return t[rank * B : (rank + 1) * B]


def halve(model):
    """An in-place edit between steps."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def sgd(params):
    """For runs with a loss scaler: unlike Adam's, SGD's step shows a gradient left scaled."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def dense(world, opt_restored=True, make_opt=adamw, make_model=Net, amp=False):
    """The dense truth: one process, the global batch; the same checkpoint, lost step, load and edit. ``amp``:
    float16 autocast, the loss scaled by 2**15 and the gradients unscaled before the step."""
    scale = 2.0**15 if amp else 1.0
    model = make_model()
    opt = make_opt(model.parameters())
    for s in range(STEPS):
        if s == SAVE:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        if s == LOAD:
            model.load_state_dict(saved[0])
            if opt_restored:
                opt.load_state_dict(saved[1])
            halve(model)
        x, y = batch(s, world)
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = F.mse_loss(model(x), y)
        (loss * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def resume(model, train_step, save, load):
    """Train STEPS steps on this rank: ``save()`` before step SAVE, ``load(what it returned)`` and an in-place
    edit before step LOAD."""
    for s in range(STEPS):
        if s == SAVE:
            ckpt = save()
        if s == LOAD:
            load(ckpt)
            halve(model)
        train_step(s)


def check(results, want, tol=(1e-5, 1e-6)):
    for rank, got in enumerate(results):
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=tol[0], atol=tol[1], msg=lambda m: f"rank {rank} {k}: {m}")


# -- group_sharded_parallel, DataParallel, fleet: plain modules, checkpoints as plain state dicts -----------------


def _backward_step(loss, opt, scaler) -> None:
    """Backward and step, through ``scaler`` when there is one, then the gradients cleared."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    getattr(opt, "clear_grad", opt.zero_grad)()


def _plain_steps(model, opt, world, rank, scaler=None):
    def train_step(s):
        x, y = batch(s, world)
        _backward_step(F.mse_loss(model(rows(x, rank)), rows(y, rank)), opt, scaler)

    return train_step


def _plain_save(model, opt):
    return lambda: copy.deepcopy(({k: v.detach().clone() for k, v in model.state_dict().items()},
                                  opt.state_dict()))


def _plain_load(model, opt):
    def load(ckpt):
        model.set_state_dict(ckpt[0]) if hasattr(model, "set_state_dict") else model.load_state_dict(ckpt[0])
        opt.set_state_dict(ckpt[1]) if hasattr(opt, "set_state_dict") else opt.load_state_dict(ckpt[1])

    return load


def group_sharded_run(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    model = Net()
    model, opt, _ = group_sharded_parallel(model, adamw(model.parameters()), level, segment_size=8)
    resume(model, _plain_steps(model, opt, 2, dist.get_rank()), _plain_save(model, opt),
           _plain_load(model, opt))
    return {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["os", "os_g", "p_g_os"])
def test_group_sharded_parallel(level):
    check(run_ranks(group_sharded_run, 2, level, timeout=100), dense(2))


def data_parallel_run():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    model = dist.DataParallel(Net())
    opt = adamw(model.parameters())
    resume(model, _plain_steps(model, opt, 2, dist.get_rank()), _plain_save(model, opt),
           _plain_load(model, opt))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_data_parallel():
    check(run_ranks(data_parallel_run, 2, timeout=100), dense(2))


def fleet_run(hybrid, scaled):
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    model = Net()
    opt = fleet.distributed_optimizer((sgd if scaled else adamw)(model.parameters()))
    model = fleet.distributed_model(model)
    scaler = fleet.distributed_scaler(torch.amp.GradScaler("cpu", init_scale=2.0**10)) if scaled else None
    # every dp and sharding rank reads its own rows (Paddle's sharding ranks are data parallel too)
    world = hcg.get_data_parallel_world_size() * hcg.get_sharding_parallel_world_size()
    rank = hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size() + hcg.get_sharding_parallel_rank()
    resume(model, _plain_steps(model, opt, world, rank, scaler), _plain_save(model, opt),
           _plain_load(model, opt))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid,world,scaled", [
    ({"dp_degree": 2}, 2, False), ({"sharding_degree": 2}, 2, False), ({"sharding_degree": 2}, 2, True),
    ({"sharding_degree": 2, "dp_degree": 2}, 4, True),
])
def test_fleet(hybrid, world, scaled):
    check(run_ranks(fleet_run, world, hybrid, scaled, timeout=100), dense(world, make_opt=sgd if scaled else adamw))


def to_static_run(stage):
    import meshviz.distributed as dist
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    net = Net()
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": stage, "degree": 2}} if stage else None)
    dm = dist.to_static(net, None, F.mse_loss, adamw(net.parameters()), strategy)

    def train_step(s):
        x, y = batch(s, 2)
        dm(rows(x, dist.get_rank()), rows(y, dist.get_rank()))

    resume(net, train_step, lambda: copy.deepcopy(dm.state_dict()), dm.set_state_dict)
    return {k: full_tensor(v).detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [None, 1, 3])  # stage 2 steps as stage 1: test_group_sharded_parallel
def test_to_static(stage):
    check(run_ranks(to_static_run, 2, stage, timeout=100), dense(2))


# -- shard_optimizer, dist.parallelize: dist parameters, checkpoints through dist.save/load_state_dict -----------


def _dist_steps(model, opt, mesh, scaler=None):
    import meshviz.distributed as dist

    first = mesh.get_mesh_with_dim("pp", 0) if "pp" in mesh.dim_names else mesh
    pl = [dist.Shard(0) if a == "dp" else dist.Replicate() for a in first.dim_names]

    def train_step(s):
        x, y = (dist.shard_tensor(t, first, pl) for t in batch(s, first.get_dim_size("dp")))
        out = model(x)
        loss = F.mse_loss(out, dist.reshard(y, out.process_mesh, [dist.Replicate()] * out.process_mesh.ndim)
                          if "pp" in mesh.dim_names else y)
        _backward_step(loss, opt, scaler)

    return train_step


def _dist_save(model, opt, path):
    import meshviz.distributed as dist

    def save():
        dist.save_state_dict(model.state_dict(), f"{path}/model")
        dist.save_state_dict(opt.state_dict(), f"{path}/opt")

    return save


def _dist_load(model, opt, path):
    import meshviz.distributed as dist

    def load(_):
        dist.load_state_dict(model.state_dict(), f"{path}/model")
        sd = opt.state_dict()
        dist.load_state_dict(sd, f"{path}/opt")
        opt.set_state_dict(sd)

    return load


def _unsharded(model):
    import meshviz.distributed as dist

    return {k: dist.unshard_dtensor(v).detach().clone() for k, v in model.state_dict().items()}


def parallelize_run(mesh, axes, level, mp, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh(mesh, dim_names=axes)
    dist.auto_parallel.set_mesh(None)
    config = {}
    if mp:
        config["mp_config"] = {"parallelize_plan": {"layers.*.up": dist.ColWiseParallel(),
                                                    "layers.*.down": dist.RowWiseParallel()}}
    if "pp" in axes:
        config["pp_config"] = {"split_spec": "layers"}
    if level is not None:
        config["dp_config"] = {"sharding_level": level}
    model = Net()
    model, opt = dist.parallelize(model, adamw(model.parameters()), mesh=mesh, config=config)
    resume(model, _dist_steps(model, opt, mesh), _dist_save(model, opt, path), _dist_load(model, opt, path))
    return _unsharded(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("axes,level,mp", [(["dp", "mp"], 0, True), (["dp", "mp"], 3, True),
                                           (["pp", "dp"], 2, False)])
def test_parallelize(axes, level, mp, tmp_path):
    # levels 1 and 2 step as shard_optimizer's stages do (test_shard_optimizer_with_a_scaler)
    res = run_ranks(parallelize_run, 4, [[0, 1], [2, 3]], axes, level, mp, str(tmp_path), timeout=100)
    want = dense(2)
    for rank, got in enumerate(res):
        held = {k: v for k, v in got.items() if v.numel()}  # a rank off a pipeline stage's mesh holds nothing of it
        assert held
        for k, v in held.items():
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


def _mp_split(name, layer, mesh):
    import meshviz.distributed as dist

    if isinstance(layer, Block):  # the up projection split by its outputs, the down one by its inputs, along mp
        layer.up.weight = dist.shard_tensor(layer.up.weight, mesh, [dist.Replicate(), dist.Shard(0)])
        layer.down.weight = dist.shard_tensor(layer.down.weight, mesh, [dist.Replicate(), dist.Shard(1)])


def shard_optimizer_run(stage, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = dist.shard_layer(Net(), mesh, _mp_split)
    opt = sgd(model.parameters())
    stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
    opt = dist.shard_optimizer(opt, stages[stage]("dp", mesh) if stage else None)
    scaler = dist.shard_scaler()
    resume(model, _dist_steps(model, opt, mesh, scaler), _dist_save(model, opt, path),
           _dist_load(model, opt, path))
    return _unsharded(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [None, 1, 2, 3])
def test_shard_optimizer_with_a_scaler(stage, tmp_path):
    check(run_ranks(shard_optimizer_run, 4, stage, str(tmp_path), timeout=100), dense(2, make_opt=sgd))


def to_static_dist_run(stage, amp):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    net = dist.shard_layer(Net(), mesh, _mp_split)
    opt = dist.shard_optimizer((sgd if amp else adamw)(net.parameters()),
                               dist.ShardingStage1("dp", mesh) if stage else None)
    strategy = dist.Strategy({"amp": {"enable": True, "dtype": "float16", "level": "O1"}} if amp else None)
    dm = dist.to_static(net, None, F.mse_loss, opt, strategy)
    pl = [dist.Shard(0), dist.Replicate()]

    def train_step(s):
        dm(*(dist.shard_tensor(t, mesh, pl) for t in batch(s, 2)))

    resume(net, train_step, lambda: copy.deepcopy(dm.state_dict()), dm.set_state_dict)
    return _unsharded(net)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,amp", [(None, False), (1, True)])
def test_to_static_dist_parameters(stage, amp):
    want = dense(2, make_opt=sgd if amp else adamw, amp=amp)
    # float16 blocks round apart from the dense float16 ops: a gradient left scaled would be 2**15 off
    check(run_ranks(to_static_dist_run, 4, stage, amp, timeout=100), want, (1e-3, 1e-4) if amp else (1e-5, 1e-6))


def _stages():
    """Two Blocks as a pipeline builds them: layer i under seed 1234 + i."""
    blocks = []
    for i in range(2):
        torch.manual_seed(1234 + i)
        blocks.append(Block())
    return nn.Sequential(*blocks)


def pipeline_run(hybrid, scaled):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    s.pipeline_configs = {"micro_batch_size": 1, "accumulate_steps": B}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    layer = PipelineLayer([LayerDesc(Block), LayerDesc(Block)], loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer((sgd if scaled else adamw)(layer.parameters()))
    scaler = fleet.distributed_scaler(torch.amp.GradScaler("cpu", init_scale=2.0**10)) if scaled else None
    world, rank = hcg.get_sharding_parallel_world_size(), hcg.get_sharding_parallel_rank()

    def train_step(s):
        model.train_batch(tuple(rows(t, rank) for t in batch(s, world)), opt, scaler=scaler)

    resume(layer, train_step, _plain_save(layer, opt), _plain_load(layer, opt))
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid,world,scaled", [({"pp_degree": 2}, 2, False),
                                                 ({"pp_degree": 2, "sharding_degree": 2}, 4, True)])
def test_pipeline(hybrid, world, scaled):
    want = dense(hybrid.get("sharding_degree", 1), make_opt=sgd if scaled else adamw, make_model=_stages)
    res = run_ranks(pipeline_run, world, hybrid, scaled, timeout=100)
    assert set().union(*res) == set(want)  # the stages together hold every parameter
    for rank, got in enumerate(res):
        for k, v in got.items():
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


# -- a fresh run: the optimizer has no states yet when the checkpoint is loaded into what state_dict() gives --------


def _fresh(make):
    """Train to SAVE and save; then, as a new run, make everything again, load, edit and train on from LOAD."""
    model, train_step, save, _ = make()
    for s in range(SAVE):
        train_step(s)
    save()
    model, train_step, _, load = make()
    load(None)
    halve(model)
    for s in range(LOAD, STEPS):
        train_step(s)
    return model


def fresh_shard_optimizer_run(stage, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}

    def make():
        model = dist.shard_layer(Net(), mesh, _mp_split)
        opt = dist.shard_optimizer(adamw(model.parameters()), stages[stage]("dp", mesh) if stage else None)
        return model, _dist_steps(model, opt, mesh), _dist_save(model, opt, path), _dist_load(model, opt, path)

    return _unsharded(_fresh(make))


def fresh_to_static_run(stage, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": stage, "degree": 2}} if stage else None)

    def make():
        net = Net()
        dm = dist.to_static(net, None, F.mse_loss, adamw(net.parameters()), strategy)

        def train_step(s):
            x, y = batch(s, 2)
            dm(rows(x, dist.get_rank()), rows(y, dist.get_rank()))

        def load(_):
            sd = dm.state_dict()
            dist.load_state_dict(sd, path)
            dm.set_state_dict(sd)

        return net, train_step, lambda: dist.save_state_dict(dm.state_dict(), path), load

    from meshviz.runtime.devices import full_tensor

    return {k: full_tensor(v).detach().clone() for k, v in _fresh(make).state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [None, 1, 2, 3])
def test_shard_optimizer_in_a_fresh_run(stage, tmp_path):
    check(run_ranks(fresh_shard_optimizer_run, 4, stage, str(tmp_path), timeout=100), dense(2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [None, 1, 3])
def test_to_static_in_a_fresh_run(stage, tmp_path):
    check(run_ranks(fresh_to_static_run, 2, stage, str(tmp_path), timeout=100), dense(2))


def bad_key_run(stage, bad):
    import meshviz.distributed as dist
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    net = Net()
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": stage, "degree": 2}} if stage else None)
    dm = dist.to_static(net, None, F.mse_loss, adamw(net.parameters()), strategy)
    before = {k: full_tensor(v).detach().clone() for k, v in net.state_dict().items()}
    sd = {k: v * 2 for k, v in dm.state_dict().items()}
    if bad == "key":
        sd["layers.9.up.weight.exp_avg"] = torch.zeros(1)
    else:  # a moment of the wrong shape, after the parameters in the dict
        key = "layers.1.up.weight.exp_avg"
        shape = list(sd[key].shape)
        sd[key] = torch.zeros(7)
    try:
        dm.set_state_dict(sd)
        err = None
    except ValueError as e:
        err = str(e)
    after = {k: full_tensor(v).detach().clone() for k, v in net.state_dict().items()}
    want = ("set_state_dict: unknown key 'layers.9.up.weight.exp_avg'" if bad == "key" else
            f"set_state_dict: layers.1.up.weight.exp_avg has shape {shape}, got [7]")
    return err == want or err, all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", ["key", "shape"])
@pytest.mark.parametrize("stage", [None, 1, 3])
def test_to_static_refuses_an_unknown_key_or_a_wrong_shape_before_writing_anything(stage, bad):
    assert run_ranks(bad_key_run, 2, stage, bad, timeout=100) == [(True, True)] * 2
