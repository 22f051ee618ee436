"""save_state_dict/load_state_dict across layouts: saved on N ranks in one, loaded on M in another, checked by hand."""

import random
import zlib

import pytest
import torch

from meshviz.testing import run_ranks

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64, "f64": torch.float64}


def _dense(key: str, shape, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype == "i64":
        return torch.randint(-(2 ** 40), 2 ** 40, tuple(shape), generator=g)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(DTYPES[dtype])


def _mesh_shape(ids) -> list:
    shape = []
    while isinstance(ids, list):
        shape.append(len(ids))
        ids = ids[0]
    return shape


def _coord(ids, rank):
    """``rank``'s coordinate in the nested list ``ids``; None when it is not there."""
    if not isinstance(ids, list):
        return () if ids == rank else None
    for i, sub in enumerate(ids):
        c = _coord(sub, rank)
        if c is not None:
            return (i, *c)
    return None


def _block(shape, ids, pls, rank):
    """The slices ``rank`` holds (nested ceil chunks, mesh axis 0 outermost); None off the mesh."""
    c = _coord(ids, rank)
    if c is None:
        return None
    mshape = _mesh_shape(ids)
    bounds = [[0, n] for n in shape]
    for axis, p in enumerate(pls):
        if p[0] == "S":
            lo, hi = bounds[p[1]]
            k = mshape[axis]
            size = -(-(hi - lo) // k)
            a = min(lo + c[axis] * size, hi)
            bounds[p[1]] = [a, min(a + size, hi)]
    return tuple(slice(a, b) for a, b in bounds)


def _expected(key, spec, rank):
    """What ``rank`` holds of ``key`` laid out as ``spec`` = (shape, dtype, layout): layout None is a plain tensor."""
    shape, dtype, layout = spec
    full = _dense(key, shape, dtype)
    if layout is None:
        return full
    blk = _block(shape, *layout, rank)
    return full[blk] if blk is not None else None


def _placements(pls):
    import meshviz.distributed as dist

    kinds = {"S": lambda p: dist.Shard(p[1]), "R": lambda p: dist.Replicate(), "P": lambda p: dist.Partial()}
    return [kinds[p[0]](p) for p in pls]


def _build(key, spec, fill):
    """The value a rank puts in its state dict for ``key``: the dense (``fill`` False: zeros) laid out as ``spec``."""
    import meshviz.distributed as dist

    shape, dtype, layout = spec
    full = _dense(key, shape, dtype) if fill else torch.zeros(tuple(shape), dtype=DTYPES[dtype])
    if layout is None:
        return full
    ids, pls = layout
    return dist.shard_tensor(full, dist.ProcessMesh(ids), _placements(pls))


def _local(v):
    return v._local_value().detach().clone() if hasattr(v, "_local_value") else v.detach().clone()


def _save(path, specs):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    sd = {k: _build(k, s, True) for k, s in specs.items()}
    dist.save_state_dict(sd, path)


def _load(path, specs, kw=None):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    sd = {k: _build(k, s, False) for k, s in specs.items()}
    before = dict(sd)
    dist.load_state_dict(sd, path, **(kw or {}))
    assert all(sd[k] is before[k] for k in sd), "loaded in place"
    return {k: _local(v) for k, v in sd.items()}


def _check_rank(rank, got, specs):
    for key, spec in specs.items():
        want = _expected(key, spec, rank)
        if want is None:
            assert got[key].numel() == 0, (rank, key)
        else:
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), (rank, key, spec)


def _check(results, specs):
    for rank, got in enumerate(results):
        _check_rank(rank, got, specs)


# -- the sweep: random layouts over meshes of 1-8 ranks, saved on one world size and loaded on another ---------------


def _factor(n, rng):
    """A random mesh shape of 1-3 axes with ``n`` ranks."""
    shape = []
    while n > 1 and len(shape) < 2 and rng.random() < 0.75:
        ds = [d for d in range(2, n) if n % d == 0] or [n]
        d = rng.choice(ds)
        shape.append(d)
        n //= d
    shape.append(n)
    rng.shuffle(shape)
    return shape


def _nest(flat, shape):
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _layout(world, ndim, rng, partial):
    """None (a plain tensor) or (mesh ids, placements) on some of the ranks ``0..world-1`` in a random order."""
    if rng.random() < 0.15:
        return None
    n = world if rng.random() < 0.8 else rng.randint(1, world)
    mshape = _factor(n, rng)
    kinds = ["S"] * 5 + ["R"] * 2 + (["P"] if partial else [])
    pls = []
    for _ in mshape:
        k = rng.choice(kinds) if ndim else rng.choice(kinds[5:])
        pls.append(("S", rng.randrange(ndim)) if k == "S" else (k,))
    return _nest(rng.sample(range(world), n), mshape), tuple(pls)


def _case(seed):
    rng = random.Random(seed)
    n, m = rng.randint(1, 8), rng.randint(1, 8)
    save, load = {}, {}
    for i in range(4):
        ndim = rng.choice([0, 1, 2, 2, 3])
        shape = tuple(rng.choice([1, 2, 3, 5, 7]) for _ in range(ndim))
        key = f"t{i}"
        dtype = rng.choice(list(DTYPES))
        save[key] = (shape, dtype, _layout(n, ndim, rng, True))
        load[key] = (shape, dtype, _layout(m, ndim, rng, False))
    return n, m, save, load


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(14))
def test_layout_sweep(tmp_path, seed):
    """14 cases of 4 tensors (56 layout pairs): world sizes, mesh shapes and id orders, Shard / co-shard / Replicate /
    Partial, uneven and empty blocks, ranks off the mesh, plain tensors, 0-d tensors, four dtypes."""
    n, m, save, load = _case(seed)
    path = str(tmp_path / "ckpt")
    run_ranks(_save, n, path, save)
    _check(run_ranks(_load, m, path, load), load)


