"""The collectives against the dense truth and Paddle's contract: a seeded sweep over ops, groups, dtypes and shapes."""

import random
from dataclasses import dataclass

import pytest
import torch

from meshviz.testing import run_ranks

W = 4
GROUPS = [None, [0, 2], [1, 3], [3, 1, 2], [0, 1, 3]]
OPS = ["all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather", "gather", "scatter", "alltoall",
       "alltoall_single", "send_recv", "batch_p2p"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
SHAPES = [(), (3,), (2, 3), (4,)]
REDUCES = ["SUM", "MAX", "MIN", "PROD", "AVG"]
N_CASES = 132  # 12 per op


@dataclass(frozen=True)
class Case:
    i: int
    op: str
    group: list | None
    dtype: torch.dtype
    shape: tuple
    reduce: str
    root: int
    strided: bool  # results land in a strided view (x[..., 1]) of a larger tensor
    sync: bool
    splits: tuple | None  # alltoall_single: splits[src][dst] rows, None for even (split sizes not passed)

    @property
    def ranks(self) -> list:
        return sorted(self.group) if self.group is not None else list(range(W))


def _cases() -> list:
    rng = random.Random(20240611)
    out = []
    for i in range(N_CASES):
        op = OPS[i % len(OPS)]
        group = rng.choice(GROUPS)
        dtype = rng.choice(DTYPES)
        red = rng.choice(REDUCES)
        if dtype is torch.bool and red == "AVG":  # no mean of booleans (test_bool_avg_...)
            red = rng.choice(REDUCES[:4])
        shape = rng.choice(SHAPES[1:] if op == "alltoall_single" else SHAPES)
        ranks = sorted(group) if group is not None else list(range(W))
        splits = None
        if op == "alltoall_single" and rng.random() < 0.5:
            splits = tuple(tuple(rng.randrange(3) for _ in ranks) for _ in ranks)
        out.append(Case(i, op, group, dtype, shape, red, rng.choice(ranks), rng.random() < 0.35, rng.random() < 0.7,
                        splits))
    return out


def _value(case: Case, rank: int, tag: int = 0, shape=None) -> torch.Tensor:
    """Rank ``rank``'s input ``tag`` of ``case``: small integers, so every float sum is exact."""
    g = torch.Generator().manual_seed(case.i * 1000 + rank * 10 + tag)
    shape = case.shape if shape is None else shape
    lo, hi = (0, 2) if case.dtype is torch.bool else (0, 4) if case.dtype is torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, shape, generator=g).to(case.dtype)


def _target(value: torch.Tensor, strided: bool):
    """(where a result lands, the tensor it lives in): ``value`` itself, or a copy in a strided view of a tensor twice
    its size whose other half must stay as it was."""
    if not strided:
        return value.clone(), None
    base = torch.ones(tuple(value.shape) + (2,), dtype=value.dtype)
    view = base[..., 1]
    view.copy_(value)
    return view, base


def _rows(case: Case, src: int, dst: int) -> int:
    """Rows ``src`` sends ``dst`` in an alltoall_single (global ranks)."""
    if case.splits is None:
        return 1
    ranks = case.ranks
    return case.splits[ranks.index(src)][ranks.index(dst)]


def _row_values(case: Case, src: int, dst: int) -> torch.Tensor:
    return _value(case, src, 100 + dst, (_rows(case, src, dst),) + case.shape)


