"""dist.parallelize (Paddle's intermediate API) on gloo ranks: a tiny Llama trained 3 steps against one process."""

import importlib

import numpy as np
import pytest
import torch

from meshviz import compat
from meshviz.testing import run_ranks
from tests.models import LlamaForCausalLM, llama_batches, llama_loss

STEPS = 3
MLP_TRANSPOSE = not compat.linear_keeps_split_batch_dims()
COL_LINEAR = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW_LINEAR = ("o_proj", "down_proj")


def _plan(sp: bool) -> dict:
    """Paddle's test plan (test/auto_parallel/hybrid_strategy/parallel_api.py), with and without sequence parallel."""
    import meshviz.distributed as dist

    plan = {
        "llama.layers.*.self_attn.q_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.k_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.v_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.o_proj": dist.RowWiseParallel(),
        "llama.layers.*.mlp.gate_proj": dist.ColWiseParallel(),
        "llama.layers.*.mlp.up_proj": dist.ColWiseParallel(),
        "llama.layers.*.mlp.down_proj": dist.RowWiseParallel(),
    }
    if not sp:
        plan["llama.embed_tokens"] = dist.ColWiseParallel(gather_output=True)
        plan["lm_head"] = dist.ColWiseParallel(gather_output=True)
    else:
        plan["llama.embed_tokens"] = [dist.ColWiseParallel(), dist.SequenceParallelBegin()]
        plan["llama.layers.*.self_attn"] = dist.SequenceParallelDisable()
        plan["llama.layers.*.mlp"] = dist.SequenceParallelDisable(need_transpose=MLP_TRANSPOSE)
        plan["lm_head.weight"] = dist.ColWiseParallel()
        plan["lm_head"] = [dist.PrepareLayerOutput(_gather_logits), dist.SequenceParallelEnd()]
    return plan


def _gather_logits(process_mesh):
    """The LM head's output, all-gathered along mp (a PrepareLayerOutput hook)."""
    import meshviz.distributed as dist

    def hook(layer, input, output):
        pl = list(output.placements)
        pl[process_mesh.dim_names.index("mp")] = dist.Replicate()
        return dist.reshard(output, process_mesh, pl)

    return hook


# -- what Paddle's plans give each parameter (torch layout: a Linear weight is [out, in]) ------------------------


def _mp_dim(name: str):
    """The tensor dim the mp axis splits, or None: Paddle's ColWise splits [in, out] dim 1 (torch Linear dim 0) and
    a bias dim 0; RowWise splits [in, out] dim 0 (torch Linear dim 1); an Embedding weight [num, dim] on dim 1."""
    if "embed_tokens" in name:
        return 1
    if any(k in name for k in COL_LINEAR):
        return 0
    if any(k in name for k in ROW_LINEAR) and name.endswith("weight"):
        return 1
    return None


def _with_sharding(placements, ndim, dp):
    """Paddle's get_placement_with_sharding: the dp axis takes the first dim the other axes do not split."""
    taken = [p[1] for p in placements if p[0] == "S"]
    free = [d for d in range(ndim) if d not in taken]
    out = list(placements)
    if free:
        out[dp] = ("S", free[0])
    return out


def _fmt(placements) -> str:
    return "[" + ", ".join("R" if p[0] == "R" else f"S({p[1]})" for p in placements) + "]"


def expected_layout(names_shapes, axes, mp: bool, level: int):
    """name -> (param placements, optimizer state placements) as Paddle gives them."""
    out = {}
    for name, shape in names_shapes.items():
        pl = [("R",)] * len(axes)
        dim = _mp_dim(name) if mp else None
        if dim is not None:
            pl[axes.index("mp")] = ("S", dim)
        state = pl
        if level and "dp" in axes:
            state = _with_sharding(pl, len(shape), axes.index("dp"))
        out[name] = (_fmt(state if level == 3 else pl), _fmt(state))
    return out


# -- the runs ---------------------------------------------------------------------------------------------------


