"""A process group one rank makes alone (a mesh that differs on that rank) on real gloo processes: every rank fails
at the collective timeout, the one that made it saying so, rather than wait torch's 30 minutes for the group."""

import time

import pytest
import torch

from meshviz.testing import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TIMEOUT = 3  # the collective timeout


def _other_mesh_on_rank_1():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    t = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    target = mesh if r == 0 else dist.ProcessMesh([1, 0], dim_names=["x"])  # its groups: a new one, in that order
    t0 = time.monotonic()
    try:
        dist.reshard(t, target, [dist.Replicate()])
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_a_mesh_that_differs_on_one_rank_fails_at_the_collective_timeout():
    """Rank 1 reshards onto ProcessMesh([1, 0]), whose process group rank 0 never makes: rank 1 waited in torch's
    new_group for its default 30 minutes (the run was killed at its deadline), not the world's timeout."""
    t0 = time.monotonic()
    (theirs, waited0), (mine, waited1) = run_ranks(_other_mesh_on_rank_1, 2, timeout=60, collective_timeout=TIMEOUT)
    took = time.monotonic() - t0
    assert mine is not None and mine.startswith("making the process group over ranks [1, 0] failed: every rank of "
                                                "the world makes the same groups in the same order"), mine
    assert theirs is not None, theirs  # rank 0's all-gather timed out: rank 1 never came
    assert waited1 < TIMEOUT + 5 and waited0 < TIMEOUT + 5, (waited0, waited1)
    assert took < 40, took  # well under the run's deadline (60 s), ranks' start included
