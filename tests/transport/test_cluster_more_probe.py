"""A Cluster's failure reports and roll-call: one error raised on every rank, raw torch.distributed collectives on
thread ranks, what threads a rank's cell starts print."""

import threading
import time

import pytest

import meshviz
from meshviz.cluster import RankError

from ..cluster_checks import fails, rollcall_shows_raw_waits

pytestmark = pytest.mark.timeout(120)

SETUP = "import threading, time, torch, torch.distributed as tdist\nr = tdist.get_rank()\n"
NAME_ERROR = "NameError: name 'undefined_name_xyz' is not defined"


@pytest.fixture(scope="module")
def threads():
    c = meshviz.Cluster(n=3, timeout=30, ranks="threads")
    c.execute(SETUP)
    yield c
    c.stop()


def _all_reduce_works(cluster, n: int = 3) -> None:
    ar = cluster.execute("x = torch.full((1,), float(r + 1))\ntdist.all_reduce(x)\nprint(x.item())")
    assert ar.stdout == [f"{float(sum(range(1, n + 1)))}\n"] * n


def test_one_error_on_every_thread_rank_is_named_as_every_ranks(threads):
    """A NameError on all three ranks read "rank 0 raised NameError ... (ranks 1, 2 stopped because of it)":
    ranks 1 and 2 were stopped by nothing, they raised it themselves."""
    err = fails(threads, "undefined_name_xyz")
    assert err.ranks == [0, 1, 2] and not err.lead
    assert err.headline() == f"every rank (0-2) raised {NAME_ERROR}"
    text = str(err)
    assert "stopped because of it" not in text
    assert text.count("traceback") == 1 and "--- rank 0 traceback (the same on ranks 1, 2) ---" in text
    assert threads.state == "ready"  # nothing was torn down
    # some ranks raising it alike, one ending well
    err = fails(threads, "if r:\n    raise KeyError('k')")
    assert err.ranks == [1, 2] and err.headline() == "ranks 1, 2 raised KeyError: 'k'", str(err)
    # different errors stay one rank's each
    err = fails(threads, "raise KeyError(r)")
    first = err.ranks[0]
    assert len(err.ranks) == 1 and err.headline().startswith(f"rank {first} raised KeyError: {first} ("), str(err)
    # the view's own error says the same
    with pytest.raises(RankError) as info:
        threads.view.execute("undefined_name_xyz")
    assert info.value.ranks == [0, 1, 2] and info.value.headline() == f"every rank (0-2) raised {NAME_ERROR}"
    _all_reduce_works(threads)


def test_the_px_magic_shows_one_error_of_every_rank_once(threads):
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    threads.activate()
    res = shell.run_cell("%%px\nundefined_name_xyz\n")
    err = res.error_in_exec
    assert isinstance(err, RankError) and err.ranks == [0, 1, 2]
    lines = err._render_traceback_()
    assert lines[0] == f"RankError: every rank (0-2) raised {NAME_ERROR}"
    assert sum("traceback" in ln for ln in lines) == 1
    assert shell.run_cell("%%px\nz = r * 10\n").error_in_exec is None
    assert threads.view.pull("z") == [0, 10, 20]


def test_a_raw_collective_one_thread_rank_skips_is_named_as_meshvizs_are(threads):
    """tdist.all_reduce called directly on rank 0 alone: the error named rank 0 (its deadlock) with no word of
    ranks 1 and 2, which never entered it; meshviz's own collective named those two."""
    t0 = time.monotonic()
    err = fails(threads, "x = torch.ones(2)\nif r == 0:\n    tdist.all_reduce(x)\n")
    assert time.monotonic() - t0 < 10  # the collective timeout is 30 s
    assert err.ranks == [1, 2] and err.lead, str(err)
    assert err.diagnosis[0] == "rank 1 never entered all_reduce on group [0, 1, 2] (idle: its cell finished)"
    assert err.diagnosis[1] == "rank 2 never entered all_reduce on group [0, 1, 2] (idle: its cell finished)"
    _all_reduce_works(threads)


def test_the_roll_call_shows_a_rank_waiting_in_a_raw_collective_or_receive(threads):
    rollcall_shows_raw_waits(threads, 10)


@pytest.mark.timeout(60)
def test_a_rank_keeping_the_turn_is_named_at_the_timeout_of_a_raw_collective():
    c = meshviz.Cluster(n=3, timeout=3, hang_after=1, ranks="threads")
    try:
        c.execute(SETUP)
        cell = ("if r == 1:\n"
                "    time.sleep(0.5)  # the turn goes to ranks 0 and 2, which enter the all-reduce\n"
                "    while True:\n"
                "        pass\n"
                "x = torch.ones(1)\n"
                "tdist.all_reduce(x)\n")
        t0 = time.monotonic()
        err = fails(c, cell, timeout=30)
        assert time.monotonic() - t0 < 15, str(err)
        assert err.ranks == [1] and err.lead, str(err)
        assert err.diagnosis[0] == "rank 1 never entered all_reduce on group [0, 1, 2]; it is running at line 3 " \
            "of the cell", str(err)
        assert err.diagnosis[1].startswith("ranks 0, 2 waited in all_reduce on group [0, 1, 2] for ")
        _all_reduce_works(c)
    finally:
        c.stop()


