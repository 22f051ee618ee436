"""Collective forms Paddle 3 accepts (all_gather into one tensor, alltoall's output first), aliased buffers and
mixed dtypes, against the dense truth."""

import pytest
import torch

from meshviz.testing import run_ranks

W = 4


def _mine(r: int, shape=(2,)) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 10.0 * r


# -- all_gather into one tensor ----------------------------------------------------------------------------------

def _gather_into():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    flat = torch.zeros(2 * W)
    task = dist.all_gather(flat, _mine(r))
    out["flat"] = (flat, task.is_completed())
    stacked = torch.zeros(W, 2)
    dist.all_gather(stacked, _mine(r))
    out["stacked"] = stacked
    rows = torch.zeros(2 * W, 3)
    task = dist.all_gather(rows, _mine(r, (2, 3)), sync_op=False)
    task.wait()
    out["rows"] = rows
    wide = torch.full((2 * W, 2), -1.0)  # the output a strided view: its other column is left alone
    dist.all_gather(wide[:, 1], _mine(r))
    out["strided"] = wide
    inplace = torch.zeros(2 * W)  # the input this rank's own slice of the output
    inplace[2 * r:2 * r + 2] = _mine(r)
    dist.all_gather(inplace, inplace[2 * r:2 * r + 2])
    out["inplace"] = inplace
    g = dist.new_group([3, 1])  # sorted, as Paddle: [1, 3]
    sub = torch.full((2 * 2,), -1.0)
    dist.all_gather(sub, _mine(r), group=g)
    out["sub"] = sub
    try:
        dist.all_gather(torch.zeros(2 * W + 1), _mine(r))
    except ValueError as e:
        out["bad"] = str(e)
    s = torch.ones(1)
    dist.all_reduce(s)  # nothing was sent by the refused call
    out["after"] = s.item()
    return out


@pytest.mark.timeout(60)
def test_all_gather_fills_one_output_tensor_as_paddles_tensor_form():
    """Paddle 3.3.1 (4 ranks, gloo): ``dist.all_gather(out, x)`` with a tensor ``out`` of 4x the elements holds the
    ranks' tensors one after another ([0, .5, 1, 1.5, ...] as ``[8]`` or ``[4, 2]``; ``[2, 3]`` inputs as
    ``[8, 3]``)."""
    res = run_ranks(_gather_into, W, timeout=50)
    dense = torch.cat([_mine(i) for i in range(W)])
    for r, out in enumerate(res):
        torch.testing.assert_close(out["flat"][0], dense)
        assert out["flat"][1]
        torch.testing.assert_close(out["stacked"], dense.view(W, 2))
        torch.testing.assert_close(out["rows"], torch.cat([_mine(i, (2, 3)) for i in range(W)]))
        torch.testing.assert_close(out["strided"][:, 1], dense)
        torch.testing.assert_close(out["strided"][:, 0], torch.full((2 * W,), -1.0))
        torch.testing.assert_close(out["inplace"], dense)
        want = torch.cat([_mine(1), _mine(3)]) if r in (1, 3) else torch.full((4,), -1.0)
        torch.testing.assert_close(out["sub"], want, msg=str(r))
        assert "float32[9]" in out["bad"] and "needs 4 times its elements" in out["bad"], out["bad"]
        assert out["after"] == W


# -- alltoall: the output first ------------------------------------------------------------------------------------

def _alltoall():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    ins = [torch.full((2,), 10.0 * r + j) for j in range(W)]
    given = [torch.zeros(2) for _ in range(W)]
    dist.alltoall(given, ins)
    out["given"] = given
    filled: list = []
    dist.alltoall(filled, ins)
    out["filled"] = filled
    kw: list = []
    dist.alltoall(in_tensor_list=ins, out_tensor_list=kw)
    out["keywords"] = kw
    single = torch.zeros(W)
    dist.alltoall_single(single, torch.arange(W, dtype=torch.float32) + 10 * r)
    out["single"] = single
    # uneven: rank r sends j + 1 rows to rank j, so it receives r + 1 rows from each
    uneven = torch.zeros(W * (r + 1))
    dist.alltoall_single(uneven, torch.cat([torch.full((j + 1,), 10.0 * r + j) for j in range(W)]),
                         [j + 1 for j in range(W)], [r + 1] * W)
    out["uneven"] = uneven
    two = torch.zeros(W)
    dist.alltoall(two, torch.arange(W, dtype=torch.float32) + 10 * r)  # two tensors: alltoall_single
    out["tensors"] = two
    try:
        dist.alltoall(ins, [])  # the older order (input first): the empty list can only be the output
    except ValueError as e:
        out["old_order"] = str(e)
    return out


