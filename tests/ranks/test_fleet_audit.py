"""fleet audit fixes: grad clip in distributed_optimizer and by hand under mp, recompute with the RNG tracker, mp input
broadcast, init seeding, ColumnParallelLinear's bias default, ParallelCrossEntropy labels, strategy attributes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

CLIP = 0.01
X = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randn(4, 2, generator=torch.Generator().manual_seed(2))


def _init(**hybrid):
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=s)
    return fleet


def _dense_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _mp_model():
    from meshviz.distributed.fleet import meta_parallel as mpu

    torch.manual_seed(0)  # the same full weights as _dense_model's
    return nn.Sequential(mpu.ColumnParallelLinear(4, 6, has_bias=True, gather_output=False), nn.Tanh(),
                         mpu.RowParallelLinear(6, 2, input_is_parallel=True))


def _dense_step(clip):
    """One SGD step (lr 1) on the dense model, the gradients clipped Paddle's way; (global norm, parameters)."""
    m = _dense_model()
    F.mse_loss(m(X), Y).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())).item()
    with torch.no_grad():
        for p in m.parameters():
            p -= p.grad * (clip / max(norm, clip))
    return norm, [p.detach() for p in m.parameters()]


def _my_block(params, mp_rank):
    """This mp rank's block of the dense [col.weight, col.bias, row.weight, row.bias] (split 2 ways)."""
    r = slice(3 * mp_rank, 3 * mp_rank + 3)
    return [params[0][r], params[1][r], params[2][:, r], params[3]]


def clip_via_optimizer(hybrid, by_hand):
    import meshviz.nn as mnn

    fleet = _init(**hybrid)
    mp = hybrid.get("mp_degree", 1) > 1
    model = _mp_model() if mp else _dense_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    if not by_hand:
        inner._grad_clip = mnn.ClipGradByGlobalNorm(CLIP)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(inner)
    F.mse_loss(model(X), Y).backward()  # every rank the dense batch
    norm = float(mnn.ClipGradByGlobalNorm(CLIP)(model.parameters())) if by_hand else None
    opt.step()
    mp_rank = fleet.get_hybrid_communicate_group().get_model_parallel_rank()
    return norm, mp_rank, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hybrid", [{"dp_degree": 2}, {"dp_degree": 1, "mp_degree": 2},
                                    {"dp_degree": 1, "sharding_degree": 2}], ids=["dp", "mp", "sharding"])
def test_distributed_optimizer_clips_by_the_global_norm_over_all_ranks(hybrid):
    _, want = _dense_step(CLIP)
    for _, mp_rank, got in run_ranks(clip_via_optimizer, 2, hybrid, False, timeout=120):
        ref = _my_block(want, mp_rank) if "mp_degree" in hybrid else want
        for g, w in zip(got, ref):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_clip_by_hand_under_mp_adds_the_split_parameters_norms_over_the_mp_group():
    norm, want = _dense_step(CLIP)
    for got_norm, mp_rank, got in run_ranks(clip_via_optimizer, 2, {"dp_degree": 1, "mp_degree": 2}, True,
                                            timeout=120):
        assert got_norm == pytest.approx(norm, rel=1e-6)
        for g, w in zip(got, _my_block(want, mp_rank)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def recompute_tracker_dropout():
    from meshviz.distributed.fleet.meta_parallel import get_rng_state_tracker
    from meshviz.distributed.fleet.utils import recompute

    fleet = _init(dp_degree=1, mp_degree=2)
    tr = get_rng_state_tracker()
    tr.reset()
    tr.add("local_seed", 200 + fleet.get_hybrid_communicate_group().get_model_parallel_rank())
    w = nn.Parameter(torch.ones(16))

    def block(x):
        with tr.rng_state("local_seed"):
            return F.dropout(x * w, 0.5, training=True)

    x = torch.arange(1.0, 17.0, requires_grad=True)
    y = recompute(block, x)
    y.sum().backward()
    return y.detach(), x.grad


def _forward_mask_replayed(y, gx) -> None:
    """``y`` = dropout(x * 1) of x = 1..16 at p 0.5, ``gx`` its gradient: both from the forward's one mask."""
    kept = (y != 0).float()
    assert 0 < kept.sum() < 16
    torch.testing.assert_close(gx, kept * 2.0)  # d(dropout(x * 1))/dx = mask / (1 - 0.5), the forward's mask
    torch.testing.assert_close(y, torch.arange(1.0, 17.0) * kept * 2.0)


def test_recompute_replays_the_rng_trackers_dropout_mask():
    for y, gx in run_ranks(recompute_tracker_dropout, 2, timeout=120):
        _forward_mask_replayed(y, gx)


def pipeline_chunk_tracker_dropout():
    from meshviz.distributed.fleet.meta_parallel import get_rng_state_tracker
    from meshviz.distributed.pipeline.layers import _Chunk

    fleet = _init(dp_degree=1, mp_degree=2)
    tr = get_rng_state_tracker()
    tr.reset()
    tr.add("local_seed", 300 + fleet.get_hybrid_communicate_group().get_model_parallel_rank())

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(16))

        def forward(self, x):
            with tr.rng_state("local_seed"):
                return F.dropout(x * self.w, 0.5, training=True)

    x = torch.arange(1.0, 17.0, requires_grad=True)
    y = _Chunk([Drop()], recompute_interval=1)(x)  # a pipeline stage's layers under recompute_interval
    y.sum().backward()
    return y.detach(), x.grad


