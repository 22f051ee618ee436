"""Checkpoint probes: resuming on another mesh, world size and stage; what a load leaves unread; per-rank values."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

LR, WD, ROWS, K, M = 0.05, 0.01, 4, 2, 2  # train K steps, save, resume in a fresh run for M more


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 10)  # 10 rows: uneven blocks over 3 and 4 ranks
        self.down = nn.Linear(10, 6)

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


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 6, generator=g)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, amsgrad=True)


def _dense() -> dict:
    """One process, K + M steps on the whole batch, the learning rate halved after each step."""
    model = Net()
    opt = _adamw(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    for s in range(K + M):
        x, y = _batch(s)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- a run saved on one mesh resumes on another: other world size, axes, tensor-parallel split and sharding stage ----


def _resume_run(layout, first, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    ids, names, stage = layout
    mesh = dist.ProcessMesh(ids, dim_names=names)

    def split(name, layer, m):  # the up projection split by its outputs, the down one by its inputs, along mp
        if isinstance(layer, Block) and "mp" in names:
            pl = [dist.Replicate()] * len(names)
            pl[names.index("mp")] = dist.Shard(0)
            layer.up.weight = dist.shard_tensor(layer.up.weight, m, pl)
            pl[names.index("mp")] = dist.Shard(1)
            layer.down.weight = dist.shard_tensor(layer.down.weight, m, pl)

    model = dist.shard_layer(Net(), mesh, split)
    stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
    opt = dist.shard_optimizer(_adamw(model.parameters()), stages[stage]("dp", mesh) if stage else None)
    sched = torch.optim.lr_scheduler.StepLR(opt._inner_opt, 1, 0.5)
    pl = [dist.Shard(0) if a == "dp" else dist.Replicate() for a in names]

    def step(s):
        x, y = (dist.shard_tensor(t, mesh, pl) for t in _batch(s))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
        sched.step()

    if first:
        for s in range(K):
            step(s)
        dist.save_state_dict(model.state_dict(), f"{path}/model")
        dist.save_state_dict({"opt": opt.state_dict(), "sched": sched.state_dict()}, f"{path}/opt")
        return None
    dist.load_state_dict(model.state_dict(), f"{path}/model")
    sd = {"opt": opt.state_dict(), "sched": sched.state_dict()}
    dist.load_state_dict(sd, f"{path}/opt")
    opt.set_state_dict(sd["opt"])
    sched.load_state_dict(sd["sched"])
    for s in range(K, K + M):
        step(s)
    return {k: dist.unshard_dtensor(v).detach().clone() for k, v in model.state_dict().items()}


LAYOUTS = {
    "dp2 x mp2, stage 1": ([[0, 1], [2, 3]], ["dp", "mp"], 1),
    "mp2 x dp2 reordered, stage 3": ([[3, 1], [0, 2]], ["mp", "dp"], 3),
    "dp2, stage 2": ([1, 0], ["dp"], 2),
    "dp1 x mp3, stage 2": ([[0, 1, 2]], ["dp", "mp"], 2),
    "one rank": ([0], ["dp"], None),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved,loaded", [("dp2 x mp2, stage 1", "dp2, stage 2"),
                                          ("dp2, stage 2", "mp2 x dp2 reordered, stage 3"),
                                          ("mp2 x dp2 reordered, stage 3", "dp1 x mp3, stage 2"),
                                          ("dp1 x mp3, stage 2", "one rank")])
def test_resume_on_another_mesh_equals_one_uninterrupted_process(tmp_path, saved, loaded):
    import numpy as np

    a, b = LAYOUTS[saved], LAYOUTS[loaded]
    run_ranks(_resume_run, int(np.size(a[0])), a, True, str(tmp_path), timeout=100)
    want = _dense()
    for rank, got in enumerate(run_ranks(_resume_run, int(np.size(b[0])), b, False, str(tmp_path), timeout=100)):
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


# -- bad input on one rank: every rank raises (the others used to wait in the first collective) -----------------------


def _one_rank_passes_a_list(path, saving):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    w = dist.shard_tensor(torch.zeros(6), dist.ProcessMesh([0, 1]), [dist.Shard(0)])
    if not saving:
        dist.save_state_dict({"w": w}, path)
    sd = [w] if dist.get_rank() == 1 else {"w": w}
    with pytest.raises(TypeError) as info:
        (dist.save_state_dict if saving else dist.load_state_dict)(sd, path)
    return str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saving", [True, False])
def test_a_state_dict_that_is_no_dict_on_one_rank_raises_on_every_rank(tmp_path, saving):
    path = str(tmp_path / "ck")
    what = "save_state_dict" if saving else "load_state_dict"
    got = run_ranks(_one_rank_passes_a_list, 2, path, saving, timeout=40, collective_timeout=10)
    assert got == [f"{what}: state_dict must be a dict, got list (rank 1)"] * 2
    assert os.path.exists(path) != saving


# -- keys the checkpoint holds and the state_dict does not ask for are named (Paddle warns "Unexpected keys") ----------


def _dp_resume(first, path):
    """DataParallel with a plain torch optimizer: before its first step it has no states to load into."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    model = dist.DataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if first:
        x, y = _batch(0)
        F.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
        opt.step()
        dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        return None
    sd = {"model": model.state_dict(), "opt": opt.state_dict()}
    told = []
    if r == 0:  # rank threads share the warnings machinery: one of them records
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dist.barrier()
            dist.load_state_dict(sd, path)
            dist.barrier()
        told = [str(w.message) for w in seen]
    else:
        dist.barrier()
        dist.load_state_dict(sd, path)
        dist.barrier()
    return told, sd["opt"]["state"], sd["opt"]["param_groups"][0]["lr"]


