"""dist.parallelize's pp_config forms (uneven, lists of names, a dict with global_spec), a second call, cp_config
and RowWiseParallel's input split, as Paddle 3.3.1 runs them, each against one dense process."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks
from tests.ranks.test_pipeline_audit import Gate  # H is 4 in both

H, SEED, LR = 4, 1234, 0.01


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, skip=None, g=None):
        y = torch.tanh(self.lin(x))
        y = y if skip is None else y + skip
        return y if g is None else y * g


class Net(nn.Module):
    """Named as the model Paddle's stage boundaries below were taken from: emb, layers.<i>.lin, norm, head.
    ``skip``: every block also takes emb's output (a tensor of the first stage) as a positional input."""

    def __init__(self, n=3, gated=False, skip=False):
        super().__init__()
        torch.manual_seed(SEED)
        self.skip = skip
        self.emb = nn.Linear(H, H)
        self.gate = Gate() if gated else None
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, H)

    def forward(self, x):
        g = self.gate(x) if self.gate is not None else None
        h = self.emb(x)
        h0 = h if self.skip else None
        for layer in self.layers:
            h = layer(h, h0, g=g)
        return self.head(self.norm(h))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.a, self.b = nn.Linear(H, 8), nn.Linear(8, H)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


X = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
Y = torch.randn(4, H, generator=torch.Generator().manual_seed(2))


def dense_step(model):
    """One dense AdamW step: the output, the gradients, the parameters after the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = model(X)
    ((out - Y) ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return {"out": out.detach(), "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _full(t):
    import meshviz.distributed as dist

    full = dist.unshard_dtensor(t).detach().clone()
    return full if full.numel() else None  # a rank off the tensor's mesh holds nothing of it


def dist_step(model, opt, mesh):
    """The same step on the parallelized model: the batch Replicate (split along dp) on the first stage's mesh."""
    import meshviz.distributed as dist
    from meshviz import trace

    def place(t, m):
        pl = [dist.Replicate()] * m.ndim
        if "dp" in m.dim_names:
            pl[m.dim_names.index("dp")] = dist.Shard(0)
        return dist.shard_tensor(t, m, pl)

    pp = mesh.get_dim_size("pp") if "pp" in mesh.dim_names else 1
    first = mesh.get_mesh_with_dim("pp", 0) if pp > 1 else mesh
    last = mesh.get_mesh_with_dim("pp", pp - 1) if pp > 1 else mesh
    sink = trace.MemorySink()
    trace.add_sink(sink)
    out = model(place(X, first))
    trace.remove_sink(sink)
    ((out - place(Y, last)) ** 2).mean().backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    opt.step()
    return {"out": _full(out), "grads": grads, "params": {n: _full(p) for n, p in model.named_parameters()},
            "stages": {n: getattr(m, "pipeline_stage_index", 0) for n, m in model.named_modules() if n},
            "ids": {n: p.process_mesh.process_ids for n, p in model.named_parameters()},
            "forward": [(e.name, e.op) for e in sink.events if e.kind == "reshard_step"]}


def check_against_dense(res: list, ref: dict, what: str) -> None:
    """Every rank that holds the output or a parameter holds the dense values; each is held somewhere."""
    assert any(r["out"] is not None for r in res), what
    for rank, r in enumerate(res):
        if r["out"] is not None:
            torch.testing.assert_close(r["out"], ref["out"], msg=lambda m: f"{what} rank {rank} output: {m}")
        for key in ("grads", "params"):
            for name, want in ref[key].items():
                got = r[key][name]
                if got is not None:
                    torch.testing.assert_close(got, want, msg=lambda m: f"{what} rank {rank} {key} {name}: {m}")
    for key in ("grads", "params"):
        for name in ref[key]:
            assert any(r[key][name] is not None for r in res), f"{what}: no rank holds {key} of {name}"


# -- pp_config: uneven prefix splits, lists of names, a dict with global_spec -------------------------------------


