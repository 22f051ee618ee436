"""Bad input across the Paddle API: a clear error on every rank, before any collective, and nothing changed."""

import numpy as np
import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks


def _sent() -> dict:
    """The collectives this rank has entered, per group (what a bad call must leave as it was)."""
    from meshviz.runtime import rollcall

    return dict(rollcall.current().entered)


def _expect(exc, words, fn) -> str:
    """``fn()`` raises ``exc`` whose message holds every one of ``words``, without entering a collective."""
    sent = _sent()
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert type(info.value) is exc and all(w in msg for w in words), msg
    assert _sent() == sent, msg
    return msg


def _net(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _values(model) -> list:
    return [p._local_value().detach().clone() if hasattr(p, "_local_value") else p.detach().clone()
            for p in model.parameters()]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- the tensor API -----------------------------------------------------------------------------------------------


def tensor_api():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    far = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    a = torch.arange(8.0).reshape(2, 4)
    t = dist.shard_tensor(a, mesh, [dist.Shard(1)])
    block = t._local_value().clone()
    # Paddle's dtype names are dtypes
    d = dist.shard_tensor([[1, 2], [3, 4]], mesh, [dist.Shard(0)], dtype="float64")
    assert d.dtype == torch.float64 and d._local_value().tolist() == [[1.0 + 2 * r, 2.0 + 2 * r]]
    _expect(ValueError, ["unknown dtype 'float65'", "'float32'"],
            lambda: dist.shard_tensor(a, mesh, [dist.Replicate()], dtype="float65"))
    _expect(TypeError, ["expected a tensor", "got str"], lambda: dist.shard_tensor("abc", mesh, [dist.Shard(0)]))
    _expect(ValueError, ["Shard(-3) is out of range for a 2-D tensor", "valid dims are [-2, -1, 0, 1]"],
            lambda: dist.shard_tensor(a, mesh, [dist.Shard(-3)]))
    _expect(ValueError, ["names ranks [2]", "the world has only 2 ranks"],
            lambda: dist.reshard(t, far, [dist.Replicate()]))
    _expect(ValueError, ["names ranks [2]", "the world has only 2 ranks"],
            lambda: dist.dtensor_from_local(torch.ones(2), far, [dist.Shard(0)]))
    # a dist tensor is not a block: it was wrapped as the block of a second dist tensor
    _expect(ValueError, ["got a dist tensor", "dist.reshard", "dist.dtensor_to_local"],
            lambda: dist.dtensor_from_local(t, mesh, [dist.Shard(1)]))
    _expect(ValueError, ["shape must be the global shape", "[-4]"],
            lambda: dist.dtensor_from_local(torch.ones(2), mesh, [dist.Shard(0)], shape=[-4]))
    assert torch.equal(t._local_value(), block) and t.placements == [dist.Shard(1)]
    return dist.unshard_dtensor(t).tolist()


@pytest.mark.timeout(60)
def test_the_tensor_api_names_bad_input_on_every_rank():
    assert run_ranks(tensor_api, 2, timeout=50) == [torch.arange(8.0).reshape(2, 4).tolist()] * 2


def one_rank_other_block():
    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    r = dist.get_rank()
    old = set_checking(True)
    try:
        mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
        t = dist.shard_tensor(torch.ones(9 if r == 1 else 6), mesh, [dist.Shard(0)])
        with pytest.raises(CollectiveMismatch) as info:
            dist.unshard_dtensor(t)
        # nothing moved: the world goes on
        s = torch.ones(1)
        dist.all_reduce(s)
        return str(info.value), info.value.ranks, s.item()
    finally:
        set_checking(old)


@pytest.mark.timeout(60)
def test_a_block_of_another_shape_on_one_rank_is_named_before_data_moves():
    res = run_ranks(one_rank_other_block, 3, timeout=50)
    line = ("mismatch at #1 on group [0, 1, 2]: rank 0 entered all_gather with float32[2]; rank 1 entered "
            "all_gather with float32[3]; rank 2 entered all_gather with float32[2]")
    assert res == [(line, [1], 3.0)] * 3


# -- collectives and groups ---------------------------------------------------------------------------------------


def collectives():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    t = torch.full((2,), float(r + 1))
    outs = [torch.zeros(3), torch.zeros(3)]
    _expect(ValueError, ["all_gather: tensor_list[0] is float32[3]", "the tensor is float32[2]"],
            lambda: dist.all_gather(outs, t))
    _expect(ValueError, ["reduce_scatter: tensor_list[1] is float64[2]", "the tensor is float32[2]"],
            lambda: dist.reduce_scatter(t, [torch.ones(2), torch.ones(2, dtype=torch.float64)]))
    # not a list: raised on every rank here, not on the receiving ranks once the objects have moved
    _expect(TypeError, ["object_list must be a list", "tuple"], lambda: dist.broadcast_object_list(("x",), src=0))
    _expect(ValueError, ["unknown reduce op 'sum'", "dist.ReduceOp.SUM"], lambda: dist.all_reduce(t, op="sum"))
    _expect(ValueError, ["new_group: ranks must be a list of int global ranks", "['0', '1']"],
            lambda: dist.new_group(["0", "1"]))
    _expect(ValueError, [f"send: dst={r} is this rank itself"], lambda: dist.send(t, dst=r))
    _expect(ValueError, [f"recv: src={r} is this rank itself"], lambda: dist.recv(t, src=r))
    assert all(torch.equal(o, torch.zeros(3)) for o in outs) and torch.equal(t, torch.full((2,), float(r + 1)))
    # a Partial dist tensor's blocks are summands: a collective would leave them read as Partial (summed twice)
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    p = dist.dtensor_from_local(torch.full((2,), float(r + 1)), mesh, [dist.Partial()])
    for name, call in (("all_reduce", lambda: dist.all_reduce(p)), ("broadcast", lambda: dist.broadcast(p, src=0)),
                       ("all_gather", lambda: dist.all_gather([p, p], t)), ("send", lambda: dist.send(p, dst=1 - r))):
        _expect(ValueError, [f"{name} got a dist tensor with placements [P(sum)]", "dist.reshard"], call)
    assert p._local_value().tolist() == [float(r + 1)] * 2 and dist.unshard_dtensor(p).tolist() == [3.0, 3.0]
    s = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    dist.all_reduce(s)  # a Shard or Replicate dist tensor: the collective runs on this rank's block
    assert s._local_value().tolist() == [2.0, 4.0]
    # the world still talks, and the group ids agree (numpy ints are ranks too)
    g = dist.new_group(np.arange(2))
    dist.all_reduce(t, group=g)
    return t.tolist(), g.id


@pytest.mark.timeout(60)
def test_collectives_check_their_arguments_before_communicating():
    assert run_ranks(collectives, 2, timeout=50) == [([3.0, 3.0], 10)] * 2  # Paddle's first id


# -- shard_layer and shard_optimizer ------------------------------------------------------------------------------


def shard_layer_midway():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    model = _net()
    params = list(model.parameters())

    def shard_fn(name, layer, m):
        if name == "0":
            layer.weight = dist.shard_tensor(layer.weight, m, [dist.Shard(0)])
            layer.bias = dist.shard_tensor(layer.bias, m, [dist.Shard(1)])  # a 1-D bias has no dim 1

    _expect(ValueError, ["Shard(1) is out of range for a 1-D tensor"], lambda: dist.shard_layer(model, mesh, shard_fn))
    assert all(p is q for p, q in zip(model.parameters(), params))  # not half sharded
    _expect(TypeError, ["input_fn must be callable", "str"], lambda: dist.shard_layer(model, mesh, input_fn="x"))
    assert all(p is q for p, q in zip(model.parameters(), params)) and not model._forward_pre_hooks
    dist.shard_layer(model, mesh)
    return [repr(p.placements) for p in model.parameters()]


@pytest.mark.timeout(60)
def test_shard_layer_leaves_the_layer_as_it_was_when_shard_fn_raises():
    assert run_ranks(shard_layer_midway, 2, timeout=50) == [["[R]"] * 4] * 2


def stage_on_a_mesh_without_the_axis():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    model = _net()
    model[0] = dist.shard_layer(model[0], dist.ProcessMesh([0, 1], dim_names=["dp"]))
    model[1] = dist.shard_layer(model[1], dist.ProcessMesh([[0], [1]], dim_names=["pp", "mp"]))
    opt = torch.optim.AdamW(model.parameters())
    before = _values(model)
    _expect(ValueError, ["unknown mesh dim name 'dp'", "['pp', 'mp']"],
            lambda: dist.shard_optimizer(opt, dist.ShardingStage3("dp")))
    assert _same(before, _values(model))
    return [repr(p.placements) for p in model.parameters()]


@pytest.mark.timeout(60)
def test_a_sharding_stage_checks_every_parameter_before_sharding_one():
    assert run_ranks(stage_on_a_mesh_without_the_axis, 2, timeout=50) == [["[R]", "[R]", "[R, R]", "[R, R]"]] * 2


def training_wrappers():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    model = dist.shard_layer(_net(), dist.ProcessMesh([0, 1], dim_names=["x"]))
    opt = torch.optim.AdamW(model.parameters())
    params = [list(g["params"]) for g in opt.param_groups]
    _expect(ValueError, ["unknown mesh dim name 'dp'", "['x']"],
            lambda: dist.shard_optimizer(opt, dist.ShardingStage1("dp")))
    assert [list(g["params"]) for g in opt.param_groups] == params and not opt.state
    # a group this rank is not in: the rank outside says so; the member wraps its model on its own
    g = dist.new_group([0])
    plain = _net(seed=r)
    before = _values(plain)
    if r == 1:
        _expect(ValueError, ["DataParallel: this rank (1) is not in the group [0]"],
                lambda: dist.DataParallel(plain, group=g))
        _expect(ValueError, ["group_sharded_parallel: rank 1 is not in the group [0]"],
                lambda: dist.sharding.group_sharded_parallel(plain, torch.optim.AdamW(plain.parameters()), "os",
                                                             group=g))
    else:
        dist.DataParallel(plain, group=g)
    model = _net(seed=2)
    opt = torch.optim.AdamW(model.parameters())
    wrapped, sharded, _ = dist.sharding.group_sharded_parallel(model, opt, "os_g")
    for again in (opt, sharded):  # the torch optimizer now steps this rank's shards: a second call is refused
        _expect(ValueError, ["group_sharded_parallel: this optimizer is already sharded"],
                lambda: dist.sharding.group_sharded_parallel(model, again, "os"))
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    for bad, what in (("abc", "got str"), (5, "got int"), ([torch.ones(1), "w"], "got str"), (plain, "got Linear")):
        _expect(TypeError, ["fused_allreduce_gradients: parameter_list is a list of parameters", what],
                lambda: fused_allreduce_gradients(bad))
    return _same(before, _values(plain))


@pytest.mark.timeout(60)
def test_training_wrappers_refuse_an_axis_or_group_they_cannot_use():
    assert run_ranks(training_wrappers, 2, timeout=50) == [True, True]


def data_parallel_strategy():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    plain = _net(seed=dist.get_rank())
    before = _values(plain)
    for bad, got in (("junk", "got 'junk' (str)"), (fleet.DistributedStrategy(), "(DistributedStrategy)")):
        _expect(TypeError, ["DataParallel: strategy must be a ParallelStrategy (an object with nranks) or None", got],
                lambda: dist.DataParallel(plain, strategy=bad))
    unchanged = _same(before, _values(plain))  # nothing broadcast
    dist.DataParallel(plain, strategy=dist.ParallelEnv())  # it has nranks, as Paddle's ParallelStrategy
    return unchanged, [v.tolist() for v in _values(plain)]


@pytest.mark.timeout(60)
def test_data_parallel_refuses_a_strategy_that_is_not_a_parallel_strategy():
    rank0 = [v.tolist() for v in _values(_net(seed=0))]
    assert run_ranks(data_parallel_strategy, 2, timeout=50) == [(True, rank0)] * 2


# -- to_static / DistModel ----------------------------------------------------------------------------------------


def to_static_bad_degree():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    model = _net(seed=dist.get_rank())  # each rank its own values: a broadcast would show
    before = _values(model)
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": 1, "degree": 3}})
    _expect(ValueError, ["sharding.degree (3) must equal the number of ranks (2)"],
            lambda: dist.to_static(model, None, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                                   strategy=strategy))
    return _same(before, _values(model))


@pytest.mark.timeout(60)
def test_to_static_refuses_a_sharding_degree_before_broadcasting():
    assert run_ranks(to_static_bad_degree, 2, timeout=50) == [True, True]


def set_state_dict_shapes():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    model = _net()
    dm = dist.to_static(model, None, nn.MSELoss(), torch.optim.AdamW(model.parameters()))
    sd = dm.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    new = {k: v + 1 for k, v in sd.items()}
    bad = dict(new, **{"1.weight": torch.ones(3, 3)})
    _expect(ValueError, ["set_state_dict: 1.weight has shape [2, 4], got [3, 3]"], lambda: dm.set_state_dict(bad))
    bad = dict(new, **{"0.bias": torch.ones(1)})  # copy_ would have broadcast it
    _expect(ValueError, ["set_state_dict: 0.bias has shape [4], got [1]"], lambda: dm.set_state_dict(bad))
    bad = dict(new, **{"1.bias.exp_avg": torch.zeros(7)})
    _expect(ValueError, ["set_state_dict: 1.bias.exp_avg has shape [2], got [7]"], lambda: dm.set_state_dict(bad))
    _expect(TypeError, ["expected a dict", "list"], lambda: dm.set_state_dict(list(new.items())))
    after = dm.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    dm.set_state_dict(new)
    loaded = all(torch.equal(new[k], v) for k, v in dm.state_dict().items())
    return unchanged, loaded


@pytest.mark.timeout(60)
def test_dist_model_set_state_dict_checks_every_shape_before_writing():
    assert run_ranks(set_state_dict_shapes, 2, timeout=50) == [(True, True)] * 2


# -- fleet and spawn ----------------------------------------------------------------------------------------------


def fleet_mp_model():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2}
    fleet.init(is_collective=True, strategy=s)
    model = _net(seed=dist.get_rank())
    split = model[1].weight
    split.is_distributed = True  # a model-parallel shard: each rank keeps its own
    own = split.detach().clone()
    fleet.distributed_model(model)
    _expect(TypeError, ["fleet.distributed_optimizer expects a torch optimizer", "str"],
            lambda: fleet.distributed_optimizer("adam"))
    return [p.detach().tolist() for p in (model[0].weight, model[1].bias)], torch.equal(split, own)