def _run_case(case: Case, dist, r: int) -> dict:
    """Run ``case`` on rank ``r``: what it holds afterwards, the other half of any strided result, and its events."""
    from meshviz import trace
    from meshviz.runtime.comm import Task

    ranks, group = case.ranks, case.group
    g = dist.new_group(group) if group is not None else None
    member = r in ranks
    k = len(ranks)
    op = getattr(dist.ReduceOp, case.reduce)
    x, base = _target(_value(case, r), case.strided)
    got: dict = {}
    with trace.record() as mem:
        if case.op == "all_reduce":
            task = dist.all_reduce(x, op=op, group=g, sync_op=case.sync)
        elif case.op == "reduce":
            task = dist.reduce(x, dst=case.root, op=op, group=g, sync_op=case.sync)
        elif case.op == "reduce_scatter":
            x, base = _target(torch.zeros(case.shape, dtype=case.dtype), case.strided)
            task = dist.reduce_scatter(x, [_value(case, r, 1 + j) for j in range(k)], op=op, group=g,
                                       sync_op=case.sync)
        elif case.op == "broadcast":
            task = dist.broadcast(x, src=case.root, group=g, sync_op=case.sync)
        elif case.op == "all_gather":
            lst = [] if case.i % 2 else [_target(torch.zeros(case.shape, dtype=case.dtype), case.strided)[0]
                                         for _ in range(k)]
            task = dist.all_gather(lst, x, group=g, sync_op=case.sync)
            got["list"] = lst
        elif case.op == "gather":
            lst = [] if r == case.root else [torch.zeros(1)]  # a list on another rank is ignored, as in Paddle
            task = dist.gather(x, lst, dst=case.root, group=g, sync_op=case.sync)
            got["list"] = lst
        elif case.op == "scatter":
            pieces = [_value(case, r, 1 + j) for j in range(k)]
            task = dist.scatter(x, pieces if r == case.root or case.i % 2 else None, src=case.root, group=g,
                                sync_op=case.sync)
        elif case.op == "alltoall":
            lst = [] if case.i % 2 else [torch.zeros(case.shape, dtype=case.dtype) for _ in range(k)]
            task = dist.alltoall(lst, [_value(case, r, 1 + j) for j in range(k)], group=g, sync_op=case.sync)
            got["list"] = lst
        elif case.op == "alltoall_single":
            ins = (torch.cat([_row_values(case, r, d) for d in ranks]) if member
                   else _value(case, r, 0, (k,) + case.shape))
            rows = sum(_rows(case, s, r) for s in ranks) if member else k
            x, base = _target(torch.zeros((rows,) + case.shape, dtype=case.dtype), case.strided)
            sizes = (None, None) if case.splits is None or not member else (
                [_rows(case, r, d) for d in ranks], [_rows(case, s, r) for s in ranks])
            task = dist.alltoall_single(x, ins, sizes[0], sizes[1], group=g, sync_op=case.sync)
        elif case.op in ("send_recv", "batch_p2p"):
            task = None
            if member:
                i = ranks.index(r)
                nxt, prv = ranks[(i + 1) % k], ranks[(i - 1) % k]
                x, base = _target(torch.zeros(case.shape, dtype=case.dtype), case.strided)
                if case.op == "send_recv":
                    tasks = [dist.isend(_value(case, r), nxt, group=g), dist.irecv(x, prv, group=g)]
                else:
                    tasks = dist.batch_isend_irecv([dist.P2POp(dist.isend, _value(case, r), nxt, g),
                                                    dist.P2POp(dist.irecv, x, prv, g)])
                for t in tasks:
                    t.wait()
        else:
            raise AssertionError(case.op)
        if case.op not in ("send_recv", "batch_p2p"):
            assert isinstance(task, Task), (case, task)
            if not member:
                assert task.is_completed()
            task.wait()
    got["x"] = x.clone()
    got["other_half"] = None if base is None else base[..., 0].clone()
    got["events"] = [(e.kind, e.op, list(e.group), e.bytes) for e in mem.events if e.kind in ("collective", "send",
                                                                                                  "recv")]
    return got


def _sweep():
    import meshviz.distributed as dist
    from meshviz.runtime.match import set_checking

    dist.init_parallel_env()
    set_checking(True)  # the members compare what they run first: a wrong shape fails the case, not the world
    r = dist.get_rank()
    return [_run_case(c, dist, r) for c in _cases()]


def _reduce(case: Case, xs: list) -> torch.Tensor:
    """The dense truth of reducing ``xs`` with ``case.reduce`` (integer sums and products wrap in the dtype, an
    integer mean rounds toward zero, booleans reduce as any / all)."""
    dt = case.dtype
    if dt is torch.bool:
        s = torch.stack(xs)
        return (s.any(0) if case.reduce in ("SUM", "MAX") else s.all(0)).clone()
    s = torch.stack([x.to(torch.float64 if dt.is_floating_point else torch.int64) for x in xs])
    if case.reduce == "SUM":
        v = s.sum(0)
    elif case.reduce == "PROD":
        v = s.prod(0)
    elif case.reduce == "MAX":
        v = s.max(0).values
    elif case.reduce == "MIN":
        v = s.min(0).values
    else:
        v = s.sum(0) / len(xs) if dt.is_floating_point else torch.div(s.sum(0), len(xs), rounding_mode="trunc")
    return v.to(dt)


