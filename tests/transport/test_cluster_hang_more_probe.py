"""Hangs on a Cluster's engines in raw torch.distributed calls (skipped, raised before, interrupted, waiting for a
send) and in meshviz's own, against what ranks as threads say; a thread a rank's cell starts, through the patch."""

import threading
import time

import pytest

import meshviz
from meshviz.ranks import patches

from ..cluster_checks import fails, rollcall_shows_raw_waits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

SETUP = ("import threading, time, torch, torch.distributed as tdist\nimport meshviz.distributed as dist\n"
         "r = tdist.get_rank()\n")
TIMEOUT = 20  # the collective timeout: every hang below must end well before it
HANG = 0.5


@pytest.fixture(scope="module")
def engines():
    c = meshviz.Cluster(n=3, timeout=TIMEOUT, hang_after=HANG)
    c.execute(SETUP)
    yield c
    c.stop()


def _all_reduce_works(cluster, n: int = 3) -> None:
    ar = cluster.execute("x = torch.full((1,), float(r + 1))\ntdist.all_reduce(x)\nprint(x.item())")
    assert ar.stdout == [f"{float(sum(range(1, n + 1)))}\n"] * n
    assert cluster.state == "ready"


def _timed_fail(cluster, code):
    t0 = time.monotonic()
    err = fails(cluster, code)
    return err, time.monotonic() - t0


@pytest.mark.engines
def test_a_raw_collective_one_engine_skips_is_named_first_at_the_roll_call(engines):
    """Rank 0 alone in tdist.all_reduce: engines waited the whole collective timeout, then named rank 0 (whose
    collective timed out) and not ranks 1 and 2, which never entered it; threads named those two at once."""
    err, took = _timed_fail(engines, "x = torch.ones(2)\nif r == 0:\n    tdist.all_reduce(x)\n")
    assert took < TIMEOUT / 2, str(err)
    assert err.ranks == [1, 2] and err.lead, str(err)
    assert err.diagnosis[0] == "rank 1 never entered all_reduce on group [0, 1, 2] (idle: its cell finished)"
    assert err.diagnosis[1] == "rank 2 never entered all_reduce on group [0, 1, 2] (idle: its cell finished)"
    assert err.diagnosis[2].startswith("rank 0 waited in all_reduce on group [0, 1, 2] for ")
    shown = engines.rollcalls[0]
    assert [s.state for s in shown] == ["in_collective", "idle", "idle"]
    assert (shown[0].op, shown[0].group, shown[0].seq, shown[0].where) == ("all_reduce", (0, 1, 2), None,
                                                                           "line 3 of the cell")
    _all_reduce_works(engines)


@pytest.mark.engines
def test_a_raw_barrier_on_a_subgroup_names_the_member_that_skipped_it_not_the_outsider(engines):
    engines.execute("sub = tdist.new_group([0, 2])")
    err, took = _timed_fail(engines, "if r == 0:\n    tdist.barrier(group=sub)\n")
    assert took < TIMEOUT / 2, str(err)
    assert err.ranks == [2] and err.lead, str(err)
    assert err.diagnosis[0] == "rank 2 never entered barrier on group [0, 2] (idle: its cell finished)"
    _all_reduce_works(engines)


@pytest.mark.engines
def test_meshvizs_own_skipped_collective_ends_at_the_roll_call_too(engines):
    err, took = _timed_fail(engines, "t = torch.ones(4)\nif r != 1:\n    dist.all_reduce(t)\n")
    assert took < TIMEOUT / 2, str(err)
    assert err.ranks == [1] and err.lead, str(err)
    assert err.diagnosis[0].startswith("rank 1 never entered all_reduce #")
    assert err.diagnosis[0].endswith(" on group [0, 1, 2] (idle: its cell finished)")
    _all_reduce_works(engines)


@pytest.mark.engines
def test_a_rank_late_to_a_raw_collective_is_waited_for(engines):
    """A rank still running (asleep) is no hang nothing can end: the cell ends well, with every rank's sum."""
    ar = engines.execute("x = torch.full((2,), float(r + 1))\nif r == 2:\n    time.sleep(2.5)\n"
                         "tdist.all_reduce(x)\nprint(x.tolist())")
    assert ar.stdout == ["[6.0, 6.0]\n"] * 3
    assert engines.rollcalls, "rank 0 waited 2.5 s with hang_after 0.5: the roll-call showed it"
    line = engines.rollcalls[0].lines()[0]
    assert line.startswith("ranks 0, 1 wait in all_reduce on group [0, 1, 2] for ") and \
        line.endswith("rank 2 is running at line 3 of the cell: it never entered all_reduce"), line


@pytest.mark.engines
def test_the_roll_call_shows_an_engine_in_a_raw_collective_and_receive_until_the_peer_comes(engines):
    """A --noblock cell is left waiting (a later cell joins it); the roll-call shows the wait as on threads."""
    rollcall_shows_raw_waits(engines, 20)
    _all_reduce_works(engines)


@pytest.mark.engines
def test_a_rank_raising_while_the_others_sit_in_a_raw_barrier(engines):
    err, took = _timed_fail(engines, "if r == 1:\n    raise ValueError('one broke')\ntdist.barrier()\n")
    assert took < TIMEOUT / 2, str(err)
    assert err.ranks == [1] and "rank 1 raised ValueError: one broke" in str(err)
    assert [o.status for o in err.outcomes] == ["error"] * 3
    _all_reduce_works(engines)


