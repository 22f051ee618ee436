"""shard_dataloader's dense_tensor_idx, batch_size, batch_sampler and passes, against the plain DataLoader's batches."""

import pytest
import torch

from meshviz.core.layout import chunk
from meshviz.testing import run_ranks

N = 10


class _Lists(torch.utils.data.Dataset):
    """Row i: ([a, b], y) with a = [i, i + 0.5], b = [10 + i], y = [i mod 3]."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return [torch.tensor([float(i), i + 0.5]), torch.tensor([10.0 + i])], torch.tensor([float(i % 3)])


class _Dicts(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "m": {"z": torch.tensor([i])}, "y": torch.tensor([2.0 * i])}


def _mesh(world):
    """The mesh and the axis batches split along: 2 ranks on 'dp', 4 on 'y' of a 2x2 mesh (parts 2, rank r at r % 2)."""
    import meshviz.distributed as dist

    if world == 2:
        return dist.ProcessMesh([0, 1], dim_names=["dp"]), "dp"
    return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]), "y"


def _held(t):
    """('dist', its local block, the whole) or ('dense', the tensor)."""
    import meshviz.distributed as dist

    if dist.is_dist_tensor(t):
        return "dist", t._local_value().cpu(), dist.unshard_dtensor(t).cpu()
    return "dense", t.cpu()


def dense_idx(world):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh, axis = _mesh(world)
    lists = torch.utils.data.DataLoader(_Lists(), batch_size=4)
    dl = dist.shard_dataloader(lists, mesh, shard_dims=axis, dense_tensor_idx=[[1], [0]])
    out = {"lists": [[_held(a), _held(b), _held(y)] for (a, b), y in dl]}
    dicts = torch.utils.data.DataLoader(_Dicts(), batch_size=4)
    dl = dist.shard_dataloader(dicts, mesh, input_keys=["y", "x"], shard_dims=axis, dense_tensor_idx=[[], [0]])
    out["dicts"] = [[_held(b["x"]), _held(b["y"]), _held(b["m"]["z"])] for b in dl]
    sampler = torch.utils.data.DistributedSampler(_Lists(), num_replicas=2, rank=dist.get_rank() % 2, shuffle=False)
    part = torch.utils.data.DataLoader(_Lists(), batch_size=2, sampler=sampler)
    dl = dist.shard_dataloader(part, mesh, shard_dims=axis, is_dataset_splitted=True, dense_tensor_idx=[[0], []])
    out["splitted"] = [[_held(a), _held(b), _held(y)] for (a, b), y in dl]
    dl = dist.shard_dataloader(lists, mesh, dense_tensor_idx=[[0, 1], []])
    out["replicated"] = [[_held(a), _held(b), _held(y)] for (a, b), y in dl]
    if world == 4:
        stages = [dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"])]
        dl = dist.shard_dataloader(dicts, stages, input_keys=["x", "y"], shard_dims="dp",
                                   dense_tensor_idx=[[0], []])
        out["stages"] = [[_held(b["x"]), _held(b["y"])] for b in dl]
        # input_keys naming a nested dict: it stays dense, as Paddle passes a dict value through
        dl = dist.shard_dataloader(dicts, stages, input_keys=["m", "y"], shard_dims="dp")
        out["nested"] = [[_held(b["m"]["z"]), _held(b["y"])] for b in dl]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dense_tensor_idx_keeps_those_inputs_dense_with_this_ranks_rows(world):
    # Paddle 3.3.1: dense_tensor_idx[i] lists the tensors of list input i that stay dense (any entry: a tensor
    # input stays dense); a dense input holds the rows of the rank's own loader, as the rest left dense
    res = run_ranks(dense_idx, world, world, timeout=50)
    whole = list(torch.utils.data.DataLoader(_Lists(), batch_size=4))
    dicts = list(torch.utils.data.DataLoader(_Dicts(), batch_size=4))
    for r in range(world):
        rows = [slice(*chunk(len(y), 2, r % 2)) for _, y in whole]
        got = res[r]["lists"]
        assert len(got) == len(whole) == 3
        for k, (((a, b), y), (ga, gb, gy)) in enumerate(zip(whole, got, strict=True)):
            assert ga[0] == "dist" and torch.equal(ga[1], a[rows[k]]) and torch.equal(ga[2], a), (r, k)
            assert gb[0] == "dense" and torch.equal(gb[1], b[rows[k]]), (r, k)
            assert gy[0] == "dense" and torch.equal(gy[1], y[rows[k]]), (r, k)
        for k, (b, (gx, gy, gz)) in enumerate(zip(dicts, res[r]["dicts"], strict=True)):
            assert gx[0] == "dense" and torch.equal(gx[1], b["x"][rows[k]]), (r, k)
            assert gy[0] == "dist" and torch.equal(gy[1], b["y"][rows[k]]) and torch.equal(gy[2], b["y"]), (r, k)
            assert gz[0] == "dense" and torch.equal(gz[1], b["m"]["z"][rows[k]]), (r, k)
        parts = [list(torch.utils.data.DataLoader(_Lists(), batch_size=2, sampler=range(q, N, 2))) for q in (0, 1)]
        for k, (((a, b), y), (ga, gb, gy)) in enumerate(zip(parts[r % 2], res[r]["splitted"], strict=True)):
            # each rank's loader reads its own part: dense a is that part's batch, b's block too
            assert ga[0] == "dense" and torch.equal(ga[1], a), (r, k)
            assert gb[0] == "dist" and torch.equal(gb[1], b), (r, k)
            assert gy[0] == "dist" and torch.equal(gy[1], y), (r, k)
            assert torch.equal(gb[2], torch.cat([parts[0][k][0][1], parts[1][k][0][1]])), (r, k)
        for k, (((a, b), y), (ga, gb, gy)) in enumerate(zip(whole, res[r]["replicated"], strict=True)):
            assert [ga[0], gb[0], gy[0]] == ["dense", "dense", "dist"], (r, k)
            assert torch.equal(ga[1], a) and torch.equal(gb[1], b) and torch.equal(gy[1], y), (r, k)
        if world == 4:
            for k, (b, (gx, gy)) in enumerate(zip(dicts, res[r]["stages"], strict=True)):
                assert gx[0] == "dense" and torch.equal(gx[1], b["x"][rows[k]]), (r, k)
                assert gy[0] == "dist" and (gy[1].numel() == 0 if r < 2 else torch.equal(gy[1], b["y"][rows[k]]))
                if r >= 2:  # the last stage's ranks hold y; the first stage's an empty block
                    assert torch.equal(gy[2], b["y"]), (r, k)
            for k, (b, (gz, gy)) in enumerate(zip(dicts, res[r]["nested"], strict=True)):
                assert gz[0] == "dense" and torch.equal(gz[1], b["m"]["z"][rows[k]]), (r, k)
                assert gy[0] == "dist" and (gy[1].numel() == 0 if r < 2 else torch.equal(gy[1], b["y"][rows[k]]))


def sizes(world):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh, axis = _mesh(world)
    ds = torch.utils.data.TensorDataset(torch.arange(float(N)))
    out = {}
    for name, bs, drop in (("even", 4, False), ("uneven", 3, False), ("drop_last", 4, True)):
        dl = dist.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=bs, drop_last=drop), mesh,
                                   shard_dims=axis)
        held = [x._local_value().tolist() for (x,) in dl]
        out[name] = [dl.batch_size, len(dl), len(dl.batch_sampler), list(dl.batch_sampler), held,
                     [dl.batch_sampler.nranks, dl.batch_sampler.local_rank, dl.batch_sampler.drop_last]]
    torch.manual_seed(r)  # each rank its own global RNG
    dl = dist.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True), mesh, shard_dims=axis)
    dl.batch_sampler.set_epoch(3)
    indices = list(dl.batch_sampler)
    dl.batch_sampler.set_epoch(3)
    out["shuffled"] = [indices, [x._local_value().tolist() for (x,) in dl], dl.batch_sampler.shuffle]
    loader = torch.utils.data.DataLoader(ds, batch_size=5)
    dl = dist.shard_dataloader(loader, mesh, shard_dims=None)
    out["replicated"] = [dl.batch_size, len(dl), dl.batch_sampler is loader.batch_sampler]
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=r % 2, shuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler)
    dl = dist.shard_dataloader(loader, mesh, shard_dims=axis, is_dataset_splitted=True)
    out["splitted"] = [dl.batch_size, len(dl), dl.batch_sampler is loader.batch_sampler,
                       [x._local_value().tolist() for (x,) in dl]]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_batch_size_and_batch_sampler_are_this_ranks_as_in_paddle(world):
    # Paddle 3.3.1 (2 ranks, 10 rows): batch 4 -> batch_size 2, len 3, rank 0's sampler [[0, 1], [4, 5], [8]];
    # is_dataset_splitted or no shard_dims: the loader's own batch size
    res = run_ranks(sizes, world, world, timeout=50)
    ds = range(N)
    for r in range(world):
        for name, bs, drop in (("even", 4, False), ("uneven", 3, False), ("drop_last", 4, True)):
            whole = list(torch.utils.data.BatchSampler(ds, bs, drop))
            mine = [idx[slice(*chunk(len(idx), 2, r % 2))] for idx in whole]
            got = res[r][name]
            assert got[:4] == [bs // 2, len(whole), len(whole), mine], (r, name, got)
            assert got[4] == [[float(i) for i in m] for m in mine], (r, name)
            assert got[5] == [2, r % 2, drop], (r, name)
        order = list(torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3)))
        mine = [order[k:k + 4][slice(*chunk(len(order[k:k + 4]), 2, r % 2))] for k in range(0, N, 4)]
        assert res[r]["shuffled"] == [mine, [[float(i) for i in m] for m in mine], True], r
        assert res[r]["replicated"] == [5, 2, True]
        part = list(range(N))[r % 2::2]
        assert res[r]["splitted"] == [2, 3, True, [[float(i) for i in part[k:k + 2]] for k in range(0, 5, 2)]]


def passes(world):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh, axis = _mesh(world)
    dl = dist.shard_dataloader(torch.utils.data.DataLoader(_Dicts(), batch_size=4), mesh, shard_dims=axis)
    out = {}
    for b in dl:
        first = b["x"]._local_value().tolist()
        break
    out["break"] = [first, next(dl)["x"]._local_value().tolist()]  # continues the pass the loop left
    out["twice"] = [[b["x"]._local_value().tolist() for b in dl] for _ in range(2)]
    out["call"] = [b["x"]._local_value().tolist() for b in dl()]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_next_after_a_loop_breaks_continues_its_pass_and_passes_repeat(world):
    # Paddle 3.3.1: for b in loader: break; next(loader) gives the second batch (rank 0 rows 4, 5), not the first
    res = run_ranks(passes, world, world, timeout=50)
    whole = [b["x"] for b in torch.utils.data.DataLoader(_Dicts(), batch_size=4)]
    for r in range(world):
        mine = [x[slice(*chunk(len(x), 2, r % 2))].tolist() for x in whole]
        assert res[r]["break"] == mine[:2], r
        assert res[r]["twice"] == [mine, mine] and res[r]["call"] == mine, r


def bad_input(world):
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    mesh, axis = _mesh(world)
    stages = [dist.ProcessMesh([0], dim_names=["dp"]), dist.ProcessMesh([1], dim_names=["dp"])]
    lists = torch.utils.data.DataLoader(_Lists(), batch_size=4)
    dicts = torch.utils.data.DataLoader(_Dicts(), batch_size=4)
    cases = {
        "flat dense_tensor_idx": lambda: dist.shard_dataloader(lists, mesh, shard_dims=axis, dense_tensor_idx=[0, 1]),
        "negative index": lambda: dist.shard_dataloader(lists, mesh, shard_dims=axis, dense_tensor_idx=[[-1], []]),
        "entries != meshes": lambda: dist.shard_dataloader(lists, stages, shard_dims="dp", dense_tensor_idx=[[1]]),
        "entries != inputs": lambda: next(iter(dist.shard_dataloader(dicts, mesh, shard_dims=axis,
                                                                     dense_tensor_idx=[[], [0]]))),
        "index past a list": lambda: next(iter(dist.shard_dataloader(lists, mesh, shard_dims=axis,
                                                                     dense_tensor_idx=[[2], []]))),
        "input_keys a string": lambda: dist.shard_dataloader(dicts, mesh, input_keys="x", shard_dims=axis),
        "a key twice": lambda: dist.shard_dataloader(dicts, stages, input_keys=["x", "x"], shard_dims="dp"),
    }
    out = {}
    for name, fn in cases.items():
        before = dict(rollcall.current().entered)
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        assert dict(rollcall.current().entered) == before, name
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_bad_dense_tensor_idx_and_input_keys_raise_on_every_rank_before_communicating(world):
    res = run_ranks(bad_input, world, world, timeout=50)
    words = {"flat dense_tensor_idx": "one list of indices per input", "negative index": "[[-1], []]",
             "entries != meshes": "1 dense_tensor_idx entries for 2 meshes",
             "entries != inputs": "2 entries for a batch of 3 inputs", "index past a list": "[2] names a tensor past",
             "input_keys a string": "input_keys must be a list", "a key twice": "name a key twice"}
    for r in range(world):
        for name, word in words.items():
            assert res[r][name] is not None and word in res[r][name], (r, name, res[r][name])
