"""Pipelines (fleet's PipelineLayer, dist.parallelize's pp_config) against one torch process on the full batch."""

from functools import partial

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

H, V, LR, SEED = 4, 8, 0.1, 1234


class Block(nn.Module):
    def __init__(self, width=H):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Scale(nn.Module):
    """No parameters."""

    def forward(self, x):
        return 1.5 * x


class Pair(nn.Module):
    """Starts a (hidden, mask) pair: the mask (integers, no gradient) travels with the activations."""

    def __init__(self, width=H):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        if isinstance(x, tuple):  # given as two inputs
            x, mask = x
        else:
            mask = (x > 0).long()
        return torch.tanh(self.lin(x)), mask


class PairBlock(nn.Module):
    def __init__(self, width=H):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, pair):
        h, mask = pair
        return torch.tanh(self.lin(h)) * mask.to(h.dtype) + h, mask


def first(pair):
    return pair[0]


class TPBlock(nn.Module):
    def __init__(self, width=H):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        self.up = mpu.ColumnParallelLinear(width, 2 * width, has_bias=True, gather_output=False)
        self.down = mpu.RowParallelLinear(2 * width, width, input_is_parallel=True)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class DenseTPBlock(nn.Module):
    """TPBlock unsplit: the tensor-parallel layers draw their full weights as these Linears do."""

    def __init__(self, width=H):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def logits(embedding, x):
    return x @ embedding.weight.t()  # the last stage's output projection is the first stage's embedding


def descs(model):
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

    block = partial(LayerDesc, TPBlock if model.endswith("tp") else Block)
    if model == "mlp5":
        return [block() for _ in range(5)]
    if model == "paramless":  # with seg_method [0, 1, 3, 4] the middle stage has no parameters
        return [block(), LayerDesc(Scale), torch.tanh, block()]
    if model == "marked":  # four Blocks among parameter-free layers
        return [block(), LayerDesc(Scale), block(), block(), nn.Tanh(), block()]
    if model.startswith("pair"):
        return [LayerDesc(Pair), LayerDesc(PairBlock), LayerDesc(PairBlock), first]
    if model.startswith("tied"):
        emb = partial(SharedLayerDesc, "embed", nn.Embedding)
        return [emb(None, "weight", V, H), block(), block(), emb(logits, "weight", V, H)]
    raise ValueError(model)


def dense(model):
    """The model as one torch module: layer i drawn under seed 1234 + i (Paddle's rule), a shared key once, at its
    first layer. Returns (run(x), {name as PipelineLayer's state_dict names it: parameter})."""
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

    funcs, named, shared = [], {}, {}
    for i, d in enumerate(descs(model)):
        if isinstance(d, LayerDesc):
            cls = DenseTPBlock if d.layer_func is TPBlock else d.layer_func
            key = d.layer_name if isinstance(d, SharedLayerDesc) else None
            if key not in shared or key is None:
                torch.manual_seed(SEED + i)
                built = cls(*d.inputs, **d.kwargs)
                prefix = f"shared_layers.{key}" if key is not None else str(i)
                named.update({f"{prefix}.{n}": p for n, p in built.named_parameters()})
                if key is not None:
                    shared[key] = built
            layer = shared[key] if key is not None else built
            fwd = getattr(d, "forward_func", None)
            funcs.append(layer if fwd is None else partial(fwd, layer))
        else:
            funcs.append(d)

    def run(x):
        for f in funcs:
            x = f(x)
        return x

    return run, named


def batch(model, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    if model.startswith("tied"):
        return torch.randint(0, V, (rows,), generator=g), torch.randint(0, V, (rows,), generator=g)
    if model == "pair_in":  # two inputs: the first stage gets a tuple
        x, y = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)
        return (x, torch.randint(0, 2, (rows, H), generator=g)), y
    return torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)


def take(x, rows):
    return tuple(t[rows] for t in x) if isinstance(x, tuple) else x[rows]


def split(x, n):
    return list(zip(*(t.split(n) for t in x))) if isinstance(x, tuple) else list(x.split(n))


def loss_of(model):
    return nn.CrossEntropyLoss() if model.startswith("tied") else nn.MSELoss()


def make_opt(kind, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR / 10)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def poisoned(x, step, case):
    """The batch, with a NaN in the first row at the step ``case['nan_step']`` names."""
    if case.get("nan_step") != step:
        return x
    x = x.clone()
    x[0, 0] = float("nan")
    return x


