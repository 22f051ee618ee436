"""A rank that leaves without joining ends run_ranks' processes and launch's workers within seconds, naming it;
a launcher sent SIGTERM ends every worker, one that ignores SIGTERM too, and says so."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from meshviz.errors import RankError
from meshviz.testing import run_ranks

from .started import alive, wait_for_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _leaves_before_joining(leaver: int, how: str, stamp: str):
    import torch

    import meshviz.distributed as dist

    if int(os.environ["RANK"]) == leaver:
        with open(stamp, "w") as fh:
            fh.write(repr(time.time()))
        if how == "raise":
            raise ValueError("leaving on purpose")
        return "left"
    dist.init_parallel_env()
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("how", ["return", "raise"])
def test_run_ranks_processes_end_at_once_when_a_rank_leaves_without_joining(how, tmp_path):
    """Rank 2 returns (or raises) before init_parallel_env: ranks 0 and 1, which joined, waited the whole
    collective timeout (30 s here) for it before the error came."""
    stamp = str(tmp_path / "left")
    with pytest.raises(RankError) as info:
        run_ranks(_leaves_before_joining, 3, 2, how, stamp, timeout=60, collective_timeout=30, ranks="processes")
    took = time.time() - float(open(stamp).read())
    err = info.value
    assert took < 20, f"took {took:.1f} s: the ranks that joined waited for the one that had left"
    assert err.ranks == [2], str(err)
    lead = ("rank 2 never joined the process group (it returned without joining)" if how == "return"
            else "rank 2 raised ValueError: leaving on purpose")
    assert str(err).startswith(lead), str(err)
    by = {o.rank: o for o in err.outcomes}
    # the run ends once one of them waits for rank 2: the other may not have reached the rendezvous yet
    assert by[2].arrived is False and (by[0].arrived or by[1].arrived)
    assert by[0].status == by[1].status == "stopped"


def _nobody_joins(rank_delay: float):
    time.sleep(rank_delay * int(os.environ["RANK"]))
    return int(os.environ["RANK"])


def test_run_ranks_processes_still_return_every_value_when_no_rank_joins():
    """Ranks that never join and end at different times strand nobody."""
    assert run_ranks(_nobody_joins, 3, 0.3, timeout=40, ranks="processes") == [0, 1, 2]


LEAVER = textwrap.dedent("""
    import os, sys, time
    import torch
    import meshviz.distributed as dist
    if os.environ["PADDLE_TRAINER_ID"] == os.environ["LEAVER"]:
        with open(os.environ["STAMP"], "w") as fh:
            fh.write(repr(time.time()))
        sys.exit(0) if os.environ["HOW"] == "exit" else None
    else:
        dist.init_parallel_env()
        t = torch.ones(1)
        dist.all_reduce(t)
""")


def _launch(tmp_path, script: str, nproc: int, **env):
    (tmp_path / "script.py").write_text(script)
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30", **env}
    return subprocess.Popen([sys.executable, "-m", "meshviz.launch", "--nproc_per_node", str(nproc), "--devices",
                             "cpu", "--log_dir", str(tmp_path / "log"), "script.py"], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.launch
@pytest.mark.parametrize("leaver, how", [(1, "exit"), (0, "end")])
def test_launch_ends_the_workers_at_once_when_one_leaves_without_joining(tmp_path, leaver, how):
    """A worker whose script ends (or calls sys.exit(0)) before init_parallel_env: the workers that joined
    waited the whole timeout (30 s) for it, then the launcher named the worker that raised that timeout."""
    stamp = tmp_path / "left"
    p = _launch(tmp_path, LEAVER, 2, LEAVER=str(leaver), HOW=how, STAMP=str(stamp))
    try:
        out, err = p.communicate(timeout=50)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    took = time.time() - float(stamp.read_text())
    other = 1 - leaver
    assert f"meshviz.launch: rank {leaver} never joined the process group (it returned without joining) (rank " \
           f"{other} stopped because of it)" in err, err[-3000:]
    assert p.returncode == 1, err[-3000:]
    assert took < 20, f"took {took:.1f} s after the worker left: the others waited for it"


IGNORES_SIGTERM = textwrap.dedent("""
    import os, pathlib, signal, subprocess, sys, time
    rank = os.environ["PADDLE_TRAINER_ID"]
    if rank == os.environ["STUBBORN"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # what the worker started
    d = os.environ["STARTED"]
    pathlib.Path(f"{d}/pid{rank}").write_text(f"{os.getpid()} {child.pid}")
    pathlib.Path(f"{d}/started{rank}").touch()
    time.sleep(120)
""")


@pytest.mark.launch
@pytest.mark.parametrize("signals, env", [(1, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}), (2, {})],
                         ids=["grace-3s", "second-signal"])
def test_sigterm_to_the_launcher_kills_a_worker_that_ignores_it_and_names_it(tmp_path, signals, env):
    """Worker 1 ignores SIGTERM: the launcher sent SIGTERM waited torch's 30 s for it whatever the grace asked
    (torch 2.11 has none), a second SIGTERM started the 30 s again, and it said only "the workers were stopped".
    Now it is killed after the grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), or at once at a second signal, named;
    no worker, nor what a worker started, is left running."""
    p = _launch(tmp_path, IGNORES_SIGTERM, 2, STUBBORN="1", STARTED=str(tmp_path), **env)
    try:
        wait_for_files(str(tmp_path / "started"), 2, timeout=40)
        pids = [int(x) for r in (0, 1) for x in (tmp_path / f"pid{r}").read_text().split()]
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        if signals == 2:
            time.sleep(1.0)
            p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=40)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == signal.SIGTERM, err[-3000:]
    when = "after 3 s" if signals == 1 else "at a second signal"
    assert f"meshviz.launch: SIGTERM: the workers were stopped; rank 1 did not end on SIGTERM: killed (SIGKILL) " \
           f"{when}" in err, err[-3000:]
    assert took < 15, f"took {took:.1f} s to end the workers"
    deadline = time.monotonic() + 5
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"left running: {alive(pids)} of {pids}"


@pytest.mark.launch
def test_every_node_names_the_worker_that_left_without_joining(tmp_path):
    """Two nodes of one worker each; node 1's worker exits 0 before init_parallel_env: node 0's worker waited the
    timeout for it, and node 1's agent waited at torch's exit barrier for node 0."""
    from meshviz.runtime.rendezvous import free_port

    (tmp_path / "script.py").write_text(LEAVER)
    port = free_port()
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30", "LEAVER": "1", "HOW": "exit",
           "STAMP": str(tmp_path / "left")}
    procs = [subprocess.Popen([sys.executable, "-m", "meshviz.launch", "--nnodes", "2", "--master",
                               f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", "1", "--devices", "cpu",
                               "--log_dir", str(tmp_path / f"log{node}"), "--job_id", "left", "script.py"],
                              cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    try:
        errs = [p.communicate(timeout=50)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    took = time.time() - float((tmp_path / "left").read_text())
    for err in errs:
        assert "meshviz.launch: rank 1 never joined the process group (it returned without joining) (rank 0 stopped " \
               "because of it)" in err, err[-3000:]
    assert [p.returncode for p in procs] == [1, 1], errs
    assert took < 20, f"took {took:.1f} s after the worker left"
