"""The roll-call host stops waiting for ranks that ended: a failing spawn or launch is named at once, not a second
later, and says the same as before."""

import json
import threading
import time

import pytest

from meshviz.runtime import rendezvous
from meshviz.runtime.watchdog import RollCallHost, _key
from meshviz.trace.status import RankStatus

IN = RankStatus(0, "in_collective", op="all_reduce", group=(0, 1, 2), seq=1, waiting_s=0.5)


@pytest.fixture
def store():
    res = rendezvous.reserve_port()
    server = rendezvous.serve_store(res, None, 30)
    yield server, res.port
    del server


def _answer(server, n, status):
    server.set(_key("ans", n, status.rank), json.dumps(status.to_dict()))


def test_a_roll_call_ends_once_every_rank_yet_to_answer_has_ended(store):
    server, port = store
    gone = {1: "exit code 1"}
    host = RollCallHost(rendezvous.LOOPBACK, port, 3, 0.5, dead=lambda: dict(gone))
    _answer(server, 1, IN)
    ends = threading.Timer(0.3, lambda: gone.update({2: "exit code 1"}))  # rank 2 exits without answering
    ends.start()
    t0 = time.monotonic()
    rc = host.collect(1, timeout=8.0)
    took = time.monotonic() - t0
    ends.join()
    # as at the deadline: the rank that answered as it was, the one dead when asked as dead, the silent one unknown
    assert [(s.rank, s.state) for s in rc] == [(0, "in_collective"), (1, "dead"), (2, "unknown")]
    assert rc.by_rank()[1].note == "exit code 1"
    assert took < 4.0, took  # not the whole 8 s: the silent ranks had ended


def test_ranks_said_to_have_ended_are_not_waited_for_and_stay_unknown(store):
    """A launch's workers the agent stopped are not dead() (they did not fail on their own), but once the agent
    returned none of them will answer: the launcher says so with ``ended`` and its roll-call does not wait."""
    server, port = store
    host = RollCallHost(rendezvous.LOOPBACK, port, 3, 0.5, dead=lambda: {1: "exit code 1"})
    host.ended = lambda: [0, 1, 2]
    t0 = time.monotonic()
    rc = host.collect(1, timeout=8.0)
    assert time.monotonic() - t0 < 4.0  # not the whole 8 s: the silent ranks had ended
    assert [(s.rank, s.state) for s in rc] == [(0, "unknown"), (1, "dead"), (2, "unknown")]


def test_an_answer_given_just_before_the_rank_ended_is_kept(store):
    server, port = store
    calls = []

    def dead():  # rank 1 answers, then ends, between two looks of the host
        calls.append(1)
        if len(calls) == 2:
            _answer(server, 1, RankStatus(1, "idle", note="its function returned"))
        return {} if len(calls) == 1 else {1: "exit code 0"}

    host = RollCallHost(rendezvous.LOOPBACK, port, 2, 0.5, dead=dead)
    _answer(server, 1, RankStatus(0, "in_collective", op="barrier", group=(0, 1), seq=2))
    t0 = time.monotonic()
    rc = host.collect(1, timeout=8.0)
    assert time.monotonic() - t0 < 4.0
    assert [(s.rank, s.state) for s in rc] == [(0, "in_collective"), (1, "idle")]
    assert rc.by_rank()[1].note == "its function returned"


def test_blame_shows_the_collective_a_rank_failed_in_while_it_was_asked(store):
    """A rank that left the collective with an error (its record under failed/) and ended during the roll-call is
    shown in that collective, not as a dead rank that never entered it."""
    server, port = store
    calls = []
    failed = RankStatus(1, "in_collective", op="all_reduce", group=(0, 1), seq=1, waiting_s=0.2)

    def dead():
        calls.append(1)
        if len(calls) == 2:  # rank 1's collective raised (its record written), then its process ended
            server.set(_key("failed", 1), json.dumps(failed.to_dict()))
        return {} if len(calls) == 1 else {1: "exit code 1: RuntimeError: Connection closed by peer"}

    host = RollCallHost(rendezvous.LOOPBACK, port, 2, 0.5, dead=dead)

    def answer_rank_0():  # rank 0 answers whichever roll-call is asked
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for n in range(1, 4):
                if server.check([_key("ask", n)]) and not server.check([_key("ans", n, 0)]):
                    _answer(server, n, RankStatus(0, "in_collective", op="all_reduce", group=(0, 1), seq=1))
                    return
            time.sleep(0.01)

    t = threading.Thread(target=answer_rank_0)
    t.start()
    t0 = time.monotonic()
    rc = host.blame()
    took = time.monotonic() - t0
    t.join()
    by = rc.by_rank()
    assert by[0].state == "in_collective" and by[0].op == "all_reduce"
    assert by[1].state == "in_collective" and (by[1].op, by[1].group, by[1].seq) == ("all_reduce", (0, 1), 1), by[1]
    assert took < 0.9, took  # not the ask's whole second
