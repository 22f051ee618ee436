"""save_state_dict/load_state_dict: saved sharded on 4 ranks, loaded on 2 (and 1) in other layouts, bit-exact."""

import pytest
import torch

from meshviz.testing import run_ranks


def _full():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(10, 3, generator=g), "b": torch.randn(8, 4, generator=g),
            "plain": torch.arange(6.0), "step": 7, "opt": {"m": torch.randn(5, generator=g)}}


def _save4(path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = init_device_mesh("cpu", (4,))
    f = _full()
    sd = {"w": distribute_tensor(f["w"], mesh, [Shard(0)]),  # 10 rows on 4: 3, 3, 3, 1
          "b": distribute_tensor(f["b"], mesh, [Shard(1)]),
          "plain": f["plain"], "step": f["step"],
          "opt": {"m": distribute_tensor(f["opt"]["m"], mesh, [Shard(0)])}}
    dist.save_state_dict(sd, path)
    return sd["w"].to_local().shape[0]


def _load2(path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = init_device_mesh("cpu", (2,))
    z = {k: torch.zeros_like(v) for k, v in _full().items() if isinstance(v, torch.Tensor)}
    w = distribute_tensor(z["w"], mesh, [Replicate()])
    b = distribute_tensor(z["b"], mesh, [Shard(0)])
    m = distribute_tensor(torch.zeros(5), mesh, [Replicate()])
    plain = torch.zeros(6)
    sd = {"w": w, "b": b, "plain": plain, "step": 0, "opt": {"m": m}}
    dist.load_state_dict(sd, path)
    return {"w": sd["w"].to_local(), "b": sd["b"].to_local(), "plain": sd["plain"], "step": sd["step"],
            "m": sd["opt"]["m"].to_local(), "in_place": sd["w"] is w and sd["plain"] is plain}


@pytest.mark.timeout(120)
def test_save_on_4_sharded_load_on_2_replicated(tmp_path):
    path = str(tmp_path / "ckpt")
    assert run_ranks(_save4, 4, path) == [3, 3, 3, 1]
    f = _full()
    res = run_ranks(_load2, 2, path)
    for r, out in enumerate(res):
        assert torch.equal(out["w"], f["w"])
        assert torch.equal(out["b"], f["b"].chunk(2, dim=0)[r])
        assert torch.equal(out["plain"], f["plain"]) and out["step"] == 7
        assert torch.equal(out["m"], f["opt"]["m"])
        assert out["in_place"]
    # and into plain tensors in one process without any process group
    import meshviz.distributed as dist

    sd = {"w": torch.zeros(10, 3), "b": torch.zeros(8, 4), "plain": torch.zeros(6), "step": 0,
          "opt": {"m": torch.zeros(5)}}
    dist.load_state_dict(sd, path)
    for k in ("w", "b", "plain"):
        assert torch.equal(sd[k], f[k])
    assert torch.equal(sd["opt"]["m"], f["opt"]["m"]) and sd["step"] == 7


def test_plain_round_trip_single_process(tmp_path):
    import meshviz.distributed as dist
    from meshviz.distributed.checkpoint import _to_dcp

    sd = {"a": torch.randn(3, 2), "n": {"c": torch.arange(4)}}
    dist.save_state_dict(sd, str(tmp_path / "c"))
    new = {"a": torch.zeros(3, 2), "n": {"c": torch.zeros(4, dtype=torch.long)}}
    dist.load_state_dict(new, str(tmp_path / "c"))
    assert torch.equal(new["a"], sd["a"]) and torch.equal(new["n"]["c"], sd["n"]["c"])
    assert _to_dcp(sd["a"]) is sd["a"]
    with pytest.raises(TypeError):
        dist.save_state_dict([1], str(tmp_path / "d"))


def _save_dist(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[2, 0], [3, 1]], dim_names=["x", "y"])  # ids not increasing
    t = dist.shard_tensor(_full()["w"].reshape(6, 5), mesh, [dist.Shard(0), dist.Shard(1)])
    p = dist.shard_tensor(_full()["w"].reshape(6, 5), mesh, [dist.Partial(), dist.Shard(1)])
    dist.save_state_dict({"t": t, "p": p}, path)
    return t._local_value().clone()


def _load_dist(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([1, 0], dim_names=["x"])
    a = dist.shard_tensor(torch.zeros(6, 5), mesh, [dist.Replicate()])
    b = dist.shard_tensor(torch.zeros(6, 5), mesh, [dist.Shard(1)])
    sd = {"t": a}
    dist.load_state_dict(sd, path)
    sd2 = {"t": b}
    dist.load_state_dict(sd2, path)
    c = dist.shard_tensor(torch.zeros(6, 5), mesh, [dist.Replicate()])
    dist.load_state_dict({"p": c}, path)  # a Partial tensor is saved reduced
    return a._local_value().clone(), b._local_value().clone(), sd["t"] is a, c._local_value().clone()


@pytest.mark.timeout(120)
def test_dist_tensors_reshard_on_load(tmp_path):
    path = str(tmp_path / "dist")
    full = _full()["w"].reshape(6, 5)
    saved = run_ranks(_save_dist, 4, path)
    # rank 0 sits at coordinate (0, 1): rows 0-2, cols 3-4
    assert torch.equal(saved[0], full[0:3, 3:5])
    res = run_ranks(_load_dist, 2, path)
    for r, (rep, sh, same, partial) in enumerate(res):
        assert torch.equal(rep, full) and same and torch.equal(partial, full)
        # rank 1 is coordinate 0 of mesh [1, 0]: cols 0-2; rank 0 cols 3-4
        assert torch.equal(sh, full[:, 0:3] if r == 1 else full[:, 3:5])


def _model_and_optimizer(stage, seed):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(seed)
    model = dist.shard_layer(torch.nn.Linear(2, 3), mesh, lambda name, layer, pm: None)  # 3 rows on 2 ranks: 2, 1
    stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                               stages[stage]("dp", mesh) if stage else None)
    return model, opt


def _saved(path):
    import meshviz.distributed as dist

    model, opt = _model_and_optimizer(None, 0)
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)


def _loaded_model_first(path, stage):
    import meshviz.distributed as dist

    model, opt = _model_and_optimizer(stage, 1)
    sd = {"model": model.state_dict(), "opt": opt.state_dict()}  # the model's first, as Paddle's examples take them
    dist.load_state_dict(sd, path)
    return {k: dist.unshard_dtensor(v).detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [None, 1, 2, 3])
def test_a_model_state_dict_taken_before_the_optimizers_loads_into_the_model(tmp_path, stage):
    """The optimizer's state_dict() makes its states with a step at learning rate 0: at stages 1 and 2 that step
    gathers the unevenly split parameters back into the blocks the model's state_dict() already holds."""
    path = str(tmp_path / "ckpt")
    run_ranks(_saved, 2, path, timeout=120)
    torch.manual_seed(0)
    want = torch.nn.Linear(2, 3).state_dict()  # what was saved: the seed-0 weights, before any step
    for got in run_ranks(_loaded_model_first, 2, path, stage, timeout=120):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
