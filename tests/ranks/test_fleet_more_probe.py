"""fleet's hybrid parallel (pipelines, tensor-parallel layers, clipping) in less common uses, against one process."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

from .test_pipeline_audit import LR, batch, dense, descs, loss_of, make_opt, reference, split, take


def raw_optimizer_case(case):
    """``fleet_case`` with the torch optimizer handed to train_batch as it is (not through distributed_optimizer)."""
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = case["hybrid"]
    strategy.pipeline_configs = case["pipe"]
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    layer = PipelineLayer(descs(case["model"]), loss_fn=loss_of(case["model"]))
    pipe = fleet.distributed_model(layer)
    opt = make_opt(case.get("opt", "sgd"), list(layer.parameters()))
    replica = hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size() + \
        hcg.get_sharding_parallel_rank()
    x, y = batch(case["model"], case["rows"] * hcg.get_data_parallel_world_size() *
                 hcg.get_sharding_parallel_world_size())
    rows = slice(replica * case["rows"], (replica + 1) * case["rows"])
    losses = [float(pipe.train_batch((take(x, rows), y[rows]), opt)) for _ in range(case.get("steps", 3))]
    ev = float(pipe.eval_batch((take(x, rows), y[rows]), compute_loss=True))
    return {"replica": replica, "losses": losses, "eval": ev,
            "state": {n: p.detach().clone() for n, p in layer.named_parameters()}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid", [{"sharding_degree": 2, "pp_degree": 2}, {"dp_degree": 2, "pp_degree": 2}],
                         ids=["sharding", "dp"])
def test_train_batch_with_a_plain_torch_optimizer_matches_one_process(hybrid):
    case = {"model": "mlp5", "hybrid": hybrid, "rows": 4, "opt": "adam",
            "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}}
    ref_losses, ref_evals, ref_state = reference(case)
    for r, out in enumerate(run_ranks(raw_optimizer_case, 4, case, timeout=100)):
        want = [step[out["replica"]] for step in ref_losses]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6)
        for name, p in out["state"].items():
            torch.testing.assert_close(p, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")


def clip_case(case):
    """Three clipped train_batch steps on this rank: the losses and this rank's parameters (shards marked)."""
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer
    from meshviz.nn import ClipGradByGlobalNorm

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = case["hybrid"]
    strategy.pipeline_configs = case["pipe"]
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    layer = PipelineLayer(descs(case["model"]), loss_fn=loss_of(case["model"]), seg_method=case.get("seg", "uniform"),
                          num_virtual_pipeline_stages=case.get("v"))
    pipe = fleet.distributed_model(layer)
    inner = make_opt(case.get("opt", "sgd"), list(layer.parameters()))
    inner._grad_clip = ClipGradByGlobalNorm(case["clip"])
    opt = fleet.distributed_optimizer(inner)
    replica = hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size() + \
        hcg.get_sharding_parallel_rank()
    n = hcg.get_data_parallel_world_size() * hcg.get_sharding_parallel_world_size()
    x, y = batch(case["model"], case["rows"] * n)
    rows = slice(replica * case["rows"], (replica + 1) * case["rows"])
    losses = [float(pipe.train_batch((take(x, rows), y[rows]), opt)) for _ in range(3)]
    state = {nm: (p.detach().clone(), getattr(p, "split_axis", None) if getattr(p, "is_distributed", False)
                  else None) for nm, p in layer.named_parameters()}
    return {"replica": replica, "losses": losses, "state": state,
            "mp": (hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size())}


def clip_reference(case):
    h = case["hybrid"]
    replicas = h.get("dp_degree", 1) * h.get("sharding_degree", 1)
    run, named = dense(case["model"])
    params = list({id(p): p for p in named.values()}.values())
    opt = make_opt(case.get("opt", "sgd"), params)
    x, y = batch(case["model"], replicas * case["rows"])
    loss_fn = loss_of(case["model"])
    losses = []
    for _ in range(3):
        loss_fn(run(x), y).backward()
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
        with torch.no_grad():
            for p in params:
                p.grad.mul_(case["clip"] / max(norm, case["clip"]))
            losses.append([loss_fn(run(a), b).item() for a, b in zip(split(x, case["rows"]), split(y, case["rows"]))])
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in named.items()}


