"""A call refused on one rank whose code catches the error and goes on: the others' error names the refusal (the
call, its reason, where) rather than only "never entered" or "deadlock"."""

import pytest
import torch

from meshviz.errors import RankError
from meshviz.testing import run_ranks
from meshviz.trace import RankStatus, RollCall

pytestmark = pytest.mark.timeout(60)

HERE = "test_refusals_named_edge_probe.py:"


def _rank():
    from meshviz.rank_context import getenv

    return int(getenv("RANK"))


def _failure(fn, n=2, **kw) -> RankError:
    with pytest.raises(RankError) as info:
        run_ranks(fn, n, timeout=15, collective_timeout=5, **kw)
    return info.value


# -- the collectives ---------------------------------------------------------------------------------------------

def _broadcast_src_outside():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.arange(3.0) + _rank()
    dist.all_reduce(t)
    if _rank() == 0:
        try:
            dist.broadcast(t, src=5)  # refused: src 5 is not in the group
        except ValueError:
            pass
        return None
    dist.broadcast(t, src=0)
    return t.tolist()


def test_a_caught_refused_broadcast_is_named_where_the_others_wait():
    """Rank 0 refuses broadcast(src=5), catches it and returns; rank 1 waits for it in broadcast #2. On HEAD the
    error said only "rank 0 never entered broadcast #2 on group [0, 1] (idle: its function returned)" and rank 1's
    "deadlock: ... rank 0 finished"."""
    err = _failure(_broadcast_src_outside)
    head = err.headline()
    assert head.startswith("rank 0 never entered broadcast #2 on group [0, 1]: it refused broadcast (ValueError: "
                           "src=5 is not in the group [0, 1]"), head
    assert f"at {HERE}" in head and "in _broadcast_src_outside() and went on (idle: its function returned)" in head
    stopped = next(o for o in err.outcomes if o.rank == 1).error
    assert "deadlock" in stopped and "rank 0 refused broadcast (ValueError: src=5 is not in the group" in stopped


def _scatter_short_list():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    out = torch.zeros(2)
    if _rank() == 0:
        try:
            dist.scatter(out, [torch.ones(2)], src=0)  # one tensor for a group of two
        except ValueError:
            pass
        return None
    dist.scatter(out, src=0)
    return out.tolist()


def test_a_caught_refused_scatter_is_named():
    err = _failure(_scatter_short_list)
    assert err.diagnosis and err.diagnosis[0].startswith(
        "rank 0 never entered scatter #1 on group [0, 1]: it refused scatter (ValueError: src rank needs a "
        "tensor_list of 2 tensors, got 1)"), err.diagnosis


# -- the auto-parallel API: the others wait in another op than the one refused -------------------------------

def _unshard_plain():
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    if _rank() == 0:
        try:
            dist.unshard_dtensor(x._local_value())  # a plain tensor
        except ValueError:
            pass
        return None
    return dist.unshard_dtensor(x).tolist()


def test_a_caught_refused_unshard_is_named_where_the_others_gather():
    err = _failure(_unshard_plain)
    line = err.diagnosis[0]
    assert line.startswith("rank 0 never entered all_gather #1 on group [0, 1]: it refused unshard_dtensor "
                           "(ValueError: The input should be a distributed tensor"), line
    assert f"at {HERE}" in line and "in _unshard_plain() and went on" in line


def _reshard_bad_placement():
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    if _rank() == 1:
        try:
            dist.reshard(x, mesh, [dist.Shard(3)])  # a 1-d tensor has no dim 3
        except ValueError:
            pass
        return None
    return dist.reshard(x, mesh, [dist.Replicate()])._local_value().tolist()


def test_a_caught_refused_reshard_on_one_rank_is_named():
    err = _failure(_reshard_bad_placement)
    line = err.diagnosis[0]
    assert line.startswith("rank 1 never entered all_gather #1 on group [0, 1]: it refused reshard (ValueError: "), line
    assert "in _reshard_bad_placement() and went on" in line and "Shard(3)" in line, line


# -- an old refusal is not blamed --------------------------------------------------------------------------------

def _refused_then_went_on():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.ones(2)
    if _rank() == 0:
        try:
            dist.broadcast(t, src=5)
        except ValueError:
            pass
    dist.all_reduce(t)  # both ranks: the refusal above left nobody waiting
    if _rank() == 1:
        dist.all_reduce(t)  # rank 0 skips this one, without refusing anything
    return t.tolist()