def _expected(case: Case, r: int):
    """(what rank ``r`` holds after ``case``, the list it holds or None, its events), all computed by hand."""
    ranks, k = case.ranks, len(case.ranks)
    s = torch.empty((), dtype=case.dtype).element_size()
    n = torch.Size(case.shape).numel()
    if r not in ranks:
        if case.op == "reduce_scatter":
            x = torch.zeros(case.shape, dtype=case.dtype)
        elif case.op == "alltoall_single":
            x = torch.zeros((k,) + case.shape, dtype=case.dtype)
        else:
            x = _value(case, r)
        lst = {"all_gather": [] if case.i % 2 else [torch.zeros(case.shape, dtype=case.dtype)] * k,
               "gather": [torch.zeros(1)],
               "alltoall": [] if case.i % 2 else [torch.zeros(case.shape, dtype=case.dtype)] * k}.get(case.op)
        return x, lst, []
    me = ranks.index(r)
    vals = [_value(case, q) for q in ranks]
    op, ev = case.op, []
    x, lst = _value(case, r), None
    if op == "all_reduce":
        x = _reduce(case, vals)
        ev = [("collective", op, ranks, 2 * min(n, (k - 1) * -(-n // k)) * s)]  # a ring never counts more than n
    elif op == "reduce":
        x = _reduce(case, vals) if r == case.root else vals[me]
        ev = [("collective", op, ranks, (k - 1) * n * s if r == case.root else 0)]
    elif op == "reduce_scatter":
        x = _reduce(case, [_value(case, q, 1 + me) for q in ranks])
        ev = [("collective", op, ranks, (k - 1) * n * s)]
    elif op == "broadcast":
        x = vals[ranks.index(case.root)]
        ev = [("collective", op, ranks, 0 if r == case.root else n * s)]
    elif op == "all_gather":
        lst = vals
        ev = [("collective", op, ranks, (k - 1) * n * s)]
    elif op == "gather":
        lst = vals if r == case.root else [torch.zeros(1)]
        ev = [("collective", op, ranks, (k - 1) * n * s if r == case.root else 0)]
    elif op == "scatter":
        x = _value(case, case.root, 1 + me)
        ev = [("collective", op, ranks, 0 if r == case.root else n * s)]
    elif op == "alltoall":
        lst = [_value(case, q, 1 + me) for q in ranks]
        ev = [("collective", op, ranks, (k - 1) * n * s)]
    elif op == "alltoall_single":
        x = torch.cat([_row_values(case, q, r) for q in ranks])
        got_rows = sum(_rows(case, q, r) for q in ranks if q != r)
        ev = [("collective", op, ranks, got_rows * n * s)]
    else:
        x = vals[(me - 1) % k]
        ev = [("send", "send", ranks, 0), ("recv", "recv", ranks, n * s)]
    return x, lst, ev


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values (a mean in half precision within its rounding)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        rtol = 1e-2 if a.element_size() == 2 else 1e-6
        return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=0))
    return bool(torch.equal(a, b))


@pytest.mark.timeout(120)
def test_seeded_sweep_matches_the_dense_truth_and_the_events_count_what_each_rank_receives():
    res = run_ranks(_sweep, W, timeout=100)
    cases = _cases()
    assert {c.op for c in cases} == set(OPS) and {c.dtype for c in cases} == set(DTYPES)
    wrong = []
    for case in cases:
        for r in range(W):
            got = res[r][case.i]
            x, lst, ev = _expected(case, r)
            if not _same(got["x"], x):
                wrong.append(f"{case} rank {r}: holds {got['x'].tolist()}, expected {x.tolist()}")
            if lst is not None and (len(got["list"]) != len(lst) or not all(_same(a, b) for a, b in
                                                                            zip(got["list"], lst))):
                wrong.append(f"{case} rank {r}: list {[t.tolist() for t in got['list']]}, expected "
                             f"{[t.tolist() for t in lst]}")
            if got["other_half"] is not None and not bool((got["other_half"] == 1).all()):
                wrong.append(f"{case} rank {r}: wrote past its strided view: {got['other_half'].tolist()}")
            if sorted(got["events"]) != sorted(ev):
                wrong.append(f"{case} rank {r}: events {got['events']}, expected {ev}")
    assert not wrong, f"{len(wrong)} wrong:\n" + "\n".join(wrong[:25])


# -- Paddle's contract, case by case ---------------------------------------------------------------------------


def _contracts():
    import meshviz.distributed as dist
    from meshviz.runtime.comm import Task

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}

    # reduce: every op lands on dst; every other rank's tensor is left as it was (Paddle's docs)
    for name in ("SUM", "MAX", "MIN", "PROD", "AVG"):
        t = torch.tensor([r + 1.0, -r, 2.0])
        dist.reduce(t, dst=3, op=getattr(dist.ReduceOp, name))
        out[f"reduce_{name}"] = t

    # scatter: Paddle's own example has src 1 pass its output tensor as rank 0's piece; each rank gets its piece
    t = torch.full((2,), float(r))
    dist.scatter(t, [torch.full((2,), 100.0 + i) if i != 0 else t for i in range(W)] if r == 1 else None, src=1)
    out["scatter_alias_src1"] = t
    t = torch.full((2,), float(r))
    dist.scatter(t, [torch.full((2,), 100.0 + i) if i != 2 else t for i in range(W)] if r == 0 else None, src=0)
    out["scatter_alias_src0"] = t

    # a rank outside the group: every collective returns a finished task at once and leaves its tensors alone
    g = dist.new_group([2, 0])
    t = torch.full((2,), float(r))
    lst: list = []
    two = [torch.ones(2), torch.ones(2)]
    tasks = [dist.all_reduce(t, group=g), dist.broadcast(t, src=2, group=g), dist.reduce(t, dst=0, group=g),
             dist.all_gather(lst, t, group=g), dist.gather(t, [] if r == 0 else None, dst=0, group=g),
             dist.scatter(t, two if r == 0 else None, src=0, group=g), dist.reduce_scatter(t, two, group=g),
             dist.alltoall(lst, two, group=g), dist.alltoall_single(t, t.clone(), group=g)]
    out["outside"] = (t.clone(), len(lst), all(isinstance(k, Task) and k.is_completed() for k in tasks))
    objs = ["kept"]
    dist.all_gather_object(objs, r, group=g)
    dist.broadcast_object_list(objs, src=0, group=g)
    out["outside_objects"] = objs
    dist.barrier(group=g)
    try:
        backend = dist.get_backend(g)
    except RuntimeError as e:  # a rank outside, as Paddle's
        backend = str(e)
    out["group"] = (g.ranks, g.rank, g.nranks, g.is_member(), dist.get_group(g.id) is g, backend)
    # Paddle: -1 on a rank outside (torch reads a non-member's missing process group as the world)
    out["group_sizes"] = (dist.get_rank(g), dist.get_world_size(g), g.world_size, dist.get_world_size(),
                          dist.get_rank(g.process_group) if g.process_group is not None else None)

    # new_group with a backend or a timeout: the world's kind of group, so ranks as threads work too
    g13 = dist.new_group([3, 1], backend="gloo", timeout=30)
    s = torch.tensor([float(r)])
    dist.all_reduce(s, group=g13)
    out["backend_group"] = (g13.ranks, s.item())
    dist.destroy_process_group(g13)
    out["destroyed"] = dist.get_group(g13.id)
    dist.wait(s, group=g13)  # Paddle: a no-op on a group this rank left
    return out


@pytest.mark.timeout(60)
def test_paddle_contracts_reduce_scatter_aliasing_outsiders_and_groups():
    res = run_ranks(_contracts, W, timeout=50)
    vals = torch.stack([torch.tensor([q + 1.0, -q, 2.0]) for q in range(W)])
    truth = {"SUM": vals.sum(0), "MAX": vals.max(0).values, "MIN": vals.min(0).values, "PROD": vals.prod(0),
             "AVG": vals.mean(0)}
    for r, out in enumerate(res):
        for name, v in truth.items():
            torch.testing.assert_close(out[f"reduce_{name}"], v if r == 3 else vals[r])
        exp1 = {0: torch.full((2,), 1.0)}.get(r, torch.full((2,), 100.0 + r))  # rank 0's piece: src's tensor
        torch.testing.assert_close(out["scatter_alias_src1"], exp1)
        exp0 = {2: torch.full((2,), 0.0)}.get(r, torch.full((2,), 100.0 + r))  # rank 2 gets src 0's tensor
        torch.testing.assert_close(out["scatter_alias_src0"], exp0)
        t, n, done = out["outside"]
        if r in (1, 3):
            assert t.tolist() == [float(r)] * 2 and n == 0 and done
            assert out["outside_objects"] == ["kept"]
        assert out["group"][:5] == ([0, 2], {0: 0, 2: 1}.get(r, -1), 2, r in (0, 2), True)
        if r in (0, 2):
            assert out["group"][5] in ("THREADS", "GLOO")
        else:  # Paddle raises there too ("Invalid group specified")
            assert out["group"][5].startswith(f"get_backend: Invalid group specified (rank {r} is not in Group(")
        inside = {0: 0, 2: 1}.get(r)
        assert out["group_sizes"] == ((inside, 2, 2, W, inside) if inside is not None else (-1, -1, -1, W, None))
        assert out["backend_group"] == ([1, 3], 4.0 if r in (1, 3) else float(r))
        assert out["destroyed"] is None


# -- dtypes, dist tensors ---------------------------------------------------------------------------------------


def _bool_avg():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    r = dist.get_rank()
    entered = dict(rollcall.current().entered)
    t = torch.tensor([True, r == 0])
    errs = []
    for fn in (lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG),
               lambda: dist.reduce(t, dst=0, op=dist.ReduceOp.AVG),
               lambda: dist.reduce_scatter(t[:1], [t[:1], t[1:]], op=dist.ReduceOp.AVG, group=[0, 1])):
        try:
            fn()
            errs.append(None)
        except ValueError as e:
            errs.append(str(e))
    same = dict(rollcall.current().entered) == entered
    u = torch.tensor([True, r == 0])
    dist.all_reduce(u, op=dist.ReduceOp.MIN)  # the world goes on; MIN / MAX are all / any
    return errs, same, t.tolist(), u.tolist()