# -- loading into a Partial tensor: each rank holds what shard_tensor of the dense value would give it ---------------


def _load_partial(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh1, mesh2 = dist.ProcessMesh([2, 0, 1, 3]), dist.ProcessMesh([[3, 1], [0, 2]])
    z = torch.zeros(5, 3)
    sd = {"sum": dist.shard_tensor(z, mesh1, [dist.Partial()]),
          "max": dist.shard_tensor(z, mesh2, [dist.Partial(dist.ReduceType.kRedMax), dist.Shard(1)]),
          "prod": dist.shard_tensor(z, mesh2, [dist.Shard(0), dist.Partial(dist.ReduceType.kRedProd)]),
          "avg": dist.shard_tensor(z, mesh1, [dist.Partial(dist.ReduceType.kRedAvg)])}
    dist.load_state_dict(sd, path)
    return {k: _local(v) for k, v in sd.items()}


@pytest.mark.timeout(30)
def test_load_into_partial(tmp_path):
    path = str(tmp_path / "ckpt")
    spec = ((5, 3), "f32", ([0, 1], (("S", 0),)))
    run_ranks(_save, 2, path, {k: spec for k in ("sum", "max", "prod", "avg")})
    full = {k: _dense(k, (5, 3), "f32") for k in ("sum", "max", "prod", "avg")}
    res = run_ranks(_load_partial, 4, path)
    for r, got in enumerate(res):
        # SUM: the value at coordinate 0 of [2, 0, 1, 3] (rank 2), zeros elsewhere; AVG: the value everywhere
        assert torch.equal(got["sum"], full["sum"] if r == 2 else torch.zeros(5, 3))
        assert torch.equal(got["avg"], full["avg"])
        # [[3, 1], [0, 2]]: MAX keeps the value on both rows, columns split 2 + 1 along axis 1
        col = {3: slice(0, 2), 0: slice(0, 2), 1: slice(2, 3), 2: slice(2, 3)}[r]
        assert torch.equal(got["max"], full["max"][:, col])
        # PROD along axis 1: the value at column 0 of the mesh (ranks 3, 0), ones at column 1; rows split 3 + 2
        rows = slice(0, 3) if r in (3, 1) else slice(3, 5)
        assert torch.equal(got["prod"], full["prod"][rows] if r in (3, 0) else torch.ones(3 if r == 1 else 2, 3))


# -- keys on some ranks only: each pipeline stage saves its own; loaded on fewer stages, or on one rank ---------------

STAGES = {  # key -> (shape, dtype, layout on the 4 save ranks): stage 0 on ranks 0, 1; stage 1 on ranks 2, 3
    "s0.w": ((5, 3), "f32", ([0, 1], (("S", 0),))),
    "s0.b": ((3,), "bf16", None),
    "s1.w": ((3, 7), "f32", ([3, 2], (("S", 1),))),
    "s1.opt.m": ((7,), "f64", ([2, 3], (("R",),))),
    "s1.n": ((), "i64", None),
}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        *outer, last = key.split(".")
        d = out
        for k in outer:
            d = d.setdefault(k, {})
        d[last] = v
    return out


def _flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _save_stage(path, stage_of):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    built = {k: _build(k, s, True) for k, s in STAGES.items()}  # every rank makes every mesh (its groups)
    mine = {k: v for k, v in built.items() if k[1] == str(stage_of[dist.get_rank()])}
    dist.save_state_dict({**_nested(mine), "name": "pp"}, path)


def _load_stage(path, specs, stage_of):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    built = {k: _build(k, s, False) for k, s in specs.items()}
    mine = {k: v for k, v in built.items() if k[1] == str(stage_of[dist.get_rank()])}
    sd = {**_nested(mine), "name": ""}
    dist.load_state_dict(sd, path)
    return {**{k: _local(v) for k, v in _flat(sd).items() if k != "name"}, "name": sd["name"]}


@pytest.mark.timeout(30)
def test_pipeline_stage_keys(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_stage, 4, path, [0, 0, 1, 1])
    # two ranks, one a stage, other layouts; non-tensor values too
    two = dict(STAGES, **{"s0.w": ((5, 3), "f32", ([0], (("S", 1),))), "s0.b": ((3,), "bf16", ([0], (("R",),))),
                          "s1.w": ((3, 7), "f32", None), "s1.opt.m": ((7,), "f64", ([1], (("S", 0),)))})
    res = run_ranks(_load_stage, 2, path, two, [0, 1])
    for r, got in enumerate(res):
        assert got.pop("name") == "pp"
        mine = {k: s for k, s in two.items() if k[1] == str(r)}
        assert set(got) == set(mine)
        _check_rank(r, got, mine)


def _load_all(path, specs):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    sd = _nested({k: _build(k, s, False) for k, s in specs.items()})
    dist.load_state_dict(sd, path)
    return {k: _local(v) for k, v in _flat(sd).items()}


@pytest.mark.timeout(30)
def test_pipeline_stages_merged_on_one_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_stage, 4, path, [0, 0, 1, 1])
    one = {k: (s[0], s[1], None) for k, s in STAGES.items()}
    _check(run_ranks(_load_all, 1, path, one), one)


