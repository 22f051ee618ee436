"""Every kind of hang on real ranks (a Cluster's engines and spawn): the roll-call shows within hang_after plus a
little, the error names the rank and the collective, and the next cell works."""

import os
import re
import signal
import threading
import time

import pytest
import torch

import meshviz
import meshviz.distributed as dist
from meshviz.errors import RankError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

HANG = 0.5  # hang_after
SLACK = 2.5  # how late after hang_after the roll-call may come on a loaded 2-core machine
TIMEOUT = 2  # the collective timeout, of the cluster and of spawn
COLL = r"all_reduce #(\d+) on group \[0, 1\]"


@pytest.fixture(scope="module")
def cluster():
    c = meshviz.Cluster(n=2, timeout=TIMEOUT, hang_after=HANG)
    c.execute("import time, torch, meshviz.distributed as dist\nfrom meshviz.runtime import match\n"
              "r = dist.get_rank()\n")
    yield c
    c.stop()


def _next_cell_works(c):
    ar = c.execute("t = torch.full((2,), float(r + 1))\ndist.all_reduce(t)\nprint(t.tolist())")
    assert ar.stdout == ["[3.0, 3.0]\n"] * 2
    assert c.state == "ready"


def _first_rollcall(c):
    shown = c if isinstance(c, list) else c.rollcalls
    assert shown, "no roll-call was shown"
    rc = shown[0]
    waited = max(s.waiting_s for s in rc.waiting())
    assert HANG <= waited <= HANG + SLACK, f"the roll-call came after {waited:.1f} s of waiting"
    return rc


def _run(c, code):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        c.execute(code)
    return info.value, time.monotonic() - t0


@pytest.mark.engines
def test_a_skipped_collective(cluster):
    err, took = _run(cluster, "t = torch.ones(4)\nif r == 0:\n    dist.all_reduce(t)\n")
    line = _first_rollcall(cluster).lines()[0]
    assert re.fullmatch(rf"rank 0 waits in {COLL} for [\d.]+ s; rank 1 is idle: its cell finished without entering "
                        r"all_reduce #\1", line), line
    assert err.ranks == [1]
    head = str(err).splitlines()[0]
    assert re.fullmatch(rf"rank 1 never entered {COLL} \(idle: its cell finished\); rank 0 waited in {COLL} for "
                        r"[\d.]+ s", head), head
    assert took < TIMEOUT + 10  # at the latest the collective timeout, then the error at once
    _next_cell_works(cluster)


@pytest.mark.engines
def test_a_different_collective_at_the_same_sequence_number(cluster):
    """Without the gloo match check the roll-call spots it at hang_after and the cell fails then, not at the timeout;
    with the check (a Cluster's default) it fails before any data moves."""
    cluster.apply(_set_checking, False)
    try:
        err, took = _run(cluster, "t = torch.ones(4)\nif r == 0:\n    dist.all_reduce(t)\nelse:\n"
                                  "    dist.all_gather([], t)\n")
        shown = list(cluster.rollcalls)
    finally:
        cluster.apply(_set_checking, True)
    _first_rollcall(shown)
    # ended by the roll-call's mismatch, not by the collective timeout (which a loaded machine may reach while
    # the error travels back: the time alone does not tell them apart with a 2 s timeout)
    assert err.ranks == [0, 1] and took < TIMEOUT + SLACK and "Timed out" not in str(err)
    assert re.fullmatch(r"mismatch at #(\d+) on group \[0, 1\]: rank 0 entered all_reduce float32\[4\]; rank 1 "
                        r"entered all_gather float32\[4\]", str(err).splitlines()[0]), str(err)
    _next_cell_works(cluster)
    err, took = _run(cluster, "t = torch.ones(4)\nif r == 0:\n    dist.all_reduce(t)\nelse:\n"
                              "    dist.broadcast(t, src=0)\n")
    assert err.ranks == [0, 1] and took < HANG + SLACK and not cluster.rollcalls
    assert re.fullmatch(r"mismatch at #\d+ on group \[0, 1\]: rank 0 entered all_reduce float32\[4\]; rank 1 "
                        r"entered broadcast float32\[4\]", str(err).splitlines()[0]), str(err)
    _next_cell_works(cluster)


def _set_checking(on):
    from meshviz.runtime import match

    return match.set_checking(on)


@pytest.mark.engines
def test_a_shape_mismatch(cluster):
    """Gloo would end both processes; the match check names both ranks before any data moves."""
    err, took = _run(cluster, "t = torch.ones(4 if r == 0 else 8)\ndist.all_reduce(t)\n")
    assert err.ranks == [0, 1] and took < HANG + SLACK
    assert re.fullmatch(r"mismatch at #\d+ on group \[0, 1\]: rank 0 entered all_reduce with float32\[4\]; rank 1 "
                        r"entered all_reduce with float32\[8\]", str(err).splitlines()[0]), str(err)
    assert [o.status for o in err.outcomes] == ["error", "error"]
    _next_cell_works(cluster)