def test_pipeline_recompute_interval_replays_the_rng_trackers_dropout_mask():
    for y, gx in run_ranks(pipeline_chunk_tracker_dropout, 2, timeout=120):
        _forward_mask_replayed(y, gx)


class TwoInputs(nn.Module):
    def __init__(self):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        torch.manual_seed(0)
        self.col = mpu.ColumnParallelLinear(4, 6, has_bias=True, gather_output=True)

    def forward(self, x, shift=None):
        return self.col(x) + (0 if shift is None else shift)


def _batch(rank, ragged=True):
    g = torch.Generator().manual_seed(100 + rank)
    rows = 4 - rank % 2 if ragged else 4  # ragged: the shapes differ between ranks
    return torch.randn(rows, 4, generator=g), torch.randn(6, generator=g)


def mp_input_broadcast(hybrid, need):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {**hybrid, "mp_configs": {"need_broadcast_data": need}}
    fleet.init(is_collective=True, strategy=s)
    model = fleet.distributed_model(TwoInputs())
    x, shift = _batch(dist.get_rank(), ragged=need)
    return list(model.state_dict()), model(x, shift=shift).detach()


@pytest.mark.parametrize("hybrid,world", [({"dp_degree": 1, "mp_degree": 2}, 2),
                                          ({"dp_degree": 2, "mp_degree": 2}, 4)], ids=["mp2", "dp2xmp2"])
def test_tensor_parallel_model_takes_the_inputs_of_the_mp_groups_first_rank(hybrid, world):
    torch.manual_seed(0)
    dense = nn.Linear(4, 6)
    outs = run_ranks(mp_input_broadcast, world, hybrid, True, timeout=120)
    for rank, (keys, y) in enumerate(outs):
        assert keys == ["col.weight", "col.bias"]
        x, shift = _batch(rank - rank % 2)  # its mp group's first rank's (mp is the inner axis)
        torch.testing.assert_close(y, (dense(x) + shift).detach(), rtol=1e-5, atol=1e-6)


def test_need_broadcast_data_false_keeps_each_ranks_inputs():
    torch.manual_seed(0)
    dense = nn.Linear(4, 6)
    outs = run_ranks(mp_input_broadcast, 2, {"dp_degree": 1, "mp_degree": 2}, False, timeout=120)
    (x0, s0), (x1, _) = _batch(0, False), _batch(1, False)
    # rank 0's output: its own columns on its batch, rank 1's columns gathered from rank 1's batch
    want = torch.cat([dense(x0)[:, :3], dense(x1)[:, 3:]], dim=1) + s0
    torch.testing.assert_close(outs[0][1], want.detach(), rtol=1e-5, atol=1e-6)