def test_a_refusal_before_a_collective_that_went_through_is_not_blamed():
    err = _failure(_refused_then_went_on)
    assert err.diagnosis[0] == "rank 0 never entered all_reduce #2 on group [0, 1] (idle: its function returned)", \
        err.diagnosis
    assert "refused" not in str(err)


def _all_fine():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.full((2,), float(_rank() + 1))
    dist.broadcast(t, src=1)
    from meshviz.runtime import rollcall

    return t.tolist(), rollcall.current().refused


def test_calls_that_go_through_leave_no_refusal():
    assert run_ranks(_all_fine, 2, timeout=15) == [([2.0, 2.0], None)] * 2


def _caught_a_failed_collective():
    import meshviz.distributed as dist
    from meshviz.runtime import rollcall

    dist.init_parallel_env()
    if _rank() == 1:
        try:
            dist.all_reduce(torch.ones(2))  # rank 0 never comes: the wait fails (a deadlock), inside the collective
        except Exception as e:
            return type(e).__name__, rollcall.current().refused
    return None


def test_an_error_out_of_a_collective_is_no_refusal():
    assert run_ranks(_caught_a_failed_collective, 2, timeout=15, collective_timeout=5) == [
        None, ("RankStopped", None)]


# -- ranks as processes: the refusing rank returned, so the roll-call reads what it left -------------------------

@pytest.mark.timeout(60)
def test_a_refused_broadcast_on_a_rank_process_that_returned_is_named():
    """gloo processes: rank 0 refused, caught it and returned (its process exited, its roll-call answers with it);
    rank 1 lost the connection. On HEAD the diagnosis said only that rank 0 returned without entering."""
    err = _failure(_broadcast_src_outside, ranks="processes")
    line = err.diagnosis[0]
    assert line.startswith("rank 0 never entered broadcast #2 on group [0, 1]: it refused broadcast (ValueError: "
                           "src=5 is not in the group [0, 1]"), line
    assert line.endswith("and went on (idle: its function returned)"), line


def _refuse_then_sleep():
    import time

    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.ones(2)
    if _rank() == 0:
        try:
            dist.broadcast(t, src=5)
        except ValueError:
            pass
        time.sleep(5)  # still running when the others' wait times out: it answers the roll-call itself
        return None
    dist.broadcast(t, src=0)
    return t.tolist()


@pytest.mark.timeout(60)
def test_a_refusing_rank_process_still_running_answers_with_its_refusal():
    with pytest.raises(RankError) as info:
        run_ranks(_refuse_then_sleep, 2, timeout=20, collective_timeout=2, ranks="processes")
    line = info.value.diagnosis[0]
    assert line.startswith("rank 0 never entered broadcast #1 on group [0, 1]: it refused broadcast (ValueError: "
                           "src=5 is not in the group [0, 1]"), line
    assert f"and went on; it is running at {HERE}" in line, line


# -- the roll-call's words, and its records on the wire -------------------------------------------------------------

def test_roll_call_lines_name_the_refusal_only_where_it_was_the_next_call():
    g = (0, 1)
    waits = RankStatus(1, "in_collective", op="broadcast", group=g, seq=3, waiting_s=6.0, entered=((g, 3),))
    said = "broadcast (ValueError: src=5 is not in the group [0, 1]) at line 4 of the cell"
    idle = RankStatus(0, "idle", note="its cell finished", entered=((g, 2),), refused=said,
                      refused_entered=((g, 2),))
    assert RankStatus.from_dict(idle.to_dict()) == idle
    rc = RollCall([idle, waits])
    assert rc.lines() == ["rank 1 waits in broadcast #3 on group [0, 1] for 6.0 s; rank 0 is idle: its cell finished "
                          f"without entering broadcast #3; it refused {said} and went on"]
    assert rc.blame()[0] == f"rank 0 never entered broadcast #3 on group [0, 1]: it refused {said} and went on " \
                            "(idle: its cell finished)"
    old = RollCall([RankStatus(0, "idle", note="its cell finished", entered=((g, 2),), refused=said,
                               refused_entered=((g, 1),)), waits])  # refused before #2, which it entered
    assert "refused" not in " ".join(old.lines() + old.blame())