@pytest.mark.engines
def test_a_rank_stuck_in_a_python_loop(cluster):
    err, took = _run(cluster, "t = torch.ones(4)\nif r == 0:\n    dist.all_reduce(t)\nelse:\n    while True:\n"
                              "        time.sleep(0.01)\n")
    line = _first_rollcall(cluster).lines()[0]
    assert re.fullmatch(rf"rank 0 waits in {COLL} for [\d.]+ s; rank 1 is running at line 6 of the cell: it never "
                        r"entered all_reduce #\1", line), line
    assert err.ranks == [1]
    assert re.match(rf"rank 1 never entered {COLL}; it is running at line 6 of the cell; rank 0 waited", str(err))
    assert took < TIMEOUT + 10  # the loop was interrupted once the others had failed
    _next_cell_works(cluster)


@pytest.mark.engines
def test_status_while_hung_and_interrupt(cluster):
    mark = cluster._mark()  # before the cell goes: a rank may report before _finish starts waiting
    ar = cluster.view.execute("t = torch.ones(4)\nif r == 0:\n    dist.all_reduce(t)\n", block=False)
    deadline = time.monotonic() + 20
    while True:
        rc = cluster.status(stacks=True)
        if rc[0].state == "in_collective" and rc[1].state == "idle":
            break
        assert time.monotonic() < deadline, rc
        time.sleep(0.1)
    s0, s1 = rc
    assert (s0.op, s0.group, s0.where, s0.shapes, s0.dtypes) == ("all_reduce", (0, 1), "line 3 of the cell",
                                                                 ((4,),), ("float32",))
    assert s0.seq == s1.entered_on((0, 1)) + 1 and s0.waiting_s >= 0 and "all_reduce" in s0.stack
    assert s1.note == "its cell finished" and rc.culprits() == [1]
    cluster.interrupt()
    with pytest.raises(RankError) as info:
        cluster._finish(ar, timeout=TIMEOUT, mark=mark)  # the interrupt ends it, by the collective timeout at most
    assert info.value.ranks == [1] and str(info.value).startswith("rank 1 never entered all_reduce #")
    _next_cell_works(cluster)


@pytest.mark.engines
def test_a_failure_report_handled_late_still_resets_the_group(cluster, monkeypatch):
    """Rank 0 fails with an error that tears its process group down while rank 1 has finished (as a collective
    that timed out on rank 0 after an interrupt); its report (it aborted) reaches the client's handler after the
    cell's result, as on a loaded machine. The cell must not count as ended before the report is handled: the next
    cell re-creates the group rather than run rank 1's old one against rank 0's torn-down one."""
    receiver = cluster._ranks._receiver
    handle = receiver.on_control

    def late(message):
        if message.get("type") == "failed":
            time.sleep(1.5)
        handle(message)

    monkeypatch.setattr(receiver, "on_control", late)
    err, _ = _run(cluster, "if r == 0:\n    raise RuntimeError('gloo/transport: the peer went away')\n")
    assert err.ranks == [0] and str(err).startswith("rank 0 raised RuntimeError: gloo/transport"), str(err)
    assert cluster.state == "aborted"
    _next_cell_works(cluster)


@pytest.mark.engines
def test_a_killed_engine(cluster):
    """Runs last: it breaks the shared cluster; restart() mends it."""
    mark = cluster._mark()
    ar = cluster.view.execute("t = torch.ones(4)\nif r == 1:\n    time.sleep(60)\ndist.all_reduce(t)\n", block=False)
    pid = cluster.info[1]["pid"]

    def kill_after_the_rollcall():
        deadline = time.monotonic() + 30
        while not cluster.rollcalls and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_the_rollcall)
    killer.start()
    with pytest.raises(RankError) as info:
        cluster._finish(ar, timeout=30, mark=mark)
    killer.join()
    line = _first_rollcall(cluster).lines()[0]
    assert re.fullmatch(rf"rank 0 waits in {COLL} for [\d.]+ s; rank 1 is running at line 3 of the cell: it never "
                        r"entered all_reduce #\1", line), line
    err = info.value
    assert err.ranks == [1] and "rank 1 died" in str(err)
    assert re.search(rf"rank 1 never entered {COLL}: it is dead \(engine process {pid} exited\)", str(err)), str(err)
    assert cluster.state == "broken"
    cluster.restart()
    cluster.execute("import time, torch, meshviz.distributed as dist\nr = dist.get_rank()\n")
    _next_cell_works(cluster)


