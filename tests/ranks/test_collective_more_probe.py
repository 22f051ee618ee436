"""The collectives on parameters, complex tensors and all-to-alls whose sizes disagree, against one process."""

import pytest
import torch

from meshviz.testing import run_ranks

W = 3


def _vals(r: int) -> torch.Tensor:
    return torch.tensor([3.0 * r, 1.0 - r, 6.0])


# -- an average in place -----------------------------------------------------------------------------------------

def _average_in_place():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    avg = dist.ReduceOp.AVG
    p = torch.nn.Parameter(_vals(r))
    dist.all_reduce(p, op=avg)
    q = torch.nn.Parameter(_vals(r))
    dist.reduce(q, dst=1, op=avg)
    s = torch.nn.Parameter(torch.zeros(3))
    dist.reduce_scatter(s, [_vals(r) + j for j in range(W)], op=avg)
    t = torch.nn.Parameter(torch.stack([_vals(r), _vals(r) * 2]))
    dist.all_reduce(t.t(), op=avg)  # a strided view of a parameter
    a = torch.tensor([r + 1.0], requires_grad=True)
    y = a * 2
    dist.all_reduce(y, op=avg)  # not recorded by autograd, as the sum it divides is not
    y.sum().backward()
    return ([x.detach().clone() for x in (p, q, s, t)], [x.requires_grad for x in (p, q, s, t)],
            y.detach().clone(), type(y.grad_fn).__name__, a.grad.clone())


@pytest.mark.timeout(60)
def test_an_average_lands_in_place_in_a_parameter_and_autograd_does_not_record_its_division():
    """Paddle averages a parameter in place (``all_reduce(p, op=ReduceOp.AVG)``); gloo has no AVG, and the division
    that follows its sum raised "a leaf Variable that requires grad is being used in an in-place operation" on
    every rank after the data had moved, and on a tensor inside a graph it was recorded (its gradient divided by
    the group size, where a SUM's is not)."""
    res = run_ranks(_average_in_place, W, timeout=50)
    mean = torch.stack([_vals(q) for q in range(W)]).mean(0)
    for r, (vals, grads, y, fn, g) in enumerate(res):
        torch.testing.assert_close(vals[0], mean)
        torch.testing.assert_close(vals[1], mean if r == 1 else _vals(r))  # reduce: only dst changes
        torch.testing.assert_close(vals[2], mean + r)
        torch.testing.assert_close(vals[3], torch.stack([mean, mean * 2]))
        assert grads == [True] * 4
        torch.testing.assert_close(y, torch.tensor([4.0]))  # (2 + 4 + 6) / 3
        assert fn == "MulBackward0" and g.tolist() == [2.0]


# -- complex tensors ---------------------------------------------------------------------------------------------

def _cx(r: int, k: int = 0) -> torch.Tensor:
    return torch.tensor([complex(r + 1, r - k), complex(k, 1)], dtype=torch.complex64)


def _complex():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    lst = [] if r == 2 else None
    dist.gather(_cx(r), lst, dst=2)
    out["gather"] = lst
    entered = dict(rollcall.current().entered)
    errs = []
    for name in ("MAX", "MIN", "PROD"):
        op = getattr(dist.ReduceOp, name)
        t = _cx(r)
        for call in (lambda: dist.all_reduce(t, op=op), lambda: dist.reduce(t, dst=0, op=op),
                     lambda: dist.reduce_scatter(t[:1], [t[:1], t[1:], t[:1]], op=op)):
            with pytest.raises(ValueError) as info:
                call()
            errs.append(str(info.value))
        assert torch.equal(t, _cx(r))
    out["errs"] = errs
    out["nothing_moved"] = dict(rollcall.current().entered) == entered
    t = _cx(r)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # the world goes on: SUM and AVG are defined
    out["avg"] = t
    t = _cx(r)
    dist.reduce(t, dst=1)
    out["reduce"] = t
    return out


def _check_complex(res) -> None:
    vals = torch.stack([_cx(q) for q in range(W)])
    for r, out in enumerate(res):
        assert out["gather"] is None if r != 2 else [x.tolist() for x in out["gather"]] == [_cx(q).tolist()
                                                                                              for q in range(W)]
        whats = [f"{op}: ReduceOp.{name}" for name in ("MAX", "MIN", "PROD")
                 for op in ("all_reduce", "reduce", "reduce_scatter")]
        assert [e[:len(w)] for e, w in zip(out["errs"], whats)] == whats
        assert all("of a complex64 tensor is not supported" in e and "use SUM or AVG" in e for e in out["errs"])
        assert out["nothing_moved"]
        torch.testing.assert_close(out["avg"], vals.mean(0))
        torch.testing.assert_close(out["reduce"], vals.sum(0) if r == 1 else _cx(r))