@pytest.mark.timeout(60)
def test_fleet_model_parallel_makes_the_unsplit_parameters_equal():
    res = run_ranks(fleet_mp_model, 2, timeout=50)
    rank0 = _net(seed=0)
    # rank 0's values everywhere (a tensor's own is_distributed method made every one of them look split)
    assert res == [([rank0[0].weight.tolist(), rank0[1].bias.tolist()], True)] * 2


@pytest.mark.timeout(30)
def test_spawn_refuses_an_unknown_option_before_starting():
    import meshviz.distributed as dist

    with pytest.raises(ValueError, match=r"spawn: unknown options \['backnd'\]; the options are \[.*'backend'"):
        dist.spawn(print, nprocs=2, backnd="gloo")
    with pytest.raises(ValueError, match=r"spawn: ips='10\.0\.0\.2,10\.0\.0\.3': spawn starts its ranks on this "
                                         r"machine; for several machines run python -m meshviz.launch on each"):
        dist.spawn(print, nprocs=2, ips="10.0.0.2,10.0.0.3")
    with pytest.raises(ValueError, match=r"spawn: xpus='0,1': meshviz runs on CPUs and CUDA GPUs"):
        dist.spawn(print, nprocs=2, xpus="0,1")


def other_reduce_op():
    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    r = dist.get_rank()
    old = set_checking(True)
    try:
        t = torch.full((2,), float(r + 1))
        with pytest.raises(CollectiveMismatch) as info:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if r == 1 else dist.ReduceOp.SUM)
        return str(info.value), info.value.ranks, t.tolist()
    finally:
        set_checking(old)