def _full_match(path):
    """Lists of dicts (an optimizer's param_groups) are keyed as DCP keys them: nothing is left unread."""
    m = nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.3)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    import meshviz.distributed as dist

    sd = {"opt": opt.state_dict(), "rows": [{"a": 1}, {"b": [2]}], "pairs": [(1, {"c": 3})]}
    dist.save_state_dict(sd, path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.load_state_dict(sd, path)
    return [str(w.message) for w in seen]


@pytest.mark.timeout(60)
def test_checkpoint_keys_the_state_dict_has_no_place_for_are_named(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_dp_resume, 2, True, path)
    told, states, lr = run_ranks(_dp_resume, 2, False, path)[0]
    assert states == {} and lr == LR  # the model and param_groups load; the states have nowhere to go
    assert told and all("left unread: opt.state.0.exp_avg, opt.state.0.exp_avg_sq" in t for t in told), told
    assert all("and 20 more" in t and "model." not in t for t in told)
    assert _full_match(str(tmp_path / "one")) == []


# -- plain values that differ across ranks: the checkpoint would keep one rank's, so each rank raises ----------------


def _save_values(path, varying):
    import random

    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    random.seed(r if varying else 0)
    sd = {"w": dist.shard_tensor(torch.arange(6.0), dist.ProcessMesh([0, 1, 2]), [dist.Shard(0)]),
          "meta": {"epoch": 3, "names": ["a", "b"], "tags": {"x", "y", "z"}}, "rng": random.getstate()}
    if varying:
        sd["meta"]["seen"] = [r, 7]
        sd["flag"] = 0 if r == 0 else 0.0  # equal on every rank, but an int on rank 0
    try:
        dist.save_state_dict(sd, path)
    except ValueError as e:
        return str(e)
    return None


def _load_values(path):
    import random

    import meshviz.distributed as dist

    dist.init_parallel_env()
    sd = {"w": torch.zeros(6), "meta": {"epoch": 0, "names": None, "tags": None}, "rng": None}
    dist.load_state_dict(sd, path)
    random.seed(0)
    return sd["meta"], sd["rng"] == random.getstate()


@pytest.mark.timeout(60)
def test_plain_values_differing_across_ranks_are_refused(tmp_path):
    path = str(tmp_path / "ck")
    msgs = run_ranks(_save_values, 3, path, True)
    assert msgs[0] == msgs[1] == msgs[2] and not os.path.exists(path)
    assert msgs[0].startswith("save_state_dict: plain (not distributed) tensors or values differ across ranks under "
                              "'flag' (types differ), 'meta.seen' (values differ), 'rng' (values differ); ")
    assert run_ranks(_save_values, 3, path, False) == [None] * 3  # a set is not compared: its order may differ
    for meta, same_rng in run_ranks(_load_values, 2, path):
        assert meta == {"epoch": 3, "names": ["a", "b"], "tags": {"x", "y", "z"}} and same_rng


# -- a tensor in the state_dict where the checkpoint holds a plain value: one error on every rank, nothing loaded -----


def _save_mixed(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.save_state_dict({"a": torch.arange(4.0), "n": 7, "m": {"lr": 0.5}}, path)


def _load_tensor_for_value(path, dist_target):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1])
    a = dist.shard_tensor(torch.zeros(4), mesh, [dist.Shard(0)])
    n = dist.shard_tensor(torch.zeros(2), mesh, [dist.Shard(0)]) if dist_target else torch.zeros(2)
    sd = {"a": a, "n": n, "m": {"lr": torch.zeros(())}}
    with pytest.raises(ValueError) as info:
        dist.load_state_dict(sd, path)
    return str(info.value), a._local_value().clone(), sd["n"] is n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dist_target", [True, False])
