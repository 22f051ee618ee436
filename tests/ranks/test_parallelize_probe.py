"""dist.parallelize at its edges (plans, frozen, stages, tied weights, optimizers), trained against one process."""

import importlib

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

H, V, B, STEPS, LR = 8, 16, 4, 3, 0.05


class Blk(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.up, self.down = nn.Linear(H, 16, bias=bias), nn.Linear(16, H, bias=bias)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Deep(nn.Module):
    """Two blocks and a head; ``bias=False``: no linear layer has a bias; ``tied``: an embedding whose weight
    is the head's; ``act_first``: the first layer an activation; ``twice``: the first block runs twice;
    ``frozen``: the first block's up weight and the head's bias take no gradient."""

    def __init__(self, bias=True, tied=False, act_first=False, twice=False, frozen=False):
        super().__init__()
        torch.manual_seed(7)
        self.twice = twice
        self.act0 = nn.Tanh() if act_first else None
        self.emb = nn.Embedding(V, H) if tied else None
        self.layers = nn.ModuleList(Blk(bias) for _ in range(2))
        self.head = nn.Linear(H, V if tied else H, bias=bias and not tied)
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.layers[0].up.weight.requires_grad_(False)
            self.head.bias.requires_grad_(False)

    def forward(self, x=None, scale=1.0):
        x = self.emb(x) if self.emb is not None else x
        x = self.act0(x) if self.act0 is not None else x
        x = self.layers[0](self.layers[0](x)) if self.twice else self.layers[0](x)
        return self.head(self.layers[1](x)) * scale


class LossHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, h, y):
        return ((self.proj(h) - y) ** 2).mean()


class WithLoss(nn.Module):
    """The loss is the model's output, made by the last layer (the last pipeline stage)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.l0, self.l1, self.head = nn.Linear(H, H), nn.Linear(H, H), LossHead()

    def forward(self, x, y):
        return self.head(torch.tanh(self.l1(torch.tanh(self.l0(x)))), y)


def _model(case):
    return WithLoss() if case.get("with_loss") else Deep(**case.get("model", {}))


def _data(case, i):
    g = torch.Generator().manual_seed(100 + i)
    b = case.get("batch", B)
    if case.get("model", {}).get("tied"):
        return torch.randint(0, V, (b, 4), generator=g), torch.randn(b, 4, V, generator=g)
    shape = (b, 4, H) if case.get("seq") else (b, H)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _loss(model, x, y, case):
    if case.get("with_loss"):
        return model(x, y)
    out = model(x=x, scale=2.0) if case.get("kwargs") else model(x)
    return ((out - y) ** 2).mean()


def _train(model, opt, case, place=lambda t, last: t, full=lambda t: t):
    """STEPS AdamW steps of ``accum`` backwards each: the losses, then every parameter after the steps."""
    losses, accum = [], case.get("accum", 1)
    for step in range(STEPS):
        for a in range(accum):
            x, y = _data(case, 10 * step + a)
            loss = _loss(model, place(x, False), place(y, True), case) / accum
            loss.backward()
            losses.append(full(loss))
        opt.step()
        opt.zero_grad()
    return losses, {n: full(p) for n, p in model.named_parameters()}


def _dense(case):
    model = _model(case)
    opt = torch.optim.AdamW(_stepped(model, case), lr=LR)
    return _train(model, opt, case, full=lambda t: t.detach().clone())


def _stepped(model, case):
    """The optimizer's parameters: the trainable ones, or (``opt_all``) every one, frozen too, as torch allows."""
    return list(model.parameters()) if case.get("opt_all") else [p for p in model.parameters() if p.requires_grad]


