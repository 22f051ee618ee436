"""group_sharded_parallel with dp_group, exclude_layer, clipping under model parallelism, against one process."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

LEVELS = ("os", "os_g", "p_g_os")
LR, CLIP, STEPS = 0.1, 0.05, 3


class _Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.extra = nn.Linear(6, 10), nn.Linear(10, 3), nn.Linear(10, 10)

    def forward(self, x, use_extra=False):
        h = torch.tanh(self.a(x))
        return self.b(h + self.extra(h) if use_extra else h)


def _batch(step, d):
    g = torch.Generator().manual_seed(1000 * step + d)
    return torch.randn(3, 6, generator=g), torch.randn(3, 3, generator=g)


def _uses_extra(level, step, d):
    return level != "p_g_os" and step == 0 and d == 3  # a branch one rank takes (p_g_os: every rank runs each unit)


def _dense(n, level, clip=CLIP, steps=STEPS, no_clip=()):
    from meshviz.nn import ClipGradByGlobalNorm

    net = _Net()
    for name in no_clip:
        net.get_parameter(name).need_clip = False
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(steps):
        sum(F.mse_loss(net(_batch(step, d)[0], _uses_extra(level, step, d)), _batch(step, d)[1])
            for d in range(n)).div(n).backward()
        if clip:
            ClipGradByGlobalNorm(clip)([p for p in net.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _full(model):
    from meshviz.runtime.devices import full_tensor

    return {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}


# -- dp_group: sharding inside each group, gradients averaged across the groups -----------------------------------

def _dp_train(level, segment_size):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.nn import ClipGradByGlobalNorm

    dist.init_parallel_env()
    r = dist.get_rank()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    net = _Net(seed=r)  # each rank starts elsewhere: the weights come from rank 0 through both groups
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(net, opt, level, group=shard_groups[r // 2], dp_group=dp_groups[r % 2],
                                           segment_size=segment_size, grad_clip=ClipGradByGlobalNorm(CLIP))
    for step in range(STEPS):
        x, y = _batch(step, r)
        F.mse_loss(model(x, _uses_extra(level, step, r)), y).backward()
        opt.step()
        opt.clear_grad()
    return _full(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("segment_size", [1, 2**20])
@pytest.mark.parametrize("level", LEVELS)
def test_dp_group_trains_every_rank_of_both_groups_as_one_process(level, segment_size):
    want = _dense(4, level)
    for r, got in enumerate(run_ranks(_dp_train, 4, level, segment_size, timeout=100)):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=(r, k))


def _bad_dp(case):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    kwargs = {"overlap": {"dp_group": dist.new_group([0, 1])},
              "offload": {"dp_group": dist.new_group([0, 1]), "offload": True, "group": dist.new_group([0, 1])},
              "exclude": {"exclude_layer": "Linear"}}[case]
    level = "p_g_os" if case == "exclude" else "os_g"
    try:
        group_sharded_parallel(net, opt, level, **kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,said", [("overlap", "only this rank"), ("offload", "offload with dp_group"),
                                       ("exclude", "exclude_layer must be a list")])
def test_bad_dp_group_offload_or_exclude_layer_raise_on_every_rank(case, said):
    for out in run_ranks(_bad_dp, 2, case, timeout=50):
        assert out is not None and said in out, out


# -- exclude_layer (p_g_os): the named layers' own parameters stay whole --------------------------------------------

def _excluded(how):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    exclude = [id(net.b)] if how == "id" else ["Linear"]
    model, opt, _ = group_sharded_parallel(net, opt, "p_g_os", segment_size=1, exclude_layer=exclude)
    for step in range(STEPS):
        x, y = _batch(step, r)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return {p.name: p.mode for p in opt.ownership}, _full(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["id", "class name"])
def test_exclude_layer_keeps_the_layers_parameters_whole_and_trains_as_one_process(how):
    want = _dense(2, "p_g_os", clip=None)
    whole = {"b.weight", "b.bias"} if how == "id" else set(want)
    for modes, got in run_ranks(_excluded, 2, how, timeout=50):
        assert {n for n, m in modes.items() if m == "replicated"} == whole, modes
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=k)


# -- the global-norm clip: need_clip, and model-parallel split weights ----------------------------------------------

def _no_clip(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.nn import ClipGradByGlobalNorm

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _Net()
    net.a.weight.need_clip = False
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(net, opt, level, segment_size=1, grad_clip=ClipGradByGlobalNorm(CLIP))
    for step in range(STEPS):
        x, y = _batch(step, r)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return _full(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
def test_a_parameter_with_need_clip_false_is_neither_counted_nor_scaled(level):
    want = _dense(2, level, no_clip=("a.weight",))
    for got in run_ranks(_no_clip, 2, level, timeout=50):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=k)


class _MPNet(nn.Module):
    """``_Net``'s a and b as tensor-parallel layers (mp rank ``r`` of ``n`` holds its blocks)."""

    def __init__(self, r, n):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        ref = _Net()
        self.a = mpu.ColumnParallelLinear(6, 10, has_bias=True, gather_output=False)
        self.b = mpu.RowParallelLinear(10, 3, input_is_parallel=True)
        self.extra = nn.Linear(10, 10)
        split = {"a.weight": 0, "a.bias": 0, "b.weight": 1}
        self.load_state_dict({k: v.chunk(n, split[k])[r] if k in split else v for k, v in ref.state_dict().items()})

    def forward(self, x, use_extra=False):
        return self.b(torch.tanh(self.a(x)))