def test_a_tensor_where_the_checkpoint_holds_a_plain_value_raises_before_reading(tmp_path, dist_target):
    path = str(tmp_path / "ck")
    run_ranks(_save_mixed, 2, path)
    for msg, block, same in run_ranks(_load_tensor_for_value, 2, path, dist_target):
        assert msg == ("load_state_dict: the checkpoint holds plain values, not tensors, under m.lr, n, where the "
                       "state_dict holds tensors (rank 0)")
        assert torch.equal(block, torch.zeros(2)) and same  # nothing loaded, nothing replaced


# -- a lazy model (LazyGuard, not initialized): a clear error on every rank, before anything is written or read --------


def _lazy(path, saving):
    import meshviz
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1])
    if not saving:
        dist.save_state_dict({"weight": dist.shard_tensor(torch.ones(4, 3), mesh, [dist.Shard(0)]),
                              "bias": torch.ones(4)}, path)
    with meshviz.LazyGuard():
        m = nn.Linear(3, 4)
    m.weight = dist.shard_tensor(m.weight, mesh, [dist.Shard(1)])
    with pytest.raises(ValueError) as info:
        (dist.save_state_dict if saving else dist.load_state_dict)(dict(m.state_dict()), path)
    return str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saving", [True, False])
def test_a_lazy_model_not_initialized_is_refused_by_name(tmp_path, saving):
    path = str(tmp_path / "ck")
    what = "save_state_dict" if saving else "load_state_dict"
    assert run_ranks(_lazy, 2, path, saving) == [
        f"{what}: bias, weight hold no values (on the meta device: built under LazyGuard and not initialized yet); "
        f"call initialize() on them first (for p in model.parameters(): p.initialize()) (rank 0)"] * 2
    assert os.path.exists(path) != saving


# -- a Partial tensor is saved reduced (Paddle 3.3.1 saves one rank's summand: 1 here, for 1 + 2 + 3) ----------------


def _save_summands(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([2, 0, 1])
    sd = {op: dist.dtensor_from_local(torch.tensor([r + 1.0, -2.0 * r]), mesh, [dist.Partial(op)])
          for op in ("sum", "avg", "max", "min")}
    dist.save_state_dict(sd, path)


@pytest.mark.timeout(60)
def test_a_partial_tensor_is_saved_reduced(tmp_path):
    import meshviz.distributed as dist

    path = str(tmp_path / "ck")
    run_ranks(_save_summands, 3, path)
    sd = {op: torch.zeros(2) for op in ("sum", "avg", "max", "min")}
    dist.load_state_dict(sd, path)
    assert {k: v.tolist() for k, v in sd.items()} == {"sum": [6.0, -6.0], "avg": [2.0, -2.0], "max": [3.0, 0.0],
                                                     "min": [1.0, -4.0]}


# -- -0.0 and 0.0 are one value: a checkpoint of them is no difference across ranks ---------------------------------


def _save_signed_zeros(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    zero = -0.0 if r == 0 else 0.0
    sd = {"w": dist.shard_tensor(torch.arange(4.0), dist.ProcessMesh([0, 1]), [dist.Shard(0)]),
          "loss_scale": zero, "shift": complex(1.0, zero), "bias": torch.tensor([zero, 2.0])}
    dist.save_state_dict(sd, path)
    out = {"w": torch.zeros(4), "loss_scale": None, "shift": None, "bias": torch.ones(2)}
    dist.load_state_dict(out, path)
    return out["loss_scale"], out["shift"], out["bias"].tolist(), out["w"].tolist()


@pytest.mark.timeout(60)
def test_minus_zero_and_zero_are_the_same_plain_value_on_every_rank(tmp_path):
    for scale, shift, bias, w in run_ranks(_save_signed_zeros, 2, str(tmp_path / "ck")):
        assert scale == 0.0 and shift == complex(1.0, 0.0) and bias == [0.0, 2.0] and w == [0.0, 1.0, 2.0, 3.0]
