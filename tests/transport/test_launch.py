"""python -m meshviz.launch: Paddle's flags on torchrun's agent, one node and two nodes on loopback."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from meshviz.runtime.rendezvous import free_port

from .started import wait_for_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(args, cwd, timeout=90, wait=True, **env_extra):
    cmd = [sys.executable, "-m", "meshviz.launch", *args]
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30", **env_extra}
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def _losses(path):
    with open(path) as fh:
        return [float(m) for m in re.findall(r"loss:\[([-0-9.e]+)\]", fh.read())]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_seed004_under_launch_matches_single_process(tmp_path):
    from tests.ranks.test_fleet import _seed004_single_on

    rc, out, err = _launch(["--devices", "cpu", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
                            "--max_restart", "0", os.path.join(ROOT, "examples", "seed004_fleet.py")],
                           cwd=str(tmp_path))
    assert rc == 0, err
    assert "Configuration Arguments" in out and "nproc_per_node: 2" in out
    l0, l1 = _losses(tmp_path / "log" / "workerlog.0"), _losses(tmp_path / "log" / "workerlog.1")
    assert len(l0) == len(l1) == 20
    assert "step:19" in out  # local rank 0's log is also shown on the console
    ref, _ = _seed004_single_on([0, 1], steps=20)
    for step in range(20):
        assert (l0[step] + l1[step]) / 2 == pytest.approx(ref[step], abs=2e-6)


SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    r = dist.get_rank()
    if "--fail" in sys.argv and r == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if "--kill" in sys.argv and r == 1:  # as the OOM killer ends a process
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1) * (r + 1)
    dist.all_reduce(t)
    print(f"rank={r} world={dist.get_world_size()} local={os.environ['LOCAL_RANK']} "
          f"paddle={os.environ['PADDLE_TRAINER_ID']} sum={t.item()} args={sys.argv[1:]}")
    print("on stderr", file=sys.stderr)
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_nodes_on_loopback(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    port = free_port()
    procs = [
        _launch(["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", "1",
                 "--devices", "cpu",
                 "--log_dir", str(tmp_path / f"log{node}"), "--max_restart", "0", "--job_id", "t2",
                 "s.py", "--x", "1"], cwd=str(tmp_path), wait=False)
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for node in (0, 1):
        text = (tmp_path / f"log{node}" / "workerlog.0").read_text()
        assert f"rank={node} world=2 local=0 paddle={node} sum=3.0 args=['--x', '1']" in text
        assert "on stderr" in text  # stderr joins stdout in workerlog.N


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_failing_worker_and_bad_flags(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    rc, out, err = _launch(["--nproc_per_node", "3", "--devices", "0,1", "s.py"], cwd=str(tmp_path))
    assert rc == 2 and "more processes than the 2 devices" in err
    rc, out, err = _launch(["--nnodes", "2", "s.py"], cwd=str(tmp_path))
    assert rc == 2 and "--rank" in err
    # no restart by default (as Paddle outside its elastic mode): the first attempt's error is what is shown
    rc, out, err = _launch(["--nproc_per_node", "2", "--devices", "cpu", "--log_dir", str(tmp_path / "log"),
                            "s.py", "--fail"], cwd=str(tmp_path))
    assert rc == 1
    # rank 0 may fail too (its all_reduce loses rank 1) before the agent stops it: rank 1 is named first either way
    assert "the worker with global rank 1 failed" in err and "rank 1 fails on purpose" in err
    assert "rank 1 fails on purpose" in (tmp_path / "log" / "workerlog.1").read_text()
    assert "TORCHELASTIC_RESTART_COUNT" not in err and "Connection refused" not in err
    # a worker killed from outside is named, not the one the agent then ended
    rc, out, err = _launch(["--nproc_per_node", "2", "--devices", "cpu", "--log_dir", str(tmp_path / "logk"),
                            "s.py", "--kill"], cwd=str(tmp_path))
    assert rc == 247  # Paddle's code for a worker killed with SIGKILL (-9 wrapped to 0-255)
    assert "the worker with global rank 1 failed" in err and "rank 1, exit code -9" in err, err[-2000:]


LISTENING = textwrap.dedent("""
    import psutil, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    t = torch.ones(1)
    dist.all_reduce(t)
    agent = psutil.Process().parent()  # the launcher, where torchrun's agent serves the store
    pids = {agent.pid} | {c.pid for c in agent.children(recursive=True)}
    ips = sorted({c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in pids})
    print(f"rank={dist.get_rank()} sum={t.item()} listening={ips}")