def _split(spec):
    import meshviz.distributed as dist

    return {k: getattr(dist.SplitPoint, v) for k, v in spec.items()} if isinstance(spec, dict) else spec


PP_CASES = {
    # 3 layers on 2 stages: Paddle warns and splits after layers.1 (the first stage holds one layer more)
    "uneven_2": {"n": 2, "mesh": [0, 1], "axes": ["pp"], "model": {"n": 3}, "split": "layers",
                 "stage1": ["layers.2", "layers.2.lin", "norm", "head"], "warn": "first 1 stages hold 2"},
    # a list of layer names: Paddle matches them exactly; two of them on two stages split after emb
    "names_2": {"n": 2, "mesh": [0, 1], "axes": ["pp"], "model": {"n": 2}, "split": ["emb", "head"],
                "stage1": ["layers", "layers.0", "layers.0.lin", "layers.1", "layers.1.lin", "norm", "head"]},
    # a dict split_spec with global_spec: every layer moves a tensor of another mesh onto its stage (Paddle's
    # pre-hook): the gate's output (a keyword) and emb's (a positional input of the second stage's block)
    "dict_global_2": {"n": 2, "mesh": [0, 1], "axes": ["pp"], "model": {"n": 2, "gated": True, "skip": True},
                      "split": {"layers.0": "END"}, "global": "gate",
                      "stage1": ["layers.1", "layers.1.lin", "norm", "head"]},
    # the prefix form with global_spec: the gate's output, a keyword of every block, moved onto the second stage
    "prefix_global_kw": {"n": 2, "mesh": [0, 1], "axes": ["pp"], "model": {"n": 2, "gated": True},
                         "split": "layers", "global": "gate", "stage1": ["layers.1", "layers.1.lin", "norm", "head"]},
    # 7 layers on 4 stages: splits after layers.1, 3 and 5
    "uneven_4": {"n": 4, "mesh": [0, 1, 2, 3], "axes": ["pp"], "model": {"n": 7}, "split": "layers",
                 "stage1": ["layers.2", "layers.2.lin", "layers.3", "layers.3.lin"], "warn": "first 3 stages hold 2"},
    # pp x dp, 5 layers on 2 stages (3 + 2), a list prefix with global_spec (keyword), ShardingStage1 along dp
    "list_global_dp": {"n": 4, "mesh": [[0, 1], [2, 3]], "axes": ["pp", "dp"],
                       "model": {"n": 5, "gated": True, "skip": True},
                       "split": ["layers"], "global": ["gate"], "level": 1,
                       "stage1": ["layers.3", "layers.3.lin", "layers.4", "layers.4.lin", "norm", "head"],
                       "warn": "first 1 stages hold 3"},
}


