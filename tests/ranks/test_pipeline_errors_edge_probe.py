"""A pipeline stage that raises (its layers, the last stage's loss) stops the stages waiting on it at once."""

import functools
import time

import pytest
import torch
import torch.nn.functional as F

from meshviz.testing import run_ranks

from .test_distmodel_edge3_probe import LR, OUT, B, _feed, _staged, data, strategy
from .test_pipeline import Block

MBS = 2
BAD = "IndexError: Target 9 is out of bounds"


class Refusing(Block):
    """A layer that raises on a batch holding a row of 9s (only the first stage's first layer is one)."""

    def forward(self, x):
        if bool((x == 9).all(dim=1).any()):
            raise ValueError("stage 0 refuses a row of 9s")
        return super().forward(x)


class _RefuseBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("stage 0's backward refuses")


class RefusingBackward(Block):
    def forward(self, x):
        return _RefuseBackward.apply(super().forward(x))


def _caught(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def _fleet(mode, p, acc, v=1, evaluate=False, where="loss", catch=True):
    """A fleet pipeline of p stages whose last stage's loss gets a class id out of range (9 of 4) in the last
    micro-batch only (``where='layer'``: the first stage's first layer refuses the last micro-batch instead;
    ``'backward'``: that layer's backward refuses)."""
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": p}
    s.pipeline_configs = {"micro_batch_size": MBS, "accumulate_steps": acc, "schedule_mode": mode}
    fleet.init(is_collective=True, strategy=s)
    torch.manual_seed(0)
    first = {"layer": Refusing, "backward": RefusingBackward}.get(where, Block)
    descs = [LayerDesc(first, 4)] + [LayerDesc(Block, 4) for _ in range(2 * p * v - 1)]
    pipe = fleet.distributed_model(PipelineLayer(descs, loss_fn=lambda out, y: F.cross_entropy(out, y),
                                                 num_virtual_pipeline_stages=v))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(MBS * acc, 4, generator=g), torch.zeros(MBS * acc, dtype=torch.long)
    if where == "layer":
        x[-1] = 9
    elif where == "loss":
        y[-1] = 9
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    step = (lambda: pipe.eval_batch((x, y), compute_loss=True)) if evaluate else (lambda: pipe.train_batch((x, y), opt))
    return _caught(step) if catch else step()


def _check(got, failing, stage, error, took=10.0):
    for rank, (name, msg, secs) in enumerate(got):
        assert secs < took, (rank, secs, msg)  # the collective timeout is 60 s
        if rank in failing:
            assert f"{name}: {msg}".startswith(error), (rank, name, msg)
        else:
            # not the deadlock detector's "every rank waits for another": the failing stage, its rank and error
            assert name == "RankStopped", (rank, name, msg)
            who = failing[rank % len(failing)]  # the rank at this one's place in the failing stage's mesh
            assert f"(pipeline stage {stage} (rank {who}) raised {error}" in msg, (rank, msg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, p, acc, v, evaluate", [
    ("1F1B", 2, 4, 1, False), ("1F1B", 4, 4, 1, False), ("FThenB", 4, 4, 1, False), ("VPP", 2, 2, 2, False),
    ("ZBH1", 2, 2, 1, False), ("FThenB", 2, 2, 1, True), ("1F1B", 4, 4, 1, True)])
def test_a_fleet_loss_error_on_the_last_stage_stops_every_stage_naming_it(mode, p, acc, v, evaluate):
    """Every rank catches its error: the last stage has its own IndexError; every other stage, two transfers away
    too, stops at once with the last stage's rank and error (on HEAD: a bare deadlock)."""
    got = run_ranks(functools.partial(_fleet, mode, p, acc, v, evaluate), p, timeout=50, collective_timeout=60)
    _check(got, [p - 1], p - 1, BAD)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["1F1B", "FThenB"])
def test_a_fleet_layer_error_on_the_first_stage_stops_the_later_stages_naming_it(mode):
    got = run_ranks(functools.partial(_fleet, mode, 2, 4, where="layer"), 2, timeout=50, collective_timeout=60)
    _check(got, [0], 0, "ValueError: stage 0 refuses a row of 9s")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["1F1B", "FThenB"])
def test_a_fleet_backward_error_on_the_first_stage_comes_out_as_itself_naming_it(mode):
    """torch's stage wraps it in "Failed to run stage backward", which does not say what failed."""
    got = run_ranks(functools.partial(_fleet, mode, 2, 4, where="backward"), 2, timeout=50, collective_timeout=60)
    _check(got, [0], 0, "ArithmeticError: stage 0's backward refuses")


@pytest.mark.timeout(60)
def test_an_uncaught_stage_error_still_names_the_failing_rank_first():
    from meshviz.errors import RankError

    with pytest.raises(RankError) as err:
        run_ranks(functools.partial(_fleet, "1F1B", 4, 4, catch=False), 4, timeout=50, collective_timeout=60)
    assert err.value.rank == 3 and BAD in err.value.outcomes[3].error, str(err.value)
    for o in err.value.outcomes[:3]:
        assert "pipeline stage 3 (rank 3) raised " + BAD in o.error, o.error


# -- DistModel (to_static with strategy.pipeline) ------------------------------------------------------------------