def _mp_train(level, segment_size):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.nn import ClipGradByGlobalNorm

    dist.init_parallel_env()
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "sharding_degree": 2}
    fleet.init(is_collective=True, strategy=s)
    h = fleet.get_hybrid_communicate_group()
    r, n = h.get_model_parallel_rank(), h.get_model_parallel_world_size()
    net = _MPNet(r, n)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(net, opt, level, group=h.get_sharding_parallel_group(),
                                           segment_size=segment_size, grad_clip=ClipGradByGlobalNorm(CLIP))
    d = h.get_sharding_parallel_rank()
    for step in range(STEPS):
        x, y = _batch(step, d)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return r, n, _full(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("segment_size", [1, 2**20])
@pytest.mark.parametrize("level", LEVELS)
def test_clip_under_model_parallelism_uses_the_whole_models_norm(level, segment_size):
    want = _dense(2, "p_g_os")  # no branch
    split = {"a.weight": 0, "a.bias": 0, "b.weight": 1}
    for r, n, got in run_ranks(_mp_train, 4, level, segment_size, timeout=100):
        for k, v in want.items():
            if k.startswith("extra"):
                continue
            torch.testing.assert_close(got[k], v.chunk(n, split[k])[r] if k in split else v, msg=(r, k))


# -- p_g_os: a sublayer whose forward every rank runs, but whose output one rank's loss leaves out -------------------

class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, read_c):
        h = torch.tanh(self.a(x))
        yb, yc = self.b(h), self.c(h)
        return yb.pow(2).sum() + yc.pow(2).sum() if read_c else yb.pow(2).sum()


def _branchy_batch(step, r):
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + r))


def _branchy(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _Branchy()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(net, opt, level, segment_size=1)
    for step in range(STEPS):
        model(_branchy_batch(step, r), r == 0).backward()
        opt.step()
        opt.clear_grad()
    return _full(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
def test_a_sublayer_output_one_ranks_loss_leaves_out_trains_as_one_process(level):
    """Every rank runs c's forward, only rank 0's loss reads it: at p_g_os rank 1's FSDP2 reduced c's gradients
    after the others (its backward never reached c), so the ranks' collectives no longer matched."""
    net = _Branchy()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        sum(net(_branchy_batch(step, r), r == 0) for r in range(2)).div(2).backward()
        opt.step()
        opt.zero_grad()
    for got in run_ranks(_branchy, 2, level, timeout=50):
        for k, v in net.state_dict().items():
            torch.testing.assert_close(got[k], v, msg=k)


# -- the model's own zero_grad() between steps ---------------------------------------------------------------------

def _model_zero_grad(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(net, opt, level, segment_size=1)
    for step in range(STEPS):
        x, y = _batch(step, r)
        F.mse_loss(model(x, step == 0), y).backward()  # extra: used by the first step only
        opt.step()
        model.zero_grad()
    return _full(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", ["os", "p_g_os"])
def test_a_weight_unused_after_the_models_zero_grad_is_not_stepped_again(level):
    """After ``model.zero_grad()`` a weight no rank uses has no gradient, as in one process: 'os' stepped it again
    on the first step's gradient, still held by the copy it steps."""
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for step in range(STEPS):
        sum(F.mse_loss(net(_batch(step, r)[0], step == 0), _batch(step, r)[1]) for r in range(2)).div(2).backward()
        opt.step()
        net.zero_grad()
    for got in run_ranks(_model_zero_grad, 2, level, timeout=50):
        for k, v in net.state_dict().items():
            torch.testing.assert_close(got[k], v, msg=k)


def _segment_zero(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(net, opt, level, segment_size=0)
    for step in range(STEPS):
        x, y = _batch(step, r)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return {p.mode for p in opt.ownership}, _full(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", LEVELS)
def test_segment_size_zero_shards_every_parameter_as_paddle_accepts(level):
    want = _dense(2, level, clip=None)
    for modes, got in run_ranks(_segment_zero, 2, level, timeout=50):
        assert modes == {"fsdp" if level == "p_g_os" else "slice"}, modes
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=k)