# -- optimizer states: shard_optimizer stage 1 on a 2 x 2 mesh, loaded under stages 2 and 3 and into plain tensors ----


def _spec_of(t):
    """The layout of dist tensor ``t`` in this file's terms (ids nested as the mesh, placements as tuples)."""
    import numpy as np

    mesh = t.process_mesh
    ids = np.array(mesh.process_ids).reshape(mesh.shape).tolist()
    return ids, tuple(("S", p.get_dim()) if p.is_shard() else ("R",) for p in t.placements)


def _opt_states(opt):
    """(param index, state name) -> state tensor, the states made first if there are none yet."""
    return {(i, name): v for i, st in opt.state_dict()["state"].items() for name, v in st.items()}


def _opt_run(path, mesh_ids, w_pls, stage, save):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh(mesh_ids, dim_names=["dp", "mp"][:len(_mesh_shape(mesh_ids))])

    def shard_fn(name, layer, m):
        if isinstance(layer, torch.nn.Linear):
            layer.weight = dist.shard_tensor(layer.weight, m, _placements(w_pls))

    model = dist.shard_layer(torch.nn.Linear(5, 3), mesh, shard_fn)
    stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), stages[stage]("dp", mesh))
    sd = opt.state_dict()
    if save:
        for (i, name), t in _opt_states(opt).items():
            if name != "step":
                block = _block(tuple(t.shape), *_spec_of(t), dist.get_rank())
                with torch.no_grad():
                    t._local_value().copy_(_dense(f"{i}.{name}", tuple(t.shape), "f32")[block])
            else:
                t.fill_(3)
        dist.save_state_dict(opt.state_dict(), path)
        return None
    dist.load_state_dict(sd, path)
    opt.set_state_dict(sd)
    out = {}
    for (i, name), t in _opt_states(opt).items():  # what the optimizer holds now, not only the dict loaded into
        out[(i, name)] = (_local(t), None if name == "step" else _spec_of(t), tuple(t.shape))
    return out


