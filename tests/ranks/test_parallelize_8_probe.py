"""dist.parallelize on 8 ranks (dp x pp x mp, sequence parallel, tied weights, micro-batches) against one process."""

import numpy as np
import pytest
import torch

from meshviz import compat
from meshviz.testing import run_ranks
from tests.models import LlamaForCausalLM, llama_loss

MLP_TRANSPOSE = not compat.linear_keeps_split_batch_dims()


class Cfg:
    """A tiny Llama whose sizes the mp degree 8 divides."""

    vocab_size = 16
    hidden_size = 16
    num_heads = 8
    intermediate_size = 32
    num_layers = 2
    eps = 1e-6


def _batches(accum, steps=3, batch=4, seq=8):
    g = torch.Generator().manual_seed(5)
    return [[(torch.randint(0, 16, (batch, seq), generator=g), torch.randint(0, 16, (batch, seq), generator=g))
             for _ in range(accum)] for _ in range(steps)]


def _plan(sp: bool) -> dict:
    import meshviz.distributed as dist

    col, row = dist.ColWiseParallel, dist.RowWiseParallel
    plan = {r"llama\.layers\.\d+\.self_attn\.(q|k|v)_proj": col(), "llama.layers.*.self_attn.o_proj": row(),
            r"llama\.layers\.\d+\.mlp\.(gate|up)_proj": col(), "llama.layers.*.mlp.down_proj": row()}
    if sp:
        plan["llama.embed_tokens"] = [col(), dist.SequenceParallelBegin()]
        plan["llama.layers.*.self_attn"] = dist.SequenceParallelDisable()
        plan["llama.layers.*.mlp"] = dist.SequenceParallelDisable(need_transpose=MLP_TRANSPOSE)
        plan["lm_head"] = [col(gather_output=True), dist.SequenceParallelEnd()]
    else:
        plan["llama.embed_tokens"] = col(gather_output=True)
        plan["lm_head"] = col(gather_output=True)
    return plan


def _train(model, opt, case, place=lambda t, last: t, full=lambda t: t.detach().clone()):
    """3 SGD steps of ``accum`` micro-batches: the losses, then every parameter."""
    losses = []
    for micro in _batches(case.get("accum", 1)):
        total = 0.0
        for ids, labels in micro:
            loss = llama_loss(model(place(ids, False)), place(labels, True)) / len(micro)
            loss.backward()
            value = full(loss)
            total = total + (value.item() if value is not None else float("nan"))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: full(p) for n, p in model.named_parameters()}


def _dense(case):
    model = LlamaForCausalLM(Cfg, num_layers=case.get("layers", 2), tie=case.get("tie", False))
    return _train(model, torch.optim.SGD(model.parameters(), lr=0.5), case)


def _ranked(case):
    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    axes = case["axes"]
    mesh = dist.ProcessMesh(np.arange(8).reshape(case["shape"]).tolist(), dim_names=axes)
    model = LlamaForCausalLM(Cfg, num_layers=case.get("layers", 2), tie=case.get("tie", False))
    config = {}
    if "mp" in axes:
        config["mp_config"] = {"parallelize_plan": _plan(case.get("sp", False))}
    if "pp" in axes:
        config["pp_config"] = {"split_spec": "llama.layers"}
    dp_config = {"dp_config": {"sharding_level": case.get("level", 0)}} if "dp" in axes else {}
    if case.get("dp_later"):  # the model first, then a second call shards the optimizer along dp
        model, _ = dist.parallelize(model, None, mesh=mesh, config=config)
        for _ in range(case["dp_later"]):
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            model, opt = dist.parallelize(model, opt, mesh=mesh, config=dp_config)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = dist.parallelize(model, opt, mesh=mesh, config={**config, **dp_config})
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
        t = dist.unshard_dtensor(t).detach().clone()
        return t if t.numel() else None  # a rank off the tensor's stage holds nothing of it

    sink = trace.MemorySink()
    trace.add_sink(sink)
    try:
        model(place(_batches(1)[0][0][0], False))
    finally:
        trace.remove_sink(sink)
    moves = sorted((str(e.name), str(e.op)) for e in sink.events if e.kind == "reshard_step")
    return _train(model, opt, case, place, full), moves


def _check(name, case, res):
    ref_losses, ref_params = _dense(case)
    for rank, ((losses, params), _) in enumerate(res):
        if not np.isnan(losses[0]):
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"{name} rank {rank}")
        for pname, want in ref_params.items():
            if params[pname] is not None:
                torch.testing.assert_close(params[pname], want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{name} rank {rank} {pname}: {m}")
    for pname in ref_params:
        assert any(params[pname] is not None for (_, params), _ in res), f"{name}: no rank holds {pname}"


CASES = {
    "dp2_pp2_mp2_sp_level_3_tied_two_micro_batches": dict(shape=(2, 2, 2), axes=["dp", "pp", "mp"], sp=True,
                                                          level=3, tie=True, accum=2),
    "mp8_sequence_parallel_tied": dict(shape=(8,), axes=["mp"], sp=True, tie=True),
    "pp8_one_layer_a_stage_three_micro_batches": dict(shape=(8,), axes=["pp"], layers=8, tie=True, accum=2),
    "pp2_mp4_regex_keys": dict(shape=(2, 4), axes=["pp", "mp"], tie=True),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_8_ranks_train_as_one_process(name):
    case = CASES[name]
    _check(name, case, run_ranks(_ranked, 8, case, timeout=100, collective_timeout=40))


@pytest.mark.timeout(120)
def test_a_second_dp_call_moves_a_weight_tied_across_stages_once_a_forward():
    """Each parallelize with a dp_config only (a new optimizer) of a pipeline whose embedding is tied to the head
    on the other stage added another move of the tied weight to every forward (3 calls: 3 send_recv, not 1)."""
    base = dict(shape=(2, 4), axes=["pp", "dp"], tie=True, level=1)
    once = run_ranks(_ranked, 8, base, timeout=100, collective_timeout=40)
    thrice = run_ranks(_ranked, 8, {**base, "dp_later": 3}, timeout=100, collective_timeout=40)
    _check("dp_later", base, thrice)
    for rank, ((_, moves_once), (_, moves_thrice)) in enumerate(zip(once, thrice)):
        assert moves_thrice == moves_once, rank
        assert moves_once.count(("llama.embed_tokens.weight", "send_recv")) == 1, (rank, moves_once)


def _raise_in_the_tied_head():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh([0, 1], dim_names=["pp"])
    model = LlamaForCausalLM(Cfg, num_layers=2, tie=True)
    model, _ = dist.parallelize(model, None, mesh=mesh, config={"pp_config": {"split_spec": "llama.layers"}})
    origin = model.llama.embed_tokens.weight

    def broken(x):
        raise RuntimeError("head failed")

    model.lm_head.forward = broken
    ids = dist.shard_tensor(_batches(1)[0][0][0], mesh.get_mesh_with_dim("pp", 0), [dist.Replicate()])
    with pytest.raises(RuntimeError, match="head failed"):
        model(ids)
    return model.lm_head._parameters["weight"] is origin


def test_a_forward_that_raises_in_a_layer_sharing_a_weight_of_another_stage_gives_the_weight_back():
    """The tied head kept the copy resharded onto its stage (not the parameter) after its forward raised."""
    assert run_ranks(_raise_in_the_tied_head, 2, timeout=60) == [True, True]
