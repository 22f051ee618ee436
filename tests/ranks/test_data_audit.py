"""shard_dataloader and DataParallel against Paddle's semantics: which rows each rank holds, and the dense truth."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

N, D = 10, 3


def _dataset(n=N):
    """Row i is [i, i + 0.5, 2i] with label i mod 3: a row's first value names it."""
    x = torch.stack([torch.arange(n) * 1.0, torch.arange(n) + 0.5, torch.arange(n) * 2.0], dim=1)
    return torch.utils.data.TensorDataset(x, (torch.arange(n) % 3).float().unsqueeze(1))


def _rows(t) -> list:
    """The rows (by their first value) this rank's block of ``t`` holds."""
    local = t._local_value() if hasattr(t, "_local_value") else t
    return [int(v) for v in (local[:, 0] if local.dim() > 1 else local).tolist()]


def _init_linear(seed=5):
    torch.manual_seed(seed)
    return nn.Linear(D, 1)


def _dense_sgd(batches):
    """The single-process run: SGD on the mean squared error of each full batch."""
    model = _init_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _full_batches(batch_size, drop_last, n=N):
    return list(torch.utils.data.DataLoader(_dataset(n), batch_size=batch_size, drop_last=drop_last))


# -- shard_dataloader ------------------------------------------------------------------------------------------


def loader_rows(batch_size, drop_last, n, epochs=2):
    """Every batch's rows on this rank, for two epochs, and training on them with a plain model and SGD."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(_dataset(n), batch_size=batch_size, drop_last=drop_last)
    dl = dist.shard_dataloader(loader, mesh, shard_dims="dp")
    model = _init_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(epochs):
        rows = []
        for x, y in dl():
            assert x.placements == [dist.Shard(0)] and y.placements == [dist.Shard(0)]
            rows.append((_rows(x), _rows(y), list(x.shape)))
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        seen.append(rows)
    return {"len": len(dl), "seen": seen,
            "params": {k: dist.unshard_dtensor(v).detach() if dist.is_dist_tensor(v) else v.detach()
                       for k, v in model.state_dict().items()}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size,drop_last,n,split", [
    (4, False, 10, [([0, 1], [2, 3]), ([4, 5], [6, 7]), ([8], [9])]),
    (4, True, 10, [([0, 1], [2, 3]), ([4, 5], [6, 7])]),
    (3, False, 9, [([0, 1], [2]), ([3, 4], [5]), ([6, 7], [8])]),  # 3 rows on 2 ranks: 2 and 1
    (4, False, 9, [([0, 1], [2, 3]), ([4, 5], [6, 7]), ([8], [])]),  # a last batch of one row: 1 and 0
])
def test_shard_dataloader_rows_per_rank_and_training_match_the_dense_run(batch_size, drop_last, n, split):
    res = run_ranks(loader_rows, 2, batch_size, drop_last, n, timeout=50)
    full = _full_batches(batch_size, drop_last, n)
    want = _dense_sgd(full * 2)
    for r in range(2):
        assert res[r]["len"] == len(full)
        for epoch in res[r]["seen"]:  # the second epoch holds the same rows as the first
            assert [rows for rows, _labels, _shape in epoch] == [s[r] for s in split]
            assert [labels for _rows, labels, _shape in epoch] == [[i % 3 for i in s[r]] for s in split]
            assert [shape for _r, _l, shape in epoch] == [[len(b[0]), D] for b in full]
        for k, v in want.items():
            torch.testing.assert_close(res[r]["params"][k], v, rtol=1e-5, atol=1e-6)


class _Dict(torch.utils.data.Dataset):
    """Paddle's example 2: {"inputs": [x1, x2], "label": y}; x2 is x1 + 100, so a row still names itself."""

    def __init__(self, nested=True):
        self.x, self.y = _dataset().tensors
        self.nested = nested

    def __len__(self):
        return N

    def __getitem__(self, i):
        inputs = [self.x[i], self.x[i] + 100] if self.nested else self.x[i]
        return {"inputs": inputs, "label": self.y[i], "extra": torch.tensor(i)}


def _held(v) -> list:
    if isinstance(v, (list, tuple)):
        return [_held(t) for t in v]
    return [_rows(v), repr(v.placements), v.process_mesh.process_ids]


