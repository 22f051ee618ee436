"""shard_dataloader's less common batches and uses, against Paddle's per-rank loaders and one process."""

import collections

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

N = 10


class _Rows(torch.utils.data.Dataset):
    """Row i: x = [i, i + 0.5], y = i mod 3, a name, an int and a nested dict; every value names its row."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i), i + 0.5]), "y": torch.tensor([float(i % 3)]), "name": f"s{i}",
                "k": i, "meta": {"z": torch.tensor([i]), "tag": f"t{i}"}}


def _rows(t) -> list:
    local = t._local_value() if hasattr(t, "_local_value") else t
    return [int(v) for v in (local[:, 0] if local.dim() > 1 else local).tolist()]


def dense_values():
    """Strings, ints and nested dicts next to the batch's tensors, on a 2-D mesh split along 'y' and on two
    pipeline stages."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4)
    out = {}
    b = next(iter(dist.shard_dataloader(loader, mesh, shard_dims="y")))
    out["mesh"] = [_rows(b["x"]), b["name"], _rows(b["k"]), _rows(b["meta"]["z"]), b["meta"]["tag"],
                   type(b["meta"]["z"]).__name__]
    b = next(iter(dist.shard_dataloader(loader, mesh, shard_dims=None)))
    out["replicated"] = [_rows(b["x"]), b["name"], _rows(b["meta"]["z"])]
    stages = [dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"])]
    dl = dist.shard_dataloader(loader, stages, input_keys=["x", "y"], shard_dims="dp")
    out["stages"] = [[_rows(b["x"]), [int(v) for v in _rows(b["y"])], b["name"], _rows(b["meta"]["z"])]
                     for b in dl]
    # a tuple batch: (x, names) where the names are a list of strings
    pairs = torch.utils.data.DataLoader([(torch.tensor([float(i)]), f"s{i}") for i in range(5)], batch_size=5)
    x, names = next(iter(dist.shard_dataloader(pairs, mesh, shard_dims="x")))
    out["tuple"] = [_rows(x), list(names)]

    def collate(samples):  # ragged lists of ids, one per row, as a tokenizer's collate gives them
        return {"x": torch.stack([s["x"] for s in samples]), "ids": [[s["k"]] * (s["k"] % 3 + 1) for s in samples]}

    b = next(iter(dist.shard_dataloader(torch.utils.data.DataLoader(_Rows(), batch_size=4, collate_fn=collate),
                                        mesh, shard_dims="y")))
    out["ids"] = [_rows(b["x"]), b["ids"]]
    return out


@pytest.mark.timeout(60)
def test_dense_values_of_a_batch_hold_this_ranks_rows_as_in_paddle():
    # Paddle 3.3.1 gives each rank a loader of its own part: what it leaves dense holds that rank's rows too
    res = run_ranks(dense_values, 4, timeout=50)
    for r in range(4):
        mine = [[0, 1], [2, 3]][r % 2]  # 'y' coordinate r % 2
        assert res[r]["mesh"] == [mine, [f"s{i}" for i in mine], mine, mine, [f"t{i}" for i in mine], "Tensor"]
        assert res[r]["replicated"] == [[0, 1, 2, 3], ["s0", "s1", "s2", "s3"], [0, 1, 2, 3]]
        # first stage ranks hold x, last stage ranks y; each its own rows (its stage's coordinate) of the rest
        want = [[0, 1], [2, 3], [4, 5], [6, 7], [8], [9]]
        for step, got in enumerate(res[r]["stages"]):
            rows = want[2 * step + r % 2]
            assert got == [rows if r < 2 else [], [] if r < 2 else [i % 3 for i in rows],
                           [f"s{i}" for i in rows], rows], (r, step)
        mine = [[0, 1, 2], [3, 4]][r // 2]  # 5 rows on 'x': 3 and 2
        assert res[r]["tuple"] == [mine, [f"s{i}" for i in mine]]
        assert res[r]["ids"] == [[[0, 1], [[0], [1, 1]]], [[2, 3], [[2, 2, 2], [3]]]][r % 2]


P = collections.namedtuple("P", "x y")


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return P(torch.tensor([float(i)]), torch.tensor(i))


def _next_or_stop(dl):
    try:
        return _rows(next(dl).x)
    except StopIteration:
        return "StopIteration"


def next_and_namedtuples():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    dl = dist.shard_dataloader(torch.utils.data.DataLoader(_Pairs(), batch_size=4), mesh, shard_dims="dp")
    out = {"next": [_next_or_stop(dl) for _ in range(5)]}  # one pass, then exhausted until a new one starts
    first = next(iter(dl))
    out["type"] = [type(first).__name__, repr(first.x.placements), list(first.y.shape)]
    out["pass"] = [_rows(b.y) for b in dl]
    out["next_after_pass"] = _next_or_stop(dl)  # a pass restarts what next(loader) continues
    return out


@pytest.mark.timeout(60)
def test_next_on_the_loader_continues_one_pass_and_namedtuple_batches_keep_their_type():
    res = run_ranks(next_and_namedtuples, 2, timeout=50)
    for r in range(2):
        got = res[r]
        assert got["next"] == [[[0, 1], [2, 3]][r], [[4, 5], [6, 7]][r], [[8], [9]][r], "StopIteration",
                               "StopIteration"]
        assert got["type"] == ["P", "[S(0)]", [4]]
        assert got["pass"] == [[[0, 1], [2, 3]][r], [[4, 5], [6, 7]][r], [[8], [9]][r]]
        assert got["next_after_pass"] == [[0, 1], [2, 3]][r]


def epochs():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)  # each rank its own global RNG
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    ds = torch.utils.data.TensorDataset(torch.arange(float(N)))
    dl = dist.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True), mesh, shard_dims="dp")
    passes = [[_rows(dist.unshard_dtensor(x)) for (x,) in dl] for _ in range(3)]
    dl.set_epoch(1)
    again = [_rows(dist.unshard_dtensor(x)) for (x,) in dl]
    then = [_rows(dist.unshard_dtensor(x)) for (x,) in dl]
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=3)
    split = dist.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=5, sampler=sampler), mesh,
                                  shard_dims="dp", is_dataset_splitted=True)
    split.set_epoch(4)
    return {"passes": passes, "again": again, "then": then, "sampler_epoch": sampler.epoch,
            "split": [_rows(x) for (x,) in split]}