def _plan(name):
    import meshviz.distributed as dist

    col, row = dist.ColWiseParallel, dist.RowWiseParallel
    return {
        "blocks": lambda: {"layers.*.up": col(), "layers.*.down": row()},
        "blocks_weights": lambda: {"layers.*.up.weight": col(), r"layers.\d+.down.weight": row()},
        "prefix": lambda: {"layers.0.*": col()},  # the block and both its linear layers: column, column
        "gather_2d": lambda: {"layers.0.up": col(gather_output=True), "head": col(gather_output=True)},
        "tied": lambda: {"emb": col(), "head": col(gather_output=True), "layers.*.up": col(),
                         "layers.*.down": row()},
        # sequence parallel on the layer a pipeline stage ends with: its output hook runs before the transfer
        "sp_enable_split": lambda: {"layers.0": dist.SequenceParallelEnable(), "layers.1.up": col(),
                                    "layers.1.down": row()},
        "sp_disable_split": lambda: {"layers.0": dist.SequenceParallelDisable(), "layers.*.up": col(),
                                     "layers.*.down": row()},
    }[name]()


def _config(case):
    import meshviz.distributed as dist

    config = {}
    if case.get("plan"):
        config["mp_config"] = {"parallelize_plan": _plan(case["plan"])}
    if "level" in case:
        config["dp_config"] = {"sharding_level": case["level"]}
    if case.get("split"):
        split = case["split"]
        config["pp_config"] = {"split_spec": split if isinstance(split, str) else
                               {k: dist.SplitPoint.END for k in split}}
    return config


def _ranked(case):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh(case["mesh"], dim_names=case["axes"])
    model = _model(case)
    opt = torch.optim.AdamW(_stepped(model, case), lr=LR)
    model, opt = dist.parallelize(model, opt, mesh=mesh, config=_config(case))
    pp = mesh.get_dim_size("pp") if "pp" in mesh.dim_names else 1
    first = mesh.get_mesh_with_dim("pp", 0) if pp > 1 else mesh
    last = mesh.get_mesh_with_dim("pp", pp - 1) if pp > 1 else mesh

    def place(t, is_label):  # the batch on the first stage, the labels on the last, both split along dp
        m = last if is_label else first
        pl = [dist.Replicate()] * m.ndim
        if "dp" in m.dim_names:
            pl[m.dim_names.index("dp")] = dist.Shard(0)
        return dist.shard_tensor(t, m, pl)

    def full(t):
        t = dist.unshard_dtensor(t).detach().clone()
        return t if t.numel() else None  # a rank off the tensor's stage holds nothing of it

    return _train(model, opt, case, place, full)


MP2, DP2, PP2 = ([0, 1], ["mp"]), ([0, 1], ["dp"]), ([0, 1], ["pp"])
DPMP, PPDP, PPMP = ([[0, 1], [2, 3]], ["dp", "mp"]), ([[0, 1], [2, 3]], ["pp", "dp"]), ([[0, 1], [2, 3]], ["pp", "mp"])
CASES = {
    "mp_no_bias": (MP2, {"model": {"bias": False}, "plan": "blocks"}),
    "dp_mp_no_bias_level_3": (DPMP, {"model": {"bias": False}, "plan": "blocks", "level": 3}),
    "mp_wildcard_weight_keys": (MP2, {"plan": "blocks_weights"}),
    "mp_prefix_key_col_col": (MP2, {"plan": "prefix"}),
    "mp_gather_output_2d": (MP2, {"plan": "gather_2d"}),
    "mp_gather_output_3d": (MP2, {"plan": "gather_2d", "seq": True}),
    "mp_layer_used_twice": (MP2, {"plan": "blocks", "model": {"twice": True}}),
    "dp_mp_layer_used_twice_level_3": (DPMP, {"plan": "blocks", "model": {"twice": True}, "level": 3}),
    "mp_keyword_inputs": (MP2, {"plan": "blocks", "kwargs": True}),
    "dp_mp_two_backwards_level_3": (DPMP, {"plan": "blocks", "level": 3, "accum": 2}),
    "pp_stage_of_an_activation_only_dp_level_3": (PPDP, {"model": {"act_first": True}, "split": ["act0"],
                                                         "level": 3}),
    "pp_loss_head_on_the_last_stage": (PP2, {"with_loss": True, "split": ["l1"]}),
    "pp_mp_tied_across_stages_two_backwards": (PPMP, {"model": {"tied": True}, "plan": "tied", "split": "layers",
                                                      "accum": 2}),
    "pp_mp_sequence_parallel_enable_on_a_split_layer": (PPMP, {"plan": "sp_enable_split", "split": "layers",
                                                               "seq": True}),
    "pp_mp_sequence_parallel_disable_on_a_split_layer": (PPMP, {"plan": "sp_disable_split", "split": "layers",
                                                                "seq": True}),
    "pp_dp_tied_across_stages_level_2": (PPDP, {"model": {"tied": True}, "split": "layers", "level": 2}),
    "dp_batch_of_3_level_3": (DP2, {"batch": 3, "level": 3}),
}
for level in (0, 1, 2, 3):
    CASES[f"dp_frozen_level_{level}"] = (DP2, {"model": {"frozen": True}, "level": level})
    CASES[f"dp_frozen_in_the_optimizer_level_{level}"] = (DP2, {"model": {"frozen": True}, "level": level,
                                                                "opt_all": True})