@pytest.mark.timeout(60)
def test_alltoall_and_alltoall_single_take_the_output_first_as_paddle_3():
    """Paddle 3.3.1's ``alltoall(out_tensor_list, in_tensor_list)`` and ``alltoall_single(out_tensor, in_tensor,
    in_split_sizes, out_split_sizes)`` (its sources; gloo has no all-to-all): the first argument receives. The older
    order sent the zeros of the output list and overwrote the inputs."""
    res = run_ranks(_alltoall, W, timeout=50)
    for r, out in enumerate(res):
        want = [torch.full((2,), 10.0 * i + r) for i in range(W)]
        for key in ("given", "filled", "keywords"):
            assert len(out[key]) == W
            for got, w in zip(out[key], want):
                torch.testing.assert_close(got, w, msg=f"{key} on rank {r}")
        torch.testing.assert_close(out["single"], torch.tensor([10.0 * i + r for i in range(W)]))
        torch.testing.assert_close(out["tensors"], torch.tensor([10.0 * i + r for i in range(W)]))
        torch.testing.assert_close(out["uneven"], torch.cat([torch.full((r + 1,), 10.0 * i + r) for i in range(W)]))
        assert "output comes first" in out["old_order"], out["old_order"]


# -- aliased buffers -----------------------------------------------------------------------------------------------

def _aliased():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    x = torch.arange(W, dtype=torch.float32) + 10 * r
    dist.alltoall_single(x, x)  # in place
    out["a2a_inplace"] = x
    y = _mine(r)
    lst = [torch.zeros(2) for _ in range(W)]
    lst[(r + 1) % W] = y  # the input is another rank's slot of the output list
    dist.all_gather(lst, y)
    out["gather_alias"] = lst
    return out


@pytest.mark.timeout(60)
def test_an_input_that_is_also_an_output_is_sent_before_it_is_overwritten():
    """``alltoall_single(x, x)`` and an ``all_gather`` list holding the input in another rank's slot: each rank sends
    its values as they were (before, rank 1 got [10, 11, 21, 31] for [1, 11, 21, 31] and a gathered list repeated
    a rank's value)."""
    res = run_ranks(_aliased, W, timeout=50)
    for r, out in enumerate(res):
        torch.testing.assert_close(out["a2a_inplace"], torch.tensor([10.0 * i + r for i in range(W)]))
        for i, got in enumerate(out["gather_alias"]):
            torch.testing.assert_close(got, _mine(i), msg=f"rank {r} slot {i}")


# -- one dtype per all-to-all --------------------------------------------------------------------------------------

def _mixed_dtypes():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    errs = {}

    def catch(name, fn):
        try:
            fn()
            errs[name] = None
        except ValueError as e:
            errs[name] = str(e)

    big = [torch.full((1,), 2**40 + 10 * r + j, dtype=torch.int64) for j in range(W)]
    catch("mixed_in", lambda: dist.alltoall([], big[:-1] + [torch.zeros(1)]))
    catch("out_dtype", lambda: dist.alltoall([torch.zeros(1) for _ in range(W)], big))
    catch("single", lambda: dist.alltoall_single(torch.zeros(W), torch.arange(W)))
    catch("zero_d", lambda: dist.alltoall_single(torch.tensor(1.0), torch.tensor(2.0)))
    outs: list = []
    dist.alltoall(outs, big)  # one dtype: int64 values beyond float precision arrive exactly
    errs["exact"] = [int(o.item()) for o in outs]
    return errs


@pytest.mark.timeout(60)
def test_an_alltoall_of_mixed_dtypes_is_refused_on_every_rank_before_data_moves():
    """One packed buffer carries an alltoall: an int64 piece beside a float32 one went through float32 (2**40 + 10
    arrived as 2**40) and a float32 output list took int64 pieces converted. Paddle's contract: one dtype."""
    res = run_ranks(_mixed_dtypes, W, timeout=50)
    for r, errs in enumerate(res):
        assert "in_tensor_list[3] is float32" in errs["mixed_in"], errs["mixed_in"]
        assert "out_tensor_list[0] is float32" in errs["out_dtype"], errs["out_dtype"]
        assert "one dtype" in errs["single"], errs["single"]
        assert "0-d" in errs["zero_d"], errs["zero_d"]
        assert errs["exact"] == [2**40 + 10 * i + r for i in range(W)]


# -- scatter and reduce_scatter from one tensor ------------------------------------------------------------------------

