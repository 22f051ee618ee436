"""Ranks as threads take turns: while a rank keeps the turn (a loop that never waits), the roll-call and the hang
report show the ranks waiting for their turn and the rank keeping it, where it runs."""

import time

import pytest

import meshviz
from meshviz.trace.status import RankStatus, RollCall

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 4

# rank 1 spins without waiting; rank 0 wants the turn to go on after a sleep (or, had rank 1 run first, to start)
SPIN = """t = torch.ones(2)
if r == 0:
    {first}dist.all_reduce(t)
else:
    t0 = time.time()
    while time.time() - t0 < {secs}:
        sum(range(1000))
{after}"""


@pytest.fixture(scope="module")
def cluster():
    c = meshviz.Cluster(n=2, timeout=TIMEOUT, hang_after=1.5, ranks="threads")
    c.execute("import torch, time\nimport meshviz.distributed as dist\nr = dist.get_rank()")
    yield c
    c.stop()


def test_the_hang_report_names_the_rank_keeping_the_turn(cluster):
    cluster.execute("t = torch.full((2,), float(r + 1))\ndist.all_reduce(t)")
    # rank 1 spins past hang_after, then both all-reduce: the cell ends well, after a roll-call was shown
    out = cluster.execute(SPIN.format(first="time.sleep(0.2)\n    ", secs=3.0, after="    dist.all_reduce(t)\n")
                          + "t.tolist()")
    assert [e["data"]["text/plain"] for e in out.execute_result] == ["[2.0, 2.0]"] * 2
    shown = cluster.rollcalls  # those this cell showed
    assert shown, "no roll-call was shown"
    by = shown[0].by_rank()
    assert by[0].state == "running" and by[0].turn == 1, shown[0]
    assert "rank 0: waiting for its turn for " in shown[0].text() and "(rank 1 keeps it)" in shown[0].text()
    assert any("rank 1 keeps it, running at line" in ln for ln in shown[0].lines()), shown[0].lines()


def test_status_names_the_rank_a_waiting_rank_waits_for(cluster):
    res = cluster.view.execute(SPIN.format(first="time.sleep(0.2)\n    ", secs=2.5, after="    dist.all_reduce(t)\n"),
                               block=False)
    time.sleep(1.2)
    st = cluster.status().by_rank()
    assert st[0].state == "running" and st[0].turn == 1 and st[0].waiting_s > 0.5, st
    assert st[0].line().startswith("rank 0: waiting for its turn for ") and "(rank 1 keeps it)" in st[0].line()
    assert st[1].state == "running" and st[1].turn is None
    res.get(timeout=30)  # it ends well: rank 1 gave the turn back before the timeout
    assert [s.state for s in cluster.status()] == ["idle", "idle"]


def test_a_waiting_for_the_turn_status_reads_and_round_trips():
    s = RankStatus(0, "running", waiting_s=3.0, turn=2, cell=4)
    assert RankStatus.from_dict(s.to_dict()) == s
    rc = RollCall([s, RankStatus(1, "idle"), RankStatus(2, "running", where="line 3 of the cell")])
    assert rc.hung(2.0) and not rc.hung(5.0)
    assert rc.lines() == ["rank 0 waits for the turn for 3.0 s; rank 2 keeps it, running at line 3 of the cell "
                          "(ranks as threads take turns)"]
    assert s.line() == "rank 0: waiting for its turn for 3.0 s (rank 2 keeps it)"


def test_a_shown_wait_for_the_turn_closes_as_one():
    from meshviz.cluster.hangs import HangWatch

    class Display:
        def close(self, text):
            self.text = text

    watch = HangWatch(None, 1.5)
    watch.display = Display()
    watch.shown = [RollCall([RankStatus(0, "running", waiting_s=3.0, turn=1),
                             RankStatus(1, "running", where="line 8 of the cell")])]
    watch.close(True)
    assert watch.display.text == "the wait for the turn ended; every rank went on"
