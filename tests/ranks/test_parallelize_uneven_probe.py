"""A sequence the mp degree does not divide, and shard_optimizer on an optimizer that has stepped, vs one process."""

import numpy as np
import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks
from tests.models import LlamaForCausalLM, llama_loss

from .test_parallelize_8_probe import MLP_TRANSPOSE, Cfg  # a tiny Llama the mp degrees 2, 4 and 8 divide


def _batches(seq, steps=2, batch=4):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 16, (batch, seq), generator=g), torch.randint(0, 16, (batch, seq), generator=g))
            for _ in range(steps)]


def _plan() -> dict:
    import meshviz.distributed as dist

    col, row = dist.ColWiseParallel, dist.RowWiseParallel
    return {r"llama\.layers\.\d+\.self_attn\.(q|k|v)_proj": col(), "llama.layers.*.self_attn.o_proj": row(),
            r"llama\.layers\.\d+\.mlp\.(gate|up)_proj": col(), "llama.layers.*.mlp.down_proj": row(),
            "llama.embed_tokens": [col(), dist.SequenceParallelBegin()],
            "llama.layers.*.self_attn": dist.SequenceParallelDisable(),
            "llama.layers.*.mlp": dist.SequenceParallelDisable(need_transpose=MLP_TRANSPOSE),
            "lm_head": [col(gather_output=True), dist.SequenceParallelEnd()]}


def _train(model, opt, seq, place=lambda t, last: t, full=lambda t: t.detach().clone()):
    """2 AdamW steps: the losses, the gradients of the last backward, then every parameter."""
    losses, grads = [], {}
    for ids, labels in _batches(seq):
        loss = llama_loss(model(place(ids, False)), place(labels, True))
        loss.backward()
        losses.append(full(loss))
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: full(p) for n, p in model.named_parameters()}


