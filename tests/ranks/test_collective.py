"""Collectives against their definitions on 4 gloo ranks, and bad input raising on every rank."""

import pytest
import torch

from meshviz.testing import run_ranks

W = 4


def _val(r, n=3):
    return torch.arange(n, dtype=torch.float32) + 10 * r + 1


def _collectives():
    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}
    mem = trace.MemorySink()
    trace.add_sink(mem)

    # all_reduce, every op, sync and async
    for name in ("SUM", "MAX", "MIN", "PROD", "AVG"):
        t = _val(r)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out[f"all_reduce_{name}"] = t
    t = _val(r)
    task = dist.all_reduce(t, sync_op=False)
    task.wait()
    out["all_reduce_async"] = (t, task.is_completed())
    ti = torch.tensor([r * 3 + 1, 7])
    dist.all_reduce(ti, op=dist.ReduceOp.AVG)
    out["all_reduce_avg_int"] = ti

    # all_gather into an empty list and into a given list
    lst = []
    dist.all_gather(lst, _val(r))
    out["all_gather"] = lst
    lst2 = [torch.zeros(3) for _ in range(W)]
    dist.all_gather(lst2, _val(r), sync_op=False).wait()
    out["all_gather_given"] = lst2
    objs = []
    dist.all_gather_object(objs, {"rank": r, "sq": r * r})
    out["all_gather_object"] = objs

    t = _val(r)
    dist.broadcast(t, src=2)
    out["broadcast"] = t

    for name in ("SUM", "AVG", "MAX"):
        t = _val(r)
        dist.reduce(t, dst=1, op=getattr(dist.ReduceOp, name))
        out[f"reduce_{name}"] = t

    t = torch.zeros(3)
    dist.scatter(t, [_val(10 + i) for i in range(W)] if r == 3 else None, src=3)
    out["scatter"] = t

    g = []
    dist.gather(_val(r), g if r == 0 else None, dst=0)
    out["gather"] = g

    for name in ("SUM", "AVG", "MAX"):
        t = torch.zeros(3)
        dist.reduce_scatter(t, [_val(r) * (i + 1) for i in range(W)], op=getattr(dist.ReduceOp, name))
        out[f"reduce_scatter_{name}"] = t

    outs = []
    dist.alltoall(outs, [torch.full((2,), 100.0 * r + j) for j in range(W)])
    out["alltoall"] = outs

    t_out = torch.zeros(W)
    dist.alltoall_single(t_out, torch.arange(W, dtype=torch.float32) + 100 * r)
    out["alltoall_single"] = t_out
    # uneven: rank r sends j+1 rows to rank j, so rank r receives r+1 rows from everyone
    ins = torch.cat([torch.full((j + 1,), 10.0 * r + j) for j in range(W)])
    t_out = torch.zeros(W * (r + 1))
    dist.alltoall_single(t_out, ins, [j + 1 for j in range(W)], [r + 1] * W)
    out["alltoall_single_uneven"] = t_out

    # point to point: a ring with send/recv, then batch_isend_irecv the other way
    nxt, prv = (r + 1) % W, (r - 1) % W
    buf = torch.zeros(3)
    if r % 2 == 0:
        dist.send(_val(r), dst=nxt)
        dist.recv(buf, src=prv)
    else:
        dist.recv(buf, src=prv)
        dist.send(_val(r), dst=nxt)
    out["sendrecv"] = buf
    buf2 = torch.zeros(3)
    tasks = dist.batch_isend_irecv([dist.P2POp(dist.isend, _val(r), prv), dist.P2POp(dist.irecv, buf2, nxt)])
    for tk in tasks:
        tk.wait()
    out["batch_p2p"] = buf2
    buf3 = torch.zeros(3)
    if r == 0:
        dist.isend(_val(r), 3).wait()
    elif r == 3:
        dist.irecv(buf3, 0).wait()
    out["isend_irecv"] = buf3

    # groups: sorted ranks, group ranks, collectives inside a subgroup with global src
    g13 = dist.new_group([3, 1])
    g02 = dist.new_group([0, 2])
    out["group"] = (g13.ranks, g13.nranks, g13.rank, g13.is_member(), g13.get_group_rank(3),
                    g13.get_group_rank(0), g13.get_global_rank(0), dist.get_group(g13.id) is g13)
    mine = g13 if r in (1, 3) else g02
    t = _val(r)
    dist.all_reduce(t, group=mine)
    out["group_all_reduce"] = t
    t = _val(r)
    dist.broadcast(t, src=mine.ranks[1], group=mine)
    out["group_broadcast"] = t
    t = _val(r)
    dist.all_reduce(t, group=g13)  # a non-member returns at once, tensor untouched
    out["non_member"] = t
    dist.barrier(group=g13)
    dist.barrier()
    dist.wait(t)

    evs = [e for e in mem.events if e.kind == "collective" and e.op == "all_reduce"]
    out["events"] = (len(evs), evs[0].group, evs[0].bytes, evs[0].payload.reduce_op,
                     sorted({e.kind for e in mem.events}))
    trace.remove_sink(mem)
    return out


