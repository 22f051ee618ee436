"""An optimizer that has stepped, handed to group_sharded_parallel or parallelize: its states carry over."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.testing import run_ranks

LEVELS = ("os", "os_g", "p_g_os")
B, PLAIN, SHARDED = 3, 2, 2


class _Net(nn.Module):
    """``b`` is used from the first sharded step on only: it has no state when the optimizer is wrapped."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 10)
        self.c = nn.Linear(10, 3)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h + self.b(h) if self.use_b else h)


def _model(branch=False):
    torch.manual_seed(0)
    return _Net() if branch else nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind == "sgd_dampening":  # a fresh momentum buffer is the gradient; a zero one would take half of it
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.5)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, 6, generator=g), torch.randn(B, 3, generator=g)


def _whole(step, world):
    xs, ys = zip(*(_batch(step, r) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def _dense(kind, world, branch=False):
    """One process, every rank's batch at every step."""
    model = _model(branch)
    opt = _opt(kind, model.parameters())
    for s in range(PLAIN + SHARDED):
        model.use_b = s >= PLAIN
        x, y = _whole(s, world)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    names = [k for k, _ in model.named_parameters()]
    state = {names[i]: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, state


def _group_sharded(kind, world, branch=False, segment_sizes=(1,)):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {}
    for level, seg in [(lv, seg) for lv in LEVELS for seg in segment_sizes]:
        model = _model(branch)
        opt = _opt(kind, model.parameters())
        for s in range(PLAIN):  # every rank steps the whole batch: one process, replicated
            x, y = _whole(s, world)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=seg)
        model.use_b = True
        for s in range(PLAIN, PLAIN + SHARDED):
            x, y = _batch(s, rank)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.clear_grad()
        shards = {}
        for slot in opt._slots:
            key = slot.shard if slot.shard is not None else slot.param
            st = opt._inner_opt.state.get(key, {})
            shards[slot.name] = ((slot.lo, slot.hi) if slot.owned else None,
                                 {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                                  for k, v in st.items()})
        out[level, seg] = {"params": {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()},
                      "shards": shards, "modes": {s.name: s.piece.mode for s in opt._slots}}
    return out


def _check_shard(name, mode, where, got, want, rank, world, who):
    assert got.keys() == want.keys(), (who, name, sorted(got), sorted(want))
    for k, v in want.items():
        if v.dim() == 0:
            torch.testing.assert_close(got[k], v, msg=lambda m: f"{who} {name} {k}: {m}")
        elif mode == "fsdp":
            part = torch.chunk(v, world, dim=0)
            part = part[rank] if rank < len(part) else v[:0]
            torch.testing.assert_close(got[k], part, rtol=1e-5, atol=1e-6, msg=lambda m: f"{who} {name} {k}: {m}")
        else:
            lo, hi = where
            torch.testing.assert_close(got[k].reshape(-1), v.reshape(-1)[lo:hi], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{who} {name} {k}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [2, 4])
def test_group_sharded_parallel_carries_a_stepped_optimizers_states_over(world, kind):
    _check_group_sharded(world, kind, False, (1, 2**20))


@pytest.mark.timeout(240)
def test_a_parameter_without_state_when_wrapped_starts_its_state_afresh():
    _check_group_sharded(2, "sgd_dampening", True, (1, 2**20))


def _check_group_sharded(world, kind, branch, segment_sizes):
    ref, ref_state = _dense(kind, world, branch)
    results = run_ranks(_group_sharded, world, kind, world, branch, segment_sizes, timeout=200)
    for level, seg in [(lv, seg) for lv in LEVELS for seg in segment_sizes]:
        for rank, all_res in enumerate(results):
            res = {level: all_res[level, seg]}
            who = f"{level} segment {seg} rank {rank}"
            for k, v in ref.items():
                torch.testing.assert_close(res[level]["params"][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{who} {k}: {m}")
            for name, (where, st) in res[level]["shards"].items():
                mode = res[level]["modes"][name]
                if mode != "fsdp" and where is None:
                    assert not st, (who, name)
                    continue
                _check_shard(name, mode, where, st, ref_state[name], rank, world, who)


# -- dist.parallelize ------------------------------------------------------------------------------------------

def _llama_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _compared(kind, weights: dict) -> dict:
    """A key bias's gradient is zero up to rounding (softmax ignores what it adds to every score): Adam's step
    scales that rounding up to a full step, another in every run, so it is left out of the comparison with Adam."""
    return {n: w for n, w in weights.items() if kind != "adamw" or not n.endswith("k_proj.bias")}


def _dense_llama(kind, steps):
    from tests.models import llama_loss
    from tests.ranks.test_parallelize_8_probe import _batches
    from tests.ranks.test_parallelize_level3_probe import _llama

    model = _llama()
    opt = _llama_opt(kind, model.parameters())
    for (ids, labels), in _batches(1, steps=steps):
        llama_loss(model(ids), labels).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _parallelize_after_steps(kind, level, pp):
    """Steps of the plain model on every rank (one process, replicated), then dist.parallelize with the optimizer
    and steps of the parallel one."""
    import meshviz.distributed as dist
    from tests.models import llama_loss
    from tests.ranks.test_parallelize_8_probe import _batches, _plan
    from tests.ranks.test_parallelize_level3_probe import _llama

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    if pp:
        mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "pp", "mp"])
        first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", 1)
    else:
        mesh = first = last = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = _llama()
    opt = _llama_opt(kind, model.parameters())
    batches = _batches(1, steps=PLAIN + SHARDED)
    for (ids, labels), in batches[:PLAIN]:
        llama_loss(model(ids), labels).backward()
        opt.step()
        opt.zero_grad()
    cfg = {"mp_config": {"parallelize_plan": _plan(False)}, "dp_config": {"sharding_level": level}}
    if pp:
        cfg["pp_config"] = {"split_spec": "llama.layers"}
    model, opt = dist.parallelize(model, opt, mesh=mesh, config=cfg)
    for (ids, labels), in batches[PLAIN:]:
        ids = dist.shard_tensor(ids, first, [dist.Shard(0)] + [dist.Replicate()] * (first.ndim - 1))
        labels = dist.shard_tensor(labels, last, [dist.Shard(0)] + [dist.Replicate()] * (last.ndim - 1))
        llama_loss(model(ids), labels).backward()
        opt.step()
        opt.zero_grad()
    weights = {n: dist.unshard_dtensor(p).detach().clone() for n, p in model.named_parameters()}
    return {n: w for n, w in weights.items() if w.numel()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_parallelize_takes_an_optimizer_that_has_stepped_and_trains_on_as_one_process(level, kind):
    want = _dense_llama(kind, PLAIN + SHARDED)
    for rank, weights in enumerate(run_ranks(_parallelize_after_steps, 4, kind, level, False, timeout=200)):
        assert weights.keys() == want.keys(), rank
        for name, w in _compared(kind, weights).items():
            torch.testing.assert_close(w, want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{rank} {name}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("level", [1, 3])
def test_parallelize_with_pipeline_stages_takes_an_optimizer_that_has_stepped(level):
    want = _dense_llama("adamw", PLAIN + SHARDED)
    results = run_ranks(_parallelize_after_steps, 8, "adamw", level, True, timeout=200, collective_timeout=60)
    for rank, weights in enumerate(results):
        assert weights, rank
        for name, w in _compared("adamw", weights).items():
            torch.testing.assert_close(w, want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{rank} {name}: {m}")
    for name in want:  # every weight is held by the ranks of its stage
        assert any(name in w for w in results), name
