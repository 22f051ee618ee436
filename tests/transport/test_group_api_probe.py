"""The process-group surface and the launcher against Paddle 3.3.1 run for real: the 1-process world, group ids,
get_backend on a rank outside the group, the launcher's exit code on a signal and ``--rank`` on one node."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .started import wait_for_files


def _one_process_world():
    import torch

    import meshviz.distributed as dist

    g = dist.init_parallel_env()
    out = {"ret": g, "initialized": dist.is_initialized(), "group0": dist.get_group(0),
           "rank_world": (dist.get_rank(), dist.get_world_size())}
    try:
        dist.get_backend()
        out["backend"] = "ran"
    except RuntimeError as e:
        out["backend"] = str(e)
    g10 = dist.new_group([0])
    out["new_group"] = (g10.id, g10.ranks, dist.get_group(10) is g10)
    t = torch.ones(2)
    dist.all_reduce(t)  # meshviz's collectives still run there (Paddle's raise "The global group is not initialized")
    parts: list = []
    dist.all_gather(parts, torch.arange(2.0))
    out["collectives"] = (t.tolist(), [p.tolist() for p in parts])
    pe = dist.ParallelEnv()
    out["env"] = (pe.rank, pe.world_size, pe.local_rank, pe.nranks, pe.device_type, pe.nrings)
    return out


@pytest.mark.timeout(120)
def test_a_one_process_world_has_no_global_group():
    """Paddle 3.3.1, ``python s.py`` (and launch with one process) after ``init_parallel_env()``: is_initialized()
    False, get_group(0) None, get_rank() 0, get_world_size() 1, get_backend() RuntimeError "The global group is not
    initialized.", new_group([0]).id 10. meshviz said True, the global Group, "GLOO" and id 1."""
    from meshviz.testing import run_ranks

    [out] = run_ranks(_one_process_world, 1, ranks="threads")
    assert out == {
        "ret": None, "initialized": False, "group0": None, "rank_world": (0, 1),
        "backend": "get_backend: the global group is not initialized (a 1-process world has none, as in Paddle); "
                   "pass a group",
        "new_group": (10, [0], True), "collectives": ([1.0, 1.0], [[0.0, 1.0]]), "env": (0, 1, 0, 1, "", 1)}


def _group_ids_and_backend():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    g = dist.new_group([1, 0])
    g2 = dist.new_group([2])
    out = {"ids": (g.id, g.ranks, g.name, g2.id, g2.name, dist.get_group(10) is g, dist.get_group(11) is g2,
                   dist.get_group(99)),
           "initialized": dist.is_initialized(), "world": dist.get_group(0).ranks,
           "outside": (dist.get_rank(g), dist.get_world_size(g)) if r == 2 else None}
    try:
        out["backend"] = dist.get_backend(g) == dist.get_backend()
    except RuntimeError as e:
        out["backend"] = str(e)
    dist.destroy_process_group(g)
    out["after_destroy"] = (dist.get_group(10), dist.new_group([0, 1]).id)
    return out


@pytest.mark.timeout(120)
def test_group_ids_start_at_10_and_get_backend_refuses_a_rank_outside_the_group():
    """Paddle 3.3.1 with 2 and 3 processes: new_group's ids are 10, 11, ... (named _default_pg10, ...), not reused
    after destroy_process_group; get_backend(group) on a rank not in it raises RuntimeError "Invalid group
    specified". meshviz's ids were 1, 2, ... and its get_backend answered the backend."""
    from meshviz.testing import run_ranks

    res = run_ranks(_group_ids_and_backend, 3, ranks="threads")
    for r, out in enumerate(res):
        assert out["ids"] == (10, [0, 1], "_default_pg10", 11, "_default_pg11", True, True, None)
        assert out["initialized"] is True and out["world"] == [0, 1, 2]
        assert out["after_destroy"] == (None, 12)
        if r < 2:
            assert out["backend"] is True and out["outside"] is None
        else:
            assert out["outside"] == (-1, -1)
            assert out["backend"] == ("get_backend: Invalid group specified (rank 2 is not in "
                                      "Group(id=10, ranks=[0, 1], rank=-1))")


def test_rank_is_ignored_on_one_node():
    """Paddle 3.3.1's launch on one node ignores --rank and PADDLE_RANK (``--rank 3`` ran ranks 0 and 1, exit 0);
    meshviz refused them ("--rank 3 outside 0..0")."""
    from meshviz.launch.main import _flags, parse_args

    for argv, env in [(["--rank", "1"], {}), (["--rank", "3"], {}), (["--rank", "-5"], {}),
                      ([], {"PADDLE_RANK": "3"}), ([], {"PADDLE_TRAINER_ID": "2"})]:
        assert _flags(parse_args(["--nproc_per_node", "2", *argv, "s.py"], env)) == (1, 0, None)
    # more than one node: the node rank still has to be one of them
    with pytest.raises(ValueError, match=r"--rank 2 outside 0\.\.1"):
        _flags(parse_args(["--nnodes", "2", "--master", "10.0.0.1:6070", "--rank", "2", "s.py"], {}))


SLEEPER = textwrap.dedent("""
    import os, pathlib, time
    d = os.environ["STARTED"]
    pathlib.Path(f"{d}/pid{os.environ['PADDLE_TRAINER_ID']}").write_text(str(os.getpid()))
    pathlib.Path(f"{d}/started{os.environ['PADDLE_TRAINER_ID']}").touch()
    time.sleep(120)
""")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_exits_with_its_number_and_stops_the_workers(sig, tmp_path):
    """Paddle 3.3.1's launch (--nproc_per_node 2) sent SIGINT exits 2, sent SIGTERM exits 15 ("Exit with signal
    15"), its workers stopped; meshviz's exited 130 and 143."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "STARTED": str(tmp_path), "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30"}
    p = subprocess.Popen([sys.executable, "-m", "meshviz.launch", "--nproc_per_node", "2", "--devices", "cpu",
                          "--log_dir", str(tmp_path / "log"), "sleeper.py"], cwd=str(tmp_path),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files(str(tmp_path / "started"), 2, timeout=90)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        p.send_signal(sig)
        out, err = p.communicate(timeout=40)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == int(sig), err[-2000:]
    assert f"meshviz.launch: {sig.name}: the workers were stopped" in err
    assert all(_gone(pid) for pid in pids)