CASES["dp_mp_frozen_level_3"] = (DPMP, {"model": {"frozen": True}, "plan": "blocks", "level": 3})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_parallelize_edge_configurations_train_as_one_process(name):
    (mesh, axes), case = CASES[name]
    case = {**case, "mesh": mesh, "axes": axes}
    ref_losses, ref_params = _dense(case)
    n = 4 if isinstance(mesh[0], list) else 2
    res = run_ranks(_ranked, n, case, timeout=100, collective_timeout=30)
    for rank, (losses, params) in enumerate(res):
        assert len(losses) == len(ref_losses), (name, rank)
        for i, (got, want) in enumerate(zip(losses, ref_losses)):
            if got is not None:
                torch.testing.assert_close(got, want, msg=lambda m: f"{name} r{rank} loss {i}: {m}")
        for pname, want in ref_params.items():
            if params[pname] is not None:
                torch.testing.assert_close(params[pname], want, msg=lambda m: f"{name} r{rank} {pname}: {m}")
    for pname in ref_params:
        assert any(params[pname] is not None for _, params in res), f"{name}: no rank holds {pname}"


@pytest.mark.parametrize("config", [{"dp_config": {"sharding_level": 1}},
                                    {"mp_config": {"parallelize_plan": {"layers.*.up": "col"}}}])
@pytest.mark.parametrize("opt_class", ["Adafactor", "LBFGS"])
def test_a_whole_tensor_optimizer_on_parts_is_refused_before_the_model_changes(monkeypatch, config, opt_class):
    """shard_optimizer refuses an optimizer whose update reads a whole parameter where ranks would step only
    parts of one; parallelize refuses it before it places a parameter or registers a hook."""
    import meshviz.distributed as dist

    module = importlib.import_module("meshviz.distributed.auto_parallel.intermediate.parallelize")
    applied = []
    monkeypatch.setattr(module._Prepared, "apply", lambda self: applied.append(self))
    if "mp_config" in config:
        config = {"mp_config": {"parallelize_plan": {"layers.*.up": dist.ColWiseParallel()}}}
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = Deep()
    opt = getattr(torch.optim, opt_class)(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"parallelize: torch.optim.{opt_class} updates each parameter from all"):
        dist.parallelize(model, opt, mesh=mesh, config=config)
    assert applied == []
    # nothing it steps is split: the optimizer is taken (here the plan splits only the blocks' up weights)
    plain = {**config, "dp_config": {"sharding_level": 0}}
    head = getattr(torch.optim, opt_class)(model.head.parameters(), lr=0.1)
    assert not module._steps_parts(module._Prepared(model, mesh, plain), head)
    assert module._steps_parts(module._Prepared(model, mesh, plain), opt) == ("mp_config" in config)
    dist.auto_parallel.set_mesh(None)