@pytest.mark.timeout(60)
def test_set_epoch_picks_the_shuffled_order_of_that_pass():
    res = run_ranks(epochs, 2, timeout=50)
    assert res[0]["passes"] == res[1]["passes"]
    p = res[0]["passes"]
    assert p[0] != p[1] != p[2]
    for r in range(2):
        assert res[r]["again"] == p[1] and res[r]["then"] == p[2]
        assert res[r]["sampler_epoch"] == 4
        # a DistributedSampler at epoch 4: its own order for that epoch
        s = torch.utils.data.DistributedSampler(range(N), num_replicas=2, rank=r, shuffle=True, seed=3)
        s.set_epoch(4)
        assert res[r]["split"] == [list(s)]


def sampler_rank():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    out = {}
    for name, part in (("global rank mod 2", r % 2), ("coordinate", r // 2)):
        s = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=part, shuffle=False)
        try:
            dl = dist.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=4, sampler=s), mesh,
                                       shard_dims="dp", is_dataset_splitted=True)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["rows"] = [_rows(dist.unshard_dtensor(x)) for (x,) in dl]  # the loader the coordinates read
    return out


@pytest.mark.timeout(60)
def test_a_split_loaders_sampler_must_read_the_part_of_the_ranks_coordinate():
    res = run_ranks(sampler_rank, 4, timeout=50)
    for r in range(4):
        # rank 1 sits at dp 0 and rank 2 at dp 1: reading part r % 2 they would each hold the other dp half, and
        # the mp replicas of one block would differ
        got = res[r]["global rank mod 2"]
        if r in (1, 2):
            assert f"reads part {r % 2}, but the rank sits at {r // 2}" in got, got
        else:  # accepted here but refused on ranks 1 and 2: every rank raises, none waits for them later
            assert "ranks 1, 2: arguments accepted (a refusing rank raises why) False" in got, got
        assert res[r]["coordinate"] is None and res[r]["rows"] == [[0, 2, 4, 6, 1, 3, 5, 7]]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(2, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def train_3d():
    """A 2x2x2 mesh, split along the middle axis; batches of 3 (uneven: 2 and 1 rows) with strings beside them."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["pp", "dp", "mp"])
    torch.manual_seed(100 + dist.get_rank())
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=3, shuffle=True)
    dl = dist.shard_dataloader(loader, mesh, shard_dims="dp")
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(2):
        for b in dl:
            assert b["x"].placements == [dist.Replicate(), dist.Shard(0), dist.Replicate()]
            assert b["name"] == [f"s{i}" for i in _rows(b["x"])]
            seen.append(_rows(dist.unshard_dtensor(b["x"])))
            nn.functional.mse_loss(model(b["x"]), b["y"]).backward()
            opt.step()
            opt.zero_grad()
    return {"seen": seen, "len": len(dl),
            "params": {k: dist.unshard_dtensor(v).detach() if dist.is_dist_tensor(v) else v.detach()
                       for k, v in model.state_dict().items()}}


@pytest.mark.timeout(90)
def test_training_on_a_3d_mesh_from_uneven_shuffled_batches_matches_one_process():
    res = run_ranks(train_3d, 8, timeout=80)
    seen = res[0]["seen"]
    assert all(res[r]["seen"] == seen for r in range(8)) and res[0]["len"] == 4
    assert sorted(sum(seen[:4], [])) == list(range(N)) and seen[:4] != seen[4:]
    data = [_Rows()[i] for i in range(N)]
    x = torch.stack([d["x"] for d in data])
    y = torch.stack([d["y"] for d in data])
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for rows in seen:
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    for r in range(8):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res[r]["params"][k], v, rtol=1e-5, atol=1e-6, msg=(r, k))


def dict_keys_for_meshes():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    stages = [dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"])]
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4)
    before = dict(rollcall.current().entered)
    try:
        next(iter(dist.shard_dataloader(loader, stages, shard_dims="dp")))
        got = None
    except ValueError as e:
        got = str(e)
    assert dict(rollcall.current().entered) == before
    b = next(iter(dist.shard_dataloader(loader, stages, input_keys=["x", "y"], shard_dims="dp")))
    return got, {k: v.process_mesh.process_ids for k, v in b.items() if dist.is_dist_tensor(v)}


@pytest.mark.timeout(60)
def test_a_dict_batch_on_several_meshes_without_input_keys_needs_one_key_per_mesh():
    # Paddle asserts one key per mesh; placing the extra keys ('name', 'k', 'meta') on the last stage was silent
    res = run_ranks(dict_keys_for_meshes, 4, timeout=50)
    for r in range(4):
        err, meshes = res[r]
        assert err is not None and "a dict batch of 5 keys for 2 meshes: pass input_keys" in err, err
        assert meshes == {"x": [0, 1], "y": [2, 3], "k": [0, 1]}  # a key input_keys leaves out: the first mesh


class _Encoding(collections.UserDict):
    """A mapping that is not a dict, as a tokenizer's BatchEncoding."""


def mapping_batches():
    import types

    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])

    def encode(samples):
        return _Encoding(x=torch.stack([s["x"] for s in samples]), name=[s["name"] for s in samples])

    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4, collate_fn=encode)
    b = next(iter(dist.shard_dataloader(loader, mesh, shard_dims="dp")))
    out = {"mapping": [dist.is_dist_tensor(b["x"]), _rows(b["x"]), repr(b["x"].placements), b["name"]]}
    odd = torch.utils.data.DataLoader(_Rows(), batch_size=4, collate_fn=lambda s: types.SimpleNamespace(rows=s))
    before = dict(rollcall.current().entered)
    try:
        next(iter(dist.shard_dataloader(odd, mesh, shard_dims="dp")))
        out["odd"] = None
    except ValueError as e:
        out["odd"] = str(e)
    assert dict(rollcall.current().entered) == before
    return out


@pytest.mark.timeout(60)
def test_a_mapping_batch_is_split_as_a_dict_and_an_unknown_batch_raises():
    # Paddle refuses a batch that is not a tensor, dict, list or tuple; a non-dict mapping passed through unsplit
    res = run_ranks(mapping_batches, 2, timeout=50)
    for r in range(2):
        mine = [[0, 1], [2, 3]][r]
        assert res[r]["mapping"] == [True, mine, "[S(0)]", [f"s{i}" for i in mine]]
        assert "a batch is a tensor, a dict or a list of them, got <class 'types.SimpleNamespace'>" in res[r]["odd"]
