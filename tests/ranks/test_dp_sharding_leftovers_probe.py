"""DataParallel with a parameter one rank reaches outside the wrapped forward, and group_sharded os_g with gradients
dropped by hand, against single-process runs."""

import time

import pytest
import torch

from meshviz.testing import run_ranks

from .test_data_parallel_probe import _loss, _Net


def _sgd(params):  # momentum and decay: a parameter stepped on a stale or zero gradient moves away from the dense one
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


# -- DataParallel: a parameter one rank leaves out of the wrapped forward at one step, but still uses ------------

def _dp_unused_later(outside):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    net = _Net()
    dp = dist.DataParallel(net)
    opt = _sgd(net.parameters())
    states = []
    for step in range(3):
        use_b = not (step == 1 and r == 1)
        loss = _loss(dp, r, step, use_b=use_b)
        if outside and not use_b:  # b reaches this rank's loss outside the wrapped forward: its gradient comes
            loss = loss + net.b.weight.square().sum() + net.b.bias.sum()
        t = time.monotonic()
        try:
            loss.backward()
        except RuntimeError as e:
            took = time.monotonic() - t
            t = torch.tensor([float(r)])
            dist.all_reduce(t)  # the group still works: no rank was left inside a gradient all-reduce
            return states, str(e), took, float(t)
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return states, None, None, None


@pytest.mark.timeout(60)
def test_a_parameter_used_only_outside_the_wrapped_forward_on_one_rank_trains_as_one_process():
    """b left out of rank 1's forward at step 1 but in its loss by another path: its gradient comes, nothing
    waits, and the weights are those of one process."""
    res = run_ranks(_dp_unused_later, 2, True, timeout=50)
    torch.manual_seed(0)
    net = _Net()
    opt = _sgd(net.parameters())
    for step in range(3):
        losses = []
        for r in range(2):
            loss = _loss(net, r, step, use_b=not (step == 1 and r == 1))
            if step == 1 and r == 1:
                loss = loss + net.b.weight.square().sum() + net.b.bias.sum()
            losses.append(loss)
        sum(losses).div(2).backward()
        opt.step()
        opt.zero_grad()
        for r, (states, err, _, _) in enumerate(res):
            assert err is None, err
            for k, v in net.state_dict().items():
                torch.testing.assert_close(states[step][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{r} {k}: {m}")


# -- group_sharded os_g: p.grad = None by hand -----------------------------------------------------------------

def _drop_by_hand(net, step):
    if step == 0:  # every gradient dropped by hand after the step (torch's zero_grad(set_to_none=True), spelt out)
        for p in net.parameters():
            p.grad = None
    elif step == 1:  # b.weight alone: the others add step 2's gradients to step 1's
        net.b.weight.grad = None
    elif step == 2:  # between two backwards: the first one's gradient of c.weight does not count
        del net.c.weight.grad
    elif step == 3:  # replaced by zeros: the next backward adds to them alone
        net.a.bias.grad = torch.zeros_like(net.a.bias)


def _os_g_by_hand(level):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.runtime.devices import full_tensor

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(0)
    net = _Net()
    model, opt, _ = group_sharded_parallel(net, _sgd(net.parameters()), level, segment_size=8)
    out = []
    for step in range(5):
        _loss(model, r, step).backward()
        if step == 2:
            _drop_by_hand(net, step)
            _loss(model, r, 20).backward()
        opt.step()
        if step != 2:
            _drop_by_hand(net, step)
        out.append({k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()})
    return out, type(net.a.weight).__name__, isinstance(net.a.weight, torch.nn.Parameter)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["os", "os_g", "p_g_os"])
def test_gradients_set_to_none_by_hand_are_dropped_as_in_one_process(level):
    """``p.grad = None`` (and ``del p.grad``, ``p.grad = zeros``) by hand, for every parameter, for one, and between
    two backwards of a step, SGD with momentum: the weights of one process. At os_g the gradients' reduced parts
    used to stay and add to the next step's (step 1 off by up to 0.08)."""
    res = run_ranks(_os_g_by_hand, 2, level, timeout=100)
    torch.manual_seed(0)
    net = _Net()
    opt = _sgd(net.parameters())
    for step in range(5):
        sum(_loss(net, r, step) for r in range(2)).div(2).backward()
        if step == 2:
            _drop_by_hand(net, step)
            sum(_loss(net, r, 20) for r in range(2)).div(2).backward()
        opt.step()
        if step != 2:
            _drop_by_hand(net, step)
        for r, (states, name, is_param) in enumerate(res):
            assert name == ("DTensor" if level == "p_g_os" else "Parameter") and is_param
            for k, v in net.state_dict().items():
                torch.testing.assert_close(states[step][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{level} {r} {step} {k}: {m}")