""")


HANGS = textwrap.dedent("""
    import torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
""")


def _launch_hang(tmp_path, script):
    """2 ranks running ``script`` with a roll-call after 0.5 s and a collective timeout far beyond the test's."""
    (tmp_path / "s.py").write_text(script)
    return _launch(["--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"), "--max_restart", "0",
                    "--hang_after", "0.5", "s.py"], cwd=str(tmp_path), MESHVIZ_TIMEOUT="600")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_hang_prints_the_roll_call_and_names_the_rank(tmp_path):
    rc, out, err = _launch_hang(tmp_path, HANGS)
    assert rc == 1
    situation = re.search(r"  - (rank 0 waits in all_reduce #1 on group \[0, 1\] for ([\d.]+) s; .*)", err)
    assert situation, err
    assert situation.group(1).endswith("rank 1 is idle: its script finished without entering all_reduce #1")
    # seen while it waited, before the timeout (which leaves a busy machine time to ask, answer and print)
    assert 0.5 <= float(situation.group(2)) < 5.0
    assert "meshviz.launch: rank 1 never entered all_reduce #1 on group [0, 1] (idle: its script finished)" in err
    # rank 1's script finished: nothing can end rank 0's wait, so the roll-call stops the workers, not the timeout
    waited = re.search(r"meshviz.launch: rank 0 waited in all_reduce #1 on group \[0, 1\] for ([\d.]+) s\n"
                       r"meshviz.launch: the workers were stopped at the roll-call: nothing could end that wait", err)
    assert waited and 0.5 <= float(waited.group(1)) < 600, err