@pytest.mark.timeout(60)
def test_a_reduce_op_of_its_own_on_one_rank_is_named_before_data_moves():
    line = ("mismatch at #1 on group [0, 1, 2]: rank 0 entered all_reduce(sum) float32[2]; rank 1 entered "
            "all_reduce(max) float32[2]; rank 2 entered all_reduce(sum) float32[2]")
    res = run_ranks(other_reduce_op, 3, timeout=50)
    assert [r[:2] for r in res] == [(line, [1])] * 3
    assert [r[2] for r in res] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]  # nothing reduced


def other_root():
    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    r = dist.get_rank()
    old = set_checking(True)
    out = []
    try:
        t = torch.full((2,), float(r + 1))
        for call in (lambda: dist.broadcast(t, src=2 if r == 2 else 0), lambda: dist.reduce(t, dst=r % 2),
                     lambda: dist.broadcast_object_list([r], src=r)):
            with pytest.raises(CollectiveMismatch) as info:
                call()
            out.append(str(info.value))
        return out, t.tolist()
    finally:
        set_checking(old)


@pytest.mark.timeout(60)
def test_a_root_of_its_own_is_named_before_data_moves():
    lines = ["mismatch at #1 on group [0, 1, 2]: rank 0 entered broadcast(src=0) float32[2]; rank 1 entered "
             "broadcast(src=0) float32[2]; rank 2 entered broadcast(src=2) float32[2]",
             "mismatch at #2 on group [0, 1, 2]: rank 0 entered reduce(dst=0) float32[2]; rank 1 entered "
             "reduce(dst=1) float32[2]; rank 2 entered reduce(dst=0) float32[2]",
             "mismatch at #3 on group [0, 1, 2]: rank 0 entered broadcast_object_list(src=0); rank 1 entered "
             "broadcast_object_list(src=1); rank 2 entered broadcast_object_list(src=2)"]
    res = run_ranks(other_root, 3, timeout=50)
    assert res == [(lines, [float(r + 1)] * 2) for r in range(3)]  # named on every rank, nothing moved


def group_beyond_the_world():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.ones(2)
    with pytest.raises(ValueError) as info:
        dist.all_reduce(t, group=[0, 5])
    s = torch.ones(1)
    dist.all_reduce(s)  # the world goes on
    return str(info.value), t.tolist(), s.item()


@pytest.mark.timeout(60)
def test_a_group_of_ranks_beyond_the_world_is_named_on_every_rank():
    for text, t, s in run_ranks(group_beyond_the_world, 2, timeout=50):
        assert text.startswith("all_reduce on group [0, 5]: the world has no rank 5") and t == [1.0, 1.0] and s == 2.0