@pytest.mark.timeout(60)
def test_a_mean_of_booleans_is_refused_on_every_rank_before_data_moves():
    for r, (errs, same, t, u) in enumerate(run_ranks(_bool_avg, 2, timeout=50)):
        assert all(e is not None and "bool" in e and "AVG" in e for e in errs), errs
        assert same and t == [True, r == 0] and u == [True, False]


def _dist_tensors():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    out = {}
    p = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Partial()])
    before = p._local_value().clone()
    entered = dict(rollcall.current().entered)
    try:
        dist.all_reduce(p)
    except ValueError as e:
        out["partial"] = (before, p._local_value().clone(), p.placements, str(e),
                          dict(rollcall.current().entered) == entered)
    s = dist.shard_tensor(torch.arange(8.0), mesh, [dist.Shard(0)])
    lst: list = []
    dist.all_gather(lst, s)
    out["shard_gather"] = lst
    rep = dist.shard_tensor(torch.full((2,), float(r)), mesh, [dist.Replicate()])
    dist.broadcast(rep, src=2)
    out["replicate_bcast"] = (rep._local_value().clone(), rep.full_tensor().clone())
    return out


@pytest.mark.timeout(60)
def test_a_dist_tensor_in_a_collective_is_its_local_block_and_a_partial_one_is_refused():
    for r, out in enumerate(run_ranks(_dist_tensors, W, timeout=50)):
        before, after, placements, err, untouched = out["partial"]
        # P(sum) from a dense tensor: coordinate 0 holds it, the others zeros. Its blocks are summands: an all-reduce
        # would put their sum on every rank still read as P(sum) (4x the value), so every rank refuses it first
        assert before.tolist() == ([0.0, 1.0, 2.0, 3.0] if r == 0 else [0.0] * 4)
        assert after.tolist() == before.tolist() and [str(p) for p in placements] == ["P(sum)"] and untouched
        assert err.startswith("all_reduce got a dist tensor with placements [P(sum)]"), err
        assert [t.tolist() for t in out["shard_gather"]] == [[2.0 * i, 2.0 * i + 1] for i in range(W)]
        local, full = out["replicate_bcast"]
        assert local.tolist() == [2.0, 2.0] and full.tolist() == [2.0, 2.0]