def _opt_plain(path):
    import meshviz.distributed as dist

    sd = {"state": {0: {"exp_avg": torch.zeros(3, 5), "exp_avg_sq": torch.zeros(3, 5), "step": torch.tensor(0.0)},
                    1: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3), "step": torch.tensor(0.0)}}}
    dist.load_state_dict(sd, path)
    return {(i, n): (v, None, tuple(v.shape)) for i, st in sd["state"].items() for n, v in st.items()}


@pytest.mark.timeout(60)
def test_optimizer_states_across_sharding_stages(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_opt_run, 4, path, [[0, 1], [2, 3]], (("R",), ("S", 0)), 1, True)
    loads = [run_ranks(_opt_run, 2, path, [1, 0], (("R",),), 3, False),
             run_ranks(_opt_run, 3, path, [[2, 0, 1]], (("R",), ("S", 1)), 2, False),
             run_ranks(_opt_plain, 1, path)]
    for res in loads:
        for rank, got in enumerate(res):
            assert len(got) == 6
            for (i, name), (local, spec, shape) in got.items():
                if name == "step":
                    assert float(local) == 3.0
                    continue
                full = _dense(f"{i}.{name}", shape, "f32")
                want = full if spec is None else full[_block(shape, *spec, rank)]
                assert torch.equal(local, want), (rank, i, name, spec)


# -- versions: unique_id --------------------------------------------------------------------------------------------


def _save_versions(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1])
    for uid, add in ((None, 0.0), (1, 10.0), (3, 30.0), (None, 40.0)):  # the last None overwrites the newest: 3
        dist.save_state_dict({"w": dist.shard_tensor(torch.arange(6.0) + add, mesh, [dist.Shard(0)])}, path,
                             unique_id=uid)


def _load_versions(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    out = {}
    for uid in (None, 0, 1, 3):
        sd = {"w": torch.zeros(6)}
        dist.load_state_dict(sd, path, unique_id=uid)
        out[uid] = sd["w"]
    errors = []
    for uid in (2, -1, 1.5, [0, 1, 3][dist.get_rank()], [0, 0, 2][dist.get_rank()]):
        try:
            dist.load_state_dict({"w": torch.zeros(6)}, path, unique_id=uid)
        except Exception as e:  # every rank raises
            errors.append(f"{type(e).__name__}: {e}")
    return out, errors


@pytest.mark.timeout(30)
def test_unique_id_versions(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_versions, 2, path)
    for out, errors in run_ranks(_load_versions, 3, path):
        assert torch.equal(out[None], torch.arange(6.0) + 40) and torch.equal(out[3], out[None])
        assert torch.equal(out[0], torch.arange(6.0)) and torch.equal(out[1], torch.arange(6.0) + 10)
        assert errors[0].startswith("FileNotFoundError: load_state_dict: no checkpoint with unique_id 2 at ")
        assert errors[0].endswith("(it holds unique ids [0, 1, 3]) (rank 0)")
        assert [e.split(":")[0] for e in errors[1:3]] == ["ValueError", "ValueError"]
        assert errors[3] == "ValueError: load_state_dict: the ranks name different unique ids [0, 1, 3]"
        assert errors[4].startswith("FileNotFoundError") and errors[4].endswith("(rank 2)")  # only rank 2's is lost


# -- a key the checkpoint lacks, a shape other than the saved one: one clear error on every rank, nothing loaded -------


def _load_bad(path, bad):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([1, 0])
    good = dist.shard_tensor(torch.zeros(5, 3), mesh, [dist.Shard(1)])
    sd: dict = {"w": good}
    if bad == "missing":
        sd["opt"] = {"m": torch.zeros(2)}
    elif bad == "shape":
        sd["b"] = dist.shard_tensor(torch.zeros(4), mesh, [dist.Shard(0)])
    elif bad == "plain_shape":
        sd["b"] = torch.zeros(3, 1)
    elif bad == "one_rank":  # only rank 1 asks for a key the checkpoint lacks
        if dist.get_rank() == 1:
            sd["nope"] = torch.zeros(1)
    try:
        dist.load_state_dict(sd, path)
    except Exception as e:
        return type(e).__name__, str(e), bool(good._local_value().abs().sum() == 0)
    return None, "", bool(good._local_value().abs().sum() == 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, kind, words", [
    ("missing", "RuntimeError", "Missing key in checkpoint state_dict: opt.m. (ranks 0, 1)"),
    ("shape", "ValueError", "saved torch.Size([3]) and current: torch.Size([4]) for b (ranks 0, 1)"),
    ("plain_shape", "ValueError", "saved torch.Size([3]) and current: torch.Size([3, 1]) for b (ranks 0, 1)"),
    ("one_rank", "RuntimeError", "Missing key in checkpoint state_dict: nope. (rank 1)"),
    (None, None, ""),
])
def test_mismatch_is_one_clear_error_on_every_rank(tmp_path, bad, kind, words):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 3, path, {"w": ((5, 3), "f32", ([2, 0, 1], (("S", 0),))), "b": ((3,), "f32", None),
                               "c": ((2,), "i64", None)})
    for kind_got, text, untouched in run_ranks(_load_bad, 2, path, bad):
        assert kind_got == kind and words in text and text.startswith("load_state_dict(") == (kind is not None)
        assert untouched == (bad is not None)  # a failed load loads nothing; the checkpoint's extra keys are left


