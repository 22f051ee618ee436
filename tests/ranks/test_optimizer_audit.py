"""The optimizer side against one dense process: scalers over several optimizers, zeroed gradients under sharding,
state_dict() before training, frozen parameters and foreach kernels under group_sharded_parallel, refusals."""

import warnings

import pytest
import torch
import torch.nn as nn

from meshviz.testing import run_ranks

STAGES = (None, 1, 2, 3)


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _stage(dist, stage, mesh):
    return None if stage is None else getattr(dist, f"ShardingStage{stage}")("dp", mesh)


# -- one shard_scaler, two optimizers ----------------------------------------------------------------------------
def _scaled_two_optimizers():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    a = dist.shard_tensor(nn.Parameter(_w(4, 3)), mesh, [dist.Replicate()])
    b = dist.shard_tensor(nn.Parameter(_w(3, 2, seed=5)), mesh, [dist.Replicate()])
    o1 = dist.shard_optimizer(torch.optim.SGD([a], lr=0.1))
    o2 = dist.shard_optimizer(torch.optim.SGD([b], lr=0.1))
    scaler = dist.shard_scaler(torch.amp.GradScaler("cpu", init_scale=1024.0))
    x = dist.shard_tensor(_w(8, 4, seed=1), mesh, [dist.Shard(0)])
    scaler.scale((x @ a @ b).pow(2).mean()).backward()
    scaler.step(o1)
    errors = []
    for again in (lambda: scaler.step(o1), lambda: scaler.unscale_(o1)):
        with pytest.raises(RuntimeError) as e:
            again()
        errors.append(str(e.value))
    scaler.unscale_(o2)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(o2)
    scaler.step(o2)
    scaler.update()
    return dist.unshard_dtensor(a).detach(), dist.unshard_dtensor(b).detach(), errors


def test_one_scaler_unscales_each_optimizer_once_between_updates():
    a, b = nn.Parameter(_w(4, 3)), nn.Parameter(_w(3, 2, seed=5))
    (_w(8, 4, seed=1) @ a @ b).pow(2).mean().backward()
    with torch.no_grad():
        want_a, want_b = a - 0.1 * a.grad, b - 0.1 * b.grad
    for got_a, got_b, errors in run_ranks(_scaled_two_optimizers, 2):
        torch.testing.assert_close(got_a, want_a)
        torch.testing.assert_close(got_b, want_b)  # the second optimizer's gradients were unscaled too
        assert errors == ["step() has already been called since the last update().",
                          "unscale_() is being called after step()."]


# -- Paddle's clear_grad() zeroes: a parameter unused in a step is still stepped ---------------------------------------
def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _train_c_only_first(a, c, x, opt, clear):
    """Three steps in which ``c`` takes part in the first only (dense or dist tensors alike)."""
    for s in range(3):
        h = x @ a
        if s == 0:
            h = h[:, :3] @ c
        h.pow(2).mean().backward()
        opt.step()
        clear()


def _unused_after_first_step(stage):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    a = dist.shard_tensor(nn.Parameter(_w(4, 6)), mesh, [dist.Replicate()])
    c = dist.shard_tensor(nn.Parameter(_w(3, 3, seed=4)), mesh, [dist.Replicate()])
    opt = dist.shard_optimizer(_sgd([a, c]), _stage(dist, stage, mesh))
    x = dist.shard_tensor(_w(8, 4, seed=1), mesh, [dist.Shard(0)])
    _train_c_only_first(a, c, x, opt, opt.clear_grad)
    return dist.unshard_dtensor(a).detach(), dist.unshard_dtensor(c).detach()


@pytest.mark.parametrize("stage", STAGES)
def test_clear_grad_keeps_zeroed_gradients_stepped_at_every_stage(stage):
    a, c = nn.Parameter(_w(4, 6)), nn.Parameter(_w(3, 3, seed=4))
    opt = _sgd([a, c])
    _train_c_only_first(a, c, _w(8, 4, seed=1), opt, lambda: opt.zero_grad(set_to_none=False))
    for got_a, got_c in run_ranks(_unused_after_first_step, 2, stage):
        torch.testing.assert_close(got_a, a.detach())
        torch.testing.assert_close(got_c, c.detach())  # momentum and weight decay move it after step 0


