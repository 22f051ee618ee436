"""group_sharded_parallel and DataParallel in less common uses (the model's zero_grad, a copy of the model, unused
parameters), against single-process runs."""

import copy

import pytest
import torch

from meshviz.testing import run_ranks

from .test_data_parallel_probe import _batch, _loss, _Net

LEVELS = ("os", "os_g", "p_g_os")


def _sgd(params):  # momentum and decay: a parameter stepped on a zero gradient moves, one not stepped stays
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _close(got: dict, want: dict, who) -> None:
    assert got.keys() == want.keys(), who
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{who} {k}: {m}")


# -- the model's own zero_grad (torch's idiom) instead of the optimizer's -------------------------------------

def _zero_grad_plan(net, step, set_to_none, backward):
    """One step's backwards and zero_grads, ``backward(micro, use_b)`` running one backward."""
    if step == 0:
        backward(0, True)
    elif step == 1:  # a micro-batch dropped by zero_grad, then one that does not reach b
        backward(10, True)
        net.zero_grad(set_to_none=set_to_none)
        backward(11, False)
    elif step == 2:  # b alone cleared: a and c keep step 1's gradients and add this step's
        net.b.zero_grad(set_to_none=set_to_none)
        backward(20, True)
    else:  # no zero_grad before: step 2's gradients stay and this backward adds to them
        backward(30, True)


def _model_zero_grad(level, set_to_none):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(0)
    net = _Net()
    model, opt, _ = group_sharded_parallel(net, _sgd(net.parameters()), level, segment_size=8)
    states = []
    for step in range(4):
        _zero_grad_plan(net, step, set_to_none, lambda s, use_b: _loss(model, r, s, use_b=use_b).backward())
        opt.step()
        if step in (0, 1):
            net.zero_grad(set_to_none=set_to_none)
        states.append({k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()})
    return states


@pytest.mark.timeout(120)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("level", LEVELS)
def test_the_models_zero_grad_clears_the_sharded_gradients_as_in_one_process(level, set_to_none):
    """``model.zero_grad()`` (not the optimizer's) between steps, between two backwards of a step and on a
    sublayer alone, and steps with none before them (gradients accumulate): the weights of one process. At os_g
    the gradients' reduced parts used to stay and add to the next step's."""
    res = run_ranks(_model_zero_grad, 2, level, set_to_none, timeout=100)
    torch.manual_seed(0)
    net = _Net()
    opt = _sgd(net.parameters())

    def backward(s, use_b):
        sum(_loss(net, r, s, use_b=use_b) for r in range(2)).div(2).backward()

    for step in range(4):
        _zero_grad_plan(net, step, set_to_none, backward)
        opt.step()
        if step in (0, 1):
            net.zero_grad(set_to_none=set_to_none)
        for r in range(2):
            _close(res[r][step], net.state_dict(), (level, set_to_none, r, step))



# -- a copy of the sharded model (an EMA copy, say) ------------------------------------------------------------