@pytest.mark.engines
def test_a_rank_that_will_not_stop_is_named_and_the_cluster_asks_for_a_restart(cluster, monkeypatch):
    """Rank 0 raises; rank 1 ignores the interrupt that should stop it and runs on. The cell ends (not hangs) once
    the collective timeout and STUCK_AFTER have passed since the abort, and the cluster asks for a restart."""
    from meshviz.cluster import cluster as module

    STUCK_AFTER = 3.0  # the client's grace (10 s) shortened: the same path, sooner
    monkeypatch.setattr(module, "STUCK_AFTER", STUCK_AFTER)
    # rank 1 ignores SIGINT before rank 0 raises (the barrier): on a loaded machine a rank may start its cell late,
    # and an interrupt landing before its `try` (or its handler) stops it after all
    err, took = _run(cluster, "import signal\nif r == 1:\n    signal.signal(signal.SIGINT, lambda *a: None)\n"
                              "dist.barrier()\nif r == 0:\n    raise ValueError('rank 0 broke')\nt0 = time.time()\n"
                              "while time.time() - t0 < 60:\n    time.sleep(0.1)\n")
    outcomes = [o.status for o in err.outcomes]
    assert TIMEOUT + STUCK_AFTER <= took < TIMEOUT + STUCK_AFTER + 10, (took, outcomes, str(err))
    assert str(err).startswith("rank 0 raised ValueError: rank 0 broke (rank 1 still running)"), str(err)
    assert outcomes == ["error", "running"]
    assert f"Rank 1 is still running {TIMEOUT + STUCK_AFTER:.0f} s after the abort and the interrupt." in str(err)
    assert cluster.state == "broken"
    with pytest.raises(RuntimeError, match=r"rank 1 \(still running .*\); call cluster.restart\(\)"):
        cluster.execute("print(1)")
    cluster.restart()
    cluster.execute("import time, torch, meshviz.distributed as dist\nr = dist.get_rank()\n")
    _next_cell_works(cluster)


# -- spawn ---------------------------------------------------------------------------------------------------------


def _skips():
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)


def _skips_late():
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        time.sleep(HANG + 1.0)  # running at the first roll-call, then returns without entering


def _other_op():
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.all_gather([], t)


def _unsent():
    dist.init_parallel_env()
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(4), src=1)


def _loops():
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        while True:
            time.sleep(0.01)


def _dies():
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 1:
        time.sleep(HANG + 0.8)  # after the roll-call, before the timeout
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)


def _shapes():
    dist.init_parallel_env()
    dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 8))


def _spawn(fn, capfd, **kw):
    capfd.readouterr()
    with pytest.raises(RankError) as info:
        dist.spawn(fn, **{"nprocs": 2, "timeout": TIMEOUT, "hang_after": HANG, **kw})
    return info.value, capfd.readouterr().err


def _printed(err_text):
    """The situation lines of the roll-call spawn printed, and how long the rank had waited in the first."""
    lines = [ln[4:] for ln in err_text.splitlines() if ln.startswith("  - ")]
    assert lines, err_text
    first = err_text[: err_text.index("  - ")]  # the first roll-call's rank lines
    waited = max(float(w) for w in re.findall(r"^  rank \d+: in .* for ([\d.]+) s", first, re.M))
    assert HANG <= waited <= HANG + SLACK, lines[0]
    return lines


def test_spawn_names_a_skipped_collective(capfd):
    """Rank 1 returned: nothing can end rank 0's wait, so the roll-call ends the run, not the (long) timeout."""
    err, text = _spawn(_skips, capfd, timeout=120)
    stopped = ("stopped", "ended at the roll-call that found the hang")
    assert [(o.status, o.error) for o in err.outcomes] == [stopped] * 2
    assert re.fullmatch(r"rank 0 waits in all_reduce #1 on group \[0, 1\] for [\d.]+ s; rank 1 is idle: its function "
                        r"returned without entering all_reduce #1", _printed(text)[0])
    assert err.ranks == [1]
    assert re.fullmatch(r"rank 1 never entered all_reduce #1 on group \[0, 1\] \(idle: its function returned\); "
                        r"rank 0 waited in all_reduce #1 on group \[0, 1\] for [\d.]+ s", str(err).splitlines()[0])