# -- state_dict() before training changes nothing that follows -------------------------------------------------------
def _make(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.Adam(params, lr=0.1, weight_decay=0.1)


def _peeked(kind, stage):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    w = dist.shard_tensor(nn.Parameter(_w(4, 3)), mesh, [dist.Replicate()])
    opt = dist.shard_optimizer(_make(kind, [w]), _stage(dist, stage, mesh))
    made = {k: float((v._local_value() if hasattr(v, "_local_value") else v).abs().sum())
            for k, v in opt.state_dict()["state"][0].items()}
    x = dist.shard_tensor(_w(8, 4, seed=1), mesh, [dist.Shard(0)])
    for _ in range(3):
        (x @ w).pow(2).mean().backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
    return dist.unshard_dtensor(w).detach(), made


@pytest.mark.parametrize("stage", [None, 1])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_state_dict_before_training_reads_as_no_step_and_changes_nothing(kind, stage):
    w = nn.Parameter(_w(4, 3))
    opt, x = _make(kind, [w]), _w(8, 4, seed=1)
    for _ in range(3):
        (x @ w).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for got, made in run_ranks(_peeked, 2, kind, stage):
        torch.testing.assert_close(got, w.detach())
        assert made and all(v == 0.0 for v in made.values()), made  # step 0, zero moments (no L2 decay in them)


# -- group_sharded_parallel: frozen parameters, foreach asked for -----------------------------------------------------
def _gsp_model(frozen):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    if frozen:
        m[1].weight.requires_grad_(False)
    return m


def _gsp(level, frozen, foreach):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    m = _gsp_model(frozen)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=foreach)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m, opt, _ = group_sharded_parallel(m, opt, level, segment_size=20)  # 1.weight (16) stays whole
    x = torch.arange(32.0).reshape(4, 8) / 10
    for _ in range(2):
        m(x[2 * dist.get_rank():][:2]).pow(2).sum().backward()
        opt.step()
        opt.clear_grad()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in m.named_parameters()}
    return full, [str(w.message) for w in seen if "foreach" in str(w.message)]


@pytest.mark.parametrize("level,frozen,foreach", [("os", True, None), ("os_g", True, None), ("p_g_os", True, None),
                                                  ("p_g_os", False, True)])
def test_group_sharded_frozen_parameters_and_foreach_equal_dense(level, frozen, foreach):
    m = _gsp_model(frozen)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=foreach)
    x = torch.arange(32.0).reshape(4, 8) / 10
    for _ in range(2):
        (m(x[:2]).pow(2).sum() + m(x[2:]).pow(2).sum()).div(2).backward()
        opt.step()
        opt.zero_grad()
    for full, told in run_ranks(_gsp, 2, level, frozen, foreach):
        for n, p in m.named_parameters():
            torch.testing.assert_close(full[n], p.detach(), msg=n)
        assert bool(told) == bool(foreach)  # the mix of sharded and whole parameters is stepped without foreach


# -- optimizers whose update reads the whole parameter are refused where ranks step parts ---------------------------
class _Factored(torch.optim.SGD):
    """Stands for torch's Adafactor (its name is what is refused; not every supported torch has the class)."""


_Factored.__name__ = "Adafactor"


def _refused(where):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    if where == "gsp":
        m = nn.Linear(4, 4)
        group_sharded_parallel(m, _Factored(m.parameters(), lr=0.1), "os")
    placements = [dist.Shard(0)] if where == "shard" else [dist.Replicate()]
    w = dist.shard_tensor(nn.Parameter(_w(4, 4)), mesh, placements)
    stage = dist.ShardingStage1("dp", mesh) if where == "stage" else None
    dist.shard_optimizer(_Factored([w], lr=0.1), stage)
    return "accepted"


