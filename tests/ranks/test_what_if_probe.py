"""meshviz.what_if against real thread ranks beyond test_what_if.py: DataParallel over several steps with no_sync,
fleet's hybrid configs, DistModel over shard_dataloader, object collectives, group_sharded_parallel's levels with
tied weights; every rank's parameters, gradients, optimizer state and received bytes, to the byte."""

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import meshviz
from meshviz.errors import RankError
from meshviz.testing import run_ranks
from tests.ranks.test_fleet import D, H, MPNet, V
from tests.ranks.test_what_if import MLP, Meter, _step
from tests.ranks.test_what_if import _compare as compare


class LocalMeter(Meter):
    """Meter counting a torch DTensor (FSDP2's parameters) by its local shard, as a rank holds it."""

    @staticmethod
    def _bytes(tensors, skip):
        return Meter._bytes([t.to_local() if isinstance(t, DTensor) else t for t in tensors], skip)


class SteppedAdamW(torch.optim.AdamW):
    """AdamW that samples its meter when a step begins and ends (for loops that call step themselves)."""

    meter = None

    def step(self, closure=None):
        if self.meter is not None:
            self.meter.sample(state=False)
        out = super().step(closure)
        if self.meter is not None:
            self.meter.sample()
        return out


def _compare(fn, n, *args, share=True):
    return compare(fn, n, *args, share=share, timeout=120)


# -- DataParallel: a second step rebuilds DDP's buckets (an index tensor made from C++ without a device) -----------
def dp_accumulating(micro):
    import meshviz.distributed as dist
    from meshviz import trace

    with trace.record() as rec:
        dist.init_parallel_env()
        torch.manual_seed(0)
        model = dist.DataParallel(MLP())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        meter = Meter(model, opt)
        meter.sample(grads=False, state=False)
        for _ in range(2):
            for _ in range(micro - 1):
                with model.no_sync():
                    model(torch.randn(4, 16)).sum().backward()
            model(torch.randn(4, 16)).sum().backward()
            meter.sample(state=False)
            opt.step()
            meter.sample()
            opt.zero_grad()
    return meter.result(rec.events)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,micro", [(2, 1), (4, 3)])
def test_data_parallel_over_steps_with_no_sync_equals_real_run(n, micro):
    est, real = _compare(dp_accumulating, n, micro)
    grads = 4 * (16 * 32 + 32 + 32 * 8 + 8)
    # a ring all-reduce of the whole gradients once a step (none under no_sync); the broadcast from rank 0
    assert real[0]["comm_bytes"] == 2 * 2 * (n - 1) * grads // n
    assert real[1]["comm_bytes"] == real[0]["comm_bytes"] + grads
    assert est.simulated == [0, 1]
    assert meshviz.what_if(dp_accumulating, n, micro, share=False).per_rank == est.per_rank


# -- fleet: the model-parallel group's inputs come from its first rank into buffers the others make empty ----------
def fleet_hybrid(hybrid):
    from meshviz import trace
    from meshviz.distributed import fleet

    with trace.record() as rec:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = hybrid
        fleet.init(is_collective=True, strategy=s)
        torch.manual_seed(0)
        model = MPNet()
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
        model = fleet.distributed_model(model)
        meter = Meter(model, opt)
        meter.sample(grads=False, state=False)
        for _ in range(2):
            ids = torch.randint(0, V, (2, 3))
            model(ids, ids).backward()
            meter.sample(state=False)
            opt.step()
            meter.sample()
            opt.clear_grad()
    return meter.result(rec.events)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hybrid,n", [({"mp_degree": 2}, 2), ({"dp_degree": 2, "mp_degree": 2}, 4),
                                      ({"sharding_degree": 2, "dp_degree": 2, "mp_degree": 2}, 8)])
def test_fleet_model_parallel_equals_real_run(hybrid, n):
    est, real = _compare(fleet_hybrid, n, hybrid)
    # each mp rank holds half of every split layer: embedding, up, head split, down's weight split, its bias whole
    half = 4 * (V * D + D * H + H + H * D + D * V + V) // 2 + 4 * D
    assert all(real[r]["params"] == half for r in range(n))


# -- DistModel over shard_dataloader: its loss comes back as numpy ------------------------------------------------
def dist_model_loop():
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.auto_parallel import to_static

    with trace.record() as rec:
        dist.init_parallel_env()
        n = dist.get_world_size()
        mesh = dist.ProcessMesh(list(range(n)), dim_names=["dp"])
        g = torch.Generator().manual_seed(7)
        data = torch.utils.data.TensorDataset(torch.rand(4 * n, 16, generator=g), torch.rand(4 * n, 8, generator=g))
        loader = dist.shard_dataloader(torch.utils.data.DataLoader(data, batch_size=2 * n), meshes=[mesh],
                                       shard_dims="dp")
        torch.manual_seed(0)
        net = MLP()
        opt = SteppedAdamW(net.parameters(), lr=0.1)
        dm = to_static(net, loader, nn.MSELoss(), opt)
        meter = opt.meter = Meter(net, opt)
        meter.sample(grads=False, state=False)
        losses = [dm(x, y) for x, y in loader()]
        opt.meter = None
    assert len(losses) == 2 and all(loss.shape == () for loss in losses)
    return meter.result(rec.events)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_dist_model_over_shard_dataloader_equals_real_run(n):
    numpy = vars(torch.Tensor).get("numpy")
    est, real = _compare(dist_model_loop, n)
    assert vars(torch.Tensor).get("numpy") is numpy  # a fake tensor's numpy() is a simulation's only
    assert real[0]["params"] == 4 * (16 * 32 + 32 + 32 * 8 + 8)