@pytest.mark.timeout(60)
def test_complex_tensors_gather_and_a_reduction_without_a_complex_value_is_refused_before_data_moves():
    """MAX and MIN have no order to use, and the backends reduce a complex tensor as its real and imaginary parts:
    ranks as threads multiplied complex numbers in ``reduce`` while ``all_reduce`` raised torch's error, gloo
    raised "reduce does not support\\x02on complex tensors"; now each is one ValueError on every rank."""
    _check_complex(run_ranks(_complex, W, timeout=50))


# -- all-to-alls whose sizes disagree ----------------------------------------------------------------------------

def _a2a_sizes():
    import meshviz.distributed as dist
    from meshviz.runtime.match import CollectiveMismatch, set_checking

    dist.init_parallel_env()
    r = dist.get_rank()
    old = set_checking(True)
    out = {}
    try:
        # the sizes agree (Paddle's own uneven example, on ranks 0 and 1): no false alarm
        g = dist.new_group([0, 1])
        if r == 0:
            ins = [torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([7])]
            outs = [torch.empty((2, 3), dtype=torch.int64), torch.empty((3, 2), dtype=torch.int64)]
        else:
            ins = [torch.tensor([[8, 9], [10, 11], [12, 13]]), torch.tensor([[14, 15, 16, 17]])]
            outs = [torch.empty((1,), dtype=torch.int64), torch.empty((1, 4), dtype=torch.int64)]
        if r < 2:
            dist.alltoall(outs, ins, group=g)
            out["uneven"] = [o.tolist() for o in outs]
        splits = [[1, 0, 2], [2, 1, 0], [0, 1, 1]]  # splits[a][b]: rows rank a sends rank b
        o = torch.zeros(sum(s[r] for s in splits), 2)
        dist.alltoall_single(o, torch.arange(6.0).view(3, 2)[: sum(splits[r])] + 10 * r, splits[r],
                             [s[r] for s in splits])
        out["single"] = o
        # rank 2 expects 2 rows from rank 0, which sends it 1 (in_split_sizes [1, 1, 1])
        o = torch.zeros(3, 2)
        errs = []
        with pytest.raises(CollectiveMismatch) as info:
            dist.alltoall_single(o, torch.ones(3, 2), None, [2, 1, 0] if r == 2 else None)
        errs.append((str(info.value), info.value.ranks))
        # rank 1's list expects a piece of 3 elements from rank 0, which sends 2
        outs = [torch.zeros(3 if (r, q) == (1, 0) else 2) for q in range(W)]
        with pytest.raises(CollectiveMismatch) as info:
            dist.alltoall(outs, [torch.ones(2) for _ in range(W)])
        errs.append((str(info.value), info.value.ranks))
        out["errs"] = errs
        out["untouched"] = o.tolist(), [x.tolist() for x in outs]
        s = torch.ones(1)
        dist.all_reduce(s)  # the world goes on
        out["after"] = s.item()
        return out
    finally:
        set_checking(old)


def _check_a2a_sizes(res) -> None:
    splits = [[1, 0, 2], [2, 1, 0], [0, 1, 1]]
    for r, out in enumerate(res):
        if r == 0:
            assert out["uneven"] == [[[1, 2, 3], [4, 5, 6]], [[8, 9], [10, 11], [12, 13]]]
        elif r == 1:
            assert out["uneven"] == [[7], [[14, 15, 16, 17]]]
        rows = []
        for a in range(W):
            start = sum(splits[a][:r])
            rows.append(torch.arange(6.0).view(3, 2)[start : start + splits[a][r]] + 10 * a)
        torch.testing.assert_close(out["single"], torch.cat(rows))
        assert out["errs"] == [
            ("mismatch at #2 on group [0, 1, 2]: in alltoall_single, rank 0 sends rank 2 2 elements, but rank 2 "
             "expects 4 from it (and 1 more pair)", [0, 2]),
            ("mismatch at #3 on group [0, 1, 2]: in alltoall, rank 0 sends rank 1 2 elements, but rank 1 expects 3 "
             "from it", [0, 1])]
        assert out["untouched"] == ([[0.0, 0.0]] * 3, [[0.0] * (3 if (r, q) == (1, 0) else 2) for q in range(W)])
        assert out["after"] == float(W)


@pytest.mark.timeout(60)
def test_all_to_all_sizes_that_disagree_are_named_on_every_rank_with_checking_on():
    """With collective checking on, the members compare their shapes, but not what each sends each other: an
    all-to-all whose pieces disagree got past it and failed in the middle ("output with shape [1] doesn't match
    the broadcast shape [2]" on ranks as threads; gloo aborts the process). Now every member names the pair."""
    _check_a2a_sizes(run_ranks(_a2a_sizes, W, timeout=50))


# -- objects ----------------------------------------------------------------------------------------------------