def _reference(num_layers=1, tie=False):
    model = LlamaForCausalLM(num_layers=num_layers, tie=tie)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, grads = [], []
    for ids, labels in llama_batches(STEPS):
        loss = llama_loss(model(ids), labels)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _train(case):
    """One case on this rank: parallelize, train STEPS steps, return losses, full gradients, layouts, events."""
    import meshviz.distributed as dist
    from meshviz import trace

    mesh = dist.ProcessMesh(case["mesh"], dim_names=case["axes"])
    dist.auto_parallel.set_mesh(None)
    model = LlamaForCausalLM(num_layers=case.get("layers", 1), tie=case.get("tie", False))
    config = {}
    if case.get("mp"):
        config["mp_config"] = {"parallelize_plan": _plan(case.get("sp", False))}
    if case.get("pp"):
        config["pp_config"] = {"split_spec": "llama.layers"}
    if "level" in case:
        config["dp_config"] = {"sharding_level": case["level"]}
    if case.get("two_calls"):
        from meshviz.distributed.auto_parallel.intermediate.parallelize import parallelize_model, parallelize_optimizer

        dist.auto_parallel.set_mesh(mesh)
        model = parallelize_model(model, config=config)
        opt = parallelize_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, opt = dist.parallelize(model, opt, mesh=mesh, config=config)
    assert dist.get_mesh() == mesh and dist.fleet.auto.get_mesh() == mesh
    res = {"pl": {}, "ids": {}, "state": {}, "losses": [], "grads": []}
    for name, p in model.named_parameters():
        res["pl"][name] = repr(p.placements)
        res["ids"][name] = p.process_mesh.process_ids
    # the batch goes to the first stage's mesh, split along dp (Paddle's test: shard_dataloader on get_mesh(0))
    # and the labels to the last stage's
    pp = case["axes"].index("pp") if "pp" in case["axes"] else None
    first, last = (mesh, mesh) if pp is None else (mesh.get_mesh_with_dim("pp", 0),
                                                   mesh.get_mesh_with_dim("pp", mesh.shape[pp] - 1))
    for step, (ids, labels) in enumerate(llama_batches(STEPS)):
        if "dp" in first.dim_names:
            pl = [dist.Replicate()] * first.ndim
            pl[first.dim_names.index("dp")] = dist.Shard(0)
            ids, labels = dist.shard_tensor(ids, first, pl), dist.shard_tensor(labels, last, pl)
        sink = trace.MemorySink()
        if step == 0:
            trace.add_sink(sink)
        logits = model(ids)
        if step == 0:
            trace.remove_sink(sink)
            res["forward"] = list({(e.name, e.op) for e in sink.events if e.kind == "reshard_step"})
            res["implicit"] = [e.payload.inside for e in sink.events if e.kind == "collective"]
            res["logits"] = repr(logits.placements)
        loss = llama_loss(logits, labels)
        loss.backward()
        res["grads"].append({n: dist.unshard_dtensor(p.grad).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.clear_grad(set_to_zero=False)
        full = dist.unshard_dtensor(loss)
        res["losses"].append(full.item() if full.numel() else None)
    for (name, _), q in zip(model.named_parameters(), opt.param_groups[0]["params"]):
        st = opt.state.get(q, {}).get("exp_avg")
        res["state"][name] = repr(st.placements) if st is not None else None
    return res


def run_cases(cases):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    return [_train(case) for case in cases]


def _old_sharding_rule(got, want) -> bool:
    """ShardingStage before it shards a tensor-parallel weight along the next free dim: dp stays R there."""
    return got.replace("[R, ", "[S(1), ", 1) == want and want.startswith("[S(1), S(0)")


def _check_case(case, res, ref):
    ref_losses, ref_grads = ref
    ranks = [r for r in range(len(res)) if res[r]["losses"][0] is not None]
    assert ranks, "no rank holds the loss"
    for r in ranks:
        np.testing.assert_allclose(res[r]["losses"], ref_losses, rtol=1e-5, err_msg=f"{case} rank {r}")
    for r, out in enumerate(res):
        for step in range(STEPS):
            assert set(out["grads"][step]) == set(ref_grads[step])
            for name, g in out["grads"][step].items():
                if g.numel():  # ranks off a pipeline stage's mesh hold nothing of its parameters
                    torch.testing.assert_close(g, ref_grads[step][name], rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{case} rank {r} step {step} {name}: {m}")
    shapes = {n: g.shape for n, g in ref_grads[0].items()}
    axes = [a for a in case["axes"] if a != "pp"] or ["pp"]  # parameters live on the stage meshes
    pending = []
    for name, (want_pl, want_state) in expected_layout(shapes, axes, case.get("mp", False),
                                                       case.get("level", 0)).items():
        for r, out in enumerate(res):
            got_pl, got_state = out["pl"][name], out["state"][name]
            for what, got, want in (("placements", got_pl, want_pl), ("optimizer state", got_state, want_state)):
                if got == want:
                    continue
                if _old_sharding_rule(got, want):
                    pending.append(f"level {case.get('level', 0)} {name} {what} {got} (Paddle: {want})")
                    continue
                raise AssertionError(f"{case} rank {r}: {name} {what} {got}, Paddle gives {want}")
    return sorted(set(pending))


CASES_4 = [
    {"mesh": [[0, 1], [2, 3]], "axes": ["dp", "mp"], "mp": True, "level": 0},
    {"mesh": [[0, 1], [2, 3]], "axes": ["dp", "mp"], "mp": True, "sp": True, "level": 0},
    {"mesh": [[0, 1], [2, 3]], "axes": ["dp", "mp"], "mp": True, "level": 1},
    # Paddle's test mesh [dp, pp, mp] with pp = 1, and the two-call form parallelize_model / parallelize_optimizer
    {"mesh": [[[0, 1]], [[2, 3]]], "axes": ["dp", "pp", "mp"], "mp": True, "sp": True, "level": 2,
     "two_calls": True},
    {"mesh": [[0, 1], [2, 3]], "axes": ["dp", "mp"], "mp": True, "sp": True, "level": 3},
]

CASES_2 = [
    {"mesh": [0, 1], "axes": ["mp"], "mp": True},
    {"mesh": [0, 1], "axes": ["mp"], "mp": True, "sp": True},
    # a 2-stage split with the embedding tied to the LM head across the stages
    {"mesh": [0, 1], "axes": ["pp"], "pp": True, "layers": 2, "tie": True},
]


def _forward_reshards(case, n_layers=1):
    """(tensor, op) of every reshard step the plans run in one forward."""
    layers = [f"llama.layers.{i}" for i in range(n_layers)]
    if case.get("sp"):
        # the logits' gather is the user's PrepareLayerOutput hook, a reshard of an unnamed tensor
        out = {("llama.embed_tokens:output", "all_to_all"), ("lm_head:input", "all_gather"), (None, "all_gather")}
        for layer in layers:
            for sub in ("self_attn", "mlp"):
                out |= {(f"{layer}.{sub}:input", "all_gather"), (f"{layer}.{sub}:output", "reduce_scatter")}
        return out
    out = {("llama.embed_tokens:output", "all_gather"), ("lm_head:output", "all_gather")}
    for layer in layers:
        out |= {(f"{layer}.self_attn.o_proj:output", "all_reduce"), (f"{layer}.mlp.down_proj:output", "all_reduce")}
    return out


def _check_events(case, res):
    if not case.get("mp"):
        return
    assert res[0]["implicit"] == [], f"{case}: collectives outside the planner in forward: {res[0]['implicit']}"
    want = _forward_reshards(case)
    if case.get("level", 0) == 3:
        # stage 3 keeps parameters sharded along dp: each layer gathers its own once, before its forward (FSDP2's
        # units), every one shown as its own reshard
        dp = case["axes"].index("dp")
        want |= {(name, "all_gather") for name, pl in res[0]["pl"].items()
                 if pl.strip("[]").split(", ")[dp].startswith("S(")}
    for out in res:
        assert set(map(tuple, out["forward"])) == want, case
    assert res[0]["logits"] == ("[S(0), R]" if "dp" in case["axes"] else "[R]")


@pytest.mark.timeout(420)
def test_parallelize_llama_on_4_ranks_matches_one_process():
    """dp x mp (levels 0-3, sequence parallel on and off) on 4 ranks: losses, gradients, placements, reshards."""
    res = run_ranks(run_cases, 4, CASES_4, timeout=400, collective_timeout=60)
    ref = _reference()
    pending = []
    for i, case in enumerate(CASES_4):
        per_rank = [r[i] for r in res]
        pending += _check_case(case, per_rank, ref)
        _check_events(case, per_rank)
    if pending:
        pytest.xfail("needs ShardingStage to shard a tensor-parallel weight along its next free dim: "
                     + "; ".join(sorted(set(pending))))


def _no_change(model, sink, what):
    """Nothing was placed, resharded or communicated, and the model's parameters are still dense."""
    from meshviz.distributed import DistTensor

    assert not any(isinstance(p, DistTensor) for p in model.parameters()), what
    assert [e.kind for e in sink.events if e.kind != "placed"] == [], what


def errors_then_cases(cases):
    """Bad input raises on every rank before anything is placed or communicated; then LocalLayer; then cases."""
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.auto_parallel.intermediate.parallelize import parallelize_optimizer

    dist.init_parallel_env()
    sink = trace.MemorySink()
    trace.add_sink(sink)
    mp = dist.ProcessMesh([0, 1], dim_names=["mp"])
    dp = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = LlamaForCausalLM()
    plan = {"mp_config": {"parallelize_plan": {"llama.layers.*.self_attn.q_proj": dist.ColWiseParallel()}}}
    with pytest.raises(ValueError, match="Please parallelize the model before parallelize optimizer"):
        parallelize_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), mesh=mp, config=plan)
    with pytest.raises(ValueError, match=r"keys \['llama.layers.\*.attention.q_proj'\] match no layer"):
        dist.parallelize(model, mesh=mp, config={"mp_config": {"parallelize_plan": {
            "llama.layers.*.self_attn.q_proj": dist.ColWiseParallel(),
            "llama.layers.*.attention.q_proj": dist.ColWiseParallel()}}})
    _no_change(model, sink, "unmatched key")
    odd = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"0: weight has shape \[3, 4\]; its dim 0 \(3\) is not divisible by the "
                                         r"mp degree 2"):
        dist.parallelize(odd, mesh=mp, config={"mp_config": {"parallelize_plan": {
            "1": dist.RowWiseParallel(), "0": dist.ColWiseParallel()}}})
    _no_change(odd, sink, "degree")
    with pytest.raises(ValueError, match=r"mp_config needs a mesh axis named 'mp'.*\['dp'\]"):
        dist.parallelize(model, mesh=dp, config=plan)
    with pytest.raises(ValueError, match=r"dp_config needs a mesh axis named 'dp'.*\['mp'\]"):
        dist.parallelize(model, mesh=mp, config={**plan, "dp_config": {"sharding_level": 1}})
    with pytest.raises(ValueError, match=r"pp_config needs a mesh axis named 'pp'"):
        dist.parallelize(model, mesh=mp, config={**plan, "pp_config": {"split_spec": "llama.layers"}})
    _no_change(model, sink, "mesh axes")
    # Paddle's LocalLayer example: each rank's masked mean, summed as Partial
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])

    class Custom(dist.LocalLayer):
        def forward(self, x):
            mask = torch.zeros_like(x)
            if dist.get_rank() == 0:
                mask[1:3] = 1
            else:
                mask[4:7] = 1
            self.local_result = (x * mask).sum() / mask.sum()
            return self.local_result

    x = dist.dtensor_from_local(torch.arange(0, 10.0) + dist.get_rank(), mesh, [dist.Shard(0)])
    out = Custom([(mesh, [dist.Partial(dist.ReduceType.kRedSum)])])(x)
    trace.remove_sink(sink)
    local = {"local": out._local_value().item(), "global": dist.unshard_dtensor(out).item(),
             "placements": repr(out.placements)}
    return {"local_layer": local, "cases": [_train(case) for case in cases]}


