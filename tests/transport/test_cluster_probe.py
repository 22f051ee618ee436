"""A Cluster under cells that fail in unusual ways: the failing rank named, nothing left hanging."""

import threading
import time

import pytest

import meshviz
from meshviz.cluster import RankError

from ..cluster_checks import fails

pytestmark = pytest.mark.timeout(120)

SETUP = "import time, torch, torch.distributed as tdist\nimport meshviz.distributed as dist\nr = tdist.get_rank()\n"
UNPRINTABLE = ("class Unprintable(Exception):\n"
               "    def __str__(self):\n"
               "        raise ValueError('no text')\n"
               "if r == 1:\n"
               "    raise Unprintable()\n"
               "x = torch.ones(1)\n"
               "tdist.all_reduce(x)\n")
ALL_REDUCE = "x = torch.full((1,), float(r + 1))\ntdist.all_reduce(x)\nprint(x.item())"


@pytest.fixture(scope="module")
def threads():
    c = meshviz.Cluster(n=3, timeout=30, ranks="threads")
    c.execute(SETUP)
    yield c
    c.stop()


def test_an_exception_whose_str_raises_names_its_rank_on_threads(threads):
    err = fails(threads, UNPRINTABLE, timeout=20)
    assert err.ranks == [1], str(err)
    assert err.headline().startswith("rank 1 raised") and "Unprintable: <exception str() failed>" in err.headline()
    by = {o.rank: o for o in err.outcomes}
    assert [by[r].status for r in range(3)] == ["error"] * 3
    assert "raise Unprintable()" in by[1].traceback
    assert threads.execute(ALL_REDUCE).stdout == ["6.0\n"] * 3


def test_an_interrupted_cell_blames_no_rank_for_the_others(threads):
    """Every rank sleeps; the interrupt stops all three: each is named as interrupted, none as stopped by another."""
    threading.Timer(0.5, threads.interrupt).start()
    t0 = time.monotonic()
    err = fails(threads, "time.sleep(30)", timeout=20)
    assert time.monotonic() - t0 < 10
    assert err.ranks == [0, 1, 2], str(err)
    assert "stopped because of it" not in err.headline()
    assert all(f"rank {r} raised KeyboardInterrupt" in err.headline() for r in range(3))
    assert err.note.startswith("The cell was interrupted.")
    # a rank interrupted inside a collective still names those that never entered it
    threading.Timer(0.5, threads.interrupt).start()
    err = fails(threads, "if r == 2:\n    dist.all_reduce(torch.ones(1))\nelse:\n    time.sleep(30)", timeout=20)
    assert err.ranks == [0, 1] and err.lead, str(err)
    assert err.diagnosis[0].startswith("rank 0 never entered all_reduce #1 on group [0, 1, 2]")
    # a rank that raised on its own before the interrupt is still the cause
    threading.Timer(0.5, threads.interrupt).start()
    err = fails(threads, "if r == 1:\n    raise KeyError('own')\ntime.sleep(30)", timeout=20)
    assert err.ranks == [1] and "rank 1 raised KeyError: 'own' (ranks 0, 2 stopped because of it)" in str(err)
    assert threads.execute(ALL_REDUCE).stdout == ["6.0\n"] * 3


def test_the_threads_view_names_the_rank_that_raised_not_one_it_stopped(threads):
    """``view.execute`` and a non-blocking cell's ``get()`` named rank 0, stopped in its all-reduce, as the cause."""
    cell = "if r == 2:\n    raise KeyError('two')\nx = torch.ones(1)\ntdist.all_reduce(x)\n"
    with pytest.raises(RankError) as info:
        threads.view.execute(cell)
    assert info.value.ranks == [2] and info.value.headline() == "rank 2 raised KeyError: 'two' (ranks 0, 1 stopped " \
        "because of it)"
    ar = threads.view.execute(cell.replace("2", "1"), block=False)
    assert ar.wait(20)
    with pytest.raises(RankError) as info:
        ar.get()
    assert info.value.ranks == [1] and info.value.headline().startswith("rank 1 raised KeyError: 'two'")
    assert threads.execute(ALL_REDUCE).stdout == ["6.0\n"] * 3