def loader_meshes():
    """Pipeline meshes: inputs on the first stage, labels on the last; dicts, nested lists, per-mesh shard_dims."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    m0 = dist.ProcessMesh([0, 1], dim_names=["dp"])
    m1 = dist.ProcessMesh([2, 3], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=4)
    out = {}
    tuple_dl = dist.shard_dataloader(loader, [m0, m1], shard_dims="dp")
    out["tuple"] = [_held(b) for b in tuple_dl]
    out["dims"] = _held(next(iter(dist.shard_dataloader(loader, [m0, m1], shard_dims=["dp", None]))))
    out["index"] = _held(next(iter(dist.shard_dataloader(loader, [m0, m1], shard_dims=0))))
    nested = torch.utils.data.DataLoader(_Dict(), batch_size=4)
    for name, meshes in (("flat", [m0, m1]), ("lists", [[m0, m0], m1])):
        b = next(iter(dist.shard_dataloader(nested, meshes, input_keys=["inputs", "label"], shard_dims="dp")))
        out[name] = {k: _held(v) for k, v in b.items()}
    b = next(iter(dist.shard_dataloader(nested, [[m0, m1], m1], input_keys=["inputs", "label"],
                                        shard_dims=[["dp", None], "dp"])))
    out["mixed"] = _held(b["inputs"])
    return out


@pytest.mark.timeout(60)
def test_shard_dataloader_pipeline_meshes_dicts_and_nested_inputs():
    res = run_ranks(loader_meshes, 4, timeout=50)
    s0, r = "[S(0)]", "[R]"
    for rank in range(4):
        first = rank < 2
        x_rows = [[0, 1], [2, 3]][rank] if first else []
        y_rows = [] if first else [[0, 1], [2, 3]][rank - 2]
        # batch 0: x (rows 0-3) split over the first stage, y over the last; a rank outside a mesh holds nothing
        assert res[rank]["tuple"][0] == [[x_rows, s0, [0, 1]], [[i % 3 for i in y_rows], s0, [2, 3]]]
        assert len(res[rank]["tuple"]) == 3
        assert res[rank]["tuple"][2][0][0] == ([[8], [9]][rank] if first else [])
        assert res[rank]["index"] == res[rank]["tuple"][0]
        # shard_dims per mesh: None replicates the labels on the last stage
        assert res[rank]["dims"][1] == [[] if first else [0, 1, 2, 0], r, [2, 3]]
        for name in ("flat", "lists"):
            got = res[rank][name]
            assert got["inputs"] == [[x_rows, s0, [0, 1]], [[i + 100 for i in x_rows], s0, [0, 1]]], name
            assert got["label"] == [[i % 3 for i in y_rows], s0, [2, 3]], name
            assert got["extra"] == [x_rows, s0, [0, 1]], name  # a key outside input_keys: the first mesh
        # a nested list with a mesh and a shard_dim per tensor
        assert res[rank]["mixed"] == [[x_rows, s0, [0, 1]], [[] if first else [100, 101, 102, 103], r, [2, 3]]]


def loader_splitted():
    """is_dataset_splitted: each rank's loader yields its own part (a DistributedSampler), placed as it is."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    ds = _dataset()
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=r, shuffle=False)
    dl = dist.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler), mesh,
                               shard_dims="dp", is_dataset_splitted=True)
    model = _init_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows, full = [], []
    for x, y in dl:
        rows.append(_rows(x))
        full.append(_rows(dist.unshard_dtensor(x)))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"len": len(dl), "rows": rows, "full": full,
            "params": {k: dist.unshard_dtensor(v).detach() if dist.is_dist_tensor(v) else v.detach()
                       for k, v in model.state_dict().items()}}