CLIP_CASES = {
    "dp_mp_pp": {"model": "tied_tp", "hybrid": {"dp_degree": 2, "mp_degree": 2, "pp_degree": 2}, "rows": 4,
                 "clip": 0.05, "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}},
    "sharding_pp_adam": {"model": "mlp5", "hybrid": {"sharding_degree": 2, "pp_degree": 2}, "rows": 4, "clip": 0.05,
                         "opt": "adam", "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}},
    "mp_pp_vpp": {"model": "tied_tp", "hybrid": {"mp_degree": 2, "pp_degree": 2}, "rows": 4, "clip": 0.05, "v": 2,
                  "seg": "layer:Embedding|Block", "pipe": {"micro_batch_size": 1, "accumulate_steps": 4}},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CLIP_CASES))
def test_a_global_norm_clip_across_mp_pp_and_sharding_is_one_processs(name):
    case = CLIP_CASES[name]
    h = case["hybrid"]
    world = h["pp_degree"] * h.get("dp_degree", 1) * h.get("mp_degree", 1) * h.get("sharding_degree", 1)
    ref_losses, ref_state = clip_reference(case)
    seen = set()
    for r, out in enumerate(run_ranks(clip_case, world, case, timeout=100)):
        want = [step[out["replica"]] for step in ref_losses]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {r} losses: {m}")
        mp_rank, mp_size = out["mp"]
        for nm, (p, axis) in out["state"].items():
            full = ref_state[nm] if axis is None else ref_state[nm].chunk(mp_size, dim=axis)[mp_rank]
            torch.testing.assert_close(p, full, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {nm}: {m}")
            seen.add(nm)
    assert seen == set(ref_state)


def _pipe(loss_fn, pipe_cfg=None):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": 2}
    strategy.pipeline_configs = pipe_cfg or {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=strategy)
    layer = PipelineLayer(descs("mlp5"), loss_fn=loss_fn)
    return layer, fleet.distributed_model(layer)


def mse64(out, y):
    return nn.functional.mse_loss(out.double(), y.double())


def mse16(out, y):
    return nn.functional.mse_loss(out, y).to(torch.bfloat16)


def loss_dtypes(loss_fn):
    layer, pipe = _pipe(loss_fn)
    x, y = batch("mlp5", 4)
    got = pipe.train_batch((x, y), torch.optim.SGD(layer.parameters(), lr=LR))
    ev = pipe.eval_batch((x, y), compute_loss=True)
    return got, ev


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss_fn", [mse64, mse16], ids=["float64", "bfloat16"])
def test_a_loss_in_another_dtype_reaches_every_stage_in_that_dtype(loss_fn):
    """The last stage broadcast its loss in its own dtype while the others waited for float32: gloo processes died
    (SIGABRT, 'Received data size doesn't match expected size. 8 vs 4') for a float64 loss; ranks as threads gave
    the stages before the last a float32 loss. Each stage now returns the last stage's loss, in its dtype."""
    run, _ = dense("mlp5")
    x, y = batch("mlp5", 4)
    with torch.no_grad():
        want = [(loss_fn(run(a), b) / 2).to(torch.float64) for a, b in zip(x.split(2), y.split(2))]
    want = want[0] + want[1]
    for got, ev in run_ranks(loss_dtypes, 2, loss_fn, timeout=50):
        want_dtype = torch.float64 if loss_fn is mse64 else torch.bfloat16
        assert got.dtype == ev.dtype == want_dtype and got.shape == ev.shape == ()
        torch.testing.assert_close(got.double(), want, rtol=1e-2 if loss_fn is mse16 else 1e-9, atol=0)


def two_losses(per_micro):
    layer, pipe = _pipe([nn.MSELoss(), nn.L1Loss()], {"micro_batch_size": 1, "accumulate_steps": 4})
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    x, y = batch("mlp5", 4)
    steps = [pipe.train_batch((x, y), opt, loss_fn_idx=1, return_micro_batch_loss=per_micro) for _ in range(2)]
    ev = pipe.eval_batch((x, y), compute_loss=True)
    return steps, ev, {n: p.detach().clone() for n, p in layer.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_micro", [False, True])
def test_a_list_of_loss_functions_trains_the_one_loss_fn_idx_names(per_micro):
    """Paddle's PipelineLayer takes a list of loss functions: each is computed, ``train_batch(loss_fn_idx=i)``
    backpropagates loss i and returns every one (``return_micro_batch_loss``: each micro loss divided by
    accumulate_steps). The list was called as a function on the last stage, mid-schedule ('list' object is not
    callable), and train_batch took neither argument."""
    run, named = dense("mlp5")
    opt = torch.optim.SGD(list(named.values()), lr=LR)
    x, y = batch("mlp5", 4)
    fns = [nn.functional.mse_loss, nn.functional.l1_loss]
    want = []
    for _ in range(2):
        with torch.no_grad():
            micro = [[f(run(a), b).item() / 4 for a, b in zip(x.split(1), y.split(1))] for f in fns]
        want.append(micro if per_micro else [sum(m) for m in micro])
        fns[1](run(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        want_ev = [sum(f(run(a), b).item() / 4 for a, b in zip(x.split(1), y.split(1))) for f in fns]
    for r, (steps, ev, state) in enumerate(run_ranks(two_losses, 2, per_micro, timeout=50)):
        for got, w in zip(steps, want):
            assert isinstance(got, list) and len(got) == 2
            assert all(g.shape == ((4,) if per_micro else ()) for g in got)
            torch.testing.assert_close(torch.stack(got), torch.tensor(w), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.stack(ev), torch.tensor(want_ev), rtol=1e-5, atol=1e-6)
        for n, p in state.items():
            torch.testing.assert_close(p, named[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {n}: {m}")


def bad_loss_fn(loss_fn):
    try:
        _pipe(loss_fn)
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss_fn", ["mse", [nn.MSELoss(), None], []], ids=["str", "none_in_list", "empty"])
def test_a_loss_fn_that_is_not_callable_raises_on_every_rank_when_built(loss_fn):
    """It raised only on the last stage, inside the schedule, while the first waited for gradients."""
    for out in run_ranks(bad_loss_fn, 2, loss_fn, timeout=50):
        assert out == (f"PipelineLayer: loss_fn must be a callable loss_fn(output, label), a list of them, or None, "
                       f"got {loss_fn!r}")


def bad_loss_fn_idx(idx):
    layer, pipe = _pipe([nn.MSELoss(), nn.L1Loss()])
    try:
        pipe.train_batch(batch("mlp5", 4), torch.optim.SGD(layer.parameters(), lr=LR), loss_fn_idx=idx)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_a_loss_fn_idx_past_the_list_raises_on_every_rank():
    for out in run_ranks(bad_loss_fn_idx, 2, 2, timeout=50):
        assert out == "train_batch: loss_fn_idx=2, but the PipelineLayer has 2 loss function(s)"


def differing_pipelines(case):
    import meshviz.distributed as dist

    r = dist.get_rank()
    try:
        _pipe_seg(case["pipe"][r], case["seg"][r])
    except ValueError as e:
        return str(e)
    return None


def _pipe_seg(pipe_cfg, seg):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": 2}
    strategy.pipeline_configs = pipe_cfg
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.distributed_model(PipelineLayer(descs("mlp5"), loss_fn=nn.MSELoss(), seg_method=seg))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,want", [
    ({"pipe": [{"micro_batch_size": 2, "accumulate_steps": 2}] * 2, "seg": [[0, 2, 5], [0, 3, 5]]},
     ["rank 0: segment_parts [0, 2, 5]; rank 1: another segment_parts",
      "rank 0: another segment_parts; rank 1: segment_parts [0, 3, 5]"]),
    ({"pipe": [{"micro_batch_size": 2, "accumulate_steps": 2}, {"micro_batch_size": 1, "accumulate_steps": 4}],
      "seg": ["uniform"] * 2},
     ["rank 0: micro_batch_size 2, accumulate_steps 2; rank 1: micro_batch_size 1, accumulate_steps 4"] * 2),
], ids=["cut", "micro_batches"])
def test_pipeline_stages_set_up_differently_raise_on_every_rank(case, want):
    """Stages cutting the layers differently trained a model without layer 2 (stage 0 held layers 0-1, stage 1
    layers 3-4) and returned its loss; stages splitting the batch differently waited on each other until the
    collective timeout. PipelineParallel compares the settings (one small all-gather) and every rank raises."""
    for r, out in enumerate(run_ranks(differing_pipelines, 2, case, timeout=50)):
        assert out == ("PipelineParallel: the ranks were given different settings (every rank needs the same): "
                       + want[r])
