"""torch.compile on ranks as threads: one rank compiling (holding torch.compile's lock) keeps the baton while it
waits on its compiler's subprocesses, so the other ranks never block on that lock holding it; the values are one
process's."""

import pytest
import torch

from meshviz.testing import run_ranks


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _batch(r):
    g = torch.Generator().manual_seed(r)
    return torch.randn(4, 8, generator=g)


def _compiled_step():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    net = _net()
    loss = torch.compile(net)(_batch(r)).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return float(loss), grads


@pytest.mark.timeout(240)
def test_every_rank_thread_compiles_and_gets_one_processs_values():
    res = run_ranks(_compiled_step, 2, ranks="threads", timeout=180)
    net = _net()
    losses = [net(_batch(r)).square().mean() for r in range(2)]
    (sum(losses) / 2).backward()
    for r, (loss, grads) in enumerate(res):
        assert loss == pytest.approx(float(losses[r]), rel=1e-5)
        for g, p in zip(grads, net.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