@pytest.mark.timeout(300)
def test_parallelize_llama_on_2_ranks_mp_sp_and_two_stages():
    """mp with and without sequence parallel, a 2-stage split with a tied embedding; bad input; LocalLayer."""
    res = run_ranks(errors_then_cases, 2, CASES_2, timeout=280, collective_timeout=60)
    assert [r["local_layer"]["local"] for r in res] == [1.5, 6.0]
    assert [r["local_layer"]["global"] for r in res] == [7.5, 7.5]
    assert res[0]["local_layer"]["placements"] == "[P(sum)]"
    for i, case in enumerate(CASES_2):
        per_rank = [r["cases"][i] for r in res]
        ref = _reference(num_layers=case.get("layers", 1), tie=case.get("tie", False))
        assert not _check_case(case, per_rank, ref)
        _check_events(case, per_rank)
        if case.get("pp"):
            ids = per_rank[0]["ids"]
            assert ids["llama.embed_tokens.weight"] == [0] and ids["llama.layers.0.mlp.up_proj.weight"] == [0]
            assert ids["llama.layers.1.mlp.up_proj.weight"] == [1] and ids["llama.norm.weight"] == [1]
            assert per_rank[0]["losses"] == [None] * STEPS  # the loss lives on the last stage's mesh


# -- in this process: matching, the column/row mapping and every check that runs before anything changes --------


