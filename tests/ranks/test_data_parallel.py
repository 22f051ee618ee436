"""DataParallel and fused_allreduce_gradients (seed 000) against single-process runs."""

import os

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

from ..models import LinearNet, SimpleNet

W = 2


def _batches(steps, rank, n=10, d=10):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)) for _ in range(steps)]


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _dp_cases(tmpdir):
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}

    # 1. seed 000 training: different init per rank -> rank 0's after wrapping; Adam on per-rank batches
    torch.manual_seed(r)
    layer = LinearNet()
    with trace.record() as mem:
        dp = dist.DataParallel(layer)
        out["init"] = _params(dp)
        adam = torch.optim.Adam(dp.parameters(), lr=0.01)
        losses = []
        for x, y in _batches(5, r):
            loss = nn.functional.mse_loss(dp(x), y)
            loss.backward()
            adam.step()
            adam.zero_grad()
            losses.append(loss.item())
    out["trained"] = _params(dp)
    out["losses"] = losses
    out["events"] = [(e.op, e.group, e.bytes, e.name) for e in mem.of_kind("collective")]
    out["passthrough"] = (dp._linear1 is layer._linear1, dp._layers is layer,
                          sorted(dp.state_dict()) == sorted(layer.state_dict()))

    # 2. state_dict round trip (keys without prefix; module./_layers. prefixes accepted)
    path = os.path.join(tmpdir, f"dp{r}.pt")
    torch.save(dp.state_dict(), path)
    torch.manual_seed(1000 + r)
    dp2 = dist.DataParallel(LinearNet())
    dp2.set_state_dict(torch.load(path))
    out["roundtrip"] = all(torch.equal(a, b) for a, b in zip(dp2.state_dict().values(), dp.state_dict().values()))
    dp3 = dist.DataParallel(LinearNet())
    dp3.load_dict({"module." + k: v for k, v in dp.state_dict().items()})
    out["roundtrip_prefixed"] = all(torch.equal(a, b) for a, b in zip(dp3.state_dict().values(),
                                                                      dp.state_dict().values()))

    # 3. no_sync: accumulate locally, the next synced backward averages the accumulated sum
    torch.manual_seed(7)
    m = LinearNet()
    dpn = dist.DataParallel(m)
    g = torch.Generator().manual_seed(300 + r)
    x1, x2 = torch.randn(10, 10, generator=g), torch.ones(10, 10) * (r + 1)
    with dpn.no_sync():
        dpn(x1).sum().backward()
    out["no_sync_local"] = {k: p.grad.clone() for k, p in m.named_parameters()}
    dpn(x2).sum().backward()
    out["no_sync_synced"] = {k: p.grad.clone() for k, p in m.named_parameters()}

    # 4. PyLayer + no_sync + fused_allreduce_gradients, SGD 10 steps
    torch.manual_seed(11)
    net = dist.DataParallel(SimpleNet())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(500 + r)
    with trace.record() as mem:
        for _ in range(10):
            x = torch.randn(2, 2, generator=g, requires_grad=True)
            with net.no_sync():
                net(x).mean().backward()
            fused_allreduce_gradients(list(net.parameters()), None)
            opt.step()
            opt.zero_grad()
    out["pylayer"] = _params(net)
    out["fused_events"] = [(e.op, e.group, e.bytes) for e in mem.of_kind("collective")]

    # 5. bucket sizes reach DDP
    big = dist.DataParallel(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), comm_buffer_size=0.3,
                            last_comm_buffer_size=0.1)
    out["buckets"] = (big._ddp.bucket_bytes_cap, list(big._ddp.bucket_bytes_cap_list))
    errs = []
    for kw in ({"comm_buffer_size": 0}, {"last_comm_buffer_size": -1}):
        try:
            dist.DataParallel(LinearNet(), **kw)
        except ValueError as e:
            errs.append(str(e))
    out["errs"] = errs
    return out


