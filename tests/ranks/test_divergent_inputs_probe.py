"""Ranks that pass different arguments to one call: every rank raises, naming the difference, and the world stays
usable (checked against the dense truth afterwards)."""

import re

import pytest
import torch

from meshviz.errors import RankError
from meshviz.testing import run_ranks

ROWS = 8


def _dense() -> torch.Tensor:
    return torch.arange(8.0).reshape(4, 2)


def reshard_other_placements():
    """Rank 0 reshards to Replicate, rank 1 to Partial, with the members' check on (as in a Cluster)."""
    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    old = set_checking(True)
    try:
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        d = dist.shard_tensor(_dense(), mesh, [dist.Shard(0)])
        pl = [dist.Replicate()] if dist.get_rank() == 0 else [dist.Partial()]
        try:
            y = dist.reshard(d, mesh, pl)
            got = ("returned", [str(p) for p in y.placements], y._local_value().tolist())
        except CollectiveMismatch as e:
            got = ("raised", str(e))
        # the same call on every rank afterwards: the dense value, forward and backward
        w = dist.shard_tensor(_dense().requires_grad_(), mesh, [dist.Shard(0)])
        full = dist.reshard(w, mesh, [dist.Replicate()])
        (full._local_value() * torch.arange(8.0).reshape(4, 2)).sum().backward()
        return got, full._local_value().tolist(), w.grad._local_value().tolist()
    finally:
        set_checking(old)


def test_reshard_to_other_placements_on_one_rank_raises_on_every_rank():
    out = run_ranks(reshard_other_placements, 2, timeout=60)
    dense = _dense()
    for rank, (got, full, grad) in enumerate(out):
        assert got[0] == "raised", f"rank {rank} returned a layout of its own: {got}"
        mine, other = ("rank 0: reshard to [R]", "rank 1: other arguments") if rank == 0 else \
            ("rank 1: reshard to [P", "rank 0: other arguments")
        assert "different arguments" in got[1] and mine in got[1] and other in got[1], got[1]
        assert full == dense.tolist()
        assert grad == torch.arange(8.0).reshape(4, 2)[2 * rank: 2 * rank + 2].tolist()


def reshard_other_mesh():
    """Rank 1 names the same ranks in a mesh of another shape: the same all-gather, to different layouts."""
    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    old = set_checking(True)
    try:
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        d = dist.shard_tensor(_dense(), mesh, [dist.Shard(0)])
        if dist.get_rank() == 0:
            target, pl = mesh, [dist.Replicate()]
        else:
            target, pl = dist.ProcessMesh([[0, 1]], dim_names=["a", "b"]), [dist.Replicate(), dist.Shard(1)]
        try:
            y = dist.reshard(d, target, pl)
            return "returned", y._local_value().tolist()
        except CollectiveMismatch as e:
            return "raised", str(e)
    finally:
        set_checking(old)


def test_reshard_onto_another_mesh_on_one_rank_raises_on_every_rank():
    """The mesh of another shape is planned otherwise (its pieces sent, not all-gathered): the ranks make different
    collectives for the call, and every rank raises naming both (none returns a layout of its own)."""
    with pytest.raises(RankError) as info:
        run_ranks(reshard_other_mesh, 2, timeout=60)
    text = str(info.value)
    assert re.match(r"rank 1 never entered all_gather #1 on group \[0, 1\]: it is elsewhere, in send_recv on group "
                    r"\[0, 1\] at test_divergent_inputs_probe.py:\d+ in reshard_other_mesh\(\)", text), text
    assert [o.status for o in info.value.outcomes] == ["error", "error"], text


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def loader_other_batch_size(sizes):
    """Each rank's loader with its own batch size (``sizes[rank]``); the same loader on every rank afterwards."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=sizes[dist.get_rank()])
    try:
        b = next(iter(dist.shard_dataloader(loader, mesh, shard_dims="dp")))
        got = ("returned", b._local_value().ravel().tolist(), list(b.shape))
    except ValueError as e:
        got = ("raised", str(e))
    same = torch.utils.data.DataLoader(_Rows(), batch_size=4)
    b = next(iter(dist.shard_dataloader(same, mesh, shard_dims="dp")))
    return got, b._local_value().ravel().tolist()


@pytest.mark.parametrize("sizes", [(4, 2), (4, 3)])
def test_shard_dataloader_with_another_batch_size_on_one_rank_raises_on_every_rank(sizes):
    out = run_ranks(loader_other_batch_size, 2, sizes, timeout=60)
    for rank, (got, rows) in enumerate(out):
        assert got[0] == "raised", f"rank {rank} split a batch of its own: {got}"
        assert "shard_dataloader" in got[1] and "batch_size" in got[1], got[1]
        assert rows == [2.0 * rank, 2.0 * rank + 1]


def loader_iterable_same():
    """A loader without a length (an iterable dataset), the same on every rank: accepted, rows as one process."""
    import meshviz.distributed as dist

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.tensor([float(i)]) for i in range(ROWS))

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    return [b._local_value().ravel().tolist() for b in dist.shard_dataloader(loader, mesh, shard_dims="dp")]


def test_shard_dataloader_over_an_iterable_dataset_still_splits_each_batch():
    out = run_ranks(loader_iterable_same, 2, timeout=60)
    assert out == [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]


def loader_refused_on_one_rank():
    """Rank 1 names a mesh axis the mesh lacks: it refuses; rank 0, which accepted, must not go on alone."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4)
    try:
        dist.shard_dataloader(loader, mesh, shard_dims="dp" if dist.get_rank() == 0 else "pd")
        return "returned"
    except ValueError as e:
        return str(e)


def test_shard_dataloader_refused_on_one_rank_raises_on_every_rank():
    out = run_ranks(loader_refused_on_one_rank, 2, timeout=60)
    assert "rank 1: arguments accepted (a refusing rank raises why) False" in out[0], out[0]
    assert "pd" in out[1] and "different settings" not in out[1], out[1]