@pytest.mark.timeout(120)
def test_collectives_match_definitions():
    res = run_ranks(_collectives, W)
    vals = [_val(i) for i in range(W)]
    stack = torch.stack(vals)
    for r, out in enumerate(res):
        torch.testing.assert_close(out["all_reduce_SUM"], stack.sum(0))
        torch.testing.assert_close(out["all_reduce_MAX"], stack.max(0).values)
        torch.testing.assert_close(out["all_reduce_MIN"], stack.min(0).values)
        torch.testing.assert_close(out["all_reduce_PROD"], stack.prod(0))
        torch.testing.assert_close(out["all_reduce_AVG"], stack.mean(0))
        torch.testing.assert_close(out["all_reduce_async"][0], stack.sum(0))
        assert out["all_reduce_async"][1] is True
        # ints: sum (1+4+7+10=22, 28) divided by 4, toward zero
        assert out["all_reduce_avg_int"].tolist() == [5, 7]
        for got in (out["all_gather"], out["all_gather_given"]):
            assert len(got) == W
            for i in range(W):
                torch.testing.assert_close(got[i], vals[i])
        assert out["all_gather_object"] == [{"rank": i, "sq": i * i} for i in range(W)]
        torch.testing.assert_close(out["broadcast"], vals[2])
        if r == 1:
            torch.testing.assert_close(out["reduce_SUM"], stack.sum(0))
            torch.testing.assert_close(out["reduce_AVG"], stack.mean(0))
            torch.testing.assert_close(out["reduce_MAX"], stack.max(0).values)
        else:  # non-destination inputs are left as they were
            torch.testing.assert_close(out["reduce_SUM"], vals[r])
            torch.testing.assert_close(out["reduce_AVG"], vals[r])
        torch.testing.assert_close(out["scatter"], _val(10 + r))
        if r == 0:
            assert len(out["gather"]) == W
            for i in range(W):
                torch.testing.assert_close(out["gather"][i], vals[i])
        torch.testing.assert_close(out["reduce_scatter_SUM"], stack.sum(0) * (r + 1))
        torch.testing.assert_close(out["reduce_scatter_AVG"], stack.mean(0) * (r + 1))
        torch.testing.assert_close(out["reduce_scatter_MAX"], stack.max(0).values * (r + 1))
        for i in range(W):
            torch.testing.assert_close(out["alltoall"][i], torch.full((2,), 100.0 * i + r))
        torch.testing.assert_close(out["alltoall_single"], torch.tensor([100.0 * i + r for i in range(W)]))
        exp = torch.cat([torch.full((r + 1,), 10.0 * i + r) for i in range(W)])
        torch.testing.assert_close(out["alltoall_single_uneven"], exp)
        torch.testing.assert_close(out["sendrecv"], vals[(r - 1) % W])
        torch.testing.assert_close(out["batch_p2p"], vals[(r + 1) % W])
        torch.testing.assert_close(out["isend_irecv"], vals[0] if r == 3 else torch.zeros(3))
        ranks, n, grank, member, g3, g0, glob0, found = out["group"]
        assert ranks == [1, 3] and n == 2 and g3 == 1 and g0 == -1 and glob0 == 1 and found
        assert grank == {1: 0, 3: 1}.get(r, -1) and member == (r in (1, 3))
        peers = [1, 3] if r in (1, 3) else [0, 2]
        torch.testing.assert_close(out["group_all_reduce"], vals[peers[0]] + vals[peers[1]])
        torch.testing.assert_close(out["group_broadcast"], vals[peers[1]])
        exp = vals[1] + vals[3] if r in (1, 3) else vals[r]
        torch.testing.assert_close(out["non_member"], exp)
        n_ev, group, nbytes, rop, kinds = out["events"]
        # what a rank receives of a 3-float all-reduce in a ring of 4: 3 chunks of 1 float, twice (reduce-scatter,
        # all-gather)
        assert n_ev >= 7 and group == [0, 1, 2, 3] and nbytes == 2 * 3 * 4 and rop == "sum"
        assert {"collective", "send", "recv"} <= set(kinds)


