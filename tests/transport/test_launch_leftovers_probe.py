"""Launched jobs whose failed workers leave processes behind, and restarts (--max_restart) across several nodes."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from .started import alive, launch, none_left, pids_written

pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.timeout(60)]


LEAVES_A_STUBBORN_CHILD = """
    import os, pathlib, subprocess, sys, time
    rank = os.environ["PADDLE_TRAINER_ID"]
    d = os.environ["STARTED"]
    pathlib.Path(d, f"pid{rank}").write_text(str(os.getpid()))
    if rank == os.environ["CHILD_OF"]:  # a child that ignores SIGTERM
        child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); open(sys.argv[1] + '/ready', 'w').close(); time.sleep(120)", d])
        pathlib.Path(d, f"pid{rank}").write_text(f"{os.getpid()} {child.pid}")
    while not os.path.exists(os.path.join(d, "ready")):
        time.sleep(0.02)
    if rank == "1":
        raise ValueError("rank 1 fails")
    time.sleep(60)
"""


@pytest.mark.parametrize("child_of", ["1", "0"], ids=["failed", "stopped"])
def test_launch_a_worker_s_child_that_ignores_sigterm_is_killed_after_the_grace_naming_it(tmp_path, child_of):
    """Worker ``child_of`` starts a child that ignores SIGTERM, then worker 1 raises (the agent ends worker 0):
    the launcher (after torch's agent, which SIGKILLs only its own workers) sent SIGTERM to the worker's process
    group and returned with the child still running."""
    t0 = time.monotonic()
    rc, out, err = launch(tmp_path, LEAVES_A_STUBBORN_CHILD, 2, "--hang_after", "0", wait=45, rdzv_timeout=30,
                          timeout=20, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2", CHILD_OF=child_of)
    took = time.monotonic() - t0
    assert rc == 1, err[-3000:]
    pids = pids_written(tmp_path)
    assert len(pids) == 3, (pids, err[-3000:])
    left = alive(pids)
    none_left(pids, within=0)
    assert not left, f"left running after the launcher returned: {left} of {pids}"
    assert "meshviz.launch: the worker with global rank 1 failed; the others were stopped; what rank " \
           f"{child_of} started did not end on SIGTERM: killed (SIGKILL) after 2 s. Logs: " in err, err[-3000:]
    assert took < 30, f"took {took:.1f} s"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BUSY_WHEN_THE_OTHER_NODE_FAILS = """
    import os, pathlib, time
    rank, attempt = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    d = os.environ["STARTED"]
    pathlib.Path(d, f"pid{rank}.{attempt}").write_text(str(os.getpid()))
    if attempt == 0:  # run 1: rank 1 (node 1) fails at once, while rank 0 (node 0) computes before a collective
        if rank == 1:
            raise ValueError("rank 1 fails in run 1")
        time.sleep(60)
    import torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    t = torch.tensor([float(rank + 1 + 10 * attempt)])
    dist.all_reduce(t)
    pathlib.Path(d, f"sum{rank}.{attempt}").write_text(repr(t.item()))
"""


def test_launch_restarts_every_node_when_one_node_s_worker_fails(tmp_path):
    """Two nodes (one worker each), --max_restart 1: node 1's worker fails in run 1 while node 0's still computes.
    Node 1's agent restarted its worker alone (each node restarts on its own worker's failure, its keys those of
    its restart count): its run 2 waited for rank 0's run 2, which node 0 never started, timed out and the job
    failed although run 2 succeeds. Paddle's launch restarts every node when one fails (and so does torchrun's
    agent on a rendezvous that sees a node come back): node 0 ends its run 1 and both meet in run 2."""
    (tmp_path / "script.py").write_text(textwrap.dedent(BUSY_WHEN_THE_OTHER_NODE_FAILS))
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "30", "MESHVIZ_TIMEOUT": "15", "STARTED": str(tmp_path)}
    master = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "meshviz.launch", "--nnodes", "2", "--rank", str(node),
                               "--master", master, "--nproc_per_node", "1", "--devices", "cpu", "--max_restart",
                               "1", "--log_dir", str(tmp_path / f"log{node}"), "script.py"], cwd=str(tmp_path),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    outs, deadline = ["", ""], time.monotonic() + 40
    try:
        for node, p in enumerate(procs):
            outs[node] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    pids = pids_written(tmp_path)
    none_left(pids)
    errs = "\n".join(o[-2000:] for o in outs)
    assert [p.returncode for p in procs] == [0, 0], errs
    assert [(tmp_path / f"sum{r}.1").read_text() for r in (0, 1)] == ["23.0", "23.0"], errs
    assert "meshviz.launch: node 1 restarted its workers (restart 1): the workers here were stopped to restart " \
           "with them" in outs[0], outs[0][-3000:]