def _deepcopy(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(0)
    net = _Net()
    model, opt, _ = group_sharded_parallel(net, _sgd(net.parameters()), level, segment_size=8, sync_buffers=True)

    def state(m):
        return {k: full_tensor(v).detach().clone() for k, v in m.state_dict().items()}

    _loss(model, r, 0).backward()
    opt.step()
    opt.clear_grad()
    ema = copy.deepcopy(model)
    x, _ = _batch(0, 9)
    with torch.no_grad():
        same = float((ema(x) - model(x)).abs().max())
    copied = state(ema)
    _loss(model, r, 1).backward()  # the original trains on; the copy stays as it was
    opt.step()
    ema.zero_grad()
    return same, copied, state(ema), state(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["os", "os_g"])
def test_a_deep_copy_of_the_sharded_model_is_a_plain_copy(level):
    """``copy.deepcopy(model)`` used to raise (at os, and with sync_buffers at every level): the model's forward
    hooks are bound to the sharded optimizer, whose process groups cannot be copied. (At p_g_os torch's FSDP2
    refuses it itself, pointing to the state dict, but where every parameter is under segment_size.)"""
    res = run_ranks(_deepcopy, 2, level, timeout=100)
    torch.manual_seed(0)
    net = _Net()
    opt = _sgd(net.parameters())
    sum(_loss(net, r, 0) for r in range(2)).div(2).backward()
    opt.step()
    opt.zero_grad()
    after_one = {k: v.clone() for k, v in net.state_dict().items()}
    sum(_loss(net, r, 1) for r in range(2)).div(2).backward()
    opt.step()
    for r, (same, copied, later, trained) in enumerate(res):
        assert same == 0.0
        _close(copied, after_one, (level, r, "copy"))
        _close(later, after_one, (level, r, "copy after a step of the original"))
        _close(trained, net.state_dict(), (level, r, "original"))



# -- save_group_sharded_model without the optimizer, two sharding groups --------------------------------------

def _save_two_groups(level, root):
    import os

    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel, save_group_sharded_model

    dist.init_parallel_env()
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(r // 2)  # each group its own model
    net = _Net()
    model, opt, _ = group_sharded_parallel(net, _sgd(net.parameters()), level, group=groups[r // 2], segment_size=8)
    _loss(model, r, 0).backward()
    opt.step()
    save_group_sharded_model(model, os.path.join(root, f"group{r // 2}"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", LEVELS)
def test_save_group_sharded_model_without_the_optimizer_writes_each_groups_model(level, tmp_path):
    """Two sharding groups ([0, 1] and [2, 3]) each save their model to a directory of their own, without passing
    the optimizer: each directory holds its group's model (Paddle writes on every rank). Only the world's first
    rank used to write, so group [2, 3]'s model was not saved at all."""
    run_ranks(_save_two_groups, 4, level, str(tmp_path), timeout=100)
    for k in range(2):
        torch.manual_seed(k)
        net = _Net()
        opt = _sgd(net.parameters())
        sum(_loss(net, r, 0) for r in (2 * k, 2 * k + 1)).div(2).backward()
        opt.step()
        saved = torch.load(tmp_path / f"group{k}" / "model.pdmodel")
        _close(saved, net.state_dict(), (level, k))


# -- DataParallel without find_unused_parameters, a parameter the loss does not use ---------------------------

_USE_B = {  # (rank, step) -> whether the forward uses b
    "on rank 0 only": lambda r, s: r == 0,
    "on no rank": lambda r, s: False,
    "every step": lambda r, s: True,
    "not at step 2": lambda r, s: s != 2,
}


def _dp_unused(plan):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)  # every rank its own initial values: the wrap makes them rank 0's
    net = _Net()
    dp = dist.DataParallel(net, find_unused_parameters=False)
    opt = _sgd(net.parameters())
    states = []
    for step in range(3):
        try:
            _loss(dp, r, step, use_b=_USE_B[plan](r, step)).backward()
        except RuntimeError as e:
            return states, str(e)
        states.append({k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        states[-1].update({k: v.detach().clone() for k, v in net.state_dict().items()})
    return states, None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", list(_USE_B))
def test_data_parallel_without_find_unused_parameters_trains_a_model_with_an_unused_parameter(plan):
    """Paddle 3.3.1 (2 ranks, gloo) searches the graph once, at the first step: b unused on every rank keeps no
    gradient; b unused on rank 1 alone gets rank 0's gradient halved on rank 0 and none on rank 1, which does not
    step it, so the replicas drift apart; b used at the first step and not later leaves the gradients unaveraged,
    then raises at the next forward. Here every plan trains as one process: DDP searches at every step where the
    first synced forward left a parameter unused on some rank; where it used every one, a rank that leaves one out
    later sends zeros for it at the end of its backward, and one no rank used keeps no gradient."""
    res = run_ranks(_dp_unused, 2, plan, timeout=100)
    torch.manual_seed(0)
    net = _Net()
    opt = _sgd(net.parameters())
    for step in range(3):
        use = [_USE_B[plan](r, step) for r in range(2)]
        sum(_loss(net, r, step, use_b=use[r]) for r in range(2)).div(2).backward()
        want = {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}
        assert (want["b.weight"] is None) == (not any(use))
        opt.step()
        opt.zero_grad()
        want.update(net.state_dict())
        for r, (states, _) in enumerate(res):
            got = states[step]
            assert got.keys() == want.keys()
            for k, v in want.items():
                if v is None:
                    assert got[k] is None, (plan, r, step, k)
                else:
                    torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{r} {step} {k}: {m}")
    assert [err for _, err in res] == [None, None]


def _dp_unused_after_no_sync():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    net = _Net()
    dp = dist.DataParallel(net, find_unused_parameters=False)
    with dp.no_sync():
        _loss(dp, r, 0).backward()
    _loss(dp, r, 1, use_b=False).backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}


@pytest.mark.timeout(60)
def test_data_parallel_averages_a_parameter_the_first_synced_step_leaves_unused_after_no_sync():
    """b used inside no_sync() and not in the first synced step: a reducer built then would not know the no_sync
    backwards used it, so none is built; the end of the backward sends b's accumulated gradient, averaged as one
    process (the forward used to raise on every rank)."""
    res = run_ranks(_dp_unused_after_no_sync, 2, timeout=50)
    torch.manual_seed(0)
    net = _Net()
    sum(_loss(net, r, 0) + _loss(net, r, 1, use_b=False) for r in range(2)).div(2).backward()
    for r in range(2):
        for k, p in net.named_parameters():
            torch.testing.assert_close(res[r][k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{r} {k}: {m}")
