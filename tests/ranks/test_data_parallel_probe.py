"""DataParallel, sync_params_buffers and fused_allreduce_gradients in less common uses, against single-process runs."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

LR = 0.1


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 1)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + self.b(h)
        return self.c(h)


def _batch(rank, step, n=3):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _loss(model, rank, step, **kw):
    x, y = _batch(rank, step)
    return nn.functional.mse_loss(model(x, **kw), y)


def _grads(m) -> dict:
    return {k: None if p.grad is None else p.grad.detach().clone() for k, p in m.named_parameters()}


def _state(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _close(got: dict, want: dict, who) -> None:
    assert got.keys() == want.keys(), who
    for k, v in want.items():
        if v is None:
            assert got[k] is None, (who, k)
        else:
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=(who, k))


def _start():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)  # every rank its own initial values: the wrap makes them rank 0's
    return dist, r


# -- a layer frozen and unfrozen after the wrap, also inside no_sync -------------------------------------------

def _freeze_plan(step, net):
    if step == 1:
        net.b.weight.requires_grad_(False)
    if step == 3:
        net.b.weight.requires_grad_(True)


def _frozen_after_wrap():
    dist, r = _start()
    net = _Net()
    dp = dist.DataParallel(net)
    opt = torch.optim.SGD(dp.parameters(), lr=LR)
    grads = []
    for step in range(4):
        _freeze_plan(step, net)
        if step == 1:  # the reducer is built again at a forward inside no_sync: that backward stays local
            with dp.no_sync():
                _loss(dp, r, 10 * step).backward()
            _loss(dp, r, 10 * step + 1).backward()
        else:
            _loss(dp, r, 10 * step).backward()
        grads.append(_grads(net))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, _state(net)


@pytest.mark.timeout(60)
def test_a_parameter_frozen_after_the_wrap_keeps_no_gradient_and_the_rest_are_averaged():
    """Paddle 3.3.1 (2 ranks): ``b.weight.stop_gradient = True`` after the wrap leaves b.weight's gradient None and
    averages the others. DDP keeps waiting for it (unaveraged gradients, then an error at the next forward)."""
    res = run_ranks(_frozen_after_wrap, 2, timeout=50)
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(4):
        _freeze_plan(step, net)
        micro = (10 * step, 10 * step + 1) if step == 1 else (10 * step,)
        sum(_loss(net, r, s) for s in micro for r in range(2)).div(2).backward()
        want = _grads(net)
        assert (want["b.weight"] is None) == (step in (1, 2))
        for r in range(2):
            _close(res[r][0][step], want, (r, step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in range(2):
        _close(res[r][1], _state(net), r)


# -- parameters marked no_sync, non-persistent buffers --------------------------------------------------------

def _with_buffers(r):
    net = _Net()
    net.register_buffer("kept", torch.full((2,), float(r)), persistent=False)
    net.register_buffer("synced", torch.full((2,), float(r)))
    return net


def _marked_no_sync():
    dist, r = _start()
    net = _with_buffers(r)
    net.a.weight.no_sync = True
    own = net.a.weight.detach().clone()
    dp = dist.DataParallel(net)
    wrapped = _state(net)
    _loss(dp, r, 0).backward()
    return own, wrapped, net.kept.clone(), _grads(net)


@pytest.mark.timeout(60)
def test_a_parameter_marked_no_sync_and_a_non_persistent_buffer_stay_the_ranks_own():
    """Paddle 3.3.1 (2 ranks): a parameter with ``no_sync = True`` is neither broadcast at the wrap nor averaged
    (``init_reducer`` filters it out, ``sync_params_buffers`` skips it) and a non-persistent buffer is not
    broadcast (``_obtain_parameters_buffers`` leaves it out); a persistent one is."""
    res = run_ranks(_marked_no_sync, 2, timeout=50)
    torch.manual_seed(0)
    first = _Net()
    local = []
    for r in range(2):  # rank r's model after the wrap: rank 0's values but for its own a.weight
        m = _Net()
        m.load_state_dict(first.state_dict())
        with torch.no_grad():
            m.a.weight.copy_(res[r][0])
        _loss(m, r, 0).backward()
        local.append(_grads(m))
    for r in range(2):
        own, wrapped, kept, grads = res[r]
        assert torch.equal(wrapped["a.weight"], own)
        for k, v in first.state_dict().items():
            if k != "a.weight":
                assert torch.equal(wrapped[k], v), (r, k)
        assert wrapped["synced"].tolist() == [0.0, 0.0] and kept.tolist() == [float(r)] * 2
        torch.testing.assert_close(grads["a.weight"], local[r]["a.weight"])
        for k in grads:
            if k != "a.weight":
                torch.testing.assert_close(grads[k], (local[0][k] + local[1][k]) / 2, msg=(r, k))
    assert not torch.allclose(res[0][3]["a.weight"], res[1][3]["a.weight"])


def _sync_params():
    dist, r = _start()
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import broadcast_dp_parameters
    from meshviz.distributed.parallel import sync_params_buffers

    out = {}
    try:
        sync_params_buffers([torch.ones(2)])
    except TypeError as e:
        out["err"] = str(e)
    net = _with_buffers(r)
    net.b.weight.no_sync = True
    net.c.weight.no_sync = net.c.weight.expert = True
    out["own"] = _state(net)
    sync_params_buffers(net, comm_group=None, fuse_params=False)
    out["plain"] = _state(net)
    sync_params_buffers(net, None, 0, False, True, is_moe_sharding_parallel=True)
    out["moe"] = _state(net)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    torch.manual_seed(10 + r)
    other = _Net()
    broadcast_dp_parameters(other, fleet.get_hybrid_communicate_group(), fuse_params=False)
    out["dp"] = _state(other)
    return out


@pytest.mark.timeout(60)
def test_sync_params_buffers_takes_paddles_arguments_and_skips_what_paddle_skips():
    """Paddle's signature ``sync_params_buffers(model, comm_group, src_rank, is_model_parallel, fuse_params,
    is_moe_sharding_parallel)``: ``no_sync`` parameters are skipped (``expert`` ones too but with
    is_moe_sharding_parallel), non-persistent buffers are skipped."""
    res = run_ranks(_sync_params, 2, timeout=50)
    for r in range(2):
        assert res[r]["err"] == "sync_params_buffers: model must be an nn.Module, got list"
        own, plain, moe = res[r]["own"], res[r]["plain"], res[r]["moe"]
        for k in own:
            want = own[k] if k in ("b.weight", "c.weight") else res[0]["own"][k]
            assert torch.equal(plain[k], want), (r, k)
            want = own[k] if k == "b.weight" else res[0]["own"][k]
            assert torch.equal(moe[k], want), (r, k)
        torch.manual_seed(10)
        _close(res[r]["dp"], _state(_Net()), r)
    assert not torch.equal(res[0]["own"]["b.weight"], res[1]["own"]["b.weight"])


# -- fused_allreduce_gradients skips what does not require a gradient --------------------------------------------

def _fused_frozen():
    dist, r = _start()
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    torch.manual_seed(0)
    net = _Net()
    _loss(net, r, 0).backward()
    net.b.weight.requires_grad_(False)
    fused_allreduce_gradients(list(net.parameters()), None)
    return _grads(net)


@pytest.mark.timeout(60)
def test_fused_allreduce_gradients_leaves_a_frozen_parameters_gradient_alone():
    """Paddle 3.3.1 (2 ranks): ``_apply_collective_grads_eager`` reduces only ``param.trainable`` gradients; a
    parameter frozen after its backward keeps the rank's own gradient."""
    res = run_ranks(_fused_frozen, 2, timeout=50)
    local = []
    for r in range(2):
        torch.manual_seed(0)
        m = _Net()
        _loss(m, r, 0).backward()
        local.append(_grads(m))
    for r in range(2):
        torch.testing.assert_close(res[r]["b.weight"], local[r]["b.weight"])
        for k in res[r]:
            if k != "b.weight":
                torch.testing.assert_close(res[r][k], (local[0][k] + local[1][k]) / 2, msg=(r, k))