def pp_case(case):
    import warnings

    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh(case["mesh"], dim_names=case["axes"])
    model = Net(**case["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {"pp_config": {"split_spec": _split(case["split"])}}
    if case.get("global"):
        config["pp_config"]["global_spec"] = case["global"]
    if case.get("level"):
        config["dp_config"] = {"sharding_level": case["level"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = dist.parallelize(model, opt, mesh=mesh, config=config)
    res = dist_step(model, opt, mesh)
    res["warnings"] = [str(w.message) for w in caught if "pp size" in str(w.message)]
    return res


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(PP_CASES))
def test_pp_config_forms_split_as_paddle_and_train_as_one_process(name):
    case = PP_CASES[name]
    res = run_ranks(pp_case, case["n"], case, timeout=180, collective_timeout=60)
    check_against_dense(res, dense_step(Net(**case["model"])), name)
    stages = res[0]["stages"]
    assert [n for n, s in stages.items() if s == 1] == case["stage1"], stages
    assert all(r["stages"] == stages for r in res)
    stage_ids = [row if isinstance(row, list) else [row] for row in case["mesh"]]
    for name, ids in res[0]["ids"].items():  # each parameter on its layer's stage mesh
        assert ids == stage_ids[stages[name.rsplit(".", 1)[0]]], (name, ids)
    warned = res[0]["warnings"]
    assert (len(warned) == 1 and case["warn"] in warned[0]) if case.get("warn") else warned == [], warned


def _stages_of(n_layers, pp, split_spec):
    """Paddle's split (split_spec_dict, matched layers) and every layer's stage for the model ``Net(n_layers)``."""
    import meshviz.distributed as dist
    from meshviz.distributed.auto_parallel.intermediate.pipeline_parallel import resolve_split_spec, stage_indices

    mesh = dist.ProcessMesh(list(range(pp)), dim_names=["pp"])
    spec, _, matched = resolve_split_spec(Net(n_layers), mesh, {"split_spec": split_spec})
    return list(spec), matched, stage_indices(Net(n_layers), spec)


def test_split_points_are_paddles():
    """The boundaries Paddle 3.3.1's pipeline_parallel gives (split_spec_dict, matched_layer_name) on this model."""
    with pytest.warns(UserWarning, match=r"number of layers \(5\) is not divisible by the pp size \(3\)"):
        spec, matched, stages = _stages_of(5, 3, "layers")
    assert spec == ["layers.1", "layers.3"] and matched == [f"layers.{i}" for i in range(5)]
    assert [stages[f"layers.{i}"] for i in range(5)] == [0, 0, 1, 1, 2] and stages["head"] == 2
    with pytest.warns(UserWarning, match="not divisible"):
        assert _stages_of(7, 4, "layers")[0] == ["layers.1", "layers.3", "layers.5"]
    # a prefix and names together: 'layers' matches exactly but gives way to its numbered layers
    spec, matched, _ = _stages_of(4, 2, ["emb", "layers", "norm"])
    assert spec == ["layers.1"] and matched == ["emb", "layers.0", "layers.1", "layers.2", "layers.3", "norm"]
    assert _stages_of(2, 2, ("emb", "head"))[:2] == (["emb"], ["emb", "head"])
    with pytest.warns(UserWarning, match="not divisible"):
        spec, matched, stages = _stages_of(3, 2, ["layers.0", "layers.2", "head"])
    assert spec == ["layers.2"] and matched == ["layers.0", "layers.2", "head"] and stages["norm"] == 1
    with pytest.raises(ValueError, match=r"must not be less than the pp size, but got 2 layers"):
        _stages_of(2, 3, "layers")
    with pytest.raises(ValueError, match="holds layer names or prefixes"):
        _stages_of(2, 2, ["layers", 3])


# -- a second parallelize on the same model --------------------------------------------------------------------


def second_call():
    """Paddle's second parallelize: a dp_config shards a new optimizer of the parallelized model. On dp x mp: mp,
    then level 1; mp at level 3 without an optimizer, then level 3. On pp x dp: a pipeline, then level 3."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    mp = {"mp_config": {"parallelize_plan": {"a": dist.ColWiseParallel(), "b": dist.RowWiseParallel()}}}
    out = {}
    model, _ = dist.parallelize(MLP(), None, mesh=mesh, config=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = dist.parallelize(model, opt, mesh=mesh, config={"dp_config": {"sharding_level": 1}})
    out["level_1"] = dist_step(model, opt, mesh)
    out["level_1"]["bias_state"] = repr(opt.state[model.b.bias]["exp_avg"].placements)
    try:
        dist.parallelize(model, opt, mesh=mesh, config=mp)
    except ValueError as e:
        out["again"] = str(e)
    model, _ = dist.parallelize(MLP(), None, mesh=mesh, config={**mp, "dp_config": {"sharding_level": 3}})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = dist.parallelize(model, opt, mesh=mesh, config={"dp_config": {"sharding_level": 3}})
    out["level_3"] = dist_step(model, opt, mesh)
    pp = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    model, _ = dist.parallelize(Net(n=2), None, mesh=pp, config={"pp_config": {"split_spec": "layers"}})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = dist.parallelize(model, opt, mesh=pp, config={"dp_config": {"sharding_level": 3}})
    out["pp_level_3"] = dist_step(model, opt, pp)
    one = Net(n=2)
    one, opt = dist.parallelize(one, torch.optim.AdamW(one.parameters(), lr=LR), mesh=pp, config={
        "pp_config": {"split_spec": "layers"}, "dp_config": {"sharding_level": 3}})
    out["pp_level_3_one_call"] = dist_step(one, opt, pp)
    return out


@pytest.mark.timeout(200)
def test_a_second_parallelize_with_dp_config_shards_a_new_optimizer_and_trains_as_one_process():
    res = run_ranks(second_call, 4, timeout=180, collective_timeout=60)
    for key, model in (("level_1", MLP()), ("level_3", MLP()), ("pp_level_3", Net(n=2))):
        check_against_dense([r[key] for r in res], dense_step(model), key)
    # a pipeline sharded at level 3 by a second call gathers as one call does: per op, not per layer
    for r in res:
        assert r["pp_level_3"]["forward"] == r["pp_level_3_one_call"]["forward"]
    assert ("emb.weight", "all_gather") not in res[0]["pp_level_3"]["forward"]
    assert all(r["level_1"]["bias_state"] == "[S(0), R]" for r in res)  # the new optimizer is sharded along dp
    for r in res:
        assert r["again"].startswith("this model has been parallelized already: a second mp_config would add "
                                     "its hooks"), r["again"]


# -- cp_config; RowWiseParallel(is_input_parallel=False) ----------------------------------------------------------


def test_cp_config_is_refused_as_unsupported_before_anything_changes():
    import meshviz.distributed as dist
    from meshviz.distributed import DistTensor

    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = MLP()
    for config in ({"cp_config": {"parallelize_plan": {}}},
                   {"mp_config": {"parallelize_plan": {"a": dist.ColWiseParallel()}},
                    "cp_config": {"parallelize_plan": {}}}):
        with pytest.raises(NotImplementedError, match=r"parallelize: cp_config \(context parallel: ContextParallel "
                                                      r"/ PrepareContextParallel along a 'sep' mesh axis\) is not "
                                                      r"supported"):
            dist.parallelize(model, None, mesh=mesh, config=config)
    assert not any(isinstance(p, DistTensor) for p in model.parameters())
    dist.auto_parallel.set_mesh(None)


def _row_layer():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 8))


def row_input_split():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1]], dim_names=["dp", "mp"])
    plan = {"0": dist.RowWiseParallel(is_input_parallel=False)}
    model, _ = dist.parallelize(_row_layer(), None, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    seen = []
    model[0].register_forward_pre_hook(lambda layer, args: seen.append(
        (repr(args[0].placements), list(args[0]._local_value().shape))))
    x = dist.shard_tensor(torch.arange(48.0).reshape(2, 3, 8) / 50, mesh, [dist.Replicate(), dist.Replicate()])
    out = model(x)
    out.sum().backward()
    return {"seen": seen, "out": _full(out), "grad": _full(model[0].weight.grad)}


def test_rowwise_without_parallel_input_splits_the_hidden_dim_as_paddle():
    """Paddle 3.3.1 (2 CPU ranks, mesh [dp, mp] = [[0, 1]]): the layer sees [Replicate(), Shard(dim=2)], a local
    [2, 3, 4] of the [2, 3, 8] input: the hidden (last) dim, not the sequence."""
    ref = _row_layer()
    out = ref(torch.arange(48.0).reshape(2, 3, 8) / 50)
    out.sum().backward()
    for r in run_ranks(row_input_split, 2, timeout=60):
        assert r["seen"] == [("[R, S(2)]", [2, 3, 4])]
        torch.testing.assert_close(r["out"], out.detach())
        torch.testing.assert_close(r["grad"], ref[0].weight.grad)
