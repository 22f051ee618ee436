"""meshviz.what_if against the same function on real thread ranks: every rank's parameters, gradients, optimizer
state and received bytes, to the byte; alike ranks sharing a simulation; failures named as a real run names them."""

import time

import pytest
import torch

import meshviz
from meshviz.errors import RankError
from meshviz.testing import run_ranks
from tests.models import LlamaForCausalLM, LlamaPretrainingCriterion, llama_batches_with_ignored
from tests.ranks.test_parallelize import _plan

COMM = ("collective", "reshard_step", "send", "recv")
HELD = ("params", "grads", "optimizer", "comm_bytes")


class Meter:
    """What a rank's model and optimizer hold, counted by hand: distinct storages of the parameters (the model's
    and the optimizer's), of their gradients and of the optimizer's state, each the most seen at the points it is
    sampled (before the first forward, before and after each step)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.most = dict.fromkeys(HELD[:3], 0)

    def _params(self):
        seen = {}
        for p in list(self.model.parameters()) + [p for g in self.opt.param_groups for p in g["params"]]:
            seen.setdefault(id(p), p)
        return list(seen.values())

    @staticmethod
    def _bytes(tensors, skip):
        got = {}
        for t in tensors:
            if t is None:
                continue
            with torch.no_grad():
                local = t._local_value() if hasattr(t, "_local_value") else t
            st = local.untyped_storage()
            if st._cdata not in skip:
                got[st._cdata] = st.nbytes()
        return got

    def sample(self, grads=True, state=True):
        params = self._params()
        p = self._bytes(params, set())
        self.most["params"] = max(self.most["params"], sum(p.values()))
        if grads:
            g = self._bytes([q.grad for q in params], set(p))
            self.most["grads"] = max(self.most["grads"], sum(g.values()))
            p.update(g)
        if state:
            st = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self.most["optimizer"] = max(self.most["optimizer"], sum(self._bytes(st, set(p)).values()))

    def result(self, events) -> dict:
        """The numbers, with the bytes the rank received: its communication events' (``events``: the rank's own)."""
        self.sample()
        return {**self.most, "comm_bytes": sum(e.bytes for e in events if e.kind in COMM)}


def _step(model, opt, meter, batches, loss_fn=None, clip=None):
    for x, y in batches:
        out = model(x)
        loss = out.sum() if loss_fn is None else loss_fn(out, y)
        loss.backward()
        if clip is not None:
            clip(model.parameters())
        meter.sample(state=False)
        opt.step()
        meter.sample()
        opt.zero_grad()
    return loss


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def mlp_sharded(stage, steps=1):
    """An MLP under shard_layer (replicated) and shard_optimizer with ShardingStage{stage} along dp."""
    import meshviz.distributed as dist
    from meshviz import trace

    with trace.record() as rec:
        n = dist.get_world_size()
        mesh = dist.ProcessMesh(list(range(n)), ["dp"])
        torch.manual_seed(0)
        model = dist.shard_layer(MLP(), mesh)
        stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
        opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), stages[stage]("dp", mesh))
        meter = Meter(model, opt)
        meter.sample(grads=False, state=False)
        xs = [dist.shard_tensor(torch.randn(2 * n, 16), mesh, [dist.Shard(0)]) for _ in range(steps)]
        _step(model, opt, meter, [(x, None) for x in xs])
    return meter.result(rec.events)


def mlp_data_parallel():
    """An MLP under DataParallel: parameters broadcast from rank 0, gradients averaged in buckets."""
    import meshviz.distributed as dist
    from meshviz import trace

    with trace.record() as rec:
        dist.init_parallel_env()
        torch.manual_seed(0)
        model = dist.DataParallel(MLP())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        meter = Meter(model, opt)
        meter.sample(grads=False, state=False)
        _step(model, opt, meter, [(torch.randn(4, 16), None)])
    return meter.result(rec.events)


def llama(shape):
    """The notebooks' Llama under dist.parallelize on a dp x mp mesh with sequence parallel, trained as Paddle's
    tests train it: its criterion, gradients clipped by their global norm, the loss read back."""
    import numpy as np

    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.nn import ClipGradByGlobalNorm

    with trace.record() as rec:
        mesh = dist.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), ["dp", "mp"])
        dist.auto_parallel.set_mesh(mesh)
        torch.manual_seed(0)
        model = LlamaForCausalLM()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, opt = dist.parallelize(model, opt, config={"dp_config": {"sharding_level": 0},
                                                          "mp_config": {"parallelize_plan": _plan(True)}})
        meter = Meter(model, opt)
        meter.sample(grads=False, state=False)

        def shard(t):
            return dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()])

        batches = [(shard(x), shard(y)) for x, y in llama_batches_with_ignored(steps=1, batch=shape[0] * 2, seq=4)]
        loss = _step(model, opt, meter, batches, LlamaPretrainingCriterion(), ClipGradByGlobalNorm(0.5))
        dist.unshard_dtensor(loss).item()
    return meter.result(rec.events)


def llama_pipeline():
    """The notebooks' Llama on dp 2 x pp 2 x mp 2 (a stage per layer) with ShardingStage1 along dp."""
    import numpy as np

    import meshviz.distributed as dist
    from meshviz import trace

    with trace.record() as rec:
        mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2).tolist(), ["dp", "pp", "mp"])
        dist.auto_parallel.set_mesh(mesh)
        torch.manual_seed(0)
        model = LlamaForCausalLM(num_layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, opt = dist.parallelize(model, opt, config={"dp_config": {"sharding_level": 1},
                                                          "mp_config": {"parallelize_plan": _plan(False)},
                                                          "pp_config": {"split_spec": "llama.layers"}})
        meter = Meter(model, opt)
        meter.sample(grads=False, state=False)
        first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", 1)
        (x, y), = llama_batches_with_ignored(steps=1, batch=4, seq=4)
        x = dist.shard_tensor(x, first, [dist.Shard(0), dist.Replicate()])
        y = dist.shard_tensor(y, last, [dist.Shard(0), dist.Replicate()])
        _step(model, opt, meter, [(x, y)], lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1),
                                                                                              y.flatten()))
    return meter.result(rec.events)