def test_spawn_asks_again_and_names_a_rank_that_finished_after_the_first_roll_call(capfd):
    err, text = _spawn(_skips_late, capfd, timeout=120)
    lines = _printed(text)
    assert re.fullmatch(r"rank 0 waits in all_reduce #1 on group \[0, 1\] for [\d.]+ s; rank 1 is running at "
                        r"test_hangs.py:\d+ in _skips_late\(\): it never entered all_reduce #1", lines[0]), text
    assert re.fullmatch(r"rank 0 waits in all_reduce #1 on group \[0, 1\] for [\d.]+ s; rank 1 is idle: its function "
                        r"returned without entering all_reduce #1", lines[-1]), text
    assert err.ranks == [1] and [o.status for o in err.outcomes] == ["stopped", "stopped"]
    assert str(err).startswith("rank 1 never entered all_reduce #1 on group [0, 1] (idle: its function returned)")


def test_spawn_names_a_mismatch_before_the_timeout(capfd):
    err, text = _spawn(_other_op, capfd)
    assert _printed(text)[0] == ("mismatch at #1 on group [0, 1]: rank 0 entered all_reduce float32[4]; rank 1 entered "
                                 "all_gather float32[4]")
    assert err.ranks == [0, 1] and str(err).startswith("mismatch at #1 on group [0, 1]")
    assert [o.status for o in err.outcomes] == ["stopped", "stopped"]  # ended at the roll-call, not by the timeout


def test_spawn_names_the_peer_a_recv_waits_for(capfd):
    """A recv waits on its sender alone: rank 1 is named, with the send it never made; rank 2, idle too, is not."""
    err, text = _spawn(_unsent, capfd, nprocs=3, timeout=120)
    assert [o.status for o in err.outcomes] == ["stopped"] * 3
    assert re.fullmatch(r"rank 0 waits in recv on group \[0, 1\] for [\d.]+ s; rank 1 is idle: its function "
                        r"returned without entering send", _printed(text)[0]), text
    assert err.ranks == [1]
    assert re.fullmatch(r"rank 1 never entered send on group \[0, 1\] \(idle: its function returned\); "
                        r"rank 0 waited in recv on group \[0, 1\] for [\d.]+ s", str(err).splitlines()[0]), str(err)


def test_spawn_names_a_rank_stuck_in_a_loop(capfd):
    err, text = _spawn(_loops, capfd)
    assert re.fullmatch(r"rank 0 waits in all_reduce #1 on group \[0, 1\] for [\d.]+ s; rank 1 is running at "
                        r"test_hangs.py:\d+ in _loops\(\): it never entered all_reduce #1", _printed(text)[0])
    assert err.ranks == [1]
    assert re.match(r"rank 1 never entered all_reduce #1 on group \[0, 1\]; it is running at test_hangs.py:\d+ in "
                    r"_loops\(\); rank 0 waited", str(err))


def test_spawn_names_a_killed_rank(capfd):
    err, text = _spawn(_dies, capfd)
    assert re.fullmatch(r"rank 0 waits in all_reduce #1 on group \[0, 1\] for [\d.]+ s; rank 1 is running at "
                        r"test_hangs.py:\d+ in _dies\(\): it never entered all_reduce #1", _printed(text)[0])
    assert err.ranks == [1] and str(err).startswith("rank 1 died (killed by SIGKILL)")
    assert "rank 1 never entered all_reduce #1 on group [0, 1]: it is dead (killed by SIGKILL)" in str(err)


def test_spawn_shape_mismatch_with_the_check(capfd):
    err, text = _spawn(_shapes, capfd, check_collectives=True)
    assert "mismatch at #1 on group [0, 1]: rank 0 entered all_reduce with float32[4]; rank 1 entered all_reduce " \
           "with float32[8]" in str(err).splitlines()[0]
    assert "Timed out" not in str(err) and "SIGABRT" not in str(err)


def _sizes():
    dist.init_parallel_env()
    dist.all_reduce(torch.ones(2 if dist.get_rank() == 0 else 3))  # gloo may end one side's call, not the other's


def test_spawn_without_the_check_names_a_rank_that_passed_a_mismatched_collective(capfd):
    """One side's call ended (gloo paired calls of different sizes) and its function returned: nothing can end the
    other's wait, so the roll-call ends the run, naming the rank that passed."""
    err, text = _spawn(_sizes, capfd, timeout=120)
    assert [o.status for o in err.outcomes] == ["stopped", "stopped"], err.outcomes
    (done,) = err.ranks
    assert re.fullmatch(rf"rank {1 - done} waits in all_reduce #1 on group \[0, 1\] for [\d.]+ s; rank {done} passed "
                        r"all_reduce #1 and is done \(its function returned\)", _printed(text)[0]), text
    assert str(err).startswith(f"rank {done} passed all_reduce #1 on group [0, 1] without the ranks still in it and "
                               "is done (its function returned): its call was paired with another (a different "
                               "size?); check_collectives names the difference"), str(err)