def _objects():
    import threading

    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    errs = []

    def expect(call):
        with pytest.raises(ValueError) as info:
            call()
        errs.append(str(info.value))

    kept = ["kept"]
    expect(lambda: dist.all_gather_object(kept, (lambda: r) if r == 1 else r))  # a local function: no pickle
    mine = [threading.Lock()] if r == 2 else [None]
    expect(lambda: dist.broadcast_object_list(mine, src=2))
    lists = ["a", "b"] if r == 1 else ["x"] * (1 + (r == 0))
    expect(lambda: dist.broadcast_object_list(lists, src=1))  # rank 2's list is shorter than src's
    out = ["kept"]
    expect(lambda: dist.scatter_object_list(out, [1, 2] if r == 0 else None, src=0))  # one object short
    expect(lambda: dist.scatter_object_list(out, [1, threading.Lock(), 3] if r == 0 else None, src=0))
    untouched = (kept, mine[0] if r != 2 else None, lists, out)
    # the world goes on: large objects, in a group that leaves rank 1 out (new_group sorts it: [0, 2])
    g = dist.new_group([2, 0])
    big = {"rank": r, "data": list(range(5000 * (r + 1)))}
    gathered = ["first"]
    dist.all_gather_object(gathered, big, group=g)
    sent = [big, "tail"] if r == 2 else [None, None]
    dist.broadcast_object_list(sent, src=2, group=g)
    scattered = ["old"]
    dist.scatter_object_list(scattered, [{"to": i, "pad": "p" * 3000 * i} for i in range(2)] if r == 0 else None,
                             src=0, group=g)
    got = (gathered[0], [o["rank"] for o in gathered[1:]], [len(o["data"]) for o in gathered[1:]],
           sent[0]["rank"] if sent[0] else None, sent[1], scattered[0]["to"] if r != 1 else scattered[0],
           len(scattered[0]["pad"]) if r != 1 else None)
    return errs, untouched, got


def _check_objects(res) -> None:
    for r, (errs, untouched, got) in enumerate(res):
        assert errs[0].startswith("all_gather_object: the object of rank 1 " + ("(this rank) cannot be pickled ("
                                  "AttributeError: Can't" if r == 1 else "cannot be pickled (named there)")), errs[0]
        assert errs[1].startswith("broadcast_object_list: the object of rank 2 " + (
            "(this rank) cannot be pickled (TypeError: " if r == 2 else "cannot be pickled (named there)")), errs[1]
        assert errs[2] == ("broadcast_object_list: src rank 1 sends 2 objects, but rank 2 passes a list of another "
                           "length; give every rank a list as long as src's")
        assert errs[3] == "scatter_object_list: src rank 0 needs an in_object_list of 3 objects, got 2"
        assert errs[4].startswith("scatter_object_list: the object of rank 0 ")
        assert untouched == (["kept"], None, ["a", "b"] if r == 1 else ["x"] * (1 + (r == 0)), ["kept"])
        if r == 1:  # outside the group: its lists stay as they were
            assert got == ("first", [], [], None, None, "old", None)
        else:
            assert got == ("first", [0, 2], [5000, 15000], 2, "tail", {0: 0, 2: 1}[r], 3000 * {0: 0, 2: 1}[r])


@pytest.mark.timeout(60)
def test_an_object_that_cannot_be_pickled_or_a_list_of_another_length_is_named_on_every_rank():
    """Paddle and torch pickle first: the rank whose object cannot be pickled raised alone and the others waited
    for it (a hang on gloo); a broadcast_object_list whose lists differ in length sent sizes of other shapes (gloo
    aborts the process); a scatter_object_list with src's list a size short raised on src alone. Each member now
    sends a row of sizes first, and every member raises, before the objects' bytes move."""
    _check_objects(run_ranks(_objects, W, timeout=50))


@pytest.mark.timeout(120)
def test_complex_gather_objects_and_disagreeing_all_to_alls_on_gloo_processes():
    """The same on real gloo processes, where a complex gather raised "Invalid scalar type" on every rank."""
    _check_complex(run_ranks(_complex, W, timeout=100, ranks="processes"))
    _check_objects(run_ranks(_objects, W, timeout=100, ranks="processes"))
    _check_a2a_sizes(run_ranks(_a2a_sizes, W, timeout=100, ranks="processes"))


# -- new_group ---------------------------------------------------------------------------------------------------

def _new_group_options():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    g = dist.new_group([1, 0], backend="gloo", timeout=30, nccl_comm_init_option=0, nccl_config=None)
    t = torch.tensor([r + 1.0])
    dist.all_reduce(t, group=g)
    return g.ranks, t.item()


@pytest.mark.timeout(60)
def test_new_group_takes_paddles_nccl_options():
    """Paddle 3.3.1: ``new_group(ranks, nccl_comm_init_option=0)`` makes the group (the option tunes NCCL's start);
    it raised TypeError."""
    assert run_ranks(_new_group_options, 2, timeout=50) == [([0, 1], 3.0)] * 2