def test_plan_keys_are_paddle_regexes_matching_whole_names():
    import meshviz.distributed as dist
    from meshviz.distributed.auto_parallel.intermediate.tensor_parallel import match_layer

    model = LlamaForCausalLM(num_layers=2)
    col = dist.ColWiseParallel()
    plan = {"llama.layers.*.self_attn.q_proj": col, "lm_head.weight": col, "llama.layers.[1].mlp": col,
            "llama.layers.0": col, "llama.norm.bias": col}
    hits = {name: [params for _, params in match_layer(plan, layer, name)]
            for name, layer in model.named_modules() if name and match_layer(plan, layer, name)}
    assert hits == {"llama.layers.0": [[]], "llama.layers.0.self_attn.q_proj": [[]],
                    "llama.layers.1.self_attn.q_proj": [[]], "llama.layers.1.mlp": [[]], "lm_head": [["weight"]]}


def test_colwise_rowwise_map_paddle_in_out_onto_torch_out_in():
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])

    class Head(torch.nn.Module):  # a raw [in, out] weight, used as x @ weight: Paddle's layout
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 6))

    def pl(plan, layer):
        return {k: repr(v) for k, v in plan.param_placements(layer, mesh, []).items()}

    col, row = dist.ColWiseParallel(), dist.RowWiseParallel()
    assert pl(col, torch.nn.Linear(4, 6)) == {"weight": "[R, S(0)]", "bias": "[R, S(0)]"}
    assert pl(row, torch.nn.Linear(6, 4)) == {"weight": "[R, S(1)]"}  # the bias stays whole
    assert pl(col, torch.nn.Embedding(10, 4)) == {"weight": "[R, S(1)]"}
    assert pl(row, torch.nn.Embedding(10, 4)) == {"weight": "[R, S(0)]"}
    assert pl(col, Head()) == {"weight": "[R, S(1)]"}
    with pytest.raises(ValueError, match="should have 2 dims"):
        row.param_placements(torch.nn.LayerNorm(4), mesh, [])


