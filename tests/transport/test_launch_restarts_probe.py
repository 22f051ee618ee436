"""Launched jobs that restart (--max_restart) or fail: each run's roll-call is its own, nothing a worker started
outlives the job."""


import pytest

from .started import launch, none_left, pids_written

pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.timeout(90)]


FAILS_THEN_HANGS = """
    import os, pathlib, time
    import torch
    import meshviz.distributed as dist
    rank, attempt = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    pathlib.Path(os.environ["STARTED"], f"pid{rank}.{attempt}").write_text(str(os.getpid()))
    dist.init_parallel_env()
    if attempt == 0:  # run 1: rank 1's all_reduce times out (it fails in that collective), rank 0 sleeps
        if rank == 0:
            time.sleep(60)
        dist.all_reduce(torch.ones(1))
    else:  # run 2: rank 0 waits in a broadcast that rank 1 never enters: it raises outside any collective
        if rank == 1:
            time.sleep(1.5)
            raise ValueError("rank 1 fails in run 2")
        dist.broadcast(torch.ones(1), src=0)
"""


def test_launch_the_roll_call_after_a_restart_describes_that_run_only(tmp_path):
    """Run 1: rank 1 fails in all_reduce (a timeout), the agent restarts both. Run 2: rank 0 waits in a broadcast,
    rank 1 raises before it. The verdict for run 2 read run 1's roll-call keys on the agent's store (failed/1): it
    said rank 1 failed in all_reduce #1, a collective run 2 never entered, instead of naming its ValueError."""
    rc, out, err = launch(tmp_path, FAILS_THEN_HANGS, 2, "--max_restart", "1", "--hang_after", "0.5",
                           MESHVIZ_TIMEOUT="3")
    assert rc == 1, err[-3000:]
    text = "\n".join(x for x in err.splitlines() if x.startswith("meshviz.launch: "))
    assert "meshviz.launch: rank 1 never entered broadcast #1 on group [0, 1]: it is dead (exit code 1: " \
           "ValueError: rank 1 fails in run 2)" in text, err[-3000:]
    assert "all_reduce" not in text, err[-3000:]
    none_left(pids_written(tmp_path))


STARTS_A_CHILD = """
    import os, pathlib, subprocess, sys, time
    rank = os.environ["PADDLE_TRAINER_ID"]
    d = os.environ["STARTED"]
    if rank == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # what it started
        pathlib.Path(d, "pid1").write_text(f"{os.getpid()} {child.pid}")
        raise ValueError("rank 1 fails, leaving its child")
    pathlib.Path(d, "pid0").write_text(str(os.getpid()))
    time.sleep(60)
"""


def test_launch_a_failed_worker_takes_what_it_started_with_it(tmp_path):
    """Worker 1 starts a subprocess and raises: the agent ended worker 0 (and what worker 0 started, its process
    group) but not worker 1's child, which slept on after the launcher exited (torch and Paddle signal only the
    workers still running)."""
    rc, out, err = launch(tmp_path, STARTS_A_CHILD, 2, "--hang_after", "0")
    assert rc == 1, err[-3000:]
    assert "the worker with global rank 1 failed" in err, err[-3000:]
    none_left(pids_written(tmp_path))
