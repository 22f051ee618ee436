"""Ranks as threads, without the match check: a collective the members call with different dtypes, shapes, reduce
ops or roots raises CollectiveMismatch on every member before any data moves, as the check would."""

import pytest
import torch

from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def _called(kind):
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch

    dist.init_parallel_env()
    r = dist.get_rank()
    x = torch.full((2,), float(r + 1))
    try:
        if kind == "dtype":
            x = x.double() if r == 1 else x
            dist.all_reduce(x)
        elif kind == "reduce op":
            dist.all_reduce(x, op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
        elif kind == "dst":
            dist.reduce(x, dst=r % 2)
        elif kind == "shape":
            x = torch.ones(2 + r)
            dist.all_reduce(x)
        elif kind == "torch src":  # on torch.distributed directly: no roll-call number
            tdist.broadcast(x, src=r)
        elif kind == "torch gather dtype":
            x = x.double() if r == 1 else x
            gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor  # torch 2.13 renamed it
            gather(torch.empty(4, dtype=x.dtype), x)
    except CollectiveMismatch as e:
        after = torch.ones(2)
        dist.all_reduce(after)  # the group stays usable
        return str(e), e.ranks, x.tolist(), after.tolist()
    return "passed", None, x.tolist(), None


@pytest.mark.parametrize("kind, n, line, odd", [
    ("dtype", 2, "mismatch at #1 on group [0, 1]: rank 0 entered all_reduce with float32[2]; rank 1 entered "
                 "all_reduce with float64[2]", [0, 1]),
    ("reduce op", 3, "mismatch at #1 on group [0, 1, 2]: rank 0 entered all_reduce(sum) float32[2]; rank 1 entered "
                     "all_reduce(max) float32[2]; rank 2 entered all_reduce(max) float32[2]", [0]),
    ("dst", 2, "mismatch at #1 on group [0, 1]: rank 0 entered reduce(dst=0) float32[2]; rank 1 entered "
               "reduce(dst=1) float32[2]", [0, 1]),
    ("shape", 3, "mismatch at #1 on group [0, 1, 2]: rank 0 entered all_reduce with float32[2]; rank 1 entered "
                 "all_reduce with float32[3]; rank 2 entered all_reduce with float32[4]", [0, 1, 2]),
    ("torch src", 2, "mismatch at group [0, 1]: rank 0 entered broadcast(src=0) float32[2]; rank 1 entered "
                     "broadcast(src=1) float32[2]", [0, 1]),
    ("torch gather dtype", 2, "mismatch at group [0, 1]: rank 0 entered all_gather_into_tensor with float32[2]; "
                              "rank 1 entered all_gather_into_tensor with float64[2]", [0, 1]),
])
def test_a_collective_called_differently_raises_on_every_member_before_any_data_moves(kind, n, line, odd):
    """Before, the threads group compared only the op: the ranks' dtypes were cast silently, the last rank to
    arrive chose the reduce op and root for all (SUM on rank 0 and MAX on rank 1 summed on both)."""
    got = run_ranks(_called, n, kind, ranks="threads", timeout=30)
    for r, (text, ranks, x, after) in enumerate(got):
        assert (text, ranks) == (line, odd), (r, text)
        before = [1.0] * (2 + r) if kind == "shape" else [float(r + 1)] * 2
        assert x == before, (r, x)  # nothing moved
        assert after == [float(n)] * 2
