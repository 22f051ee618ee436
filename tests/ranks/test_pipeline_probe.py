"""Fleet pipelines in less common shapes (one micro-batch, uneven counts, shared layers with several weights, bad
loss functions) against one torch process on the full batch."""

from functools import partial

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

H, LR, SEED = 4, 0.1, 1234


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Named(Block):
    """A Block that ``seg_method='layer:Named'`` counts (the Blocks between are left out of the count)."""


class Pair(nn.Module):
    """Starts a (hidden, integer mask) pair: the mask travels with the activations and gets no gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.lin(x)), (x > 0).long()


class PairBlock(Block):
    def forward(self, pair):
        h, mask = pair
        return torch.tanh(self.lin(h)) * mask.to(h.dtype) + h, mask


def first(pair):
    return pair[0]


def through(layer, x):
    return torch.tanh(layer(x))


def _descs(model, attrs="weight"):
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

    if model == "mlp5":
        return [LayerDesc(Block) for _ in range(5)]
    if model == "marked":  # four Named among six layers
        return [LayerDesc(Named), LayerDesc(Block), LayerDesc(Named), LayerDesc(Named), nn.Tanh(), LayerDesc(Named)]
    if model == "pair":  # the last layer passes the hidden state on unchanged
        return [LayerDesc(Pair), LayerDesc(PairBlock), LayerDesc(PairBlock), first]
    if model == "tied":  # one Linear at both ends, ``attrs`` of it shared
        proj = partial(SharedLayerDesc, "proj", nn.Linear)
        return [proj(None, attrs, H, H), LayerDesc(Block), LayerDesc(Block), proj(through, attrs, H, H)]
    raise ValueError(model)


def _dense(model, attrs="weight"):
    """The model as one process: layer i drawn under seed 1234 + i; a shared Linear drawn where a stage first
    builds it, its ``attrs`` those of its first occurrence. Returns (run(x), {PipelineLayer's name: parameter})."""
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

    funcs, named, first = [], {}, None
    for i, d in enumerate(_descs(model, attrs)):
        if not isinstance(d, LayerDesc):
            funcs.append(d)
            continue
        torch.manual_seed(SEED + i)
        layer = d.build_layer()
        if isinstance(d, SharedLayerDesc):
            if first is None:
                first = layer
                named.update({f"shared_layers.proj.{n}": p for n, p in layer.named_parameters()})
            else:  # the last stage's copy: the shared attributes are the first's, the others its own
                for n in list(dict(layer.named_parameters())):
                    if n in d.shared_weight_attr:
                        setattr(layer, n, getattr(first, n))
                    else:
                        named[f"last.proj.{n}"] = getattr(layer, n)
            funcs.append(layer if d.forward_func is None else partial(d.forward_func, layer))
        else:
            named.update({f"{i}.{n}": p for n, p in layer.named_parameters()})
            funcs.append(layer)

    def run(x):
        for f in funcs:
            x = f(x)
        return x

    return run, named


def _batch(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)


def _fleet(case):
    """Three train_batch steps and an eval_batch on this rank: the losses, this rank's parameters, its flags."""
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = case["hybrid"]
    s.pipeline_configs = case["pipe"]
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    attrs = case.get("attrs", "weight")
    layer = PipelineLayer(_descs(case["model"], attrs), loss_fn=nn.MSELoss(), seg_method=case.get("seg", "uniform"),
                          num_virtual_pipeline_stages=case.get("v"))
    pipe = fleet.distributed_model(layer)
    params = list(layer.parameters()) or [nn.Parameter(torch.zeros(1))]  # a stage may hold no parameters
    inner = torch.optim.SGD(params, lr=LR, momentum=0.9)
    if case.get("clip"):
        from meshviz.nn import ClipGradByGlobalNorm

        inner._grad_clip = ClipGradByGlobalNorm(case["clip"])
    opt = fleet.distributed_optimizer(inner)
    dp, dp_rank = hcg.get_data_parallel_world_size(), hcg.get_data_parallel_rank()
    x, y = _batch(case["rows"] * dp)
    rows = slice(dp_rank * case["rows"], (dp_rank + 1) * case["rows"])
    losses = [float(pipe.train_batch((x[rows], y[rows]), opt)) for _ in range(3)]
    ev = float(pipe.eval_batch((x[rows], y[rows]), compute_loss=True))
    last = hcg.get_stage_id() == hcg.get_pipe_parallel_world_size() - 1
    state, firstly = {}, {}
    for n, p in layer.named_parameters():
        if n.startswith("shared_layers.proj.") and last and hcg.get_pipe_parallel_world_size() > 1:
            attr = n.rsplit(".", 1)[1]
            n = n if attr in layer.shared_weight_attrs["proj"] else f"last.proj.{attr}"
        state[n] = p.detach().clone()
        if hasattr(p, "is_firstly_shared"):
            firstly[n] = p.is_firstly_shared
    return {"replica": dp_rank, "losses": losses, "eval": ev, "state": state, "firstly": firstly, "last": last,
            "mode": pipe.schedule_mode}


def _reference(case):
    """One process: per step the mean loss of each data replica's rows (before the step), the eval loss of each,
    then the parameters."""
    dp = case["hybrid"].get("dp_degree", 1)
    run, named = _dense(case["model"], case.get("attrs", "weight"))
    params = list({id(p): p for p in named.values()}.values())
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    x, y = _batch(case["rows"] * dp)
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(run(x), y)
        loss.backward()
        if case.get("clip"):  # Paddle's global norm: each weight's gradient once
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
            for p in params:
                p.grad.mul_(case["clip"] / max(float(norm), case["clip"]))
        with torch.no_grad():
            losses.append([nn.functional.mse_loss(run(a), b).item() for a, b in zip(x.split(case["rows"]),
                                                                                    y.split(case["rows"]))])
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        evals = [nn.functional.mse_loss(run(a), b).item() for a, b in zip(x.split(case["rows"]), y.split(case["rows"]))]
    return losses, evals, {k: v.detach().clone() for k, v in named.items()}


def _check(case, res):
    ref_losses, ref_evals, ref_state = _reference(case)
    seen = set()
    for r, out in enumerate(res):
        want = [step[out["replica"]] for step in ref_losses]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {r} losses: {m}")
        assert out["eval"] == pytest.approx(ref_evals[out["replica"]], rel=1e-5, abs=1e-6), r
        for name, p in out["state"].items():
            torch.testing.assert_close(p, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(ref_state)  # the stages together hold every parameter


SCHEDULE_CASES = {
    # one micro-batch: every schedule runs it as one forward and one backward per stage
    "one_micro_1f1b": {"model": "mlp5", "hybrid": {"pp_degree": 2}, "rows": 3,
                       "pipe": {"micro_batch_size": 3, "accumulate_steps": 1}},
    "one_micro_fthenb_p4": {"model": "mlp5", "hybrid": {"pp_degree": 4}, "rows": 2,
                            "pipe": {"micro_batch_size": 2, "accumulate_steps": 1, "schedule_mode": "FThenB"}},
    # zero bubble without virtual stages, three micro-batches on two stages
    "zbh1_uneven": {"model": "mlp5", "hybrid": {"pp_degree": 2}, "rows": 3,
                    "pipe": {"micro_batch_size": 1, "accumulate_steps": 3, "schedule_mode": "ZBH1"}},
    # interleaved with a micro-batch count that is not a multiple of the stages; FThenB with virtual stages
    "vpp_three_micro": {"model": "marked", "hybrid": {"pp_degree": 2}, "rows": 3, "seg": "layer:Named", "v": 2,
                        "pipe": {"micro_batch_size": 1, "accumulate_steps": 3}},
    "fthenb_virtual_dp": {"model": "marked", "hybrid": {"dp_degree": 2, "pp_degree": 2}, "rows": 3,
                          "seg": "layer:Named", "v": 2,
                          "pipe": {"micro_batch_size": 1, "accumulate_steps": 3, "schedule_mode": "FThenB"}},
    # an integer mask crossing the stages beside the hidden state; the last stage passes the hidden state on as it
    # received it (torch 2.11 then left its receive buffer without a gradient from the second step on), under
    # zero bubble (2.11's input-only backward raised on the mask), with and without virtual stages
    "pass_on_1f1b": {"model": "pair", "hybrid": {"pp_degree": 2}, "rows": 4, "seg": [0, 3],
                     "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}},
    "pass_on_vpp": {"model": "pair", "hybrid": {"pp_degree": 2}, "rows": 4, "v": 2,
                    "pipe": {"micro_batch_size": 1, "accumulate_steps": 4}},
    "pass_on_zbh1": {"model": "pair", "hybrid": {"pp_degree": 2}, "rows": 6,
                     "pipe": {"micro_batch_size": 2, "accumulate_steps": 3, "schedule_mode": "ZBH1"}},
    "pass_on_zbh1_virtual": {"model": "pair", "hybrid": {"pp_degree": 2}, "rows": 4, "v": 2,
                             "pipe": {"micro_batch_size": 1, "accumulate_steps": 4, "schedule_mode": "ZBH1"}},
    # 5 layers on 3 stages (1, 2, 2), five micro-batches of one row
    "uneven_p3": {"model": "mlp5", "hybrid": {"pp_degree": 3}, "rows": 5,
                  "pipe": {"micro_batch_size": 1, "accumulate_steps": 5}},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_schedules_in_less_common_shapes_match_one_process(name):
    case = SCHEDULE_CASES[name]
    n = case["hybrid"]["pp_degree"] * case["hybrid"].get("dp_degree", 1)
    _check(case, run_ranks(_fleet, n, case, timeout=100))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attrs,hybrid", [(["weight", "bias"], {"pp_degree": 2}),
                                          (["weight", "bias"], {"dp_degree": 2, "pp_degree": 2}),
                                          ("weight", {"pp_degree": 2})])
def test_shared_layer_desc_shares_each_named_weight(attrs, hybrid):
    """Paddle's SharedLayerDesc takes a list of attributes: each is one weight on both stages (broadcast from the
    first, gradients summed); an attribute not named stays each stage's own. The first stage's copies are marked
    ``is_firstly_shared`` True, the others' False (a global norm counts them once)."""
    case = {"model": "tied", "attrs": attrs, "hybrid": hybrid, "rows": 4,
            "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}}
    res = run_ranks(_fleet, 2 * hybrid.get("dp_degree", 1), case, timeout=100)
    _check(case, res)
    names = [attrs] if isinstance(attrs, str) else attrs
    for out in res:
        assert out["firstly"] == {f"shared_layers.proj.{a}": not out["last"] for a in names}


def _bad_loss(kind):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=s)
    loss_fn = (nn.MSELoss(reduction="none") if kind == "per_sample"
               else lambda out, y: (nn.functional.mse_loss(out, y), out.sum()))
    pipe = fleet.distributed_model(PipelineLayer(_descs("mlp5"), loss_fn=loss_fn))
    pipe.train_batch(_batch(4), torch.optim.SGD(pipe.parameters(), lr=LR))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,error", [
    ("per_sample", "ValueError: the pipeline's loss_fn returned a tensor of shape [2, 4] for micro-batch 0: it must "
                   "return one value"),
    ("tuple", "TypeError: the pipeline's loss_fn returned a tuple: it must return one tensor")])
def test_a_loss_fn_not_returning_one_value_raises_naming_it(kind, error):
    """Paddle asserts its loss_fn returns a tensor, and its other stages fail on a per-sample loss (they receive one
    value); torch's schedule said only 'grad can be implicitly created only for scalar outputs' or failed dividing
    a tuple."""
    from meshviz.errors import RankError

    with pytest.raises(RankError) as err:
        run_ranks(_bad_loss, 2, kind, timeout=50)
    assert err.value.rank == 1 and error in err.value.outcomes[1].error


def _eval_twice(_):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=s)
    pipe = fleet.distributed_model(PipelineLayer(_descs("pair"), loss_fn=nn.MSELoss(), seg_method=[0, 3]))
    first_out = pipe.eval_batch((_batch(4, seed=1)[0], None))
    second_out = pipe.eval_batch((_batch(4, seed=2)[0], None))
    return first_out, second_out