def reference(case):
    """One process on the full batch: per step the loss of every data replica's rows (before the step), then
    the final parameters. The full batch's mean loss is the mean of the replicas' micro-batch losses."""
    h = case["hybrid"]
    replicas = h.get("dp_degree", 1) * h.get("sharding_degree", 1)
    run, named = dense(case["model"])
    opt = make_opt(case.get("opt", "sgd"), list(named.values()))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if case.get("sched") else None
    x0, y = batch(case["model"], replicas * case["rows"])
    loss_fn = loss_of(case["model"])
    losses = []
    for step in range(case.get("steps", 3)):
        x = poisoned(x0, step, case)
        loss = loss_fn(run(x), y)
        loss.backward()
        with torch.no_grad():
            losses.append([loss_fn(run(xr), yr).item() for xr, yr in zip(split(x, case["rows"]),
                                                                         split(y, case["rows"]))])
        if torch.isfinite(loss):  # the scaler skips a step whose gradients hold inf/nan, on every rank
            opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    with torch.no_grad():
        evals = [loss_fn(run(xr), yr).item() for xr, yr in zip(split(x0, case["rows"]), split(y, case["rows"]))]
    return losses, evals, {k: v.detach().clone() for k, v in named.items()}


def fleet_case(case):
    """Train ``case`` with fleet on this rank: the loss of every step, this stage's parameters (shards marked)."""
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = case["hybrid"]
    strategy.pipeline_configs = case["pipe"]
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    model = case["model"]
    layer = PipelineLayer(descs(model), loss_fn=loss_of(model), seg_method=case.get("seg", "uniform"),
                          num_virtual_pipeline_stages=case.get("v"))
    pipe = fleet.distributed_model(layer)
    params = list(layer.parameters())
    # torch optimizers refuse an empty parameter list: a stage without parameters steps a stand-in
    inner = make_opt(case.get("opt", "sgd"), params or [nn.Parameter(torch.zeros(1))])
    sched = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5) if case.get("sched") else None
    opt = fleet.distributed_optimizer(inner)
    replica = hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size() + \
        hcg.get_sharding_parallel_rank()
    x, y = batch(model, case["rows"] * hcg.get_data_parallel_world_size() * hcg.get_sharding_parallel_world_size())
    rows = slice(replica * case["rows"], (replica + 1) * case["rows"])
    scaler = fleet.distributed_scaler(torch.amp.GradScaler("cpu", init_scale=2.0**10)) if case.get("scaler") else None
    losses = []
    for step in range(case.get("steps", 3)):
        data = (take(poisoned(x, step, case), rows), y[rows])
        if case.get("as_list"):  # Paddle's other form: a list holding each micro-batch
            mbs = case["pipe"]["micro_batch_size"]
            data = (list(data[0].split(mbs)), list(data[1].split(mbs)))
        losses.append(float(pipe.train_batch(data, opt, sched, scaler=scaler)))
    ev = float(pipe.eval_batch((take(x, rows), y[rows]), compute_loss=True))
    mp = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
    state = {n: (p.detach().cpu().clone(), getattr(p, "split_axis", None) if getattr(p, "is_distributed", False)
                 else None) for n, p in layer.named_parameters()}
    return {"replica": replica, "stage": hcg.get_stage_id(), "losses": losses, "eval": ev, "state": state,
            "mp": mp, "parts": layer.segment_parts, "mode": pipe.schedule_mode,
            "scale": None if scaler is None else scaler.get_scale()}


