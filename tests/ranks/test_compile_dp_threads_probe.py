"""torch.compile over the thread backend's collectives (a compiled DataParallel, a compiled send/recv, a compiled
os_g model) on ranks as threads: the values are one process's."""

import pytest
import torch

from meshviz.testing import run_ranks

STEPS = 3


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _batch(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(4, 8, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _dense(world=2):
    """One process: the mean of every rank's loss at each step, its losses, last gradients and weights."""
    net = _net()
    opt = _sgd(net.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        ls = [net(_batch(r, step)).square().mean() for r in range(world)]
        (sum(ls) / world).backward()
        losses.append([v.item() for v in ls])
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    return losses, grads, [p.detach().clone() for p in net.parameters()]


def _compiled_data_parallel():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _net()
    if r == 1:  # the wrap makes every replica rank 0's
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    model = torch.compile(dist.DataParallel(net))
    opt = _sgd(net.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        loss = model(_batch(r, step)).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    return losses, grads, [p.detach().clone() for p in net.parameters()]


@pytest.mark.timeout(240)
def test_a_compiled_data_parallel_runs_and_averages_as_one_process():
    res = run_ranks(_compiled_data_parallel, 2, ranks="threads", timeout=180)
    losses, grads, weights = _dense()
    for r, (got_losses, got_grads, got_weights) in enumerate(res):
        assert got_losses == pytest.approx([ls[r] for ls in losses], rel=1e-5)
        for g, want in zip(got_grads, grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
        for w, want in zip(got_weights, weights):
            torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)


def _compiled_send_recv():
    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()

    @torch.compile
    def step(x):
        y = x * 2
        if r == 1:
            tdist.send(y, 0)
            return y
        buf = torch.empty_like(y)
        tdist.recv(buf, 1)  # rank 0 runs first: its receive waits for rank 1's send
        return buf + y

    return step(torch.arange(4.0) + 10 * r)


@pytest.mark.timeout(240)
def test_a_compiled_receive_waits_for_its_send():
    res = run_ranks(_compiled_send_recv, 2, ranks="threads", timeout=180)
    torch.testing.assert_close(res[0], (torch.arange(4.0) + 10) * 2 + torch.arange(4.0) * 2)
    torch.testing.assert_close(res[1], (torch.arange(4.0) + 10) * 2)


def _compiled_os_g():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _net()
    model, opt, _ = dist.sharding.group_sharded_parallel(net, _sgd(net.parameters()), "os_g", segment_size=1)
    compiled = torch.compile(model)
    losses = []
    for step in range(STEPS):
        loss = compiled(_batch(r, step)).square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.clear_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(240)
def test_a_compiled_os_g_model_steps_as_one_process():
    res = run_ranks(_compiled_os_g, 2, ranks="threads", timeout=180)
    losses, _, weights = _dense()
    for r, (got_losses, got_weights) in enumerate(res):
        assert got_losses == pytest.approx([ls[r] for ls in losses], rel=1e-5)
        for w, want in zip(got_weights, weights):
            torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)