def _from_one_tensor():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    got = torch.zeros(2)
    dist.scatter(got, torch.arange(2 * W, dtype=torch.float32) + 100 if r == 1 else None, src=1)
    out["scatter"] = got
    rows = torch.zeros(2, 3)
    dist.scatter(rows, _mine(0, (2 * W, 3)) if r == 2 else None, src=2)
    out["scatter_rows"] = rows
    whole = _mine(r, (2 * W, 3))
    piece = torch.zeros(2, 3)
    dist.reduce_scatter(piece, whole)
    out["rows"] = piece
    mean = torch.zeros(2)
    dist.reduce_scatter(mean, _mine(r, (2 * W,)), op=dist.ReduceOp.AVG)
    out["avg"] = mean
    inplace = _mine(r, (2 * W,))  # the output this rank's own slice of the input
    dist.reduce_scatter(inplace[2 * r:2 * r + 2], inplace)
    out["inplace"] = inplace[2 * r:2 * r + 2]
    try:
        dist.reduce_scatter(torch.zeros(2), torch.zeros(2 * W + 2))
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.timeout(60)
def test_scatter_and_reduce_scatter_take_one_input_tensor_as_paddles_tensor_form():
    """Paddle 3.3.1 (3 ranks, gloo): ``dist.scatter(x, in_tensor, src=1)`` gives rank i the i-th dim-0 piece
    ([100 + 2i, 101 + 2i] of ``arange(6) + 100``), and ``reduce_scatter(tensor, in_tensor)`` reduces the i-th pieces
    onto rank i (its sources: ``reduce_scatter_tensor``). Before, reduce_scatter read the tensor as a list of its
    rows (``tensor_list needs 4 tensors, got 8``) and scatter's src raised while the others waited."""
    res = run_ranks(_from_one_tensor, W, timeout=50)
    total = sum(_mine(i, (2 * W, 3)) for i in range(W))
    flat = sum(_mine(i, (2 * W,)) for i in range(W))
    for r, out in enumerate(res):
        torch.testing.assert_close(out["scatter"], torch.tensor([100.0 + 2 * r, 101.0 + 2 * r]))
        torch.testing.assert_close(out["scatter_rows"], _mine(0, (2 * W, 3))[2 * r:2 * r + 2])
        torch.testing.assert_close(out["rows"], total[2 * r:2 * r + 2])
        torch.testing.assert_close(out["avg"], flat[2 * r:2 * r + 2] / W)
        torch.testing.assert_close(out["inplace"], flat[2 * r:2 * r + 2])
        assert "needs 4 times its elements" in out["bad"], out["bad"]


# -- dist.stream ---------------------------------------------------------------------------------------------------

def _stream():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    t = _mine(r)
    dist.stream.all_reduce(t, use_calc_stream=True)
    out["all_reduce"] = t
    into = torch.zeros(W * 2)
    dist.stream.all_gather(into, _mine(r))
    out["all_gather"] = into
    # stream's alltoall_single: the output's split sizes before the input's (rank r receives r + 1 rows from each)
    uneven = torch.zeros(W * (r + 1))
    dist.stream.alltoall_single(uneven, torch.cat([torch.full((j + 1,), 10.0 * r + j) for j in range(W)]),
                                [r + 1] * W, [j + 1 for j in range(W)])
    out["alltoall_single"] = uneven
    b = _mine(r)
    dist.stream.broadcast(b, src=2).wait()
    out["broadcast"] = b
    try:
        dist.stream.all_reduce(_mine(r), sync_op=False, use_calc_stream=True)
    except RuntimeError as e:
        out["calc_stream"] = str(e)
    return out


@pytest.mark.timeout(60)
def test_dist_stream_runs_paddles_stream_collectives_and_refuses_an_async_call_on_the_calc_stream():
    """``paddle.distributed.stream``: the collectives with ``use_calc_stream``; its ``alltoall_single`` takes the
    output's split sizes first; ``use_calc_stream`` with ``sync_op=False`` raises (Paddle's rule) on every rank."""
    res = run_ranks(_stream, W, timeout=50)
    for r, out in enumerate(res):
        torch.testing.assert_close(out["all_reduce"], sum(_mine(i) for i in range(W)))
        torch.testing.assert_close(out["all_gather"], torch.cat([_mine(i) for i in range(W)]))
        torch.testing.assert_close(out["alltoall_single"],
                                   torch.cat([torch.full((r + 1,), 10.0 * i + r) for i in range(W)]))
        torch.testing.assert_close(out["broadcast"], _mine(2))
        assert "use_calc_stream can only be true in sync op behavior" in out["calc_stream"]


# -- send_object_list / recv_object_list -----------------------------------------------------------------------------

def _objects():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    data = ["hello", {"key": 100}, [1, 2, 3]]
    got = [None] * 3
    if r == 0:
        dist.send_object_list(data, dst=2)
    elif r == 2:
        dist.recv_object_list(got, src=0)
    g = dist.new_group([2, 1])  # sorted, as Paddle's: rank 1 is the group's 0, rank 2 its 1
    back = [None, None]
    if r == 2:
        dist.send_object_list([("from", r), torch.arange(3)], group=g, dst_in_group=0)
    elif r == 1:
        dist.recv_object_list(back, group=g, src_in_group=1)
    try:
        dist.send_object_list(data, dst=1, dst_in_group=0)
    except ValueError as e:
        both = str(e)
    return got, back, both


@pytest.mark.timeout(60)
def test_send_and_recv_object_list_move_picklable_objects_as_paddles():
    """Paddle 3.3.1's example: rank 0 sends ``["hello", {"key": 100}, [1, 2, 3]]``, the receiver's list of three
    ``None`` gets them; ``dst_in_group`` / ``src_in_group`` count in the group's order; naming both raises."""
    res = run_ranks(_objects, 3, timeout=50)
    assert res[2][0] == ["hello", {"key": 100}, [1, 2, 3]]
    assert res[0][0] == res[1][0] == [None] * 3
    assert res[1][1][0] == ("from", 2)
    torch.testing.assert_close(res[1][1][1], torch.arange(3))
    assert all("give dst or dst_in_group, not both" in out[2] for out in res)
