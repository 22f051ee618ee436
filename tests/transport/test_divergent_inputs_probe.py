"""Ranks given different arguments, on real gloo processes: every process raises naming the difference, none
returns a layout or batch of its own, and the world stays usable."""

import pytest

from meshviz.testing import run_ranks
from tests.ranks import test_divergent_inputs_probe as probe

pytestmark = pytest.mark.timeout(120)


def test_reshard_to_other_placements_on_one_process_raises_on_every_process():
    out = run_ranks(probe.reshard_other_placements, 2, timeout=60)
    for rank, (got, full, _grad) in enumerate(out):
        assert got[0] == "raised" and "different arguments" in got[1], f"rank {rank}: {got}"
        assert full == probe._dense().tolist()


def test_shard_dataloader_with_another_batch_size_on_one_process_raises_on_every_process():
    out = run_ranks(probe.loader_other_batch_size, 2, (4, 2), timeout=60)
    for rank, (got, rows) in enumerate(out):
        assert got[0] == "raised" and "batch_size" in got[1], f"rank {rank}: {got}"
        assert rows == [2.0 * rank, 2.0 * rank + 1]