def tracker_after_init(seed):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import get_rng_state_tracker

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2}
    if seed is not None:
        s.tensor_parallel_configs = {"tensor_init_seed": seed}
    fleet.init(is_collective=True, strategy=s)
    tr = get_rng_state_tracker()
    glob = torch.rand(3)
    with tr.rng_state():
        local = torch.rand(3)
    return sorted(tr.get_states_tracker()), glob, local


def test_fleet_init_with_mp_seeds_the_rng_tracker():
    for rank, (names, glob, local) in enumerate(run_ranks(tracker_after_init, 2, 1234, timeout=120)):
        assert names == ["model_parallel_rng"]
        torch.testing.assert_close(glob, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
        want = torch.rand(3, generator=torch.Generator().manual_seed(1234 + 1 + rank))  # + mp_rank * pp + pp_rank
        torch.testing.assert_close(local, want)
    names, _, _ = run_ranks(tracker_after_init, 2, None, timeout=120)[0]
    assert names == ["model_parallel_rng"]


def column_default_bias():
    from meshviz.distributed.fleet import meta_parallel as mpu

    _init(dp_degree=1, mp_degree=2)
    torch.manual_seed(3)
    col = mpu.ColumnParallelLinear(4, 6, gather_output=True)
    return col.bias, [n for n, _ in col.named_parameters()], col(X).detach()


def test_column_parallel_linear_has_no_bias_by_default():
    torch.manual_seed(3)
    dense = nn.Linear(4, 6)
    for bias, names, y in run_ranks(column_default_bias, 2, timeout=120):
        assert bias is None and names == ["weight"]
        torch.testing.assert_close(y, F.linear(X, dense.weight).detach(), rtol=1e-5, atol=1e-6)


LOGITS = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


def pce(labels):
    from meshviz.distributed.fleet import meta_parallel as mpu

    fleet = _init(dp_degree=1, mp_degree=2)
    r = fleet.get_hybrid_communicate_group().get_model_parallel_rank()
    try:
        return mpu.ParallelCrossEntropy()(LOGITS.chunk(2, -1)[r], labels).squeeze(-1)
    except IndexError as e:
        return str(e)


@pytest.mark.parametrize("bad", [8, -1])
def test_parallel_cross_entropy_rejects_labels_outside_the_classes_on_every_rank(bad):
    with pytest.raises(IndexError):
        F.cross_entropy(LOGITS, torch.tensor([1, bad, 2]))
    for out in run_ranks(pce, 2, torch.tensor([1, bad, 2]), timeout=120):
        assert isinstance(out, str) and f"label {bad} is out of bounds for 8 classes" in out
    want = F.cross_entropy(LOGITS, torch.tensor([1, -100, 7]), reduction="none")  # ignore_index still gives 0
    for out in run_ranks(pce, 2, torch.tensor([1, -100, 7]), timeout=120):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_strategy_rejects_unknown_attributes_and_has_paddles_config_defaults():
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match="hybrid_config is not a attribute of DistributedStrategy"):
        s.hybrid_config = {"mp_degree": 2}
    s.amp = True  # known switches still set
    s.sync_nccl_allreduce = False
    assert s.amp_configs["init_loss_scaling"] == 32768.0 and s.amp_configs["use_dynamic_loss_scaling"] is True
    assert s.recompute_configs["checkpoints"] == []
    assert s.gradient_merge_configs == {"k_steps": 1, "avg": True}
    assert s.hybrid_configs["mp_configs"]["need_broadcast_data"] is True
    s.gradient_merge_configs = {"k_steps": 4}
    assert s.gradient_merge_configs == {"k_steps": 4, "avg": True}
    with pytest.raises(ValueError, match="unknown keys"):
        s.amp_configs = {"init_loss_scale": 1.0}