@pytest.mark.engines
def test_an_interrupt_ends_a_raw_collective_and_names_the_ranks_it_stopped(engines):
    ar = engines.view.execute("x = torch.ones(1)\nif r == 0:\n    tdist.all_reduce(x)\n", block=False)
    mark = engines._mark()
    deadline = time.monotonic() + 20
    while engines.status()[0].state != "in_collective":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engines.interrupt()
    t0 = time.monotonic()
    with pytest.raises(meshviz.cluster.RankError) as info:
        engines._finish(ar, timeout=TIMEOUT, mark=mark)
    assert time.monotonic() - t0 < TIMEOUT / 2
    assert info.value.ranks == [1, 2] and info.value.lead, str(info.value)
    _all_reduce_works(engines)


@pytest.mark.engines
def test_a_restart_after_a_raw_hang_gives_a_working_cluster(engines):
    fails(engines, "x = torch.ones(2)\nif r == 0:\n    tdist.all_reduce(x)\n")
    engines.restart()
    engines.execute(SETUP)
    _all_reduce_works(engines)
    err, took = _timed_fail(engines, "x = torch.ones(2)\nif r == 2:\n    tdist.all_reduce(x)\n")
    assert err.ranks == [0, 1] and err.lead and took < TIMEOUT / 2, str(err)
    _all_reduce_works(engines)


def test_thread_ranks_follow_their_threads_through_the_patch_module():
    """The Thread.start patch is ranks.patches' (the cluster registers where the output goes), in while a thread
    cluster runs and out after; a thread a rank's cell starts still prints into that rank's output."""
    real = threading.Thread.start
    c = meshviz.Cluster(n=2, timeout=10, ranks="threads")
    try:
        assert threading.Thread.start is patches._start
        ar = c.execute("import threading\nr = __import__('torch').distributed.get_rank()\n"
                       "def f(k):\n    print('from thread', k)\n"
                       "th = threading.Thread(target=f, args=(r,))\nth.start()\nth.join()\nprint('main')")
        assert ar.stdout == [f"from thread {r}\nmain\n" for r in range(2)]
    finally:
        c.stop()
    assert threading.Thread.start is real


def test_torch_calls_are_recorded_only_while_installed_and_keep_their_signature():
    import inspect

    import torch.distributed as tdist

    before = tdist.all_reduce
    patches.record_torch_calls()
    try:
        assert tdist.all_reduce is not before and tdist.all_reduce.__wrapped__ is before
        assert inspect.signature(tdist.all_reduce) == inspect.signature(before)
        patches.record_torch_calls()  # a second time changes nothing
        assert tdist.all_reduce.__wrapped__ is before
    finally:
        patches.unrecord_torch_calls()
    assert tdist.all_reduce is before


def _waits(waited: float, culprit_state: str = "idle"):
    from meshviz.trace.status import RankStatus, RollCall

    return RollCall([RankStatus(0, "in_collective", op="all_reduce", group=(0, 1, 2), waiting_s=waited),
                     RankStatus(1, culprit_state, note="its cell finished"), RankStatus(2, "running", where="x")])


def test_a_wait_is_ended_only_when_two_roll_calls_in_a_row_find_it_stuck_for_this_execution():
    """A rank late to its cell answers idle (its last cell finished) and may run the whole cell before the answers
    are read: one roll-call is not enough, nor a wait of another execution (a --noblock cell a later one joins)."""
    from meshviz.cluster.hangs import HangWatch

    watch = HangWatch(None, HANG)
    running = [0, 2]
    three = _waits(1.0)  # rank 2 runs, and is a member: nothing is stuck
    assert not watch._stuck(three, lambda: running) and not watch._stuck(three, lambda: running)
    from meshviz.trace.status import RankStatus

    def two(waited, state="idle"):
        return _waits(waited, state).merged([RankStatus(2, "idle", note="its cell finished")])

    assert not watch._stuck(two(1.0), lambda: [0])  # the first time
    assert watch._stuck(two(1.6), lambda: [0])  # the same wait, still going
    watch = HangWatch(None, HANG)
    assert not watch._stuck(two(1.0), lambda: [0])
    assert not watch._stuck(two(0.2), lambda: [0])  # a new wait (a raw call has no number), not the same one
    assert not watch._stuck(two(2.0), lambda: [0, 1])  # rank 1's part of the execution still runs
    assert not watch._stuck(two(3.0), lambda: [0])  # ... so this is a first time again
    assert watch._stuck(two(4.0), lambda: [0])
    watch = HangWatch(None, HANG)
    assert not watch._stuck(two(1.0), lambda: [2]) and not watch._stuck(two(2.0), lambda: [2])  # not this one's


def test_a_rank_that_finished_after_the_roll_call_showed_it_running_is_named_as_finished():
    """Ranks as threads: rank 2 slept past hang_after, then finished without entering the all-reduce rank 0 waits in
    (the deadlock is found then). The error said "rank 2 never entered ...; it is running at line 5 of the cell",
    from the roll-call shown while it slept."""
    c = meshviz.Cluster(n=3, timeout=10, hang_after=HANG, ranks="threads")
    try:
        c.execute(SETUP)
        err = fails(c, "t = torch.ones(1)\nif r == 0:\n    tdist.all_reduce(t)\nelif r == 2:\n    time.sleep(2)\n")
        assert c.rollcalls and c.rollcalls[0][2].state == "running"
        assert err.ranks == [1, 2] and err.lead, str(err)
        assert err.diagnosis[:2] == ["rank 1 never entered all_reduce on group [0, 1, 2] (idle: its cell finished)",
                                     "rank 2 never entered all_reduce on group [0, 1, 2] (idle: its cell finished)"]
        _all_reduce_works(c)
    finally:
        c.stop()
