"""On a GPU: one NCCL rank, and several gloo ranks sharing one GPU over CUDA tensors, in strict device mode.

``gpu``-marked tests are skipped without CUDA (the reshard world also runs on the CPU). gloo carries CUDA tensors
for all-reduce, reduce, broadcast, all-gather, gather, scatter, all-to-all and reduce-scatter (as an all-reduce);
its send/recv read host memory, so meshviz stages point-to-point transfers (dist.send/recv, cross-mesh reshards,
pipeline stages) through the CPU.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

pytestmark = pytest.mark.slow

STRICT = {"MESHVIZ_STRICT_DEVICES": "1"}
SHARED = dict(devices="cuda", backend="gloo", env=STRICT)  # every rank on GPU 0, gloo between them


def _where():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz.runtime import devices

    return {"backend": tdist.get_backend(), "device": str(dist.device()), "strict": devices.strict()}


# -- one NCCL rank on the GPU -----------------------------------------------------------------------------------

def _nccl_rank():
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from tests.ranks.test_group_sharded import LR, WD, batch, make_model

    dist.init_parallel_env()
    out = _where()
    try:
        dist.all_reduce(torch.ones(2))
    except ValueError as e:
        out["cpu_error"] = str(e)
    t = torch.ones(2, device=dist.device())
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    mesh = dist.ProcessMesh([0], dim_names=["x"])
    out["block"] = str(dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])._local_value().device)
    # DataParallel of a CPU model: moved to the GPU; CPU inputs follow it
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    dp = dist.DataParallel(lin)
    x = torch.randn(4, 3)
    dp(x).sum().backward()
    out["dp"] = (str(lin.weight.device), lin.weight.grad.cpu())
    # offload: every optimizer state on the CPU, also when no parameter reaches segment_size
    for level in ("os", "os_g", "p_g_os"):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        model, opt, _ = group_sharded_parallel(model, opt, level, offload=True, segment_size=10**9)
        xb, yb = batch(0, 0)
        F.mse_loss(model(xb.to(dist.device())), yb.to(dist.device())).backward()
        opt.step()
        states = {v.device.type for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()}
        out[level] = (states, {p.device.type for p in model.parameters()})
    so = dist.shard_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    out["shard_optimizer"] = {p.device.type for g in so.param_groups for p in g["params"]}
    return out


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_one_nccl_rank_clear_errors_and_placement():
    (o,) = run_ranks(_nccl_rank, 1, devices="auto", backend=None, timeout=150)
    assert o["backend"] == "nccl" and o["device"] == "cuda:0" and o["strict"]
    assert "a tensor on cpu cannot go into an NCCL collective" in o["cpu_error"] and "dist.device()" in o["cpu_error"]
    assert "No backend type" not in o["cpu_error"]
    assert o["sum"] == [1.0, 1.0] and o["block"] == "cuda:0"
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    lin(torch.randn(4, 3)).sum().backward()
    assert o["dp"][0] == "cuda:0"
    torch.testing.assert_close(o["dp"][1], lin.weight.grad, rtol=1e-5, atol=1e-6)
    for level in ("os", "os_g", "p_g_os"):
        assert o[level] == ({"cpu"}, {"cuda"}), level
    assert o["shard_optimizer"] == {"cuda"}


# -- several gloo ranks sharing the GPU -----------------------------------------------------------------------

def _shared_reshard():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    out = _where()
    dev = dist.device()
    x = torch.arange(24.0, device=dev).reshape(4, 6)
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["a", "b"])
    S0, S1, R, P = dist.Shard(0), dist.Shard(1), dist.Replicate(), dist.Partial()
    results = []
    for src, dst in [([S0, S1], [R, R]), ([P, R], [R, R]), ([P, P], [S0, S1]), ([S0, R], [S1, R]),
                     ([R, R], [P, S0]), ([S1, S0], [S0, S1]), ([dist.Partial(dist.ReduceType.kRedMax), R], [R, S1])]:
        d = dist.shard_tensor(x, mesh, src)
        o = dist.reshard(d, mesh, dst)
        results.append((str(o._local_value().device), dist.unshard_dtensor(o).cpu()))
    out["results"] = results
    # across meshes: send/recv, staged through the CPU
    m1, m2 = dist.ProcessMesh([0, 1], dim_names=["x"]), dist.ProcessMesh([2, 3], dim_names=["x"])
    d = dist.shard_tensor(x, m1, [S0])
    o = dist.reshard(d, m2, [S1])
    out["cross"] = (str(o._local_value().device), o._local_value().cpu())
    # differentiable: the gradient comes back on the GPU
    leaf = torch.ones(4, 6, device=dev, requires_grad=True)
    y = dist.reshard(dist.shard_tensor(leaf * 2, mesh, [S0, R]), mesh, [R, R])
    y._local_value().sum().backward()
    out["grad"] = leaf.grad.cpu()
    # the plain collectives on CUDA tensors
    t = torch.full((2,), float(r), device=dev)
    if r == 0:
        dist.send(t + 10, dst=1)
    elif r == 1:
        dist.recv(t, src=0)
    out["p2p"] = t.cpu()
    g = []
    dist.all_gather(g, torch.tensor([r], device=dev))
    out["gather"] = [int(v) for v in g]
    b = torch.tensor([r], device=dev)
    dist.broadcast(b, src=3)
    out["bcast"] = int(b)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_four_ranks_share_one_device_reshard_and_collectives(devices):
    res = run_ranks(_shared_reshard, 4, timeout=220, devices=devices, backend="gloo", env=STRICT)
    want = "cuda:0" if devices == "cuda" else "cpu"
    x = torch.arange(24.0).reshape(4, 6)
    for r, o in enumerate(res):
        assert o["backend"] == "gloo" and o["device"] == want and o["strict"]
        for dev, full in o["results"]:
            assert dev == want
            torch.testing.assert_close(full, x)
        if r >= 2:
            dev, local = o["cross"]
            assert dev == want
            torch.testing.assert_close(local, x[:, (r - 2) * 3:(r - 1) * 3])
        torch.testing.assert_close(o["grad"], torch.full((4, 6), 2.0))  # d(2 * leaf): the Partial parts sum to one
        assert o["gather"] == [0, 1, 2, 3] and o["bcast"] == 3
    assert res[1]["p2p"].tolist() == [10.0, 10.0]


def _shared_training():
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel
    from meshviz.nn import ClipGradByGlobalNorm
    from tests.ranks.test_group_sharded import CLIP, LEVELS, LR, STEPS, WD, batch, full_params, make_model

    dist.init_parallel_env()
    rank, dev = dist.get_rank(), dist.device()
    out = _where()
    # DataParallel of a CPU model: moved to the GPU, buckets all-reduced by gloo on CUDA
    model = make_model()
    dp = dist.DataParallel(model)
    opt = torch.optim.AdamW(dp.parameters(), lr=LR, weight_decay=WD)
    for s in range(STEPS):
        x, y = batch(s, rank)
        loss = F.mse_loss(dp(x), y.to(dev))
        loss.backward()
        ClipGradByGlobalNorm(CLIP)(list(dp.parameters()))
        opt.step()
        opt.zero_grad()
    out["dp"] = {k: v.cpu() for k, v in model.state_dict().items()}
    # group sharding, every level, clipped with the true global norm
    for level in LEVELS:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=8, grad_clip=ClipGradByGlobalNorm(CLIP))
        for s in range(STEPS):
            x, y = batch(s, rank)
            F.mse_loss(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
            opt.clear_grad()
        out[level] = {k: v.cpu() for k, v in full_params(model).items()}
    return out


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_two_ranks_share_one_gpu_data_parallel_group_sharding_and_clipping():
    from tests.ranks.test_group_sharded import LEVELS, reference

    ref, _, _ = reference(2)
    for o in run_ranks(_shared_training, 2, timeout=280, **SHARED):
        assert o["backend"] == "gloo" and o["device"] == "cuda:0" and o["strict"]
        for what in ("dp",) + LEVELS:
            for k, v in ref.items():
                torch.testing.assert_close(o[what][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} {k}: {m}")


def _shared_pipeline():
    import copy

    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer, PipelineParallel
    from tests.ranks.test_pipeline import MBS, M, _descs, _train

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "pp_degree": 2}
    strategy.pipeline_configs = {"micro_batch_size": MBS, "accumulate_steps": M}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    out = _where()
    for mode in ("1F1B", "FThenB"):
        layer = PipelineLayer(_descs(4), loss_fn=nn.MSELoss())  # built on the CPU, moved to the GPU
        s = copy.deepcopy(strategy)
        s.pipeline_configs = {"schedule_mode": mode}
        res = _train(PipelineParallel(layer, hcg, s), layer)
        out[mode] = {"losses": res["losses"], "state": {k: v.cpu() for k, v in res["state"].items()},
                     "devices": sorted({str(p.device) for p in layer.parameters()})}
    return out


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_two_ranks_share_one_gpu_pipeline():
    from tests.ranks.test_pipeline import M, _data, _descs, _reference

    x, y = _data()
    losses, _, state = _reference(_descs(4), nn.MSELoss(), [(x, y), (x, y)], M)
    res = run_ranks(_shared_pipeline, 2, timeout=280, **SHARED)
    for _stage, o in enumerate(res):
        assert o["backend"] == "gloo" and o["device"] == "cuda:0" and o["strict"]
        for mode in ("1F1B", "FThenB"):
            assert o[mode]["devices"] == ["cuda:0"]
            assert o[mode]["losses"] == pytest.approx(losses, rel=1e-5), mode
            for k, v in o[mode]["state"].items():  # this stage's layers, named as in the single model
                torch.testing.assert_close(v, state[k], rtol=1e-5, atol=1e-6)


# -- a traced reshard on the GPU: its events carry the values of their time ----------------------------------

def _traced_reshard():
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.runtime.autograd import run_reshard

    dist.init_parallel_env()
    n = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])
    d = dist.shard_tensor(torch.arange(12.0, device=dist.device()).reshape(4, 3), mesh, [dist.Shard(0)])
    with trace.record() as rec:
        out = run_reshard(d, mesh, [dist.Replicate()])
        out._local.mul_(10)  # changed on the device before anything reads the events
        d._local.add_(1)
        evs = rec.events
    return str(out._local.device), [(e.kind, e.values, e.local_shape) for e in evs if e.kind.startswith("reshard")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("devices,n", [("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.gpu),
                                       pytest.param("cuda", 2, marks=pytest.mark.gpu)])
def test_a_traced_reshard_reports_the_values_of_its_time(devices, n):
    backend = None if (devices, n) == ("cuda", 1) else "gloo"  # one NCCL rank; else gloo ranks sharing the device
    res = run_ranks(_traced_reshard, n, timeout=180, devices=devices, backend=backend, env=STRICT)
    x = torch.arange(12.0).reshape(4, 3)
    for r, (dev, evs) in enumerate(res):
        assert dev == ("cuda:0" if devices == "cuda" else "cpu")
        block = x.chunk(n)[r]
        assert evs == [("reshard", block.reshape(-1).tolist(), list(block.shape)),
                       ("reshard_step", x.reshape(-1).tolist(), [4, 3])], r