def _bad_inputs():
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

    t = torch.ones(2)
    catch("op", lambda: dist.all_reduce(t, op=7))
    catch("op_str", lambda: dist.all_reduce(t, op="sum"))
    catch("reduce_op", lambda: dist.reduce(t, dst=0, op=-1))
    catch("src", lambda: dist.broadcast(t, src=5))
    catch("dst", lambda: dist.reduce(t, dst=9))
    catch("dup", lambda: dist.new_group([0, 1, 1]))
    catch("out_of_world", lambda: dist.new_group([0, 4]))
    g = dist.new_group([0, 1])
    catch("src_not_in_group", lambda: dist.broadcast(t, src=2, group=g))
    catch("scatter_src", lambda: dist.scatter(t, None, src=3, group=g))
    catch("split", lambda: dist.alltoall_single(torch.ones(4), torch.ones(4)))
    # after all that, the process group still works: nothing was sent
    s = torch.ones(1) * (r + 1)
    dist.all_reduce(s)
    errs["after"] = s.item()
    return errs


@pytest.mark.timeout(60)
def test_bad_input_raises_on_every_rank():
    res = run_ranks(_bad_inputs, 3)
    for errs in res:
        assert "unknown reduce op" in errs["op"] and "unknown reduce op" in errs["op_str"]
        assert "unknown reduce op" in errs["reduce_op"]
        assert "src=5" in errs["src"] and "dst=9" in errs["dst"]
        assert "duplicate" in errs["dup"] and "outside the world" in errs["out_of_world"]
        assert "not in the group" in errs["src_not_in_group"] and "not in the group" in errs["scatter_src"]
        assert "divisible" in errs["split"]
        assert errs["after"] == 6.0


def test_reduce_op_values_match_paddle():
    import meshviz.distributed as dist

    assert (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PROD, dist.ReduceOp.AVG) == \
        (0, 1, 2, 3, 4)


def _issue14_names():
    import meshviz.distributed as dist
    from meshviz.runtime import groups

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {"available": dist.is_available()}

    # scatter_object_list: src (a global rank) sends the i-th object to the group's i-th member; the output
    # list is cleared and holds just this rank's object
    got = ["stale", "junk"]
    dist.scatter_object_list(got, [{"to": i, "sq": i * i} for i in range(W)] if r == 1 else None, src=1)
    out["scatter_world"] = got
    g13 = dist.new_group([3, 1])
    got = ["untouched"]
    dist.scatter_object_list(got, [("first", 10), ("second", 30)] if r == 3 else None, src=3, group=g13)
    out["scatter_group"] = got
    g0 = dist.new_group([0])
    try:  # bad input on the source raises before any communication (group of one: nobody waits on it)
        dist.scatter_object_list([], [1, 2], src=0, group=g0)
        out["scatter_bad"] = None
    except ValueError as e:
        out["scatter_bad"] = str(e)

    # destroy_process_group(group): that group goes, the world and a mesh sharing its process group stay
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    value = torch.arange(8.0).reshape(4, 2)
    t = dist.shard_tensor(value, mesh, [dist.Replicate(), dist.Partial()])
    g01 = dist.new_group([0, 1])
    s = torch.tensor([float(r + 1)])
    dist.all_reduce(s, group=g01)
    out["g01_before"] = s.item()
    dist.destroy_process_group(g01)
    out["g01_gone"] = dist.get_group(g01.id) is None
    try:
        dist.destroy_process_group(g01)
        out["twice"] = None
    except ValueError as e:
        out["twice"] = str(e)
    back = dist.reshard(t, mesh, [dist.Replicate(), dist.Replicate()])  # line (0, 1) of the mesh still works
    out["mesh_after"] = back._local_value().clone()
    again = dist.new_group([0, 1])
    s = torch.tensor([float(r + 1)])
    dist.all_reduce(s, group=again)
    out["g01_again"] = (again.id != g01.id, s.item())
    w = torch.tensor([float(r)])
    dist.all_reduce(w)
    out["world_after"] = w.item()

    # destroy_process_group(): the world and every group; not initialized afterwards
    dist.destroy_process_group()
    out["world_gone"] = (dist.is_initialized(), groups._state().paddle == {}, groups._state().by_ranks == {})
    return out