def _dense(case):
    model = LlamaForCausalLM(Cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    embedded = model.llama.embed_tokens(_batches(case["seq"])[0][0]).transpose(0, 1).detach()
    return _train(model, opt, case["seq"]), embedded


def _ranked(case):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    axes = case["axes"]
    mesh = dist.ProcessMesh(np.arange(int(np.prod(case["shape"]))).reshape(case["shape"]).tolist(), dim_names=axes)
    model = LlamaForCausalLM(Cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = {"mp_config": {"parallelize_plan": _plan()}}
    if "pp" in axes:
        config["pp_config"] = {"split_spec": "llama.layers"}
    if "dp" in axes:
        config["dp_config"] = {"sharding_level": case["level"]}
    model, opt = dist.parallelize(model, opt, mesh=mesh, config=config)
    pp = mesh.get_dim_size("pp") if "pp" in axes else 0
    first = mesh.get_mesh_with_dim("pp", 0) if pp else mesh
    last = mesh.get_mesh_with_dim("pp", pp - 1) if pp else mesh

    def place(t, is_label):  # the batch on the first stage, the labels on the last, both split along dp
        m = last if is_label else first
        pl = [dist.Replicate()] * m.ndim
        if "dp" in m.dim_names:
            pl[m.dim_names.index("dp")] = dist.Shard(0)
        return dist.shard_tensor(t, m, pl)

    def full(t):
        if t is None:
            return None
        t = dist.unshard_dtensor(t).detach().clone()
        return t if t.numel() else None  # a rank off the tensor's stage holds nothing of it

    blocks = []
    hook = model.llama.embed_tokens.register_forward_hook(
        lambda _m, _i, out: blocks.append((out.placements, out._local_value().detach().clone(), full(out))))
    trained = _train(model, opt, case["seq"], place, full)
    hook.remove()
    placements, local, whole = blocks[0]
    return trained, repr(placements), local, whole


def _check(name, case, res):
    (ref_losses, ref_grads, ref_params), embedded = _dense(case)
    for rank, ((losses, grads, params), *_) in enumerate(res):
        for i, (got, want) in enumerate(zip(losses, ref_losses)):
            if got is not None:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} r{rank} loss {i}")
        for what, got_all, ref in (("grad", grads, ref_grads), ("weight", params, ref_params)):
            for pname, want in ref.items():
                # a key's bias shifts every score of a query alike: its gradient is 0 but for rounding, which
                # AdamW's step normalizes to a full step (so its weight is rounding noise; its gradient is checked)
                if got_all[pname] is not None and not (what == "weight" and pname.endswith("k_proj.bias")):
                    torch.testing.assert_close(got_all[pname], want, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{name} r{rank} {what} {pname}: {m}")
    for pname in ref_params:
        assert any(params[pname] is not None for (_, _, params), *_ in res), f"{name}: no rank holds {pname}"
    # each rank's block of the sequence: Paddle's rows (the first ranks get the extra one), batch split along dp
    shape, axes, seq = case["shape"], case["axes"], case["seq"]
    mp, dp = shape[axes.index("mp")], shape[axes.index("dp")] if "dp" in axes else 1
    bounds = np.cumsum([0] + case["rows"])
    assert bounds[-1] == seq and len(case["rows"]) == mp
    for rank, (_, placements, local, whole) in enumerate(res):
        coord = np.argwhere(np.arange(len(res)).reshape(shape) == rank)[0]
        if "pp" in axes and coord[axes.index("pp")] != 0:
            continue
        m = coord[axes.index("mp")]
        b = 4 // dp
        d = coord[axes.index("dp")] if "dp" in axes else 0
        want = embedded[bounds[m] : bounds[m + 1], d * b : (d + 1) * b]
        assert "S(0)" in placements, (name, rank, placements)
        assert tuple(local.shape) == (case["rows"][m], b, Cfg.hidden_size), (name, rank, tuple(local.shape))
        torch.testing.assert_close(local, want, msg=lambda m: f"{name} r{rank} sequence block: {m}")
        torch.testing.assert_close(whole, embedded)


SEQ_CASES = {
    "mp2_seq_7": dict(shape=(2,), axes=["mp"], seq=7, rows=[4, 3]),
    "mp4_seq_5": dict(shape=(4,), axes=["mp"], seq=5, rows=[2, 2, 1, 0]),
    "dp2_mp4_seq_7_level_3": dict(shape=(2, 4), axes=["dp", "mp"], seq=7, rows=[2, 2, 2, 1], level=3),
    "pp2_mp2_seq_7": dict(shape=(2, 2), axes=["pp", "mp"], seq=7, rows=[4, 3]),
    "mp8_seq_7": dict(shape=(8,), axes=["mp"], seq=7, rows=[1] * 7 + [0]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SEQ_CASES))
def test_an_uneven_sequence_trains_as_one_process_with_paddles_blocks(name):
    """A sequence the mp degree does not divide was refused; Paddle splits it with the first ranks one row longer
    (7 on 2: 4 and 3) and trains it as one process does."""
    case = SEQ_CASES[name]
    n = int(np.prod(case["shape"]))
    _check(name, case, run_ranks(_ranked, n, case, timeout=100, collective_timeout=40))


# -- shard_optimizer on an optimizer that has stepped --------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _opt_batches():
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]


def _make_opt(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _dense_opt(kind):
    model = Net()
    opt = _make_opt(kind, model)
    for x, y in _opt_batches():
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}


def _ranked_opt(kind, stage, placed):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = dist.shard_layer(Net(), mesh) if placed else Net()  # dense: made dist by the first step
    opt = _make_opt(kind, model)
    batches = _opt_batches()

    def run(opt, batches):
        for x, y in batches:
            x = dist.shard_tensor(x, mesh, [dist.Shard(0)])
            y = dist.shard_tensor(y, mesh, [dist.Shard(0)])
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

    run(opt, batches[:2])
    opt = dist.shard_optimizer(opt, getattr(dist, f"ShardingStage{stage}")("dp", mesh))
    run(opt, batches[2:])
    params = {n: dist.unshard_dtensor(p).detach().clone() for n, p in model.named_parameters()}
    states = {n: {k: dist.unshard_dtensor(v).clone() if isinstance(v, torch.Tensor) and v.dim() else v
                  for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    held = {k: repr(v.placements) for k, v in opt.state[model.fc1.weight].items() if hasattr(v, "placements")
            and v.dim()}
    return params, states, held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("placed", [True, False], ids=["shard_layer", "dense_model"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_optimizer_on_a_stepped_optimizer_carries_its_states(kind, stage, placed):
    """Stages 1 and 2 stepped shadows of the parameters that started without the optimizer's states (momentum
    SGD: weights 1e-3 off); as Paddle shards the accumulators it has, the states carry over, and 2 steps before
    and 2 after train as one process that never stopped."""
    want_params, want_states = _dense_opt(kind)
    for rank, (params, states, held) in enumerate(run_ranks(_ranked_opt, 2, kind, stage, placed, timeout=50)):
        for n, want in want_params.items():
            torch.testing.assert_close(params[n], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"r{rank} {n}: {m}")
            for k, v in want_states[n].items():
                torch.testing.assert_close(torch.as_tensor(states[n][k]), v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"r{rank} {n} {k}: {m}")
        # the states the optimizer had are sharded along dp, as those it makes after (Paddle's accumulators)
        assert held and all(pl == "[S(0)]" for pl in held.values()), (rank, held)