def _p2p_then_world():
    import meshviz.distributed as dist
    from meshviz.runtime.match import set_checking

    dist.init_parallel_env()
    set_checking(True)  # as in a Cluster: the members compare what they run, numbered per group
    r = dist.get_rank()
    buf = torch.zeros(2)
    if r == 0:
        dist.send(torch.ones(2), dst=1)
    elif r == 1:
        dist.recv(buf, src=0)
    s = torch.tensor([float(r)])
    dist.all_reduce(s)
    # a transfer between two meshes that rank 3 is not on, then the world again
    a, b = dist.ProcessMesh([0, 1], dim_names=["x"]), dist.ProcessMesh([2, 1], dim_names=["x"])
    t = dist.shard_tensor(torch.arange(4.0), a, [dist.Shard(0)])
    moved = dist.reshard(t, b, [dist.Shard(0)])
    u = torch.tensor([1.0])
    dist.all_reduce(u)
    return buf.tolist(), s.item(), moved._local_value().tolist(), u.item()


@pytest.mark.timeout(60)
def test_a_send_between_two_ranks_leaves_the_world_collective_numbers_alone():
    res = run_ranks(_p2p_then_world, W, timeout=50)
    blocks = {2: [0.0, 1.0], 1: [2.0, 3.0]}
    for r, (buf, s, moved, u) in enumerate(res):
        assert buf == ([1.0, 1.0] if r == 1 else [0.0, 0.0]) and s == 6.0 and u == 4.0
        assert moved == blocks.get(r, [])
