"""Launched workers that leave quietly, restarts, a failed job's stubborn worker, a launcher killed: nothing waits."""

import subprocess
import sys
import textwrap
import time

import pytest

from .started import finish, none_left, pids_written, start_launch, wait_for_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]  # 10-20 s each here; a loaded machine starts torch slowly


QUIET = """
    import os, pathlib, time
    import torch
    import meshviz.distributed as dist
    rank = os.environ["PADDLE_TRAINER_ID"]
    pathlib.Path(os.environ["STARTED"], f"pid{rank}").write_text(str(os.getpid()))
    if rank == "1":
        pathlib.Path(os.environ["STARTED"], "left").write_text(repr(time.time()))
        os._exit(0)
    dist.init_parallel_env()
    t = torch.ones(1)
    dist.all_reduce(t)
"""


@pytest.mark.launch
def test_launch_ends_the_workers_at_once_when_one_leaves_with_os_exit_before_joining(tmp_path):
    """Worker 1 calls os._exit(0) before init_parallel_env (no interpreter exit, so it never said it left):
    worker 0 waited the whole timeout (30 s) for it, then the launcher blamed worker 0's timeout."""
    p = start_launch(tmp_path, QUIET, 2)
    out, err = finish(p, 75)
    took = time.time() - float((tmp_path / "left").read_text())
    assert "meshviz.launch: rank 1 never joined the process group (it returned without joining) (rank 0 stopped " \
           "because of it)" in err, err[-3000:]
    assert p.returncode == 1, err[-3000:]
    assert took < 20, f"took {took:.1f} s after the worker left: the other waited for it"
    none_left(pids_written(tmp_path, (0, 1)))


LEFT_THEN_RESTARTED = """
    import json, os, sys, time
    rank, attempt = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and rank == 1:
        sys.exit(0)  # leaves without joining: says so
    if attempt == 0:
        time.sleep(1.5)
        raise ValueError("rank 0 fails before joining")  # nobody joined: the agent restarts both
    import torch
    import meshviz.distributed as dist
    time.sleep(2.0 * rank)  # run 2: rank 1 joins late, but joins
    dist.init_parallel_env()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(f"out{rank}.json", "w") as fh:
        json.dump([attempt, t.item()], fh)
"""


@pytest.mark.launch
def test_launch_a_worker_that_left_in_the_run_before_a_restart_does_not_end_the_next(tmp_path):
    """Run 1: worker 1 leaves (sys.exit(0)) before joining, worker 0 fails before joining: the agent restarts
    them. Run 2 (both join, worker 1 2 s late) was stopped at once: the leave marker of run 1 was still on the
    agent's store, so worker 1 of run 2 was named as having left."""
    import json

    p = start_launch(tmp_path, LEFT_THEN_RESTARTED, 2, "--max_restart", "1")
    out, err = finish(p, 75)
    assert p.returncode == 0, err[-3000:]
    assert "never joined" not in err, err[-3000:]
    assert [json.loads((tmp_path / f"out{r}.json").read_text()) for r in (0, 1)] == [[1, 3.0], [1, 3.0]]


FAILS_AFTER_JOINING = """
    import json, os, time
    import torch
    import meshviz.distributed as dist
    rank, attempt = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    time.sleep(2.0 * rank * attempt)  # run 2: rank 0 meets first, and finds what run 1's rank 1 left
    dist.init_parallel_env()
    t = torch.tensor([10.0 * attempt + rank + 1])
    dist.all_reduce(t)
    if attempt == 0 and rank == 1:
        raise ValueError("rank 1 fails after its first all_reduce")
    dist.barrier()
    with open(f"out{rank}.json", "w") as fh:
        json.dump([attempt, t.item()], fh)
"""


@pytest.mark.launch
def test_launch_a_restart_after_a_run_that_joined_joins_again(tmp_path):
    """--max_restart 1 and worker 1 fails after an all_reduce: run 2's process group met on the agent's store
    beside what run 1's left there, and gloo connected to run 1's addresses: 'Gloo connectFullMesh failed ...
    Connection refused', so the restart failed too."""
    import json

    p = start_launch(tmp_path, FAILS_AFTER_JOINING, 2, "--max_restart", "1")
    out, err = finish(p, 75)
    assert p.returncode == 0, err[-3000:]
    # run 2: 10 + 1 and 10 + 2
    assert [json.loads((tmp_path / f"out{r}.json").read_text()) for r in (0, 1)] == [[1, 23.0], [1, 23.0]]