@pytest.mark.timeout(60)
def test_shard_dataloader_of_a_split_dataset_places_each_ranks_part():
    res = run_ranks(loader_splitted, 2, timeout=50)
    # DistributedSampler: rank 0 reads rows 0, 2, 4, 6, 8, rank 1 rows 1, 3, 5, 7, 9; batches of 2 per rank
    assert [res[r]["rows"] for r in range(2)] == [[[0, 2], [4, 6], [8]], [[1, 3], [5, 7], [9]]]
    glob = [[0, 2, 1, 3], [4, 6, 5, 7], [8, 9]]
    assert res[0]["full"] == res[1]["full"] == glob and res[0]["len"] == 3
    x, y = _dataset().tensors
    want = _dense_sgd([(x[b], y[b]) for b in glob])
    for r in range(2):
        for k, v in want.items():
            torch.testing.assert_close(res[r]["params"][k], v, rtol=1e-5, atol=1e-6)


def loader_shuffled():
    """A shuffled loader while the ranks' RNGs differ (per-rank seeds, dropout on one stage only ...)."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = _init_linear()
    torch.manual_seed(100 + dist.get_rank())
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, shuffle=True)
    dl = dist.shard_dataloader(loader, mesh, shard_dims=0)  # an axis index
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs = []
    for _ in range(2):
        rows, full = [], []
        for x, y in dl:
            assert x.placements == [dist.Shard(0), dist.Replicate()]
            rows.append(_rows(x))
            full.append(_rows(dist.unshard_dtensor(x)))
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        epochs.append({"rows": rows, "full": full})
    # the loader's own sampler is left as it was
    return {"epochs": epochs, "generator": loader.sampler.generator,
            "params": {k: dist.unshard_dtensor(v).detach() if dist.is_dist_tensor(v) else v.detach()
                       for k, v in model.state_dict().items()}}


@pytest.mark.timeout(60)
def test_shard_dataloader_shuffles_the_same_way_on_every_rank():
    res = run_ranks(loader_shuffled, 4, timeout=50)
    first = res[0]["epochs"]
    for r in range(4):
        assert res[r]["generator"] is None
        for e, epoch in enumerate(res[r]["epochs"]):
            assert epoch["full"] == first[e]["full"]
            for step, full in enumerate(epoch["full"]):
                # dp coordinate r // 2 holds its half of the global batch; mp neighbours hold the same rows
                half = (len(full) + 1) // 2
                assert epoch["rows"][step] == (full[:half] if r < 2 else full[half:])
    for epoch in first:
        assert sorted(i for b in epoch["full"] for i in b) == list(range(N))
    assert first[0]["full"] != first[1]["full"]  # each epoch its own order
    x, y = _dataset().tensors
    want = _dense_sgd([(x[b], y[b]) for epoch in first for b in epoch["full"]])
    for r in range(4):
        for k, v in want.items():
            torch.testing.assert_close(res[r]["params"][k], v, rtol=1e-5, atol=1e-6)


def loader_bad_input():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    r = dist.get_rank()
    m0 = dist.ProcessMesh([0, 1], dim_names=["dp"])
    m1 = dist.ProcessMesh([2, 3], dim_names=["dp"])
    ds = _dataset()
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    split = torch.utils.data.DataLoader(ds, batch_size=2, sampler=torch.utils.data.DistributedSampler(
        ds, num_replicas=2, rank=r % 2))
    world = torch.utils.data.DataLoader(ds, batch_size=2, sampler=torch.utils.data.DistributedSampler(
        ds, num_replicas=4, rank=r))
    triples = torch.utils.data.DataLoader(list(zip(*ds.tensors, ds.tensors[1])), batch_size=4)
    dicts = torch.utils.data.DataLoader(_Dict(nested=False), batch_size=4)
    cases = {
        "splitted without shard_dims": lambda: dist.shard_dataloader(loader, m0, is_dataset_splitted=True),
        "sampler already splits": lambda: dist.shard_dataloader(split, m0, shard_dims="dp"),
        "sampler parts != axis": lambda: dist.shard_dataloader(world, m0, shard_dims="dp", is_dataset_splitted=True),
        "too many inputs": lambda: next(iter(dist.shard_dataloader(triples, [m0, m1], shard_dims="dp"))),
        "missing key": lambda: next(iter(dist.shard_dataloader(dicts, [m0, m1], input_keys=["inputs", "labels"],
                                                               shard_dims="dp"))),
        "input_keys != meshes": lambda: dist.shard_dataloader(dicts, [m0, m1], input_keys=["inputs"]),
        "list dims for a tensor": lambda: next(iter(dist.shard_dataloader(loader, [[m0, m0], m1],
                                                                          shard_dims="dp"))),
        "mesh axis out of range": lambda: dist.shard_dataloader(loader, m0, shard_dims=1),
        "unknown axis in a list": lambda: dist.shard_dataloader(loader, [[m0, m0], m1], shard_dims=[["dp", "x"], 0]),
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
def test_shard_dataloader_bad_input_raises_on_every_rank_before_communicating():
    res = run_ranks(loader_bad_input, 4, timeout=50)
    words = {"splitted without shard_dims": "needs shard_dims", "sampler already splits": "is_dataset_splitted=True",
             "sampler parts != axis": "4 parts", "too many inputs": "3 inputs for 2 meshes",
             "missing key": "['labels']", "input_keys != meshes": "1 input_keys for 2 meshes",
             "list dims for a tensor": "is a tensor", "mesh axis out of range": "out of range",
             "unknown axis in a list": "'x'"}
    for r in range(4):
        for name, word in words.items():
            assert res[r][name] is not None and word in res[r][name], (r, name, res[r][name])


# -- DataParallel ----------------------------------------------------------------------------------------------


class _Net(nn.Module):
    """Linear layers a, b (b used only when asked), c (never used, if any), a frozen scale, a float and an int
    buffer."""

    def __init__(self, with_c=False):
        super().__init__()
        self.a = nn.Linear(D, 1)
        self.b = nn.Linear(D, 1)
        self.c = nn.Linear(D, 1) if with_c else None
        self.scale = nn.Parameter(torch.randn(1), requires_grad=False)
        self.register_buffer("total", torch.randn(1))
        self.register_buffer("calls", torch.randint(0, 100, (1,)))

    def forward(self, x, use_b=True):
        if self.training:
            self.total += x.detach().sum()
            self.calls += 1
        out = self.a(x) * self.scale
        return out + self.b(x) if use_b else out


def _dp_batch(rank, step, n=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, D, generator=g), torch.randn(n, 1, generator=g)


def _grads(m) -> dict:
    return {k: None if p.grad is None else p.grad.detach().clone() for k, p in m.named_parameters()}


def _state(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def dp_run(mode, world_ranks):
    """``mode``: "accumulate" (2 micro-batches in no_sync, then a synced one), "fused" (every backward in no_sync,
    then fused_allreduce_gradients), "unused" (b used on rank 0 only, find_unused_parameters=True), "fused_unused"
    (b used on rank 0 only, c on none, the backward in no_sync, then fused_allreduce_gradients)."""
    import meshviz.distributed as dist
    from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    dist.init_parallel_env()
    r = dist.get_rank()
    groups = [dist.new_group(g) for g in world_ranks]
    group = next(g for g, ranks in zip(groups, world_ranks) if r in ranks)
    torch.manual_seed(r)  # every rank its own initial values: the wrap makes them the group's first rank's
    net = _Net(with_c=mode in _UNUSED)
    dp = dist.DataParallel(net, find_unused_parameters=mode == "unused",
                           group=None if len(world_ranks) == 1 else group)
    out = {"wrapped": _state(dp), "keys": sorted(dp.state_dict())}
    opt = torch.optim.SGD([p for p in dp.parameters() if p.requires_grad], lr=0.1)
    out["grads"] = []
    for step in range(2):
        micro = [_dp_batch(r, 3 * step + m) for m in range(3)]
        if mode == "unused":
            x, y = micro[0]
            nn.functional.mse_loss(dp(x, use_b=r == 0), y).backward()
        elif mode == "fused_unused":  # b's gradient on rank 0 only: the buffers must still agree
            x, y = micro[0]
            with dp.no_sync():
                nn.functional.mse_loss(dp(x, use_b=r == 0), y).backward()
            fused_allreduce_gradients(list(dp.parameters()), None)
        else:
            for m, (x, y) in enumerate(micro):
                if m < 2 or mode == "fused":
                    with dp.no_sync():
                        nn.functional.mse_loss(dp(x), y).backward()
                else:
                    nn.functional.mse_loss(dp(x), y).backward()
            if mode == "fused":
                fused_allreduce_gradients(list(dp.parameters()), None)
        out["grads"].append(_grads(net))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["trained"] = _state(dp)
    return out


_UNUSED = ("unused", "fused_unused")


def _dense_dp(mode, ranks):
    """The single-process run: the group's first rank's initial values, each step's loss the mean over the group's
    ranks (ranks that do not use b contribute nothing to its gradient)."""
    torch.manual_seed(ranks[0])
    net = _Net(with_c=mode in _UNUSED)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    grads = []
    for step in range(2):
        loss = 0
        for m in range(1 if mode in _UNUSED else 3):
            for r in ranks:
                x, y = _dp_batch(r, 3 * step + m)
                use_b = mode not in _UNUSED or r == ranks[0]
                loss = loss + nn.functional.mse_loss(net(x, use_b=use_b), y) / len(ranks)
        loss.backward()
        grads.append(_grads(net))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, net


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,world_ranks", [
    ("accumulate", [[0, 1]]), ("fused", [[0, 1]]), ("unused", [[0, 1]]), ("accumulate", [[0, 1], [2, 3]]),
    ("fused_unused", [[0, 1, 2]]),
])
def test_data_parallel_matches_the_dense_run(mode, world_ranks):
    n = sum(len(g) for g in world_ranks)
    res = run_ranks(dp_run, n, mode, world_ranks, timeout=50)
    for ranks in world_ranks:
        torch.manual_seed(ranks[0])
        first = _Net(with_c=mode in _UNUSED)
        grads, dense = _dense_dp(mode, ranks)
        for r in ranks:
            got = res[r]
            # parameters and buffers, the frozen one and the int one too, are the group's first rank's at the wrap
            assert got["keys"] == sorted(first.state_dict())
            for k, v in first.state_dict().items():
                assert torch.equal(got["wrapped"][k], v), (r, k)
            assert got["wrapped"]["calls"].dtype == torch.int64
            for step in range(2):
                for k, g in grads[step].items():
                    if g is None:  # the frozen scale, and c, which no rank uses
                        assert got["grads"][step][k] is None, (r, k)
                    else:
                        torch.testing.assert_close(got["grads"][step][k], g, rtol=1e-5, atol=1e-6, msg=(r, k))
            for k, p in dense.named_parameters():
                torch.testing.assert_close(got["trained"][k], p.detach(), rtol=1e-5, atol=1e-6, msg=(r, k))
            # buffers are synced at the wrap only, as in Paddle: each rank's then count its own batches
            forwards = 2 * (1 if mode in _UNUSED else 3)
            own = sum(_dp_batch(r, 3 * s + m)[0].sum() for s in range(2) for m in range(forwards // 2))
            assert int(got["trained"]["calls"]) == int(first.calls) + forwards, r
            torch.testing.assert_close(got["trained"]["total"], first.total + own, msg=r)


def dp_unused_without_finding():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(0)
    net = _Net()
    dp = dist.DataParallel(net)
    grads = []
    for step in range(2):
        x, y = _dp_batch(r, step)
        # b used by every rank at the first synced step, then by rank 0 alone: DDP is not searching for it
        nn.functional.mse_loss(dp(x, use_b=r == 0 or step == 0), y).backward()
        grads.append(_grads(net))
        net.zero_grad()
    return grads


@pytest.mark.timeout(60)
def test_data_parallel_averages_a_parameter_a_rank_leaves_unused_after_the_first_step():
    """Rank 1 sends zeros for b at the end of its backward, as one process counts it (it used to raise there, while
    rank 0 waited in b's all-reduce)."""
    res = run_ranks(dp_unused_without_finding, 2, timeout=50)
    torch.manual_seed(0)
    net = _Net()
    for step in range(2):
        sum(nn.functional.mse_loss(net(_dp_batch(r, step)[0], use_b=r == 0 or step == 0), _dp_batch(r, step)[1])
            for r in range(2)).div(2).backward()
        for r in range(2):
            for k, g in _grads(net).items():
                if g is None:
                    assert res[r][step][k] is None, (r, step, k)
                else:
                    torch.testing.assert_close(res[r][step][k], g, rtol=1e-5, atol=1e-6, msg=(r, step, k))
        net.zero_grad()
