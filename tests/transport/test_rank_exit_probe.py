"""A rank that returns, raises, exits or is killed while its peers are in (or about to enter) a collective with it:
run_ranks' processes, spawn and launch's nodes name that rank within seconds, never the peer left waiting."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import meshviz.distributed as dist
from meshviz.errors import RankError
from meshviz.runtime.rendezvous import free_port
from meshviz.testing import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _returns_early(early, pause):
    dist.init_parallel_env()
    r = dist.get_rank()
    if r == early:
        return "returned"
    time.sleep(pause)  # > 0: the rank returned before the others entered the collective
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    return t.tolist()


def _fails(bad, how):
    dist.init_parallel_env()
    r = dist.get_rank()
    if r == bad:
        if how == "raise":
            raise ValueError("failing on purpose")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(2))
    return r


def _error(fn, n, *args, **kw) -> tuple[RankError, float]:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(fn, n, *args, timeout=60, collective_timeout=20, ranks="processes", **kw)
    return info.value, time.monotonic() - t0


@pytest.mark.parametrize("n, early, pause", [(2, 1, 0.0), (3, 2, 1.0), (4, 0, 0.0)])
def test_run_ranks_names_the_rank_that_returned_not_the_peer_whose_connection_it_reset(n, early, pause):
    err, took = _error(_returns_early, n, early, pause)
    group = list(range(n))
    assert err.ranks == [early], str(err)
    assert str(err).startswith(f"rank {early} never entered all_reduce #1 on group {group} (idle: its function "
                               "returned)"), str(err)
    waiting = [r for r in group if r != early]
    assert [o.rank for o in err.outcomes if o.status == "ok"] == [early]
    assert err.outcomes[early].value == "returned"
    assert all(err.outcomes[r].status == "error" for r in waiting)
    assert took < 20, f"named after {took:.1f} s: the 20 s collective timeout ran out"


def _sizes(twice):
    dist.init_parallel_env()
    r = dist.get_rank()
    if twice and r == 0:
        dist.all_reduce(torch.ones(2))  # a collective both ranks pass alike, then rank 0 returns early
        return "returned"
    if twice:
        dist.all_reduce(torch.ones(2))
    t = torch.ones(2 + r)  # sizes differ: gloo may end one side's call, not the other's
    dist.all_reduce(t)
    return t.tolist()


def test_run_ranks_names_a_rank_that_passed_a_mismatched_collective_not_one_that_never_entered():
    """One side's call ended (gloo paired calls of different sizes), its function returned and its process exited
    at once: the error says it passed the collective and is done, as spawn's does, not that it never entered it
    (it had left no counts for the roll-call)."""
    err, took = _error(_sizes, 2, False)
    (done,) = err.ranks
    assert str(err).startswith(f"rank {done} passed all_reduce #1 on group [0, 1] without the ranks still in it and "
                               "is done (its function returned): its call was paired with another (a different "
                               "size?)"), str(err)
    assert "never entered" not in str(err), str(err)
    assert err.outcomes[done].status == "ok" and err.outcomes[1 - done].status == "error"
    assert took < 20, took


def test_run_ranks_names_a_returned_rank_by_the_collectives_it_entered():
    """Rank 0 entered all_reduce #1 and returned: rank 1, waiting in #2, is told rank 0 never entered that one."""
    err, _ = _error(_sizes, 2, True)
    assert err.ranks == [0], str(err)
    assert str(err).startswith("rank 0 never entered all_reduce #2 on group [0, 1] (idle: its function returned); "
                               "rank 1 waited in all_reduce #2"), str(err)


@pytest.mark.parametrize("how, text", [("raise", "rank 1 raised ValueError: failing on purpose"),
                                       ("exit", "rank 1 died (exit code 3)"),
                                       ("kill", "rank 1 died (killed by SIGKILL)")])
def test_run_ranks_names_the_rank_that_raised_exited_or_was_killed(how, text):
    err, took = _error(_fails, 3, 1, how)
    assert err.ranks == [1], str(err)
    assert str(err).startswith(text), str(err)
    assert took < 20, took


def test_spawn_names_the_rank_that_returned_when_the_timeout_comes_before_the_roll_call():
    # hang_after as long as the collective timeout: the waiting rank's timeout ends the run, after the rank that
    # returned has gone; the error still says it returned, not that it "did not answer the roll-call"
    with pytest.raises(RankError) as info:
        dist.spawn(_returns_early, args=(1, 0.0), nprocs=2, timeout=3, hang_after=30)
    err = info.value
    assert err.ranks == [1], str(err)
    assert str(err).startswith("rank 1 never entered all_reduce #1 on group [0, 1] (idle: its function returned)"), \
        str(err)


# -- two nodes of meshviz.launch on this machine: the node whose workers only lost their connection says why ---------