# -- containers: dicts and lists at any depth, plain values (Paddle takes only dicts of tensors) ----------------------


def _save_nested(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([[1], [0]])
    w = dist.shard_tensor(torch.arange(15.0).reshape(5, 3), mesh, [dist.Shard(0), dist.Replicate()])
    s = dist.shard_tensor(torch.tensor(2.5), mesh, [dist.Replicate(), dist.Partial()])
    dist.save_state_dict({"groups": [{"w": w, "lr": 0.5}, {"params": [0, 1, 2]}], "meta": {"step": 7, "tag": "x"},
                          "order": [3, 1, 2], "s": s}, path)


def _load_nested(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([2, 0, 1])
    w = dist.shard_tensor(torch.zeros(5, 3), mesh, [dist.Shard(1)])
    sd = {"groups": [{"w": w, "lr": 0.0}, {"params": [0]}], "meta": {"step": 0, "tag": ""}, "order": [0],
          "s": torch.tensor(0.0)}
    dist.load_state_dict(sd, path)
    g = sd["groups"]
    return g[0]["w"] is w, _local(w), g[0]["lr"], g[1]["params"] + sd["order"], sd["meta"], sd["s"]


@pytest.mark.timeout(30)
def test_nested_containers_and_plain_values(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_nested, 2, path)
    full = torch.arange(15.0).reshape(5, 3)
    for r, (same, local, lr, params, meta, s) in enumerate(run_ranks(_load_nested, 3, path)):
        col = {2: 0, 0: 1, 1: 2}[r]  # [2, 0, 1]: one column each
        assert same and torch.equal(local, full[:, col:col + 1])
        assert lr == 0.5 and params == [0, 1, 2, 3, 1, 2] and meta == {"step": 7, "tag": "x"} and float(s) == 2.5


# -- Paddle's other arguments: async_save, coordinator_rank, offload, process_group ----------------------------------


STAGE_A = {"a": ((7, 2), "bf16", ([1, 0], (("S", 0),)))}
STAGE_B = {"b": ((5, 3), "i64", ([[3], [2]], (("S", 1), ("S", 0))))}


def _save_args(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    built = [{k: _build(k, s, True) for k, s in specs.items()} for specs in (STAGE_A, STAGE_B)]
    stage = dist.get_rank() // 2  # each stage saves on its own, through its own group
    dist.save_state_dict(built[stage], f"{path}/s{stage}", process_group=groups[stage], coordinator_rank=1,
                         async_save=True, unique_id=2 * stage)


@pytest.mark.timeout(30)
def test_paddle_arguments(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_args, 4, path)
    load_a = {"a": ((7, 2), "bf16", ([2, 1, 0], (("S", 0),)))}
    load_b = {"b": ((5, 3), "i64", ([[0, 1, 2]], (("R",), ("S", 1))))}
    _check(run_ranks(_load, 3, f"{path}/s0", load_a, {"offload": True, "coordinator_rank": 2}), load_a)
    _check(run_ranks(_load, 3, f"{path}/s1", load_b, {"unique_id": 2}), load_b)