@pytest.mark.timeout(120)
def test_scatter_object_list_is_available_destroy_process_group():
    res = run_ranks(_issue14_names, W)
    for r, out in enumerate(res):
        assert out["available"] is True
        assert out["scatter_world"] == [{"to": r, "sq": r * r}]
        assert out["scatter_group"] == {1: [("first", 10)], 3: [("second", 30)]}.get(r, ["untouched"])
        if r == 0:
            assert "in_object_list of 1 objects, got 2" in out["scatter_bad"]
        else:
            assert out["scatter_bad"] is None
        assert out["g01_before"] == (3.0 if r in (0, 1) else float(r + 1))
        assert out["g01_gone"] is True
        assert "not a live group" in out["twice"]
        # P(sum) over axis y of rows [0, 1] and [2, 3]: coordinate 0 holds the value, the other zeros
        torch.testing.assert_close(out["mesh_after"], torch.arange(8.0).reshape(4, 2))
        assert out["g01_again"] == (True, 3.0 if r in (0, 1) else float(r + 1))
        assert out["world_after"] == 6.0
        assert out["world_gone"] == (False, True, True)


def _comm_layer():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.runtime import comm, groups

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {}

    # the bucketed mean: several dtypes, a budget small enough for one bucket per tensor or two
    ts = [torch.arange(5.0) * (r + 1), torch.full((3,), 10.0 * r, dtype=torch.float64),
          torch.tensor([r * 3 + 1, 7]), torch.ones(2, 2) * r]
    with trace.record() as mem:
        comm.all_reduce_mean_(ts, bucket_bytes=16, name="grads")
    out["mean"] = ts
    out["mean_events"] = [(e.op, e.bytes, e.name) for e in mem.of_kind("collective")]
    sub = [torch.tensor([float(r)])]
    comm.all_reduce_mean_(sub, (2, 0))  # a ranks tuple is a group too
    out["mean_line"] = sub[0].item()

    # one resolver for the four kinds of group
    world = groups.resolve(None)
    g = dist.new_group([0, 2])
    line = groups.resolve((2, 0))
    out["resolve"] = (world is dist.get_group(0), world.ranks, groups.resolve(g) is g, line.ranks, line.rank,
                      groups.resolve(tdist.group.WORLD) is world)
    if g.process_group is not None:
        out["resolve_pg"] = groups.resolve(g.process_group).ranks
    try:
        groups.resolve("world")
    except TypeError as e:
        out["resolve_bad"] = str(e)

    # one reset: Paddle groups, ordered groups and meshes are all forgotten
    mesh = dist.ProcessMesh([[0, 1, 2]], ["x", "y"])
    dist.reshard(dist.shard_tensor(torch.ones(3), mesh, [dist.Replicate(), dist.Shard(0)]), mesh,
                 [dist.Replicate(), dist.Replicate()])
    st = groups._state()
    before = (len(st.paddle) > 1, bool(st.by_ranks), bool(st.meshes), bool(st.lines))
    groups.clear_cache()
    st = groups._state()  # a fresh one
    after = (st.paddle, st.by_ranks, st.meshes, st.lines, st.by_pg, st.device_meshes)
    out["reset"] = (before, all(not x for x in after), dist.get_group(g.id), groups.clear_cache is groups.reset)
    g2 = dist.new_group([0, 2])
    s = torch.tensor([float(r + 1)])
    dist.all_reduce(s, group=g2)
    out["after_reset"] = (g2.id, s.item())
    return out