def _class_ids(acc):
    ids = torch.zeros(B, OUT)
    ids[:, 0] = torch.arange(B) % OUT
    ids[B - B // acc:, 0] = 9  # the last micro-batch only
    return ids


def _distmodel(mode, sched, acc, p):
    dist, net, stages = _staged(p)
    dm = to_static_of(net, sched, acc, p)
    getattr(dm, mode)()
    return _caught(lambda: dm(*_feed(dist, stages, data(0)[0], _class_ids(acc))))


def to_static_of(net, sched, acc, p, loss=None):
    from meshviz.distributed.auto_parallel import to_static

    loss = loss or (lambda out, y: F.cross_entropy(out, y[:, 0].long()))
    return to_static(net, None, loss, torch.optim.SGD(net.parameters(), lr=LR), strategy(sched, acc, p))


DM_BAD = "RuntimeError: index 9 is out of bounds for dimension 1 with size 4"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sched, acc, p, world", [("1F1B", 4, 2, 2), ("1F1B", 4, 4, 4), ("FThenB", 2, 2, 4)])
def test_a_distmodel_loss_error_on_the_last_stage_stops_every_stage_naming_it(sched, acc, p, world):
    per = world // p
    last = list(range(world - per, world))
    got = run_ranks(functools.partial(_distmodel, "train", sched, acc, p), world, timeout=50, collective_timeout=60)
    _check(got, last, p - 1, DM_BAD)


# -- the next call after a failed one trains as one process ------------------------------------------------------

_KEPT: dict = {}


def _failed_then_good(rank, first):
    """``first``: a call whose last stage's loss refuses its class ids (caught); then (a new round, as the next
    cell) a good call on another batch."""
    if first:
        dist, net, stages = _staged(2)
        bad = {"on": True}

        def loss(out, y):
            return F.cross_entropy(out, y[:, 0].long()) if bad["on"] else F.mse_loss(out, y)

        dm = to_static_of(net, "1F1B", 4, 2, loss)
        dm.train()
        _KEPT[rank] = (dist, net, stages, dm, bad)
        return _caught(lambda: dm(*_feed(dist, stages, data(0)[0], _class_ids(4))))[0]
    dist, net, stages, dm, bad = _KEPT.pop(rank)
    bad["on"] = False
    dm(*_feed(dist, stages, *data(1)))
    return {k: f.detach().clone() for k, v in net.state_dict().items() if (f := v.full_tensor()).numel()}


@pytest.mark.timeout(60)
def test_no_gradient_of_a_failed_distmodel_call_is_carried_into_the_next():
    from meshviz.ranks.threads import ThreadWorld

    from .test_distmodel_edge3_probe import Chain

    net = Chain(2)
    F.mse_loss(net(data(1)[0]), data(1)[1]).backward()
    torch.optim.SGD(net.parameters(), lr=LR).step()
    want = {k: v.detach() for k, v in net.state_dict().items()}
    tw = ThreadWorld(2, timeout=40).start()
    try:
        for first in (True, False):
            job = tw.submit(functools.partial(_failed_then_good, first=first))
            assert job.wait(50)
            outs = job.outcomes()
            assert all(o.status == "ok" for o in outs), outs
            if first:
                assert [o.value for o in outs] == ["RankStopped", "RuntimeError"], outs
    finally:
        tw.stop()
    for rank, o in enumerate(outs):
        for k, v in o.value.items():
            torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=f"rank {rank} {k}")


def _fleet_rounds(rank, first, fail):
    """A fleet 1F1B pipeline (2 stages); ``first``: build it and, with ``fail``, run a step whose last stage's loss
    refuses a class id (caught); else (a new round) a good step on another batch: each stage's weights after it."""
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    if first:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"pp_degree": 2}
        s.pipeline_configs = {"micro_batch_size": MBS, "accumulate_steps": 4}
        fleet.init(is_collective=True, strategy=s)
        torch.manual_seed(0)
        layer = PipelineLayer([LayerDesc(Block, 4) for _ in range(4)], loss_fn=lambda out, y: F.cross_entropy(out, y))
        pipe = fleet.distributed_model(layer)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        _KEPT[rank] = (layer, pipe, opt)
        if not fail:
            return None
        y = torch.zeros(MBS * 4, dtype=torch.long)
        y[-1] = 9
        return _caught(lambda: pipe.train_batch((torch.ones(MBS * 4, 4), y), opt))[0]
    layer, pipe, opt = _KEPT.pop(rank)
    g = torch.Generator().manual_seed(2)
    pipe.train_batch((torch.randn(MBS * 4, 4, generator=g), torch.arange(MBS * 4) % 4), opt)
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


@pytest.mark.timeout(60)
def test_no_gradient_of_a_failed_fleet_step_is_carried_into_the_next():
    """The step after a failed one (each a round of its own, as cells) ends with the weights of the same good step
    run alone."""
    from meshviz.ranks.threads import ThreadWorld

    got = {}
    for fail in (True, False):
        tw = ThreadWorld(2, timeout=40).start()
        try:
            for first in (True, False):
                job = tw.submit(functools.partial(_fleet_rounds, first=first, fail=fail))
                assert job.wait(50)
                outs = job.outcomes()
                assert all(o.status == "ok" for o in outs), outs
                if first and fail:
                    assert [o.value for o in outs] == ["RankStopped", "IndexError"], outs
        finally:
            tw.stop()
        got[fail] = [o.value for o in outs]
    for rank, (after, alone) in enumerate(zip(got[True], got[False])):
        assert after.keys() == alone.keys() and after
        for k in alone:
            torch.testing.assert_close(after[k], alone[k], rtol=1e-6, atol=1e-6, msg=f"rank {rank} {k}")