STUBBORN = """
    import os, pathlib, signal, subprocess, sys, time
    rank = os.environ["PADDLE_TRAINER_ID"]
    d = os.environ["STARTED"]
    pathlib.Path(f"{d}/pid{rank}").write_text(str(os.getpid()))
    if rank == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # what it started
        pathlib.Path(f"{d}/pid{rank}").write_text(f"{os.getpid()} {child.pid}")
        pathlib.Path(f"{d}/started{rank}").touch()
        time.sleep(120)
    while len([f for f in os.listdir(d) if f.startswith("started")]) < 1:
        time.sleep(0.05)
    pathlib.Path(f"{d}/failed").write_text(repr(time.time()))
    raise ValueError("rank 0 fails")
"""


@pytest.mark.launch
def test_launch_a_failed_job_kills_a_worker_that_ignores_sigterm_after_the_grace_naming_it(tmp_path):
    """Worker 0 fails while worker 1 ignores SIGTERM: the agent's own ending waited torch's 30 s for worker 1
    whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT said (the grace held only after a signal to the launcher), and the
    launcher did not say that worker 1 was killed."""
    p = start_launch(tmp_path, STUBBORN, 2, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3")
    out, err = finish(p, 75)
    took = time.time() - float((tmp_path / "failed").read_text())
    assert "meshviz.launch: the worker with global rank 0 failed; the others were stopped; rank 1 did not end on " \
           "SIGTERM: killed (SIGKILL) after 3 s" in err, err[-3000:]
    assert p.returncode == 1, err[-3000:]
    assert took < 15, f"took {took:.1f} s after the worker failed"
    none_left(pids_written(tmp_path, (0, 1)))


WAITS = """
    import os, pathlib, time
    import torch
    import meshviz.distributed as dist
    rank = os.environ["PADDLE_TRAINER_ID"]
    pathlib.Path(os.environ["STARTED"], f"pid{rank}").write_text(str(os.getpid()))
    dist.init_parallel_env()
    pathlib.Path(os.environ["STARTED"], f"started{rank}").touch()
    if rank == "1":
        time.sleep(120)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1
"""


@pytest.mark.launch
def test_launch_workers_end_when_the_launcher_is_killed(tmp_path):
    """SIGKILL to the launcher (no handler runs, nobody ends the workers): worker 1 slept on and worker 0 waited
    in all_reduce until the collective timeout, orphans (Paddle's launch leaves them so too)."""
    p = start_launch(tmp_path, WAITS, 2, "--hang_after", "0")
    try:
        wait_for_files(str(tmp_path / "started"), 2, timeout=60)
        pids = pids_written(tmp_path, (0, 1))
        p.kill()
        p.wait(timeout=10)
        none_left(pids)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


SPAWNS = """
    import os, pathlib, sys, time
    import meshviz.distributed as dist

    def rank(d):
        pathlib.Path(d, f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        pathlib.Path(d, f"started{os.environ['RANK']}").touch()
        time.sleep(120)

    if __name__ == "__main__":
        dist.spawn(rank, args=(sys.argv[1],), nprocs=2)
"""


def test_spawn_ranks_end_when_the_process_that_spawned_them_is_killed(tmp_path):
    """SIGKILL to the process that called dist.spawn: its ranks (forked from the fork server, which outlives
    them) slept on as orphans."""
    (tmp_path / "spawns.py").write_text(textwrap.dedent(SPAWNS))
    with open(tmp_path / "out.txt", "w") as out:  # not a pipe: a rank left running would hold it open
        p = subprocess.Popen([sys.executable, str(tmp_path / "spawns.py"), str(tmp_path)], cwd=str(tmp_path),
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_files(str(tmp_path / "started"), 2, timeout=60)
        pids = pids_written(tmp_path, (0, 1))
        p.kill()
        p.wait(timeout=10)
        none_left(pids)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