def test_a_thread_a_ranks_cell_starts_prints_into_that_ranks_output(threads, capfd, monkeypatch):
    """On an engine a thread the cell starts prints into that engine's output; here it went to the kernel's
    stdout, unlabelled, and its exception report too."""
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's, not pytest's
    capfd.readouterr()
    ar = threads.execute("def f(k):\n    print('from thread', k)\n"
                         "th = threading.Thread(target=f, args=(r,))\nth.start()\nth.join()\nprint('main')")
    assert ar.stdout == [f"from thread {r}\nmain\n" for r in range(3)]
    ar = threads.execute("def g():\n    raise ValueError(f'in thread {r}')\n"
                         "th = threading.Thread(target=g)\nth.start()\nth.join()")
    assert [s.splitlines()[-1] for s in ar.stderr] == [f"ValueError: in thread {r}" for r in range(3)]
    # one that outlives its cell: into the cell its rank runs then, else the kernel's, labelled with the rank
    ar = threads.execute("def h(k):\n    time.sleep(0.2)\n    print('late', k)\n"
                         "th = threading.Thread(target=h, args=(r,))\nth.start()")
    nxt = threads.execute("time.sleep(0.6)\nprint('next')")
    assert ar.stdout == [""] * 3 and nxt.stdout == [f"late {r}\nnext\n" for r in range(3)]
    threads.execute("th = threading.Thread(target=h, args=(r,))\nth.start()")
    time.sleep(0.6)
    out = capfd.readouterr().out
    assert sorted(ln for ln in out.splitlines() if "late" in ln) == [f"[stdout:{r}] late {r}" for r in range(3)]
    assert "from thread" not in out and "in thread" not in out
    _all_reduce_works(threads)


@pytest.mark.engines
@pytest.mark.timeout(150)
def test_engines_name_one_error_of_every_rank_a_system_exit_and_a_rank_that_exits():
    c = meshviz.Cluster(n=2, timeout=20)
    try:
        c.execute(SETUP)
        err = fails(c, "undefined_name_xyz")
        assert err.ranks == [0, 1] and err.headline() == f"every rank (0, 1) raised {NAME_ERROR}", str(err)
        assert "stopped because of it" not in str(err)
        assert c.state == "ready"
        _all_reduce_works(c, 2)
        # IPython takes a SystemExit before the engine's failure handler: rank 0 waited the collective timeout and
        # was named as the cause, rank 1 as stopped because of it
        t0 = time.monotonic()
        err = fails(c, "if r == 1:\n    raise SystemExit('bye')\nx = torch.ones(1)\ntdist.all_reduce(x)", timeout=60)
        assert time.monotonic() - t0 < 15, str(err)  # the collective timeout is 20 s
        assert err.ranks == [1] and err.headline().startswith("rank 1 raised SystemExit: bye"), str(err)
        _all_reduce_works(c, 2)
        err = fails(c, "import os\nif r == 1:\n    os._exit(0)\nx = torch.ones(1)\ntdist.all_reduce(x)", timeout=60)
        assert err.ranks == [1] and err.headline().startswith("rank 1 died"), str(err)
        assert c.state == "broken"
    finally:
        c.stop()


def test_a_live_px_output_sends_each_ranks_tail_not_all_it_printed(monkeypatch):
    """In a notebook every update of %px's rank-ordered output sent all the ranks had printed, ten times a second:
    a cell printing 100,000 lines on each of 3 ranks sent 5.4 million characters per update."""
    pytest.importorskip("IPython")
    import IPython.display

    from meshviz.cluster import rank_output

    class Result:
        ranks = [0, 1, 2]
        stdout = ["".join(f"rank {r} line {i}\n" for i in range(100_000)) for r in range(3)]
        stderr = ["", "warn\n", ""]

        def display_outputs(self, groupby):
            pass

    sent = []

    class Handle:
        def update(self, bundle, raw=True):
            sent.append(bundle["text/plain"])

    def display(bundle, raw=True, display_id=True):
        sent.append(bundle["text/plain"])
        return Handle()

    monkeypatch.setattr(IPython.display, "display", display)
    out = rank_output.RankOrderedOutput(Result())
    out.live = True
    out.update()
    live = sent[-1]
    assert len(live) < 100_000  # of 5.4 million
    lines = live.splitlines()
    assert lines[0] == "[stdout:0] " and lines[1].startswith("[... ") and lines[1].endswith(
        " characters above; all of it when the cell ends]")
    assert lines[2].startswith("rank 0 line ") and "rank 0 line 99999" in lines
    assert lines[-2:] == ["[stderr:1] ", "warn"]
    out.finish()  # the end shows all of it, in rank order
    whole = "".join(f"[stdout:{r}] \n{Result.stdout[r]}" for r in range(3)) + "[stderr:1] \nwarn"
    assert len(sent) == 2 and sent[-1] == whole


def test_late_threads_of_several_ranks_write_whole_lines_to_the_kernel(capsys):
    """``print`` writes a line in pieces: two ranks' late threads printing at once interleaved them mid-line
    ('[stdout:2] late[stdout:1] late 2')."""
    from meshviz.cluster.thread_view import _Kernel

    one, two = _Kernel("stdout", 1), _Kernel("stdout", 2)
    for stream, piece in [(two, "late"), (one, "late"), (two, " "), (one, " "), (two, "2"), (one, "1\nand "),
                          (two, "\n"), (one, "more")]:
        stream.append(piece)
    one.flush()
    assert capsys.readouterr().out.splitlines() == ["[stdout:1] late 1", "[stdout:2] late 2", "[stdout:1] and more"]