def check_fleet(case, res):
    ref_losses, ref_evals, ref_state = reference(case)
    seen = set()
    for r, out in enumerate(res):
        want = [step[out["replica"]] for step in ref_losses]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   equal_nan=True, msg=lambda m: f"rank {r} losses: {m}")
        assert out["eval"] == pytest.approx(ref_evals[out["replica"]], rel=1e-5, abs=1e-6), r
        mp_rank, mp_size = out["mp"]
        for name, (p, axis) in out["state"].items():
            full = ref_state[name]
            if axis is not None:
                full = full.chunk(mp_size, dim=axis)[mp_rank]
            torch.testing.assert_close(p, full, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(ref_state)  # the stages together hold every parameter
    return res


# -- fleet ---------------------------------------------------------------------------------------------------------

FLEET_CASES = {
    # 5 layers on 2 stages: Paddle's uniform cut gives the remainder to the last stage; an LR scheduler; 3 micro-batches
    "uneven_1f1b": {"model": "mlp5", "hybrid": {"pp_degree": 2}, "rows": 6, "sched": True,
                    "pipe": {"micro_batch_size": 2, "accumulate_steps": 3}, "parts": [0, 2, 5]},
    "uneven_fthenb": {"model": "mlp5", "hybrid": {"pp_degree": 2}, "rows": 6, "sched": True, "opt": "adam",
                      "pipe": {"micro_batch_size": 2, "accumulate_steps": 3, "schedule_mode": "FThenB"},
                      "parts": [0, 2, 5]},
    # the batch given as a list of micro-batches
    "micro_list": {"model": "mlp5", "hybrid": {"pp_degree": 2}, "rows": 6, "as_list": True,
                   "pipe": {"micro_batch_size": 2, "accumulate_steps": 3}, "parts": [0, 2, 5]},
    # a loss scaler: a NaN in one replica's batch skips the step on every rank (both stages, both replicas)
    "scaler_skip": {"model": "mlp5", "hybrid": {"dp_degree": 2, "pp_degree": 2}, "rows": 4, "scaler": True,
                    "nan_step": 1, "sched": True, "pipe": {"micro_batch_size": 2, "accumulate_steps": 2},
                    "parts": [0, 2, 5], "scale": 2.0**9},
    # a (hidden, integer mask) pair crossing the stages; given as two inputs too
    "pair": {"model": "pair", "hybrid": {"pp_degree": 2}, "rows": 4,
             "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}, "parts": [0, 2, 4]},
    "pair_in": {"model": "pair_in", "hybrid": {"pp_degree": 2}, "rows": 4, "opt": "adam",
                "pipe": {"micro_batch_size": 1, "accumulate_steps": 4, "schedule_mode": "FThenB"}, "parts": [0, 2, 4]},
    # fewer micro-batches than stages
    "few_micro": {"model": "mlp5", "hybrid": {"pp_degree": 3}, "rows": 4,
                  "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}, "parts": [0, 1, 3, 5]},
    # an explicit cut without its end (Paddle appends it)
    "explicit": {"model": "mlp5", "hybrid": {"pp_degree": 2}, "rows": 4, "seg": [0, 4],
                 "pipe": {"micro_batch_size": 1, "accumulate_steps": 4}, "parts": [0, 4, 5]},
    # the middle of three stages holds only parameter-free layers
    "paramless": {"model": "paramless", "hybrid": {"pp_degree": 3}, "rows": 6, "seg": [0, 1, 3, 4],
                  "pipe": {"micro_batch_size": 2, "accumulate_steps": 3}, "parts": [0, 1, 3, 4]},
    # Paddle's interleaving: 'layer:' counts only the named class; 2 stages x 2 chunks
    "vpp_layer": {"model": "marked", "hybrid": {"pp_degree": 2}, "rows": 8, "seg": "layer:Block", "v": 2,
                  "pipe": {"micro_batch_size": 2, "accumulate_steps": 4}, "parts": [0, 1, 3, 4, 6]},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(FLEET_CASES))
def test_fleet_pipeline_matches_one_process(name):
    case = FLEET_CASES[name]
    n = case["hybrid"]["pp_degree"] * case["hybrid"].get("dp_degree", 1)
    res = run_ranks(fleet_case, n, case, timeout=100)
    mode = case["pipe"].get("schedule_mode", "VPP" if case.get("v") else "1F1B")
    assert all(out["parts"] == case["parts"] and out["mode"] == mode for out in res)
    if case.get("scaler"):
        assert all(out["scale"] == case["scale"] for out in res)
    check_fleet(case, res)


HYBRID_CASES = {
    # tied input embedding / output projection across the first and last stage, with each data-parallel kind
    "tied_dp": {"model": "tied", "hybrid": {"dp_degree": 2, "pp_degree": 2}, "rows": 4, "sched": True,
                "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}},
    "tied_sharding": {"model": "tied", "hybrid": {"sharding_degree": 2, "pp_degree": 2}, "rows": 4, "opt": "adam",
                      "pipe": {"micro_batch_size": 1, "accumulate_steps": 4, "schedule_mode": "FThenB"}},
    # interleaved: the embedding on stage 0's first chunk, the projection on stage 1's last
    "tied_vpp": {"model": "tied", "hybrid": {"dp_degree": 2, "pp_degree": 2}, "rows": 4, "v": 2,
                 "seg": "layer:Embedding|Block", "pipe": {"micro_batch_size": 1, "accumulate_steps": 4}},
    "tied_vpp_fthenb": {"model": "tied", "hybrid": {"pp_degree": 2}, "rows": 4, "v": 2, "seg": "layer:Embedding|Block",
                        "pipe": {"micro_batch_size": 1, "accumulate_steps": 4, "schedule_mode": "FThenB"}},
    "tied_zbh1": {"model": "tied", "hybrid": {"pp_degree": 2}, "rows": 4, "opt": "adam",
                  "pipe": {"micro_batch_size": 1, "accumulate_steps": 4, "schedule_mode": "ZBH1"}},
    "tied_tp": {"model": "tied_tp", "hybrid": {"dp_degree": 2, "mp_degree": 2, "pp_degree": 2}, "rows": 4,
                "pipe": {"micro_batch_size": 2, "accumulate_steps": 2}},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(HYBRID_CASES))
def test_fleet_pipeline_with_tied_embeddings_and_data_or_model_parallel_matches_one_process(name):
    case = HYBRID_CASES[name]
    h = case["hybrid"]
    n = h["pp_degree"] * h.get("dp_degree", 1) * h.get("sharding_degree", 1) * h.get("mp_degree", 1)
    res = run_ranks(fleet_case, n, case, timeout=100)
    check_fleet(case, res)
    assert {out["replica"] for out in res} == set(range(n // h["pp_degree"] // h.get("mp_degree", 1)))


# -- dist.parallelize with pp_config -------------------------------------------------------------------------------


class Gate(nn.Module):
    """A per-row factor every layer uses: with global_spec its output lives on the whole mesh."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, 1)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, g):
        return torch.tanh(self.lin(x)) * g


class Act(nn.Module):
    def forward(self, x, g=None):
        return torch.tanh(x) if g is None else torch.tanh(x) * g


class Stack(nn.Module):
    def __init__(self, n=4, paramless=(), gated=True):
        super().__init__()
        self.gated = gated
        self.embed = nn.Linear(H, H)
        self.gate = Gate() if gated else None
        self.layers = nn.ModuleList(Act() if i in paramless else GatedBlock() if gated else Block()
                                    for i in range(n))
        self.head = nn.Linear(H, H)

    def forward(self, x):
        g = self.gate(x) if self.gated else None
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, g) if self.gated else layer(h)
        return self.head(h)


PP_CASES = {
    # the prefix form with global_spec: 4 layers, 2 per stage, the gate's output on the whole mesh
    "prefix_global": {"mesh": [0, 1], "axes": ["pp"], "split": "layers", "global": "gate", "model": {}},
    # with data parallel: the batch split along dp on the first stage's mesh
    "prefix_dp": {"mesh": [[0, 1], [2, 3]], "axes": ["pp", "dp"], "split": "layers", "global": "gate", "model": {}},
    # the dict form, uneven: 3 stages, the middle one holding two parameter-free layers
    "dict_uneven": {"mesh": [0, 1, 2], "axes": ["pp"], "model": {"gated": False, "paramless": (1, 2)},
                    "split": {"layers.0": "END", "layers.2": "END"}},
}


def dense_stack(case):
    torch.manual_seed(SEED)
    return Stack(**case["model"])


def pp_case(case, steps=3, rows=8):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh(case["mesh"], dim_names=case["axes"])
    model = dense_stack(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    split = case["split"]
    if isinstance(split, dict):
        split = {k: getattr(dist.SplitPoint, v) for k, v in split.items()}
    pp_config = {"split_spec": split}
    if case.get("global"):
        pp_config["global_spec"] = case["global"]
    model, opt = dist.parallelize(model, opt, mesh=mesh, config={"pp_config": pp_config})
    first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", mesh.get_dim_size("pp") - 1)
    x, y = batch("mlp", rows)

    def place(t, m):
        pl = [dist.Replicate()] * m.ndim
        if "dp" in m.dim_names:
            pl[m.dim_names.index("dp")] = dist.Shard(0)
        return dist.shard_tensor(t, m, pl)

    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(place(x, first)), place(y, last))
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        full = dist.unshard_dtensor(loss)
        losses.append(full.item() if full.numel() else None)
    state = {n: dist.unshard_dtensor(p).detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "state": state}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(PP_CASES))
def test_parallelize_pp_config_matches_one_process(name):
    case = PP_CASES[name]
    n = torch.tensor(case["mesh"]).numel()
    res = run_ranks(pp_case, n, case, timeout=100)
    model = dense_stack(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    x, y = batch("mlp", 8)
    ref = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ref.append(loss.item())
    holders = {}
    for r, out in enumerate(res):
        if out["losses"][0] is not None:
            holders[r] = out["losses"]
            torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert holders, "no rank holds the loss"
    held = set()
    for r, out in enumerate(res):
        for name, p in out["state"].items():
            if p.numel():
                held.add(name)
                torch.testing.assert_close(p, dict(model.named_parameters())[name].detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {r} {name}: {m}")
    assert held == {n for n, _ in model.named_parameters()}


# -- bad configurations: a clear error on every rank, before any communication ------------------------------------


def bad_configs():
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    dist.init_parallel_env()
    raised = []
    sink = trace.MemorySink()

    def expect(fn, pattern):
        trace.add_sink(sink)
        try:
            with pytest.raises(ValueError, match=pattern):
                fn()
        finally:
            trace.remove_sink(sink)
        moved = [e.kind for e in sink.events if e.kind in ("collective", "send", "recv", "reshard_step")]
        assert moved == [], (pattern, moved)
        raised.append(pattern)

    def init(**hybrid):
        s = fleet.DistributedStrategy()
        s.hybrid_configs = hybrid
        s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
        fleet.init(is_collective=True, strategy=s)

    # pp_degree not dividing the world, with fleet and without
    expect(lambda: init(pp_degree=3), r"world size 4 is not divisible by pp\*sharding\*mp\*sep = 3")
    expect(lambda: init(dp_degree=1, pp_degree=3), "but the world has 4 ranks")
    expect(lambda: PipelineLayer(descs("mlp5"), num_stages=3), "num_stages=3 does not divide the world size 4")
    init(pp_degree=4)
    # more stages than layers, also with virtual stages
    expect(lambda: PipelineLayer(descs("mlp5")[:3]), "3 layers cannot fill 4")
    expect(lambda: PipelineLayer(descs("mlp5"), num_virtual_pipeline_stages=2), r"5 layers cannot fill 8")
    # a seg_method that names no layer, or cuts the wrong number of parts
    expect(lambda: PipelineLayer(descs("mlp5"), seg_method="layer:Nope"), "'layer:Nope' names no layer")
    expect(lambda: PipelineLayer(descs("mlp5"), seg_method="layer:Block"), "5 matching layers do not split into 4")
    expect(lambda: PipelineLayer(descs("mlp5"), seg_method=[0, 1, 2]), "need 5 increasing boundaries from 0 to 5")
    expect(lambda: PipelineLayer(descs("mlp5"), seg_method=[0, 3, 2, 4, 5]), "increasing boundaries")
    expect(lambda: PipelineLayer(descs("mlp5"), seg_method="even"), "'even' is not supported")
    # a batch that is not micro_batch_size * accumulate_steps rows, on every stage (the middle ones too)
    pipe = fleet.distributed_model(PipelineLayer(descs("mlp5"), loss_fn=nn.MSELoss()))
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    x, y = batch("mlp", 5)
    expect(lambda: pipe.train_batch((x, y), opt), r"batch size 5 != micro_batch_size \(2\) \* accumulate_steps "
                                                  r"\(2\) = 4")
    expect(lambda: pipe.eval_batch((x[:3], y[:3]), compute_loss=True), "batch size 3")
    # Paddle's list form: one micro-batch per accumulate step, each micro_batch_size rows
    expect(lambda: pipe.train_batch(([x[:2]] * 3, [y[:2]] * 3), opt),
           "a list of 3 micro-batches; accumulate_steps is 2")
    expect(lambda: pipe.train_batch(([x[:3], x[3:4]], [y[:3], y[3:4]]), opt),
           r"inputs\[0\]: a micro-batch of 3 rows; micro_batch_size is 2")
    t = torch.ones(1)
    dist.all_reduce(t)  # no rank was left inside a collective
    assert t.item() == 4
    return raised


@pytest.mark.timeout(60)
def test_bad_pipeline_configurations_raise_on_every_rank_before_communicating():
    res = run_ranks(bad_configs, 4, timeout=50)
    assert all(len(r) == 14 for r in res)


def off_mesh_layouts():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    m0 = dist.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    h = dist.shard_tensor(torch.randn(4, 3), m0, [dist.Shard(0)])
    g = dist.shard_tensor(torch.randn(4, 3), m0, [dist.Replicate()])
    return [repr(t.placements) for t in (h * g, g + h, h @ g.T)]


@pytest.mark.timeout(60)
def test_ranks_off_a_mesh_lay_an_op_out_as_its_members():
    """torch prices every redistribution at 0 off a mesh: there an op of a Shard(0) and a Replicate input came out
    Replicate, on the members Shard(0); a pipeline stage's transfer sized its buffers from the wrong layout."""
    res = run_ranks(off_mesh_layouts, 4, timeout=50)
    assert res == [["[S(0)]", "[S(0)]", "[S(0)]"]] * 4