# -- object collectives -----------------------------------------------------------------------------------------
def objects():
    import meshviz.distributed as dist
    from meshviz import trace

    with trace.record() as rec:
        dist.init_parallel_env()
        me = dist.get_rank()
        everyone: list = []
        dist.all_gather_object(everyone, {"n": 5})
        told = [{"lr": 0.1}, "warmup"] if me == 0 else [None, None]
        dist.broadcast_object_list(told, src=0)
        passed = [None]
        if me == 0:
            tdist.send_object_list([("shape", 4, 8)], dst=1)
        elif me == 1:
            tdist.recv_object_list(passed, src=0)
        ids = torch.tensor([3, 4]) if me == 0 else torch.empty(2, dtype=torch.long)
        dist.broadcast(ids, src=0)
    got = (everyone, told, passed)
    return got, [(e.op, e.bytes) for e in rec.events if e.kind in ("collective", "send", "recv")]


@pytest.mark.timeout(300)
def test_object_collectives_on_simulated_ranks():
    real = run_ranks(objects, 3, ranks="threads", timeout=60)
    est = meshviz.what_if(objects, 3, share=False)
    everyone = [{"n": 5}] * 3
    told = [{"lr": 0.1}, "warmup"]
    assert real[1][0] == (everyone, told, [("shape", 4, 8)])
    for r in range(3):
        got, events = est.values[r]
        assert events == real[r][1]  # the same calls, each of the same bytes
        # what every peer would send were it this rank; else what a rank simulated before this one sent it
        assert got == real[r][0], (r, got, real[r][0])
    assert est.per_rank[1]["comm_bytes"] == real[1][1][-1][1] == 16
    # the real object collectives are back for the next real run
    assert tdist.all_gather_object.__module__ == "torch.distributed.distributed_c10d"
    assert run_ranks(objects, 3, ranks="threads", timeout=60) == real


def _empty_ids():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    ids = torch.empty(3, dtype=torch.long)
    dist.broadcast(ids, src=0)  # a simulated rank receives nothing: what an empty buffer held reads 0, as item() does
    return ids.tolist()


def test_an_empty_index_tensor_reads_zeros():
    assert meshviz.what_if(_empty_ids, 2, share=False).values == {0: [0, 0, 0], 1: [0, 0, 0]}


# -- group_sharded_parallel, tied weights, small and default segments -----------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 64, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.fc(self.emb(x))))


def group_sharded(level, segment_size):
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.distributed.sharding import group_sharded_parallel

    with trace.record() as rec:
        dist.init_parallel_env()
        torch.manual_seed(0)
        model = Tied()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, opt, _ = group_sharded_parallel(model, opt, level, segment_size=segment_size)
        meter = LocalMeter(model, opt)
        meter.sample(grads=False, state=False)
        x = torch.randint(0, 64, (4, 3))
        _step(model, opt, meter, [(x, None), (x, None)])
    return meter.result(rec.events)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", ["os", "os_g", "p_g_os"])
@pytest.mark.parametrize("n,segment_size", [(2, 2**20), (3, 8), (4, 8)])
def test_group_sharded_with_tied_weights_equals_real_run(level, n, segment_size):
    est, real = _compare(group_sharded, n, level, segment_size)
    if level == "p_g_os" and segment_size == 8:  # every parameter sharded: the tied one counted once, padded
        rows = -(-64 // n)
        assert real[0]["params"] == 4 * (rows * 16 + -(-16 // n) * 16 + -(-16 // n))


def _from_a_later_rank():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    got = [None]
    if dist.get_rank() == 1:
        tdist.send_object_list([{"stage": 1}], dst=0)
    else:
        tdist.recv_object_list(got, src=1)
    return got


def test_objects_from_a_rank_simulated_later_raise_naming_it():
    assert run_ranks(_from_a_later_rank, 2, ranks="threads", timeout=60)[0] == [{"stage": 1}]
    with pytest.raises(RankError) as err:
        meshviz.what_if(_from_a_later_rank, 2, timeout=60)
    assert err.value.rank == 0
    assert ("RuntimeError: what_if: rank 0 receives objects (recv_object_list) from rank 1, which sent it none: a "
            "simulated rank receives objects only from the ranks simulated before it") in err.value.outcomes[0].error


# -- a fleet pipeline: its stages send their shapes forward as objects ----------------------------------------------
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def fleet_pipeline(hybrid):
    from meshviz import trace
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    with trace.record() as rec:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = hybrid
        s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
        fleet.init(is_collective=True, strategy=s)
        torch.manual_seed(0)
        layer = PipelineLayer([LayerDesc(Block, 4) for _ in range(4)], loss_fn=nn.MSELoss())
        opt = SteppedAdamW(layer.parameters(), lr=0.01)
        model, wrapped = fleet.distributed_model(layer), fleet.distributed_optimizer(opt)
        meter = opt.meter = Meter(layer, opt)
        meter.sample(grads=False, state=False)
        for _ in range(2):
            model.train_batch((torch.randn(4, 4), torch.randn(4, 4)), wrapped)
        opt.meter = None
    return meter.result(rec.events)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hybrid,n", [({"pp_degree": 2}, 2), ({"dp_degree": 2, "pp_degree": 2}, 4)])
def test_fleet_pipeline_equals_real_run(hybrid, n):
    est, real = _compare(fleet_pipeline, n, hybrid)
    assert real[0]["params"] == 2 * 4 * (4 * 4 + 4)  # two of the four blocks a stage