@pytest.mark.timeout(120)
def test_data_parallel_matches_single_process(tmp_path):
    res = run_ranks(_dp_cases, W, str(tmp_path))
    # 1. wrap-time broadcast from rank 0, then training equal to one process on the concatenated batch
    torch.manual_seed(0)
    ref = LinearNet()
    for k, v in ref.state_dict().items():
        for r in range(W):
            torch.testing.assert_close(res[r]["init"][k], v, rtol=0, atol=0)
    adam = torch.optim.Adam(ref.parameters(), lr=0.01)
    per_rank = [_batches(5, r) for r in range(W)]
    for step in range(5):
        x = torch.cat([per_rank[r][step][0] for r in range(W)])
        y = torch.cat([per_rank[r][step][1] for r in range(W)])
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        adam.step()
        adam.zero_grad()
        # each rank's loss is its half's loss; their mean is the full batch's
        torch.testing.assert_close(sum(res[r]["losses"][step] for r in range(W)) / W, loss.item())
    for k, v in ref.state_dict().items():
        for r in range(W):
            torch.testing.assert_close(res[r]["trained"][k], v, rtol=1e-5, atol=1e-6)
    for r in range(W):
        assert res[r]["passthrough"] == (True, True, True)
        assert res[r]["roundtrip"] and res[r]["roundtrip_prefixed"]
        ops = [e[0] for e in res[r]["events"]]
        assert ops[0] == "broadcast" and ops.count("all_reduce") >= 5
        assert all(e[1] == [0, 1] for e in res[r]["events"])
        # one gradient bucket (all 121 float params fit in the first 1 MB bucket) per step; a rank receives one
        # chunk of 61 floats twice (the ring's reduce-scatter and all-gather)
        assert [e[2] for e in res[r]["events"] if e[0] == "all_reduce"][:5] == [2 * 61 * 4] * 5

    # 3. no_sync: synced grad = mean over ranks of (local no_sync grad + second backward's grad)
    torch.manual_seed(7)
    m = LinearNet()
    for k, _ in m.named_parameters():
        expect = 0
        for r in range(W):
            m.zero_grad()
            m(torch.ones(10, 10) * (r + 1)).sum().backward()
            expect = expect + res[r]["no_sync_local"][k] + dict(m.named_parameters())[k].grad
        expect = expect / W
        for r in range(W):
            torch.testing.assert_close(res[r]["no_sync_synced"][k], expect)
    # the local grads really differ between ranks (else the check above proves nothing)
    assert not torch.allclose(res[0]["no_sync_local"]["_linear1.weight"], res[1]["no_sync_local"]["_linear1.weight"])

    # 4. PyLayer + fused_allreduce_gradients == SGD on the mean of the per-rank losses
    torch.manual_seed(11)
    net = SimpleNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gens = [torch.Generator().manual_seed(500 + r) for r in range(W)]
    for _ in range(10):
        xs = [torch.randn(2, 2, generator=gens[r], requires_grad=True) for r in range(W)]
        (sum(net(x).mean() for x in xs) / W).backward()
        opt.step()
        opt.zero_grad()
    for k, v in net.state_dict().items():
        for r in range(W):
            torch.testing.assert_close(res[r]["pylayer"][k], v, rtol=1e-5, atol=1e-6)
    fused = res[0]["fused_events"]
    # one buffer: the 6 gradient values and one flag per parameter (whether the rank had its gradient)
    assert len(fused) == 10 and all(e == ("all_reduce", [0, 1], (6 + 2) * 4) for e in fused)

    MB = 1024 * 1024
    assert res[0]["buckets"] == (int(0.3 * MB), [int(0.1 * MB), int(0.3 * MB)])
    assert len(res[0]["errs"]) == 2 and all("positive" in e for e in res[0]["errs"])


class _Own(nn.Module):
    """A parameter of its own beside a sublayer (Paddle's include_sublayers)."""

    def __init__(self):
        super().__init__()
        self.own = nn.Parameter(torch.zeros(2))
        self.sub = nn.Linear(2, 3)


def _state_dict_as_paddle():
    import warnings

    import meshviz.distributed as dist

    dist.init_parallel_env()
    dp = dist.DataParallel(_Own())
    out = {"own_only": list(dp.state_dict(include_sublayers=False)), "all": list(dp.state_dict())}
    weight = dp.sub.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["returned"] = dp.set_state_dict({"own": torch.tensor([1.0, 2.0]), "sub.bias": torch.ones(7),
                                             "extra": torch.ones(1)})
    out["warned"] = [str(w.message) for w in caught]
    out["loaded"] = (dp.own.detach().clone(), torch.equal(dp.sub.weight, weight), dp.sub.bias.detach().clone())
    return out


@pytest.mark.timeout(60)
def test_state_dict_and_set_state_dict_as_paddle():
    """include_sublayers=False: the layer's own entries; set_state_dict loads what matches, warns for and skips a
    missing key or another shape, and returns (missing_keys, unexpected_keys), as Paddle's Layer."""
    for out in run_ranks(_state_dict_as_paddle, W, timeout=50):
        assert out["own_only"] == ["own"] and out["all"] == ["own", "sub.weight", "sub.bias"]
        assert out["returned"] == (["sub.weight", "sub.bias"], ["sub.bias", "extra"])
        assert out["warned"] == ["Skip loading for sub.weight. sub.weight is not found in the provided dict.",
                                 "Skip loading for sub.bias. sub.bias receives a shape [7], but the expected shape "
                                 "is [3]."]
        own, weight_kept, bias = out["loaded"]
        assert own.tolist() == [1.0, 2.0] and weight_kept and bias.shape == (3,)
        assert not torch.equal(bias, torch.ones(3))
