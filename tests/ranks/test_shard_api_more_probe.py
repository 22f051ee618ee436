"""shard_layer, shard_optimizer, shard_dataloader and dtensor_from_local in less common uses, against one process."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks


class _Count(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.register_buffer("seen", seen)
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        self.seen.add_(1.0)  # counts the calls in place: whoever shares the buffer sees the count
        return self.lin(x)


class _Scale(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.register_buffer("seen", seen, persistent=False)

    def forward(self, x):
        return x * self.seen


class _Shared(nn.Module):
    """One buffer held by two sub-layers: the first counts its calls into it, the second scales by the count."""

    def __init__(self):
        super().__init__()
        seen = torch.zeros(2)
        self.count = _Count(seen)
        self.scale = _Scale(seen)

    def forward(self, x):
        return self.scale(self.count(x))


def _dense_shared(calls=2):
    torch.manual_seed(0)
    net = _Shared()
    x = torch.arange(6.0).reshape(3, 2)
    return [net(x).detach() for _ in range(calls)]


def shared_buffer(how):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    net = _Shared()

    def shard_fn(name, sub, m):
        if name == "count" and how in ("count", "both"):
            sub.seen = dist.shard_tensor(sub.seen, m, [dist.Shard(0)])
        if name == "scale" and how == "both":
            sub.seen = dist.shard_tensor(sub.seen, m, [dist.Replicate()])

    try:
        dist.shard_layer(net, mesh, shard_fn if how else None)
    except ValueError as e:
        return "raised", str(e), dist.is_dist_tensor(net.count.seen), net.count.seen is net.scale.seen
    x = dist.shard_tensor(torch.arange(6.0).reshape(3, 2), mesh, [dist.Shard(0)])
    outs = [dist.unshard_dtensor(net(x)).detach() for _ in range(2)]
    return (net.count.seen is net.scale.seen, repr(net.count.seen.placements), outs,
            sorted(net.state_dict()), dist.unshard_dtensor(net.count.seen).tolist())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [None, "count"])
def test_a_buffer_two_sublayers_share_stays_one_buffer(how):
    # before: each holder got a Replicate copy of its own, so the count made in one never reached the other
    # (the outputs were all zeros where one process gives x @ W.T + b times 1, then times 2)
    want = _dense_shared()
    for r, (same, placements, outs, keys, seen) in enumerate(run_ranks(shared_buffer, 2, how, timeout=50)):
        assert same, r
        assert placements == ("[S(0)]" if how else "[R]"), r
        for got, w in zip(outs, want):
            torch.testing.assert_close(got, w, msg=str(r))
        assert keys == ["count.lin.bias", "count.lin.weight", "count.seen"], r
        assert seen == [2.0, 2.0], r


@pytest.mark.timeout(60)
def test_a_shared_buffer_placed_two_ways_raises_and_leaves_the_layer():
    for r, (what, msg, placed, same) in enumerate(run_ranks(shared_buffer, 2, "both", timeout=50)):
        assert what == "raised", r
        assert "['count.seen', 'scale.seen'] are one buffer (shared)" in msg, (r, msg)
        assert not placed and same, r


def local_map_without_dist_inputs():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    x = torch.arange(4.0) + r
    twice = dist.local_map(lambda a: (a * 2, "n"), out_placements=[None, None])
    out = {"plain": twice(x)}
    try:
        dist.local_map(lambda a: a * 2, out_placements=[[dist.Shard(0)]])(x)
    except ValueError as e:
        out["placed"] = str(e)
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    placed = dist.local_map(lambda a: a * 2, out_placements=[[dist.Shard(0)]], process_mesh=mesh)(x)
    out["mesh"] = (list(placed.shape), placed._local_value().tolist(), dist.unshard_dtensor(placed).tolist())
    return out


@pytest.mark.timeout(60)
def test_local_map_without_dist_inputs_returns_the_outputs_as_paddle():
    # before: ValueError 'local_map needs a process_mesh' even where no output is placed (Paddle returns them)
    for r, got in enumerate(run_ranks(local_map_without_dist_inputs, 2, timeout=50)):
        a, tag = got["plain"]
        assert not hasattr(a, "placements") and a.tolist() == [2.0 * (i + r) for i in range(4)] and tag == "n", r
        assert "needs a process_mesh" in got["placed"], r
        assert got["mesh"] == ([8], [2.0 * (i + r) for i in range(4)], [0.0, 2.0, 4.0, 6.0, 2.0, 4.0, 6.0, 8.0]), r


def mesh_groups_by_ranks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    g01 = dist.new_group([0, 1])
    got = {"new01": g01.id}
    for name, ids in (("mesh01", [0, 1]), ("mesh10", [1, 0]), ("world", [3, 1, 2, 0]), ("mesh23", [2, 3])):
        g = dist.ProcessMesh(ids, dim_names=["d"]).get_group()
        got[name] = (g.id, g.ranks, g.rank, g is g01, g is dist.get_group(0))
    line = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]).get_group("y")
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=line)
    got["y"] = (line.id, line.ranks, t.item())
    got["next"] = dist.new_group([1, 2]).id
    return got


@pytest.mark.timeout(60)
def test_a_mesh_takes_the_live_group_over_its_ranks_as_paddle():
    # Paddle 3.3.1 (4 CPU ranks): a 1-D mesh's get_group is the group new_group made over the same ranks, or the
    # world's (id 0); before, every mesh made one more group (ids 11, 12, 13, 14, then 15 for the next new_group)
    for r, got in enumerate(run_ranks(mesh_groups_by_ranks, 4, timeout=50)):
        mine = r if r < 2 else -1
        assert got["new01"] == 10, r
        assert got["mesh01"] == (10, [0, 1], mine, True, False), r
        assert got["mesh10"] == (10, [0, 1], mine, True, False), r
        assert got["world"] == (0, [0, 1, 2, 3], r, False, True), r
        assert got["mesh23"] == (11, [2, 3], r - 2 if r >= 2 else -1, False, False), r
        assert got["y"] == ((10, [0, 1], 3.0) if r < 2 else (11, [2, 3], 7.0)), r
        assert got["next"] == 12, r
