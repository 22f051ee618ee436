"""group_sharded_parallel: each level trains like plain data parallel; saving, errors, ownership, memory."""

import os
import tempfile

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F

from meshviz.nn import ClipGradByGlobalNorm
from meshviz.runtime.devices import full_tensor
from meshviz.testing import run_ranks

LEVELS = ("os", "os_g", "p_g_os")
LR, WD, CLIP, STEPS, B = 0.05, 0.01, 0.5, 4, 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, 6, generator=g), torch.randn(B, 3, generator=g)


def reference(world, steps=STEPS, clip=CLIP):
    """Single process: the full batch of all ranks, Paddle's global-norm clip, AdamW."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for s in range(steps):
        xs, ys = zip(*(batch(s, r) for r in range(world)))
        loss = F.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
        norms.append(float(norm))
        for p in model.parameters():
            p.grad.mul_(clip / max(float(norm), clip))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt, norms


def full_params(model):
    out = {}
    for k, v in model.state_dict().items():
        out[k] = full_tensor(v).detach().clone()  # gloo-safe on CUDA
    return out


def _train(levels, segment_size, save_dir=None):
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.sharding import group_sharded_parallel, memory_stats, save_group_sharded_model

    dist.init_parallel_env()
    rank = dist.get_rank()
    sink = trace.add_sink(trace.MemorySink())
    out = {}
    for level in levels:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=segment_size,
                                               grad_clip=ClipGradByGlobalNorm(CLIP))
        mem = None
        for s in range(STEPS):
            x, y = batch(s, rank)
            F.mse_loss(model(x), y).backward()
            opt.step()
            if s == STEPS - 1:
                mem = memory_stats(model, opt)
            opt.clear_grad()
        res = {"params": full_params(model), "mem": mem, "pieces": opt.ownership,
               "foreach": [g.get("foreach") for g in opt._inner_opt.param_groups]}
        if save_dir is not None:
            d = os.path.join(save_dir, level)
            save_group_sharded_model(model, d, opt)
        out[level] = res
    out["ownership"] = [(e.name, e.op, e.payload.ranges) for e in sink.of_kind("ownership")]
    out["collectives"] = sorted({e.op for e in sink.of_kind("collective")})
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_levels_match_data_parallel(world):
    ref, _, norms = reference(world)
    assert norms[0] > CLIP  # the clip is active, so a wrong global norm would show
    tmp = tempfile.mkdtemp() if world == 2 else None
    results = run_ranks(_train, world, LEVELS, 8, tmp, timeout=150)
    for level in LEVELS:
        for rank, res in enumerate(results):
            for k, v in ref.items():
                torch.testing.assert_close(res[level]["params"][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{level} rank {rank} {k}: {m}")
    # p_g_os mixes FSDP's DTensors with the whole small parameters: stepped one tensor at a time, as one foreach
    # call over both kinds raises (CUDA parameters default to foreach)
    assert results[0]["p_g_os"]["foreach"] == [False] and results[0]["os"]["foreach"] == [None]
    # ownership: every rank emitted one event per parameter and level; the ranges tile each parameter
    own = results[0]["ownership"]
    assert len(own) == 4 * len(LEVELS)
    for _name, level, ranges in own:
        if level != "p_g_os":
            covered = sorted(tuple(r) for r in ranges if r[1] > r[0])
            n = max(r[1] for r in ranges)
            assert covered[0][0] == 0 and covered[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert {"all_gather", "all_reduce", "reduce_scatter"} <= set(results[0]["collectives"])
    if tmp:
        _check_saved(tmp, ref)


def _check_saved(tmp, ref):
    _, ref_opt, _ = reference(2)
    ref_state = ref_opt.state_dict()["state"]
    for level in LEVELS:
        model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
        model.load_state_dict(torch.load(os.path.join(tmp, level, "model.pdmodel")))
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        opt.load_state_dict(torch.load(os.path.join(tmp, level, "model.pdopt")))
        got = opt.state_dict()["state"]
        assert sorted(got) == sorted(ref_state)
        for i in ref_state:
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[i][key], ref_state[i][key], rtol=1e-5, atol=1e-7)
            assert float(got[i]["step"]) == STEPS


def _clear_grad(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.zero.slot import local_tensor

    dist.init_parallel_env()
    model = make_model()
    model, opt, _ = group_sharded_parallel(model, torch.optim.SGD(model.parameters(), lr=0.0), level,
                                           segment_size=8)
    x, y = batch(0, dist.get_rank())
    # the model's parameters and the shards the user's optimizer steps (os_g frees the former after backward)
    tensors = list(model.parameters()) + [p for g in opt.param_groups for p in g["params"]]

    def grads():
        return [None if t.grad is None else local_tensor(t.grad).detach().clone() for t in tensors]

    def train():  # learning rate 0: the parameters stay, so every round's gradients are the first round's
        F.mse_loss(model(x), y).backward()
        opt.step()
        return grads()

    first = train()
    opt.clear_grad()
    zeroed = grads()
    again = train()  # accumulated onto the zeros
    opt.clear_grad(set_to_zero=False)
    return first, zeroed, again, grads(), train()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", LEVELS)
def test_clear_grad_zeroes_the_gradients_as_paddles_and_set_to_zero_false_drops_them(level):
    for first, zeroed, again, dropped, fresh in run_ranks(_clear_grad, 2, level, timeout=100):
        held = [g is not None for g in first]
        assert any(held)
        # Paddle's clear_grad() (set_to_zero=True): the same gradients, each zero, none dropped
        assert [None if z is None else list(z.shape) for z in zeroed] == \
            [None if g is None else list(g.shape) for g in first]
        assert [float(z.abs().sum()) for z in zeroed if z is not None] == [0.0] * sum(held)
        assert dropped == [None] * len(first)
        for g, a, f in zip(first, again, fresh):
            assert (a is None and f is None) if g is None else (torch.equal(a, g) and torch.equal(f, g))


def _memory(world_levels):
    return _train(world_levels, 1)


@pytest.mark.timeout(120)
def test_memory_per_rank_shrinks_with_level():
    res = run_ranks(_memory, 2, LEVELS, timeout=100)
    psi = 60 + 10 + 30 + 3
    for r in res:
        m = {lv: r[lv]["mem"] for lv in LEVELS}
        assert m["os"]["params"] == 4 * psi and m["os"]["grads"] == 4 * psi
        assert m["os"]["states"] <= 8 * psi / 2 + 64
        assert m["os_g"]["params"] == 4 * psi and m["os_g"]["grads"] <= 4 * psi / 2 + 32
        assert m["p_g_os"]["params"] <= 4 * psi / 2 + 64 and m["p_g_os"]["states"] <= 8 * psi / 2 + 128


def _small_stays_whole():
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    out = {}
    for level in LEVELS:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt, _ = group_sharded_parallel(model, opt, level)  # default segment_size 2**20
        x, y = batch(0, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        out[level] = [(p.name, p.mode, p.owners()) for p in opt.ownership]
        out[level + "_w"] = model[0].weight.detach().clone()
    return out


@pytest.mark.timeout(90)
def test_default_segment_size_keeps_small_parameters_whole():
    res = run_ranks(_small_stays_whole, 2, timeout=80)
    assert all(res[0][lv] == res[1][lv] for lv in LEVELS)
    os_ = res[0]["os"]
    assert all(mode == "whole" and len(owners) == 1 for _, mode, owners in os_)
    # greedy by size: the 60-element weight on rank 0, the 30-element weight on rank 1
    owners = {name: o[0] for name, _, o in os_}
    assert owners["0.weight"] == 0 and owners["2.weight"] == 1
    assert all(mode == "replicated" for _, mode, _ in res[0]["p_g_os"])
    for level in LEVELS:  # one step, whole or replicated, gives the same weights everywhere
        torch.testing.assert_close(res[0][level + "_w"], res[1][level + "_w"])
        torch.testing.assert_close(res[0][level + "_w"], res[0]["os_w"])


def _bad_level(level):
    from meshviz.distributed.sharding import group_sharded_parallel

    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    try:
        group_sharded_parallel(model, opt, level)
    except ValueError as e:
        return str(e), tdist.is_initialized()
    return None, tdist.is_initialized()


@pytest.mark.timeout(60)
def test_unknown_level_raises_on_every_rank_before_communication():
    res = run_ranks(_bad_level, 2, "p_g", timeout=50)
    for msg, initialised in res:
        assert msg is not None and "'p_g'" in msg
        assert "'os'" in msg and "'os_g'" in msg and "'p_g_os'" in msg
        # the process group starts all the same: a rank alone with a bad level must be able to tell the others
        # (tests/ranks/test_hang_refusals_probe.py); no data moves
        assert initialised


def _levels_per_rank():
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters())
    level = "os" if dist.get_rank() < 2 else "p_g_os"
    try:
        group_sharded_parallel(model, opt, level, offload=dist.get_rank() == 3)
    except ValueError as e:
        return str(e), all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return None, None


@pytest.mark.timeout(60)
def test_levels_that_differ_per_rank_raise_on_every_rank_naming_them():
    res = run_ranks(_levels_per_rank, 4, timeout=50)
    head = "group_sharded_parallel: the ranks were given different settings (every rank needs the same): "
    for r, (msg, untouched) in enumerate(res):
        os_, pgos = ("level 'os'", "another level") if r < 2 else ("another level", "level 'p_g_os'")
        kinds = [f"ranks 0, 1: {os_}, offload False", f"rank 2: {pgos}, offload False", f"rank 3: {pgos}, offload True"]
        assert msg == head + "; ".join(kinds) and untouched, (r, msg)


def _amp(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    rank = dist.get_rank()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, opt, scaler = group_sharded_parallel(model, opt, level, scaler=scaler, segment_size=8)
    losses = []
    for s in range(3):
        x, y = batch(s, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        losses.append(float(loss.detach()))
    return full_params(model), type(scaler).__name__, losses


def _amp_reference(world):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(3):
        xs, ys = zip(*(batch(s, r) for r in range(world)))
        losses = []
        for x, y in zip(xs, ys):  # same bf16 rounding as each rank
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(F.mse_loss(model(x).float(), y))
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_scaler_with_bf16_autocast(level):
    res = run_ranks(_amp, 2, level, timeout=100)
    ref = _amp_reference(2)
    for params, kind, _losses in res:
        assert kind == "GroupShardedScaler"
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-4, atol=1e-5)


def _inf_on_one_rank(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.zero.slot import local_tensor

    dist.init_parallel_env()
    rank = dist.get_rank()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, opt, scaler = group_sharded_parallel(model, opt, level, scaler=scaler, segment_size=8)
    synced = opt._sync_grads

    def sync_then_poison():  # an inf only this rank sees, after the gradients reached their owners
        synced()
        grads = [local_tensor(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None]
        next(g for g in grads if g.numel()).view(-1)[0] = float("inf")

    scales, held = [], []
    for s in range(3):
        opt._sync_grads = sync_then_poison if (s == 1 and rank == 1) else synced
        before = full_params(model)
        x, y = batch(s, rank)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        scales.append(scaler.get_scale())
        held.append(all(torch.equal(v, before[k]) for k, v in full_params(model).items()))
    return full_params(model), scales, held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", LEVELS)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(level):
    # the scaler's inf/NaN check is agreed over the group: every rank skips step 1 and backs off its scale,
    # and the run equals one process that never took step 1
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in (0, 2):
        xs, ys = zip(*(batch(s, r) for r in range(2)))
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for params, scales, held in run_ranks(_inf_on_one_rank, 2, level, timeout=100):
        assert held == [False, True, False]
        assert scales == [2.0**10, 2.0**9, 2.0**9]
        for k, v in model.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)


def test_clip_grad_by_global_norm_single_process():
    model = make_model()
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    clip = ClipGradByGlobalNorm(float(norm) / 2)
    got = clip(model.parameters())
    assert abs(float(got) - float(norm)) < 1e-5
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g / 2)
    with pytest.raises(ValueError):
        ClipGradByGlobalNorm(0)



def _no_gradient(level, how, segment_size):
    import contextlib
    import warnings

    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=segment_size)
    before = full_params(model)
    x, y = batch(0, dist.get_rank())
    record = warnings.catch_warnings(record=True) if dist.get_rank() == 0 else contextlib.nullcontext([])
    with record as seen:  # one rank records: catch_warnings swaps process-wide state, and thread ranks share it
        warnings.simplefilter("always")
        if how == "no_grad":
            with torch.no_grad():
                model(x)
        else:
            loss = F.mse_loss(model(x), y)
            if how == "inputs":
                loss.backward(inputs=list(model.parameters()))
            elif how == "plain":
                loss.backward()
        opt.step()
        dist.barrier()  # the other ranks have warned by now: rank 0 stops recording after
    return before, full_params(model), [str(w.message) for w in seen if "group_sharded_parallel" in str(w.message)]


NOTHING = "step() after a forward with gradients on, but no parameter on any rank has a gradient, so nothing changes"
SHARDED_NOT = "backward ran, but it reached none of the sharded parameters on any rank, so they do not change"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("level,how,segment_size,said,changed", [
    ("p_g_os", "inputs", 40, SHARDED_NOT, {"0.bias", "2.weight", "2.bias"}),  # 0.weight (60) sharded, others whole
    ("p_g_os", "inputs", 1, NOTHING, set()),
    ("p_g_os", "none", 40, NOTHING, set()),
    ("os", "none", 40, NOTHING, set()),
    ("p_g_os", "no_grad", 40, None, set()),
    ("p_g_os", "plain", 40, None, {"0.weight", "0.bias", "2.weight", "2.bias"}),
])
def test_a_step_whose_backward_reached_no_sharded_parameter_says_so(level, how, segment_size, said, changed):
    res = run_ranks(_no_gradient, 2, level, how, segment_size, timeout=80)
    for before, after, _ in res:
        assert {k for k in before if not torch.equal(after[k], before[k])} == changed
    messages = res[0][2]
    if said is None:
        assert messages == []
        return
    assert messages and messages[0].startswith(f"group_sharded_parallel ({level}): {said}")
    assert ("backward(inputs=...)" in messages[0]) == (level == "p_g_os")


class _TwoWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.linspace(-1, 1, 24).reshape(6, 4))
        self.w2 = nn.Parameter(torch.linspace(1, -1, 24).reshape(6, 4))

    def forward(self, x, use2):
        return x @ self.w1 + (x @ self.w2 if use2 else 0)


class _Uses(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = _TwoWeights()

    def forward(self, x, use2):
        return self.blk(x, use2)


USES2 = (True, False, False, True)


def _unused_after_the_first_step(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    model = _Uses()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=1)
    for s, use2 in enumerate(USES2):
        x, y = batch(s, dist.get_rank())
        F.mse_loss(model(x, use2), y[:, :1].expand(-1, 4)).backward()
        opt.step()
        opt.zero_grad()  # torch's: gradients dropped, so an unused weight has none, and AdamW leaves it
    return full_params(model)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("level", LEVELS)
def test_a_weight_no_rank_uses_after_the_first_step_is_left_as_in_one_process(level):
    model = _Uses()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for s, use2 in enumerate(USES2):
        xs, ys = zip(*(batch(s, r) for r in range(2)))
        F.mse_loss(model(torch.cat(xs), use2), torch.cat(ys)[:, :1].expand(-1, 4)).backward()
        opt.step()
        opt.zero_grad()
    for got in run_ranks(_unused_after_the_first_step, 2, level, timeout=80):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


class _Tied(nn.Module):
    """An embedding tied to the output layer (two sublayers share a weight), or a root weight a sublayer shares."""

    def __init__(self, tie):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 10, bias=False)
        if tie == "units":
            self.out.weight = self.emb.weight
        else:
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64).reshape(8, 8))
            self.mid[0].weight = self.scale

    def forward(self, ids):
        h = self.mid(self.emb(ids))
        return self.out(h @ self.scale if hasattr(self, "scale") else h)


def _ids(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 10, (4,), generator=g), torch.randint(0, 10, (4,), generator=g)


def _tied_train(level, tie):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    model = _Tied(tie)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=1)
    for s in range(3):
        x, y = _ids(s, dist.get_rank())
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return full_params(model)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("level,tie", [(lv, "units") for lv in LEVELS] + [("p_g_os", "root")])
def test_tied_weights_train_as_in_one_process(level, tie):
    model = _Tied(tie)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for s in range(3):
        xs, ys = zip(*(_ids(s, r) for r in range(2)))
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for got in run_ranks(_tied_train, 2, level, tie, timeout=80):
        assert got.keys() == model.state_dict().keys()
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def _fsdp_traffic(check):
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.match import set_checking

    dist.init_parallel_env()
    set_checking(check)
    sink = trace.add_sink(trace.MemorySink())
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, _ = group_sharded_parallel(model, opt, "p_g_os", segment_size=1)
    for s in range(2):
        x, y = batch(s, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    got: dict = {}
    for e in sink.of_kind("collective"):
        if (e.name or "").startswith("p_g_os"):
            key = (e.name, e.op)
            got[key] = got.get(key, 0) + e.bytes
    return full_params(model), got


@pytest.mark.timeout(90)
@pytest.mark.parametrize("check", [False, True])
def test_p_g_os_gathers_and_reduce_scatters_are_traced_with_the_bytes_each_rank_receives(check):
    ref, _, _ = reference(2, steps=2, clip=1e9)
    # FSDP2 shards each parameter on dim 0, padded to a multiple of 2 ranks: Linear(6, 10) holds weight [5, 6] and
    # bias [5] per rank (35 floats), Linear(10, 3) weight [2, 10] and bias [2] (22). Per step a rank receives the
    # other rank's shard twice (gathered for the forward and again for the backward) and its own part of the
    # reduce-scatter once: 2 steps
    shard = {"0": 35 * 4, "2": 22 * 4}
    want = {}
    for unit, b in shard.items():
        want[(f"p_g_os {unit}", "all_gather")] = 2 * 2 * b
        want[(f"p_g_os {unit}", "reduce_scatter")] = 2 * b
    for params, got in run_ranks(_fsdp_traffic, 2, check, timeout=80):
        assert got == want
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)


def _resumed_p_g_os(first, path):
    """p_g_os trained 2 steps and saved with dist.save_state_dict; a fresh run loads model and optimizer (before its
    first step) and trains 2 more."""
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    r = dist.get_rank()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, _ = group_sharded_parallel(model, opt, "p_g_os", segment_size=1)
    if not first:
        sd = {"model": model.state_dict(), "opt": opt.state_dict()}
        dist.load_state_dict(sd, path)
        opt.load_state_dict(sd["opt"])
    for s in (0, 1) if first else (2, 3):
        x, y = batch(s, r)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    if first:
        dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    return full_params(model)


@pytest.mark.timeout(120)
def test_p_g_os_resumed_from_a_checkpoint_in_a_fresh_run_trains_as_one_process(tmp_path):
    """A fresh GroupShardedOptimizer had no Adam states before its first step, so loading a checkpoint into its
    state_dict() left them out (with a warning naming them) and the resumed run restarted Adam from zero."""
    path = str(tmp_path / "ck")
    run_ranks(_resumed_p_g_os, 2, True, path, timeout=100)
    got = run_ranks(_resumed_p_g_os, 2, False, path, timeout=100)
    want, _, _ = reference(2, clip=1e9)  # no clipping
    for r in range(2):
        for k, v in want.items():
            torch.testing.assert_close(got[r][k], v, rtol=1e-5, atol=1e-6, msg=(r, k))