def _compare(fn, n, *args, share=True, timeout=240):
    real = run_ranks(fn, n, *args, ranks="threads", timeout=timeout)
    est = meshviz.what_if(fn, n, *args, timeout=timeout, share=share)
    for r in range(n):
        got = {k: est.per_rank[r][k] for k in HELD}
        assert got == real[r], (r, est.like[r], got, real[r])
    assert all(real[r]["params"] > 0 and real[r]["optimizer"] > 0 for r in range(n))
    return est, real


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("stage", [1, 2, 3])  # 2: the whole gradients before the step shards them
def test_sharded_mlp_equals_real_run(stage, n):
    est, real = _compare(mlp_sharded, n, stage)
    assert est.simulated == [0]  # every rank of the dp line is alike
    assert all(real[r]["comm_bytes"] > 0 for r in range(n))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_mlp_over_two_steps_equals_real_run(stage):
    """The second step finds the states the first made (a simulated rank's are fake tensors) and steps blocks."""
    _compare(mlp_sharded, 2, stage, 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_mlp_on_uneven_blocks_equals_real_run(stage):
    """3 ranks: fc2's 8 rows are blocks of 3, 3 and 2, gathered through a padded buffer the parameters must not keep."""
    est, real = _compare(mlp_sharded, 3, stage)
    assert real[2]["optimizer"] < real[0]["optimizer"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [4, 8])
def test_data_parallel_equals_real_run(n):
    est, real = _compare(mlp_data_parallel, n)
    assert est.simulated == [0, 1]  # rank 0 roots the broadcast; the rest receive it alike
    assert real[0]["comm_bytes"] < real[1]["comm_bytes"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", [(2, 2), (4, 2)])
def test_notebook_llama_equals_real_run(shape):
    est, real = _compare(llama, shape[0] * shape[1], shape)
    assert len(est.simulated) < shape[0] * shape[1]


@pytest.mark.timeout(600)
def test_pipeline_stages_equal_real_run():
    est, real = _compare(llama_pipeline, 8)
    stage = {r: (r // 2) % 2 for r in range(8)}
    assert {stage[est.like[r]] for r in range(8)} == {0, 1} and all(stage[est.like[r]] == stage[r] for r in range(8))


@pytest.mark.timeout(900)
def test_sharing_gives_what_simulating_every_rank_gives():
    # torch's first DTensor decomposition in a process caches a 4-byte mesh tensor: made once, before both runs
    meshviz.what_if(llama, 4, (2, 2))
    shared = meshviz.what_if(llama, 8, (4, 2))
    every = meshviz.what_if(llama, 8, (4, 2), share=False)
    assert every.simulated == list(range(8)) and len(shared.simulated) < 8
    assert shared.per_rank == every.per_rank
    assert shared.values == {r: every.values[r] for r in shared.simulated}


def _raises_on_rank_2():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    x = torch.ones(4)
    if dist.get_rank() == 2:
        raise ValueError("rank 2 cannot go on")  # the line the error names
    return x.sum().item()


def _unplaceable():
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    dist.auto_parallel.set_mesh(mesh)
    model = LlamaForCausalLM(num_layers=1)
    dist.parallelize(model, config={"pp_config": {"split_spec": "llama.layers"}})


@pytest.mark.timeout(300)
def test_a_rank_that_raises_is_named_with_its_line():
    with pytest.raises(RankError) as real:
        run_ranks(_raises_on_rank_2, 4, ranks="threads", timeout=60)
    with pytest.raises(RankError) as est:
        meshviz.what_if(_raises_on_rank_2, 4, timeout=60)
    assert est.value.rank == real.value.rank == 2
    tb = est.value.outcomes[[o.rank for o in est.value.outcomes].index(2)].traceback
    assert 'raise ValueError("rank 2 cannot go on")' in tb and "ValueError: rank 2 cannot go on" in tb


@pytest.mark.timeout(300)
def test_a_plan_that_cannot_be_placed_raises_as_for_real():
    with pytest.raises(RankError) as real:
        run_ranks(_unplaceable, 4, ranks="threads", timeout=60)
    with pytest.raises(RankError) as est:
        meshviz.what_if(_unplaceable, 4, timeout=60)
    # every rank raises it for real (the first to be seen is named); a simulation stops at the first rank
    line = "ValueError: The number of layers must not be less than the pp size, but got 1 layers"
    assert all(line in o.error for o in real.value.outcomes)
    assert est.value.rank == 0 and line in est.value.outcomes[0].error
    assert est.value.outcomes[0].error == real.value.outcomes[real.value.rank].error


def _sleeps():
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:  # a simulation that takes its time (Python running, as a model's ops do)
        sum(range(100))


def test_a_simulation_past_its_timeout_says_so():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"what_if: rank 0 was still simulating after 1 s") as info:
        meshviz.what_if(_sleeps, 2, timeout=1)
    assert time.monotonic() - t0 < 15 and info.value.__cause__ is not None  # the interrupted rank's traceback