def _fresh():
    import meshviz.distributed as dist

    dist.set_mesh(None)
    return LlamaForCausalLM(num_layers=2)


def test_bad_configs_raise_before_anything_is_placed(monkeypatch):
    import meshviz.distributed as dist
    module = importlib.import_module("meshviz.distributed.auto_parallel.intermediate.parallelize")

    applied = []
    monkeypatch.setattr(module._Prepared, "apply", lambda self: applied.append(self))

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    pp3 = dist.ProcessMesh([0, 1, 2], dim_names=["pp"])
    pp2 = dist.ProcessMesh([0, 1], dim_names=["pp"])
    col = dist.ColWiseParallel()
    bad = [
        (ValueError, "global mesh must not be None", None, {"dp_config": {"sharding_level": 1}}),
        (ValueError, "The mesh must be an instance of ProcessMesh", [[0, 1]], {"dp_config": {}}),
        (ValueError, r"unknown config keys \['mp_confg'\]", mesh, {"mp_confg": {}}),
        (ValueError, r"mp_config has unknown keys \['plan'\]", mesh, {"mp_config": {"plan": {}}}),
        (ValueError, "sharding_level must be 0, 1, 2 or 3, got 5", mesh, {"dp_config": {"sharding_level": 5}}),
        (ValueError, "unknown mesh dim name 'sharding'", mesh,
         {"dp_config": {"sharding_level": 1, "sharding_mesh_dim": "sharding"}}),
        (ValueError, "should be an instance of PlanBase", mesh, {"mp_config": {"parallelize_plan": {"lm_head": 1}}}),
        (ValueError, "not a valid regular expression", mesh, {"mp_config": {"parallelize_plan": {"lm_head(": col}}}),
        (ValueError, "No layer matches the split_spec", pp2, {"pp_config": {"split_spec": "llama.layer"}}),
        (ValueError, "must not be less than the pp size, but got 2 layers", pp3,
         {"pp_config": {"split_spec": "llama.layers"}}),
        (NotImplementedError, "SplitPoint.BEGINNING is not supported", pp2,
         {"pp_config": {"split_spec": {"llama.layers.0": dist.SplitPoint.BEGINNING}}}),
        (ValueError, "layer name:llama.layers.7 not in the model", pp2,
         {"pp_config": {"split_spec": {"llama.layers.7": dist.SplitPoint.END}}}),
        (ValueError, "the last layer:lm_head must not be SplitPoint.END", pp2,
         {"pp_config": {"split_spec": {"lm_head": dist.SplitPoint.END}}}),
        (ValueError, "a pp degree of 2 needs 1", pp2, {"pp_config": {"split_spec": {
            "llama.layers.0": dist.SplitPoint.END, "llama.layers.1": dist.SplitPoint.END}}}),
    ]
    for exc, msg, m, config in bad:
        model = _fresh()
        with pytest.raises(exc, match=msg):
            dist.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh=m, config=config)
    assert applied == []  # every check ran before parallelize began to change the model
    dist.set_mesh(None)