@pytest.mark.parametrize("where", ["shard", "stage", "gsp"])
def test_an_update_that_reads_the_whole_parameter_is_refused_on_parts(where):
    from meshviz.errors import RankError

    with pytest.raises(RankError, match=r"torch.optim.Adafactor updates each parameter from all of it"):
        run_ranks(_refused, 2, where)
    assert run_ranks(_refused, 2, "whole") == ["accepted", "accepted"]  # replicated, no stage: whole tensors


# -- torch's LR schedulers take the sharded optimizers ----------------------------------------------------------
def _scheduled(which):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    if which == "group_sharded":
        m, opt, _ = group_sharded_parallel(m, torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.5), "os_g")
    else:
        dist.shard_layer(m, mesh)
        opt = dist.shard_optimizer(torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.5),
                                   dist.ShardingStage1("dp", mesh))
        with pytest.raises(ValueError, match="not one sharded already"):
            dist.shard_optimizer(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for s in range(3):
        m(torch.full((2, 4), float(s + 1))).pow(2).sum().backward()
        opt.step()
        opt.clear_grad()
        sched.step()
    full = {n: (dist.unshard_dtensor(p) if hasattr(p, "placements") else p).detach() for n, p in m.named_parameters()}
    return full, opt.param_groups[0]["lr"]


@pytest.mark.parametrize("which", ["shard_optimizer", "group_sharded"])
def test_torch_lr_schedulers_step_the_sharded_optimizers(which):
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for s in range(3):
        m(torch.full((2, 4), float(s + 1))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    for full, lr in run_ranks(_scheduled, 2, which):
        assert lr == 0.125
        for n, p in m.named_parameters():
            torch.testing.assert_close(full[n], p.detach(), msg=n)


# -- resuming where a parameter had no gradient before the checkpoint ------------------------------------------------
def _resume_with_an_unused_parameter(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])

    def build():
        a = dist.shard_tensor(nn.Parameter(_w(4, 3)), mesh, [dist.Replicate()])
        c = dist.shard_tensor(nn.Parameter(_w(3, 3, seed=4)), mesh, [dist.Replicate()])
        return a, c, dist.shard_optimizer(torch.optim.AdamW([a, c], lr=0.1))

    x = dist.shard_tensor(_w(4, 4, seed=1), mesh, [dist.Shard(0)])
    a, c, opt = build()
    (x @ a).pow(2).sum().backward()  # c has no gradient in the first step: no state either
    opt.step()
    opt.clear_grad(set_to_zero=False)
    dist.save_state_dict({"a": a, "c": c, "opt": opt.state_dict()}, path)
    a, c, opt = build()
    sd = {"a": a, "c": c, "opt": opt.state_dict()}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.load_state_dict(sd, path)
    opt.set_state_dict(sd["opt"])
    for _ in range(2):
        (x @ a @ c).pow(2).sum().backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
    told = [str(w.message) for w in seen]
    with pytest.raises(RuntimeError, match="Missing key"):  # a key no optimizer made is still refused
        dist.load_state_dict({"a": a, "b": a.detach().clone()}, path)
    return dist.unshard_dtensor(a).detach(), dist.unshard_dtensor(c).detach(), told


def test_resuming_loads_a_checkpoint_without_the_states_of_a_parameter_that_had_no_gradient(tmp_path):
    a, c = nn.Parameter(_w(4, 3)), nn.Parameter(_w(3, 3, seed=4))
    opt, x = torch.optim.AdamW([a, c], lr=0.1), _w(4, 4, seed=1)
    (x @ a).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    for _ in range(2):
        (x @ a @ c).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    results = run_ranks(_resume_with_an_unused_parameter, 2, str(tmp_path / "ckpt"))
    for got_a, got_c, _ in results:
        torch.testing.assert_close(got_a, a.detach())
        torch.testing.assert_close(got_c, c.detach())
    # the states left as made are named (rank threads share the warnings machinery: one of them records both)
    assert any("opt.state.1.exp_avg" in t for _, _, told in results for t in told), results