@pytest.mark.timeout(60)
def test_a_rank_that_keeps_the_turn_is_named_at_the_collective_timeout_on_threads():
    """Ranks 0 and 2 wait in an all-reduce while rank 1 loops without waiting: their timeout could only be raised
    once they had the turn again, so the cell ran on past the collective timeout (forever in a notebook) instead
    of failing there, as a rank process's collective does, naming rank 1 and where it runs."""
    c = meshviz.Cluster(n=3, timeout=3, hang_after=1, ranks="threads")
    try:
        c.execute(SETUP)
        t0 = time.monotonic()
        cell = ("if r == 1:\n"
                "    time.sleep(0.5)  # the turn goes to ranks 0 and 2, which enter the all-reduce\n"
                "    while True:\n"
                "        pass\n"
                "x = torch.ones(1)\n"
                "dist.all_reduce(x)\n")
        err = fails(c, cell, timeout=30)
        assert time.monotonic() - t0 < 15, str(err)
        assert err.ranks == [1] and err.lead, str(err)
        assert err.diagnosis[0] == "rank 1 never entered all_reduce #1 on group [0, 1, 2]; it is running at line 3 " \
            "of the cell", str(err)
        assert err.diagnosis[1].startswith("ranks 0, 2 waited in all_reduce #1 on group [0, 1, 2] for ")
        assert c.execute(ALL_REDUCE).stdout == ["6.0\n"] * 3
    finally:
        c.stop()


@pytest.mark.engines
@pytest.mark.timeout(90)
def test_an_exception_whose_str_raises_is_reported_at_once_on_engines():
    """On an engine the failure hook raised too: the peers waited for the collective timeout, the error blamed a
    waiting rank, and IPython unregistered the hook, so the engine's later failures went unreported as well."""
    c = meshviz.Cluster(n=2, timeout=20, devices="cpu")
    try:
        c.execute(SETUP)
        t0 = time.monotonic()
        err = fails(c, UNPRINTABLE)
        assert time.monotonic() - t0 < 10  # the collective timeout is 20 s
        assert err.ranks == [1] and err.headline().startswith("rank 1 raised"), str(err)  # IPython's own text
        t0 = time.monotonic()
        err = fails(c, "if r == 1:\n    raise KeyError('later')\nx = torch.ones(1)\ntdist.all_reduce(x)\n")
        assert time.monotonic() - t0 < 10
        assert err.ranks == [1] and "rank 1 raised KeyError: 'later'" in err.headline(), str(err)
        assert c.execute(ALL_REDUCE).stdout == ["3.0\n"] * 2
    finally:
        c.stop()


def test_stopping_one_of_two_thread_clusters_keeps_the_others_collective_check():
    """The check is process-wide: stopping the first cluster turned it off under the second (whose mismatched
    all-reduce then failed deep in torch), and the last stop left it on in the kernel."""
    from meshviz.runtime import match

    before = match.checking()
    first = meshviz.Cluster(n=2, ranks="threads", timeout=20)
    second = meshviz.Cluster(n=2, ranks="threads", timeout=20)
    try:
        first.stop()
        assert match.checking()
        second.execute("import torch\nimport meshviz.distributed as dist")
        err = fails(second, "t = torch.ones(4 if dist.get_rank() == 0 else 8)\ndist.all_reduce(t)")
        assert err.ranks == [0, 1] and err.lead, str(err)
        assert err.diagnosis[0].endswith("rank 0 entered all_reduce with float32[4]; "
                                         "rank 1 entered all_reduce with float32[8]")
        ar = second.execute("t = torch.full((2,), float(dist.get_rank() + 1))\ndist.all_reduce(t)\nprint(t.tolist())")
        assert ar.stdout == ["[3.0, 3.0]\n"] * 2
    finally:
        first.stop()
        second.stop()
    assert match.checking() == before


@pytest.mark.parametrize("kwargs, match", [({"check_collectives": "no"}, "check_collectives must be True or False"),
                                           ({"check_collectives": 0}, "check_collectives must be True or False"),
                                           ({"hang_after": float("nan")}, "hang_after must be a positive number")])
def test_settings_that_would_mean_something_else_raise_before_starting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meshviz.Cluster(n=2, ranks="threads", **kwargs)


class _Unprintable(Exception):
    def __str__(self):
        raise ValueError("no text")


def _raise_unprintable_on_rank_1():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == 1:
        raise _Unprintable()
    dist.barrier()


@pytest.mark.timeout(60)
def test_run_ranks_on_threads_names_the_rank_whose_exception_has_no_text():
    """``run_ranks`` on thread ranks described a failure by its ``str()``, which raised: the error blamed another
    rank with an unrelated message."""
    from meshviz.testing import run_ranks

    with pytest.raises(RankError) as info:
        run_ranks(_raise_unprintable_on_rank_1, 2, ranks="threads", timeout=30)
    assert info.value.ranks == [1], info.value.headline()
    assert "_Unprintable: <exception str() failed>" in info.value.headline()
