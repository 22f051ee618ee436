"""The roll-call on real gloo processes (split from tests/unit/test_rollcall.py): collectives attributed to the
module that issued them, and the gloo match check raising on every rank before any data moves."""

import pytest
import torch

from meshviz import trace
from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


# -- on real ranks ------------------------------------------------------------------------------------------------

def _tp_step():
    from torch import nn

    import meshviz.distributed as dist
    from meshviz.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear
    from meshviz.trace import comm_table

    dist.init_parallel_env()
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.col = ColumnParallelLinear(4, 8, has_bias=True, gather_output=False)
            self.row = RowParallelLinear(8, 4, input_is_parallel=True)

        def forward(self, x):
            return self.row(torch.relu(self.col(x)))

    net = Net()
    x = torch.ones(3, 4, requires_grad=True)
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    with trace.record() as mem:
        net(x).sum().backward()
        dist.reshard(dist.shard_tensor(torch.ones(4, 2), mesh, [dist.Shard(0)]), mesh, [dist.Replicate()])
    rows = [(r.module, r.phase, r.op, r.axis, r.count, r.bytes) for r in comm_table(mem.events)]
    return rows, sorted({e.payload.where for e in mem.events if e.kind == "collective"})


def test_collectives_are_attributed_to_the_module_that_issued_them():
    rows, where = run_ranks(_tp_step, 2, timeout=100, ranks="processes")[0]
    assert rows == [
        ("(top level)", "forward", "all_gather", "axis mp", 1, 16),  # the reshard: 2x2 floats from the peer
        ("Net.col", "backward", "all_reduce", "group [0, 1]", 1, 3 * 4 * 4),  # the input gradient, summed
        ("Net.row", "forward", "all_reduce", "group [0, 1]", 1, 3 * 4 * 4),  # the partial outputs, summed
    ]
    assert all(w.startswith("test_rollcall_processes.py:") for w in where), where


def _mismatches():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    set_checking(True)
    r = dist.get_rank()
    out = []
    for case in ("shape", "op", "seq"):
        t = torch.ones(4 if r == 0 or case != "shape" else 8)
        if case == "seq":
            rollcall.reset()
            if r == 1:  # as if rank 1 had run one more collective on the world than rank 0
                rollcall.current().entered[(0, 1)] = 1
        try:
            if case == "op" and r == 1:
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
            out.append(None)
        except CollectiveMismatch as e:
            out.append((str(e), e.ranks))
    rollcall.reset()  # realign the counts, as a re-created world does
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)  # the group is intact: the check raised before any data moved
    return out, t.tolist()


def test_the_match_check_raises_on_every_rank_before_data_moves():
    res = run_ranks(_mismatches, 2, timeout=100, ranks="processes")
    for out, after in res:
        assert after == [3.0, 3.0]
        shape, op, seq = out
        assert shape == ("mismatch at #1 on group [0, 1]: rank 0 entered all_reduce with float32[4]; rank 1 entered "
                         "all_reduce with float32[8]", [0, 1])
        assert op[0] == ("mismatch at #2 on group [0, 1]: rank 0 entered all_reduce float32[4]; rank 1 entered "
                         "broadcast float32[4]")
        assert seq[0] == "mismatch on group [0, 1]: rank 0 entered all_reduce #1; rank 1 entered all_reduce #2"
    assert res[0][0] == res[1][0]


# -- torch.distributed called directly: recorded on spawn's rank processes -----------------------------------------

def _raw_skip():
    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == 0:
        tdist.all_reduce(torch.ones(1))  # rank 1 returns without entering it


def test_spawn_names_the_rank_that_skipped_a_raw_collective_at_the_roll_call():
    import time

    import meshviz.distributed as dist
    from meshviz.errors import RankError

    t = time.monotonic()
    with pytest.raises(RankError) as info:
        dist.spawn(_raw_skip, nprocs=2, hang_after=0.5, timeout=60)
    took = time.monotonic() - t
    assert str(info.value).startswith("rank 1 never entered all_reduce on group [0, 1] (idle: its function "
                                      "returned)"), str(info.value)[:500]
    assert took < 40, took  # at the roll-call, not at the 60 s collective timeout