def test_no_config_does_nothing_and_says_so():
    import meshviz.distributed as dist

    model = _fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="will do nothing since the config is `None`"):
        assert dist.parallelize(model, opt) == (model, opt)
    with pytest.warns(UserWarning, match="won't do anything"):
        assert dist.parallelize(model, opt, config={"dp_config": None, "mp_config": None}) == (model, opt)


def test_global_mesh_is_fleet_auto_mesh():
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    mesh = dist.auto_parallel.create_mesh([("dp", 2), ("mp", 2)])
    assert np.asarray(mesh.mesh).tolist() == [[0, 1], [2, 3]] and list(mesh.dim_names) == ["dp", "mp"]
    assert dist.get_mesh() is mesh and fleet.auto.get_mesh() is mesh
    fleet.auto.set_mesh(None)
    assert dist.auto_parallel.get_mesh() is None
    with pytest.raises(ValueError, match="set_mesh expects a ProcessMesh"):
        dist.set_mesh([[0, 1]])
    with pytest.raises(NotImplementedError, match="use dist.parallelize|Use dist.parallelize"):
        dist.to_distributed(LlamaForCausalLM(), None, None, device_num=4)


def meta_then_to_empty(meta, pp=False):
    """The tiny Llama built on the meta device (nothing allocated), parallelized, then each rank's blocks made
    with ``to_empty``; or built on the CPU. The layouts a step sees, and the loss after a step from the same
    weights; with ``pp``, two stages (a rank's blocks of the other stage's parameters are empty, on the device
    ``to_empty`` names too)."""
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp" if pp else "dp", "mp"])
    dist.auto_parallel.set_mesh(mesh)
    config = {"mp_config": {"parallelize_plan": _plan(False)}}
    if pp:
        config["pp_config"] = {"split_spec": "llama.layers"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(num_layers=2 if pp else 1)
    if meta:
        with torch.device("meta"):
            model = LlamaForCausalLM(num_layers=2 if pp else 1)
    model, _ = dist.parallelize(model, None, config=config)
    if meta:
        model.to_empty(device="cpu")
    devices = sorted({p._local.device.type for p in model.parameters()})
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    first = mesh.get_mesh_with_dim("pp", 0) if pp else mesh
    ids = dist.shard_tensor(torch.arange(16).reshape(4, 4) % 16, first,
                            [dist.Replicate()] if pp else [dist.Shard(0), dist.Replicate()])
    emb = model.llama.embed_tokens(ids)
    logits = model(ids)
    return [repr(emb.placements), repr(logits.placements), dist.unshard_dtensor(logits).sum().item(), devices]


@pytest.mark.parametrize("pp", [False, True], ids=["dp_mp", "pp_mp"])
def test_a_model_built_on_the_meta_device_trains_as_one_built_on_the_cpu(pp):
    cpu, meta = run_ranks(meta_then_to_empty, 4, False, pp), run_ranks(meta_then_to_empty, 4, True, pp)
    assert cpu[0][:2] == (["[R]", "[R]"] if pp else ["[S(0), R]", "[S(0), R]"])
    for a, b in zip(cpu, meta):
        assert a[:2] == b[:2] and a[2] == pytest.approx(b[2], rel=1e-6)
        assert b[3] == ["cpu"]


class _ColNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.l1(x))