# -- fleet.distributed_optimizer on a rank that never called fleet.init ------------------------------------------

def _optimizer_without_init(caught: bool):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if _rank() == 1:
        fleet.init(is_collective=True)
        fleet.distributed_optimizer(opt)
        return "initialized"
    dist.init_parallel_env()
    try:
        fleet.distributed_optimizer(opt)
    except RuntimeError as e:
        if not caught:
            raise
        return str(e)
    return "a plain optimizer"


def test_distributed_optimizer_without_fleet_init_raises_as_paddle():
    """Paddle 3.3.1 raises there (AttributeError: 'NoneType' object has no attribute '_worker_num', in one process
    and on every rank of a launch that only called init_parallel_env). meshviz returned an optimizer that steps as
    one process while the ranks that called fleet.init wait for this one: now RuntimeError naming fleet.init."""
    with pytest.raises(RankError) as info:
        run_ranks(_optimizer_without_init, 2, False, timeout=15, collective_timeout=5)
    err = info.value
    assert err.rank == 0 and "RuntimeError: fleet.distributed_optimizer: this rank never called fleet.init" in \
        err.headline(), err.headline()


def test_a_caught_distributed_optimizer_refusal_is_named_where_fleet_init_waits():
    with pytest.raises(RankError) as info:
        run_ranks(_optimizer_without_init, 2, True, timeout=15, collective_timeout=5)
    line = info.value.diagnosis[0]
    assert line.startswith("rank 0 never entered ") and "it refused fleet.distributed_optimizer (RuntimeError: " \
        "this rank never called fleet.init" in line, line


# -- a Cluster cell where one rank's input is bad and its code catches the error -----------------------------------

def test_a_cluster_cell_names_the_rank_that_refused_and_went_on():
    import meshviz

    c = meshviz.Cluster(n=2, timeout=8, ranks="threads", hang_after=1)
    try:
        c.execute("import torch, meshviz.distributed as dist\nt = torch.ones(2)\ndist.all_reduce(t)\n")
        cell = ("r = dist.get_rank()\n"
                "try:\n"
                "    dist.broadcast(t, src=5 if r == 0 else 0)\n"
                "except ValueError:\n"
                "    pass\n")
        with pytest.raises(RankError) as info:
            c.execute(cell)
        assert info.value.headline().startswith(
            "rank 0 never entered broadcast #2 on group [0, 1]: it refused broadcast (ValueError: src=5 is not in "
            "the group [0, 1] (src is a global rank, as in Paddle)) at line 3 of the cell and went on (idle: its "
            "cell finished)"), info.value.headline()
        c.execute("t = torch.ones(2)\ndist.all_reduce(t)\nassert t.tolist() == [2.0, 2.0]\n")  # the cluster goes on
    finally:
        c.stop()


def test_a_call_every_rank_refused_is_not_blamed():
    """Every rank refused the same call at the same line and went on: not why one of them is missing later."""
    g = (0, 1)
    said = "reshard (ValueError: Shard(3) ...) at line 2 of the cell"
    waits = RankStatus(1, "in_collective", op="all_reduce", group=g, seq=1, waiting_s=6.0, entered=((g, 1),),
                       refused=said, refused_entered=())
    idle = RankStatus(0, "idle", note="its cell finished", refused=said)
    rc = RollCall([idle, waits])
    assert rc.blame()[0] == "rank 0 never entered all_reduce #1 on group [0, 1] (idle: its cell finished)"
    other = RollCall([RankStatus(0, "idle", note="its cell finished", refused="broadcast (...)"), waits])
    assert other.blame()[0].startswith("rank 0 never entered all_reduce #1 on group [0, 1]: it refused broadcast")


def _send_to_nobody():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.arange(2.0)
    if _rank() == 0:
        try:
            dist.send(t, dst=7)  # no rank 7
        except ValueError:
            pass
        return None
    dist.recv(t, src=0)
    return t.tolist()


def test_a_caught_refused_send_is_named_where_its_peer_receives():
    line = _failure(_send_to_nobody).diagnosis[0]
    assert line.startswith("rank 0 never entered send on group [0, 1]: it refused send (ValueError: dst=7 is not in "
                           "the group"), line