@pytest.mark.timeout(60)
def test_eval_outputs_of_a_last_stage_passing_its_input_on_stay_after_the_next_call():
    """The last stage returns what it received: on torch 2.11 and 2.13 that was its receive buffer, which the next
    eval_batch refilled, so the outputs returned first turned into the second batch's."""
    res = run_ranks(_eval_twice, 2, None, timeout=50)
    assert res[0] == ([], [])
    run, _ = _dense("pair")
    with torch.no_grad():
        for got, seed in zip(res[1], (1, 2)):
            torch.testing.assert_close(torch.cat(got), run(_batch(4, seed=seed)[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid", [{"pp_degree": 2}, {"dp_degree": 2, "pp_degree": 2}])
def test_a_global_norm_clip_counts_a_weight_shared_across_stages_once(hybrid):
    """A tied weight holds the same summed gradient on both stages: its square counted on each made the global norm
    1.8193 where one process has 1.7043, and the clipped weights 3.4e-4 off (Paddle 3.3.1 counts it twice too: its
    ``is_firstly_shared`` is never set). The copies marked ``is_firstly_shared = False`` are scaled, not counted."""
    case = {"model": "tied", "hybrid": hybrid, "rows": 4, "clip": 0.05,
            "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}}
    _check(case, run_ranks(_fleet, 2 * hybrid.get("dp_degree", 1), case, timeout=100))


def _sep_stage_weights(_):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2, "sep_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    layer = PipelineLayer(_descs("mlp5"), loss_fn=nn.MSELoss())
    with torch.no_grad():  # each rank holds other weights
        for p in layer.parameters():
            p.add_(hcg.get_global_rank())
    fleet.distributed_model(layer)
    return hcg.get_stage_id(), hcg.get_sep_parallel_group().ranks, {n: p.detach().clone()
                                                                  for n, p in layer.named_parameters()}


@pytest.mark.timeout(120)
def test_a_pipeline_with_sep_broadcasts_each_stages_weights_over_the_sep_group():
    """Paddle's PipelineParallel broadcasts the parameters over the sep group (``broadcast_sep_parameters``): the sep
    ranks of one stage start from the same weights, the group's first rank's."""
    res = run_ranks(_sep_stage_weights, 4, None, timeout=100)
    for stage, ranks, weights in res:
        first = res[ranks[0]][2]
        for name, w in weights.items():
            torch.testing.assert_close(w, first[name], rtol=0, atol=0, msg=f"stage {stage} {name}")
    assert {tuple(r) for _, r, _ in res} == {(0, 1), (2, 3)}