_X = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3))


def _col_then_sequence_parallel():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    plan = {"l1": dist.ColWiseParallel(gather_output=True), "norm": dist.SequenceParallelEnable()}
    m, _ = dist.parallelize(_ColNorm(), None, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    m(_X).pow(2).sum().backward()  # SequenceParallelEnable's reshard hands LayerNorm a transposed block
    return {k: dist.unshard_dtensor(p.grad) for k, p in m.named_parameters()}


def test_sequence_parallel_after_a_gathered_column_split_gives_the_dense_gradients():
    ref = _ColNorm()
    ref(_X).pow(2).sum().backward()
    for grads in run_ranks(_col_then_sequence_parallel, 2, timeout=60):
        for k, p in ref.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, atol=1e-5, rtol=1e-5, msg=k)


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x)


class _EmbedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([_Residual(), _Residual()])

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x


_IDS = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(1))


def embedding_first_stage_at_level_3():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "pp"])  # stage 0: ranks 0, 2; stage 1: ranks 1, 3
    model = _EmbedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = dist.parallelize(model, opt, mesh=mesh, config={"pp_config": {"split_spec": "layers"},
                                                               "dp_config": {"sharding_level": 3}})
    out = model(dist.shard_tensor(_IDS, mesh.get_mesh_with_dim("pp", 0), [dist.Shard(0)]))
    full = dist.unshard_dtensor(out)
    return full.detach() if full.numel() else None


def test_a_stage_that_begins_with_an_embedding_at_sharding_level_3_equals_dense():
    """The ranks of the other stage lay the embedding's output out as its stage's ranks do (they chose another
    layout, and the stage transfer moved the wrong blocks: outputs off by up to 8)."""
    want = _EmbedNet()(_IDS).detach()
    got = run_ranks(embedding_first_stage_at_level_3, 4)
    for r in (1, 3):
        torch.testing.assert_close(got[r], want)


CASES_8 = [{"mesh": np.arange(8).reshape(2, 2, 2).tolist(), "axes": ["dp", "pp", "mp"], "mp": True, "pp": True,
            "layers": 2, **extra} for extra in ({"sp": True, "level": 1}, {"level": 3})]


@pytest.mark.timeout(600)
def test_dp_pp_mp_with_sequence_parallel_and_at_level_3_match_one_process():
    """dp 2 x pp 2 x mp 2: the ranks of the other stage lay out the linears of a sequence-split ``[s, b, h]`` as
    the stage's own ranks do (a stage transfer failed: "the sender's [2, 2, 8] does not fit this rank's [2, 4, 8]")."""
    res = run_ranks(run_cases, 8, CASES_8, timeout=580, collective_timeout=60)
    ref_losses, ref_grads = _reference(num_layers=2)
    for i, case in enumerate(CASES_8):
        per_rank = [r[i] for r in res]
        assert [r for r in range(8) if per_rank[r]["losses"][0] is not None] == [2, 3, 6, 7], case
        for r, out in enumerate(per_rank):
            if out["losses"][0] is not None:
                np.testing.assert_allclose(out["losses"], ref_losses, rtol=1e-5, err_msg=f"{case} rank {r}")
            for step in range(STEPS):
                for name, g in out["grads"][step].items():
                    if g.numel():
                        torch.testing.assert_close(g, ref_grads[step][name], rtol=1e-4, atol=1e-5,
                                                   msg=lambda m: f"{case} rank {r} step {step} {name}: {m}")