# -- a backward that leaves a bucket unreduced --------------------------------------------------------------------

def _used_only_in_no_sync(find_unused):
    dist, r = _start()
    net = _Net()
    dp = dist.DataParallel(net, find_unused_parameters=find_unused)
    with dp.no_sync():
        _loss(dp, r, 0).backward()
    try:
        _loss(dp, r, 1, use_b=False).backward()
    except RuntimeError as e:
        return str(e)
    return _grads(net)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("find_unused", [False, True])
def test_a_parameter_used_only_inside_no_sync_is_averaged(find_unused):
    """b used in the no_sync micro-batch only: its accumulated sums are averaged, with find_unused_parameters and
    without (then the end of the synced backward sends them; the first synced step used to raise at its forward)."""
    res = run_ranks(_used_only_in_no_sync, 2, find_unused, timeout=50)
    torch.manual_seed(0)
    net = _Net()
    sum(_loss(net, r, 0) + _loss(net, r, 1, use_b=False) for r in range(2)).div(2).backward()
    for r in range(2):
        _close(res[r], _grads(net), r)


# -- Paddle's deprecated methods ---------------------------------------------------------------------------------

def _deprecated():
    import warnings

    dist, r = _start()
    net = _Net()
    dp = dist.DataParallel(net)
    if r != 0:  # ranks as threads share the warnings state: rank 0 alone records, the others wait inside it
        loss = dp.scale_loss(_loss(dp, r, 0))
        loss.backward()
        dp.apply_collective_grads()
        dist.barrier()
        return None, _grads(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = dp.scale_loss(_loss(dp, r, 0))
        loss.backward()
        dp.apply_collective_grads()
        dist.barrier()
    return [(w.category, str(w.message)) for w in caught], _grads(net)


@pytest.mark.timeout(60)
def test_scale_loss_and_apply_collective_grads_do_nothing_as_in_paddle():
    """Paddle 3.3.1 keeps both as deprecated methods: ``scale_loss`` returns the loss, ``apply_collective_grads``
    returns None."""
    res = run_ranks(_deprecated, 2, timeout=50)
    torch.manual_seed(0)
    net = _Net()
    sum(_loss(net, r, 0) for r in range(2)).div(2).backward()
    for r, (caught, grads) in enumerate(res):
        if r == 0:  # scale_loss and apply_collective_grads (rank 1's may land in rank 0's record too)
            assert {c for c, _ in caught} == {DeprecationWarning}, caught
            assert {m.split(" is ")[0] for _, m in caught} == {"DataParallel.scale_loss",
                                                                "DataParallel.apply_collective_grads"}, caught
        _close(grads, _grads(net), "grads")


# -- shapes that already matched: two forwards, tied weights, many buckets, two dtypes, a subgroup ----------------

class _Mixed(nn.Module):
    """float32 layers with a float64 head, the head's weight tied to nothing, b's to a's."""

    def __init__(self):
        super().__init__()
        self.net = _Net()
        self.net.b.weight = self.net.a.weight
        self.net.c.double()

    def forward(self, x):
        h = torch.tanh(self.net.a(x))
        return self.net.c((h + self.net.b(h)).double()).float()


def _shapes():
    dist, r = _start()
    group = dist.new_group([0, 1])
    if r > 1:  # ranks outside the group train nothing
        return None
    m = _Mixed()
    dp = dist.DataParallel(m, comm_buffer_size=0.0001, last_comm_buffer_size=0.00005, group=group)
    opt = torch.optim.SGD(dp.parameters(), lr=LR)
    grads = []
    for step in range(3):
        if step == 1:  # two forwards, one backward
            (_loss(dp, r, 10 * step) + _loss(dp, r, 10 * step + 1)).backward()
        else:
            _loss(dp, r, 10 * step).backward()
        grads.append(_grads(m))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, _state(m), len(dp._ddp._get_ddp_logging_data().get("bucket_sizes", "").split(","))


@pytest.mark.timeout(60)
def test_two_forwards_tied_weights_two_dtypes_small_buckets_on_a_subgroup_match_the_dense_run():
    res = run_ranks(_shapes, 4, timeout=50)
    assert res[2] is None and res[3] is None
    torch.manual_seed(0)
    m = _Mixed()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for step in range(3):
        micro = (10 * step, 10 * step + 1) if step == 1 else (10 * step,)
        sum(_loss(m, r, s) for s in micro for r in range(2)).div(2).backward()
        for r in range(2):
            _close(res[r][0][step], _grads(m), (r, step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in range(2):
        _close(res[r][1], _state(m), r)
        assert res[r][2] > 2  # the small buffer sizes made several buckets