RAISES = textwrap.dedent("""
    import time, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 waits in the all_reduce first
        raise ValueError("failing on purpose")
    dist.all_reduce(t)
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_that_raised_outside_a_collective_is_named_with_its_error_at_the_roll_call(tmp_path):
    # it used to read "rank 1 never entered all_reduce #1 on group [0, 1] (it did not answer the roll-call)"
    rc, out, err = _launch_hang(tmp_path, RAISES)
    assert rc == 1
    assert ("meshviz.launch: rank 1 never entered all_reduce #1 on group [0, 1]: it is dead (exit code 1: "
            "ValueError: failing on purpose)\nmeshviz.launch: rank 0 waited in all_reduce #1 on group [0, 1] for ")\
        in err, err[-3000:]
    # rank 0's all_reduce may fail on its own once rank 1's process is gone, before the agent stops it
    assert re.search(r"meshviz.launch: the worker with global rank 1 failed( first, then global rank 0)?; the others "
                     r"were stopped\.", err), err[-3000:]


OTHER_OP = textwrap.dedent("""
    import torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.all_gather([], t)
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_mismatch_is_stopped_at_the_roll_call(tmp_path):
    rc, out, err = _launch_hang(tmp_path, OTHER_OP)
    assert rc == 1
    assert ("meshviz.launch: mismatch at #1 on group [0, 1]: rank 0 entered all_reduce float32[4]; rank 1 entered "
            "all_gather float32[4]\nmeshviz.launch: the workers were stopped at the roll-call") in err, err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_one_node_listens_on_loopback_only(tmp_path):
    """The store on the port launch picked (held until served, never free in between) and gloo stay on loopback."""
    (tmp_path / "l.py").write_text(LISTENING)
    rc, out, err = _launch(["--nproc_per_node", "2", "--devices", "cpu", "--log_dir", str(tmp_path / "log"),
                            "--max_restart", "0", "l.py"], cwd=str(tmp_path))
    assert rc == 0, err
    for r in (0, 1):
        assert f"rank={r} sum=2.0 listening=['127.0.0.1']" in (tmp_path / "log" / f"workerlog.{r}").read_text()


STARTS_THEN_SLEEPS = textwrap.dedent("""
    import os, pathlib, time
    pathlib.Path(os.environ["STARTED"] + os.environ["RANK"]).touch()
    for _ in range(1200):
        time.sleep(0.05)
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_worker_and_says_so(tmp_path):
    import signal
    import time

    (tmp_path / "sleeps.py").write_text(STARTS_THEN_SLEEPS)
    started = str(tmp_path / "started")
    p = _launch(["--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"), "sleeps.py"], cwd=str(tmp_path),
                wait=False, STARTED=started)
    wait_for_files(started, 2, timeout=60)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == signal.SIGINT, err  # as Paddle's launch (2); was 1, with torch's SignalException traceback
    assert "meshviz.launch: SIGINT: the workers were stopped" in err and "Traceback" not in err.split("Received")[0]
    assert time.monotonic() - t < 10  # the workers were stopped, not waited for (they sleep 60 s)



@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("node", [0, 1])
def test_ctrl_c_while_the_other_node_is_awaited_ends_the_launcher_at_once(tmp_path, node):
    # one node of two started alone: node 0 serves the rendezvous, node 1 tries to reach it; torch's rendezvous
    # waits in C++, where the SIGINT was handled only at the rendezvous timeout (900 s by default, 60 s here)
    import signal
    import time

    (tmp_path / "sleeps.py").write_text(STARTS_THEN_SLEEPS)
    master = f"127.0.0.1:{free_port()}"
    p = _launch(["--nnodes", "2", "--master", master, "--rank", str(node), "--log_dir", str(tmp_path / "log"),
                 "sleeps.py"], cwd=str(tmp_path), wait=False, STARTED=str(tmp_path / "started"))
    for line in p.stdout:  # the banner's last line comes just before the agent starts
        if line.startswith("-----") and "Configuration" not in line:
            break
    time.sleep(2.0)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == signal.SIGINT, (p.returncode, err[-2000:])
    assert f"meshviz.launch: SIGINT: stopped while waiting at the rendezvous at {master} (no worker had started)" \
        in err, err[-2000:]
    assert time.monotonic() - t < 10

TORCHRUN_INTERRUPTED = textwrap.dedent("""
    import importlib, json, os, signal, sys, threading
    from meshviz.launch.agent import Torchrun
    m = importlib.import_module("meshviz.launch.main")
    config, env, reservation, _ = m._build(m.parse_args(["--nproc_per_node", "2", "--log_dir", sys.argv[1], "x"]))
    store = m._agent_store(config, reservation)
    os.environ.update(env)
    before = signal.getsignal(signal.SIGINT)
    runner = Torchrun(config).start()
    started = sys.argv[2]

    def interrupt_once_started():
        import glob, time
        while len(glob.glob(started + "*")) < 2:
            time.sleep(0.05)
        runner.interrupt()

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    job = runner.submit(["-c", open(sys.argv[3]).read()])
    err = job.error()
    print(json.dumps({"done": job.done(), "pending": job.pending(),
                      "outcomes": [[o.rank, o.status, o.error] for o in job.outcomes()],
                      "ranks": err.ranks, "error": str(err),
                      "handler_back": signal.getsignal(signal.SIGINT) is before}))
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torchrun_runner_interrupt_ends_the_job_and_names_every_worker(tmp_path):
    import json

    (tmp_path / "run.py").write_text(TORCHRUN_INTERRUPTED)
    (tmp_path / "sleeps.py").write_text(STARTS_THEN_SLEEPS)
    started = str(tmp_path / "started")
    p = subprocess.run([sys.executable, "run.py", str(tmp_path / "log"), started, "sleeps.py"], cwd=str(tmp_path),
                       env={**os.environ, "STARTED": started}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    why = "interrupted: the agent got SIGINT and stopped every worker"
    # before: submit raised torch's SignalException, the job said both workers were "ok", error() was None
    assert got["done"] and got["pending"] == [] and got["ranks"] == [0, 1]
    assert got["outcomes"] == [[0, "stopped", why], [1, "stopped", why]]
    assert got["error"].startswith(f"rank 0 was stopped ({why}); rank 1 was stopped")
    assert got["handler_back"]  # torch's agent left its SIGINT handler installed in this process


def test_workers_are_named_in_the_order_they_failed(tmp_path):
    """Each worker writes what its script raised into the error file torch's agent gives it, and the job names the
    failures by when those were written: rank 1 raised first, rank 0 (which lost its connection to it) after. Before,
    both were named in rank order, rank 0 first, whenever rank 0 failed before the agent stopped it. A report says
    when to the microsecond (two reports within a file time's coarse few ms were named in rank order). A worker
    that crashed without a report counts from its log's last write (it was named first even when it crashed
    after)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from meshviz.launch.agent import TorchrunJob

    (tmp_path / "fails.py").write_text("raise RuntimeError('rank ' + __import__('sys').argv[1] + ' fails')\n")
    files = {}
    for rank in (1, 0, 2):  # written in this order: rank 1's report is the oldest
        files[rank] = str(tmp_path / f"error-{rank}.json")
        p = subprocess.run([sys.executable, "-m", "meshviz.launch._worker", "fails.py", str(rank)],
                           cwd=str(tmp_path), env={**os.environ, "TORCHELASTIC_ERROR_FILE": files[rank]},
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and f"RuntimeError: rank {rank} fails" in p.stderr
        os.utime(files[rank], (1000.0, 1000.0))  # one file time for all (it may be a few ms coarse): a tie
    read = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=files[1])  # torch's agent reads the report
    assert read.message["message"] == "RuntimeError: rank 1 fails" and "fails.py" in read.message["extraInfo"][
        "py_callstack"] and read.timestamp > 0

    job = TorchrunJob([0, 1, 2, 3])
    job.failures = {r: SimpleNamespace(exitcode=1, error_file=files[r]) for r in (0, 1, 2)}
    assert job.failed() == [1, 0, 2]
    job.failures[3] = SimpleNamespace(exitcode=-11, error_file="<N/A>")  # crashed: no report nor log, so first
    assert job.failed() == [3, 1, 0, 2]
    # a crash whose log was last written after another's report (an abort once its peer had gone) comes after it
    when = {r: float(json.loads(open(files[r]).read())["message"]["extraInfo"]["meshviz_time"]) for r in files}
    job.log_dir = str(tmp_path)
    job.failures[3] = SimpleNamespace(exitcode=-6, error_file="<N/A>", local_rank=3)
    (tmp_path / "workerlog.3").write_text("terminate called after throwing an instance of 'gloo::IoException'\n")
    os.utime(tmp_path / "workerlog.3", ((when[1] + when[0]) / 2,) * 2)
    assert job.failed() == [1, 3, 0, 2]
    os.utime(tmp_path / "workerlog.3", (when[1] - 1,) * 2)  # a silent crash: its last words came before every report
    assert job.failed() == [3, 1, 0, 2]
    job.failures = {0: SimpleNamespace(exitcode=-15, error_file="<N/A>"), 1: job.failures[1]}
    assert job.failed() == [1]  # rank 0 was stopped by the agent
    job._done.set()
    assert job.error().ranks[0] == 1


def test_fleetrun_entry_point_is_declared():
    from meshviz.launch.main import main

    assert callable(main)
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        assert 'fleetrun = "meshviz.launch.main:main"' in fh.read()
