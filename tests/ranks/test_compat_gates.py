"""meshviz.compat's version gates against the installed torch, and DTensor's decisions shared between rank threads."""

import torch

from meshviz import compat
from meshviz.testing import run_ranks


def dtensor_itself():
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    a = DTensor.from_local(torch.ones(4), mesh, [Partial("avg")])
    b = DTensor.from_local(torch.ones(4), mesh, [Partial("sum")])
    try:
        c = a + b
        converts = (repr(c.placements[0]), c.full_tensor().tolist())
    except Exception as e:  # 2.11: "Redistribution from one partial type ... is unsupported"
        converts = type(e).__name__
    g = torch.Generator().manual_seed(0)
    h, w, bias = torch.randn(4, 6, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, generator=g)
    try:
        dw, db = distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(bias, mesh, [Replicate()])
        o = torch.nn.functional.linear(distribute_tensor(h, mesh, [Shard(1)]), dw, db)
        torch.testing.assert_close(o.full_tensor(), torch.nn.functional.linear(h, w, bias))
        linear = repr(o.placements[0])
    except Exception as e:  # 2.11: its view rule cannot flatten a split dim that is not the first
        linear = type(e).__name__
    return converts, linear


def test_partial_kinds_and_split_batch_gates_match_dtensor():
    for converts, linear in run_ranks(dtensor_itself, 2):
        if compat.dtensor_converts_partial_kinds():
            assert converts == ("Partial(avg)", [3.0] * 4)  # mean of ones (1) + sum of ones over 2 ranks (2)
        else:
            assert converts == "AssertionError"
        assert (linear == "Shard(dim=1)") is compat.linear_keeps_split_batch_dims(), linear


def test_pipeline_set_up_calls_are_every_one_torch_has():
    from torch.distributed.pipelining import PipelineStage

    known = ("_prepare_forward_infra", "_prepare_backward_infra", "_warmup_forward_vote", "_warmup_backward_result")
    assert set(compat.pipeline_setup_calls()) == {n for n in known if hasattr(PipelineStage, n)}
    init = compat.pipeline_neighbor_init_ops()
    assert (init is not None) is hasattr(PipelineStage, "_get_init_p2p_neighbors_ops")
    # 2.13 keeps each gradient's metadata to send zeros for a missing one; 2.11 and 2.12 raise there
    assert compat.pipeline_stage_sends_zero_grads() is hasattr(PipelineStage, "_get_grad_send_meta")


def _doubled_and_viewed(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    x = distribute_tensor(torch.arange(rows * 29, dtype=torch.float32).reshape(rows, 29), mesh, [Shard(0)])
    return (x * 2).to_local(), x.view(rows, 29, 1).to_local()


def _counting(monkeypatch, op, searched: list, label):
    """Count each search of DTensor's strategy for ``op`` (from whichever registry this torch holds it in)."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    table = next(getattr(prop, name) for name in ("op_single_dim_strategy_funcs", "op_strategy_funcs")
                 if op in getattr(prop, name, {}))
    strategy = table[op]

    def counted(*args, **kwargs):
        searched.append((op, label()))
        return strategy(*args, **kwargs)

    monkeypatch.setitem(table, op, counted)


def test_rank_threads_search_a_decision_once_unless_it_reads_the_rank(monkeypatch):
    # DTensor's cache is per thread: each rank thread would search the same decision again (a search is most of
    # an op's first call; 3x slower on torch 2.15). A view of an uneven split holds each rank's local sizes, which
    # its search reads from the rank's coordinate: searched on every rank. A product of one reads nothing: shared.
    mul, view = torch.ops.aten.mul.Tensor, torch.ops.aten.view.default
    searched: list = []
    rows = 0
    for op in (mul, view):
        _counting(monkeypatch, op, searched, lambda: rows)
    for rows in (8, 6):  # 4 ranks: 2 rows each; 2, 2, 2 and 0
        out = run_ranks(_doubled_and_viewed, 4, rows, ranks="threads")
        x = torch.arange(rows * 29, dtype=torch.float32).reshape(rows, 29)
        assert torch.equal(torch.cat([d for d, _v in out]), x * 2)
        assert torch.equal(torch.cat([v for _d, v in out]), x.view(rows, 29, 1))
        assert [len(v) for _d, v in out] == ([2] * 4 if rows == 8 else [2, 2, 2, 0])
    assert [searched.count((mul, 8)), searched.count((mul, 6))] == [1, 1]
    assert [searched.count((view, 8)), searched.count((view, 6))] == [1, 4]


def _embedding_reduced_after_a_wait() -> torch.Tensor:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    weight = distribute_tensor(torch.arange(24, dtype=torch.float32).reshape(8, 3), mesh, [Shard(0)])
    ids = distribute_tensor(torch.tensor([[0, 5, 7, 2]]), mesh, [Replicate()])
    out = torch.nn.functional.embedding(ids, weight)  # a _MaskPartial holding this rank's mask until reduced
    tdist.all_reduce(torch.ones(1))  # the other ranks make their own masks for the same decision meanwhile
    return out.full_tensor()


def test_a_decision_holding_a_ranks_mask_is_not_shared():
    weight = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    for out in run_ranks(_embedding_reduced_after_a_wait, 2, ranks="threads"):
        assert torch.equal(out, weight[torch.tensor([[0, 5, 7, 2]])])