NODE_SCRIPT = textwrap.dedent("""
    import os, signal, time, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    r, bad, how = dist.get_rank(), int(os.environ["BAD"]), os.environ["HOW"]
    if r == bad and how == "raise":
        raise ValueError("failing on purpose")
    if r == bad and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if r != bad or how in ("late", "slow"):  # how == "skip": the bad rank's script ends without entering it
        dist.all_reduce(torch.ones(1))
    if r == bad and how == "late":
        time.sleep(1)  # the other node's workers are done by then: its agent waits in torch's exit barrier
        raise ValueError("failing after the collectives")
    if r == bad and how == "slow":
        time.sleep(60)
    if r == 0:
        open("done0", "w").close()
""")


def _two_nodes(tmp_path, bad, how, nproc=1, then=None):
    (tmp_path / "s.py").write_text(NODE_SCRIPT)
    port = free_port()
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "600", "BAD": str(bad), "HOW": how}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "meshviz.launch", "--nnodes", "2", "--master",
                               f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", str(nproc), "--devices",
                               "cpu", "--hang_after", "0.5", "--log_dir", f"log{node}", "s.py"], cwd=str(tmp_path),
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in (0, 1)]
    try:
        if then is not None:
            then(procs, t0)
        errs = [p.communicate(timeout=100)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], errs, time.monotonic() - t0


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_node_1_says_that_node_0_stopped_the_job_at_the_roll_call(tmp_path):
    # rank 1 (node 1) finished its script without entering the all_reduce rank 0 waits in: node 0's roll-call
    # stops the job; node 1 said nothing and exited 0 (its store's connection lost), now it says why and fails
    codes, (err0, err1), took = _two_nodes(tmp_path, 1, "skip")
    assert codes == [1, 1], (codes, err0[-2000:], err1[-2000:])
    blame = "meshviz.launch: rank 1 never entered all_reduce #1 on group [0, 1] (idle: its script finished)"
    assert blame in err0 and blame in err1, err1[-2000:]
    assert "meshviz.launch: node 0 stopped the job at the roll-call" in err1, err1[-2000:]
    assert took < 90, took


@pytest.mark.launch
@pytest.mark.timeout(150)
@pytest.mark.parametrize("bad, how, what", [(0, "raise", "ValueError: failing on purpose"),
                                            (3, "kill", "killed by SIGKILL")])
def test_the_other_node_names_the_worker_that_failed_not_its_own(tmp_path, bad, how, what):
    # 2 workers a node: a worker of one node fails, the other node's workers lose their connection to it; that node
    # named its own worker ("the worker with global rank 2 failed"), now the one on the other node
    codes, errs, took = _two_nodes(tmp_path, bad, how, nproc=2)
    here, there = bad // 2, 1 - bad // 2
    assert f"the worker with global rank {bad} failed" in errs[here], errs[here][-2000:]
    line = f"meshviz.launch: the worker with global rank {bad} (node {here}) failed first: {what}"
    assert line in errs[there], errs[there][-2000:]
    assert codes[there] == 1 and codes[here] != 0, codes
    assert took < 90, took


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_a_node_whose_workers_finished_hears_that_a_worker_of_another_node_failed_after_them(tmp_path):
    # rank 0 (node 0) finished; rank 1 (node 1) raised a second later: node 0's agent sat in torch's exit barrier,
    # a C++ wait its SIGTERM could not end, for the barrier's 300 s; now it says why within seconds
    codes, (err0, err1), took = _two_nodes(tmp_path, 1, "late")
    # "the workers here had finished theirs" (rank 0 exits 0 as soon as rank 1's death breaks its wait at its end;
    # "... stopped ..." were the news read first: test_launch_scale_probe checks the wording)
    line = ("meshviz.launch: the worker with global rank 1 (node 1) failed first: ValueError: failing after the "
            "collectives; the workers here ")
    assert line in err0, err0[-2000:]
    assert codes == [1, 1], (codes, err0[-2000:], err1[-2000:])
    assert "the worker with global rank 1 failed" in err1, err1[-2000:]
    assert took < 60, took


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_a_node_waiting_for_the_others_at_the_end_stops_on_sigint(tmp_path):
    # Ctrl-C on node 0 while its worker, done, waits for node 1's: the agent passes the SIGINT on to the worker,
    # which heard it inside gloo's barrier (a C++ wait) only when that was over: it was killed after the 30 s grace
    took = []

    def interrupt(procs, t0):
        while not (tmp_path / "done0").exists():
            assert time.monotonic() - t0 < 60 and procs[0].poll() is None, "rank 0 never finished"
            time.sleep(0.1)
        time.sleep(1.0)  # it waits for rank 1 at its end
        procs[0].send_signal(signal.SIGINT)
        t1 = time.monotonic()
        procs[0].wait(timeout=30)
        took.append(time.monotonic() - t1)
        procs[1].kill()

    codes, (err0, _), _ = _two_nodes(tmp_path, 1, "slow", then=interrupt)
    assert codes[0] == signal.SIGINT, (codes, err0[-2000:])
    assert "meshviz.launch: SIGINT: the workers were stopped" in err0, err0[-2000:]
    assert took[0] < 10, took