@pytest.mark.timeout(60)
def test_comm_layer_mean_resolver_and_reset():
    res = run_ranks(_comm_layer, 3)
    for r, out in enumerate(res):
        mean = out["mean"]
        torch.testing.assert_close(mean[0], torch.arange(5.0) * 2)  # (1 + 2 + 3) / 3
        torch.testing.assert_close(mean[1], torch.full((3,), 10.0, dtype=torch.float64))
        assert mean[2].tolist() == [4, 7] and mean[2].dtype == torch.int64  # (1 + 4 + 7) // 3, 21 // 3
        torch.testing.assert_close(mean[3], torch.ones(2, 2))
        # float32 in buckets of >= 16 bytes: [arange, 5 floats], [ones, 4 floats]; then 3 float64; 2 int64. A rank
        # receives 2 chunks of ceil(n / 3) twice in a ring of 3: 2 x 2 x 2 floats, 2 x 2 x 2 floats,
        # 2 x 2 x 1 float64, 2 x 2 x 1 int64
        assert out["mean_events"] == [("all_reduce", 32, "grads")] * 4
        assert out["mean_line"] == (1.0 if r in (0, 2) else float(r))
        world_ok, world_ranks, same_g, line_ranks, line_rank, pg_world = out["resolve"]
        assert world_ok and world_ranks == [0, 1, 2] and same_g and pg_world
        assert line_ranks == [2, 0] and line_rank == {2: 0, 0: 1}.get(r, -1)
        if r in (0, 2):
            assert out["resolve_pg"] == [0, 2]
        assert "got str" in out["resolve_bad"]
        assert out["reset"] == ((True, True, True, True), True, None, True)
        assert out["after_reset"] == (10, 4.0 if r in (0, 2) else float(r + 1))


_AUTOGRAD_COLLECTIVES = """
import sys, torch
from meshviz.ranks.threads import ThreadWorld
# the thread backend imports torch._dynamo, which imports it: forgotten, so that a rank thread imports it first
for name in [m for m in sys.modules if m.startswith("torch.distributed.nn")]:
    del sys.modules[name]

def step(rank):
    import torch.distributed as tdist
    import torch.distributed.nn.functional as F  # first imported on a rank thread: its default group is bound now

    t = torch.full((2,), float(tdist.get_rank() + 1), requires_grad=True)
    out = F.all_reduce(t)
    out.sum().backward()
    return out.tolist(), t.grad.tolist()

for _ in range(2):  # a second world after the first one stopped
    world = ThreadWorld(2, timeout=20).start()
    job = world.submit(step)
    assert job.wait(40), "the ranks did not finish"
    print([o.value for o in job.outcomes()])
    world.stop()
"""


@pytest.mark.timeout(120)
def test_torchs_autograd_collectives_on_rank_threads():
    # torch.distributed.nn.functional binds the world's group as its functions' default when it is imported: on a
    # rank thread, each rank would have used that rank's group (a hang), and the next world a stopped one
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _AUTOGRAD_COLLECTIVES], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    # all_reduce of 1s and 2s is 3s on both ranks; its gradient is the sum of both ranks' output gradients (1s)
    assert done.stdout.split("\n")[:2] == ["[([3.0, 3.0], [2.0, 2.0]), ([3.0, 3.0], [2.0, 2.0])]"] * 2


def _p2p_pairs(sleep_first):
    import time

    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == 0:
        dist.send(torch.arange(4.0).view(2, 2), 1)  # as gloo: the elements count, not the shape
        if sleep_first:  # the receive is posted first
            time.sleep(0.1)
        dist.send(torch.tensor([1.5, 2.5], dtype=torch.float64), 1)
        return None
    ok = torch.zeros(4)
    dist.recv(ok, 0)
    assert ok.tolist() == [0.0, 1.0, 2.0, 3.0]
    dist.recv(torch.zeros(2, dtype=torch.int64), 0)  # float64 into int64: copy_ would have truncated to [1, 2]


@pytest.mark.parametrize("sleep_first", [False, True])
def test_a_receive_of_another_dtype_raises_on_rank_threads(sleep_first):
    from meshviz.testing import RankFailed

    with pytest.raises(RankFailed) as info:
        run_ranks(_p2p_pairs, 2, sleep_first, timeout=30, ranks="threads")
    err = info.value
    line = ("recv from rank 0 (tag 0) on ranks [0, 1]: the sender's float64 [2] does not fit this rank's int64 [2] (a "
            "receive takes the sent dtype and number of elements)")
    by = {o.rank: o for o in err.outcomes}
    assert by[1].error == f"ValueError: {line}" or by[0].error == f"ValueError: send to rank 1: {line}", err.outcomes
    if sleep_first:  # the sender filled the posted receive: both hear of it
        assert by[0].error == f"ValueError: send to rank 1: {line}" and err.ranks == [0]
    else:  # the receiver found the message in its mailbox: the send had returned
        assert by[1].error == f"ValueError: {line}" and by[0].status == "ok" and err.ranks == [1]
