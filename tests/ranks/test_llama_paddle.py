"""Paddle's Llama loss (masked_select) and global-norm clipping train under dist.parallelize like one process."""

import numpy as np
import pytest
import torch

from meshviz import compat
from meshviz.testing import run_ranks
from tests.models import LlamaForCausalLM, LlamaPretrainingCriterion, llama_batches_with_ignored

STEPS = 3
CLIP_NORM = 0.5  # below the tiny Llama's gradient norm at every step, so the clipping acts
MLP_TRANSPOSE = not compat.linear_keeps_split_batch_dims()


def _optimizer(name, params):
    return torch.optim.AdamW(params, lr=0.01) if name == "adamw" else torch.optim.SGD(params, lr=0.5)


def _plan(sp: bool) -> dict:
    """Paddle's Llama plan (test/auto_parallel/hybrid_strategy/parallel_api.py), with or without sequence parallel."""
    import meshviz.distributed as dist

    plan = {f"llama.layers.*.{name}": dist.ColWiseParallel()
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    plan["llama.layers.*.self_attn.o_proj"] = dist.RowWiseParallel()
    plan["llama.layers.*.mlp.down_proj"] = dist.RowWiseParallel()
    if sp:
        plan["llama.embed_tokens"] = [dist.ColWiseParallel(), dist.SequenceParallelBegin()]
        plan["llama.layers.*.self_attn"] = dist.SequenceParallelDisable()
        plan["llama.layers.*.mlp"] = dist.SequenceParallelDisable(need_transpose=MLP_TRANSPOSE)
        plan["lm_head"] = [dist.ColWiseParallel(gather_output=True), dist.SequenceParallelEnd()]
    else:
        plan["llama.embed_tokens"] = dist.ColWiseParallel(gather_output=True)
        plan["lm_head"] = dist.ColWiseParallel(gather_output=True)
    return plan


def _clip_(params, clip_norm) -> float:
    """Paddle's ClipGradByGlobalNorm in plain torch: scale by clip_norm / max(global norm, clip_norm)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    for g in grads:
        g.mul_(clip_norm / max(norm, clip_norm))
    return norm


def _reference(opt_name):
    """The same model, loss, clipping and optimizer in one process: losses, norms, clipped grads, final params."""
    model = LlamaForCausalLM()
    opt = _optimizer(opt_name, model.parameters())
    criterion = LlamaPretrainingCriterion()
    out = {"losses": [], "norms": [], "grads": []}
    for ids, labels in llama_batches_with_ignored(STEPS):
        loss = criterion(model(ids), labels)
        loss.backward()
        out["norms"].append(_clip_(model.parameters(), CLIP_NORM))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _train(case):
    import meshviz.distributed as dist
    from meshviz.nn import ClipGradByGlobalNorm

    mesh = dist.ProcessMesh(case["mesh"], dim_names=case["axes"])
    dist.auto_parallel.set_mesh(None)
    model = LlamaForCausalLM()
    config = {"mp_config": {"parallelize_plan": _plan(case["sp"])}}
    if "dp" in case["axes"]:
        config["dp_config"] = {"sharding_level": 0}
    opt = _optimizer(case["opt"], model.parameters())
    criterion, clip = LlamaPretrainingCriterion(), ClipGradByGlobalNorm(CLIP_NORM)
    if case["clip"] == "optimizer":
        opt._grad_clip = clip  # Paddle's AdamW(..., grad_clip=clip): the step clips
    model, opt = dist.parallelize(model, opt, mesh=mesh, config=config)
    out = {"losses": [], "norms": [], "grads": []}
    for ids, labels in llama_batches_with_ignored(STEPS):
        if "dp" in case["axes"]:
            pl = [dist.Shard(0), dist.Replicate()]
            ids, labels = dist.shard_tensor(ids, mesh, pl), dist.shard_tensor(labels, mesh, pl)
        loss = criterion(model(ids), labels)
        loss.backward()
        if case["clip"] == "call":
            out["norms"].append(float(clip(model.parameters())))
        else:
            opt.step()  # the gradients it leaves are the clipped ones
        out["grads"].append({n: dist.unshard_dtensor(p.grad).detach().clone() for n, p in model.named_parameters()})
        if case["clip"] == "call":
            opt.step()
        opt.clear_grad(set_to_zero=False)
        out["losses"].append(dist.unshard_dtensor(loss).item())
    out["params"] = {n: dist.unshard_dtensor(p).detach().clone() for n, p in model.named_parameters()}
    return out


def run_cases(cases):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    return [_train(case) for case in cases]


def _zero_in_exact_arithmetic(ref, name) -> bool:
    """k_proj's bias: softmax ignores a shift shared by all keys, so its gradient is rounding noise (~1e-10), which
    Adam (eps 1e-8) turns into updates of lr's size; its clipped gradient is still compared."""
    return all(g[name].abs().max() < 1e-8 for g in ref["grads"])


def _check(case, per_rank, ref):
    assert min(ref["norms"]) > CLIP_NORM, f"clipping never acted: norms {ref['norms']}"
    for r, out in enumerate(per_rank):
        what = f"{case} rank {r}"
        np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5, err_msg=f"{what} losses")
        if case["clip"] == "call":
            np.testing.assert_allclose(out["norms"], ref["norms"], rtol=1e-5, err_msg=f"{what} global norms")
        for step in range(STEPS):
            assert set(out["grads"][step]) == set(ref["grads"][step])
            for name, g in out["grads"][step].items():
                torch.testing.assert_close(g, ref["grads"][step][name], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{what} step {step} {name} clipped grad: {m}")
        for name, p in out["params"].items():
            if case["opt"] == "adamw" and _zero_in_exact_arithmetic(ref, name):
                continue
            torch.testing.assert_close(p, ref["params"][name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{what} {name} after {STEPS} steps: {m}")


# clip "optimizer": the optimizer's grad_clip, as Paddle's Llama tests pass it; "call": clip(parameters) before step()
CASES_2 = [{"mesh": [0, 1], "axes": ["mp"], "sp": sp, "opt": opt, "clip": clip}
           for sp in (False, True) for opt, clip in (("adamw", "optimizer"), ("sgd", "call"))]


@pytest.mark.timeout(300)
def test_paddle_llama_loss_and_clipping_mp2_sp_off_and_on_match_one_process():
    res = run_ranks(run_cases, 2, CASES_2, timeout=280, collective_timeout=60, ranks="threads")
    for i, case in enumerate(CASES_2):
        _check(case, [r[i] for r in res], _reference(case["opt"]))


CASES_4 = [{"mesh": [[0, 1], [2, 3]], "axes": ["dp", "mp"], "sp": sp, "opt": "adamw", "clip": clip}
           for sp, clip in ((False, "optimizer"), (True, "optimizer"), (True, "call"))]


@pytest.mark.timeout(300)
def test_paddle_llama_loss_and_clipping_dp2_mp2_match_one_process():
    res = run_ranks(run_cases, 4, CASES_4, timeout=280, collective_timeout=60, ranks="threads")
    for i, case in enumerate(CASES_4):
        _check(case, [r[i] for r in res], _reference(case["opt"]))
