"""Waiting for ranks that say they started by touching ``prefix + str(rank)``; checking that none is left running;
launching a script with ``meshviz.launch``."""

import os
import subprocess
import sys
import textwrap
import time

__all__ = ["wait_for_files", "alive", "none_left", "start_launch", "finish", "launch", "pids_written"]


def wait_for_files(prefix: str, n: int, timeout: float = 30) -> None:
    """Wait until ranks 0..n-1 have each touched ``prefix + str(rank)``; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while sum(os.path.exists(f"{prefix}{r}") for r in range(n)) < n:
        assert time.monotonic() < deadline, f"the ranks did not start within {timeout} s"
        time.sleep(0.01)


def alive(pids) -> list[int]:
    """The processes of ``pids`` still running (a zombie is not)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def none_left(pids, within: float = 5.0) -> None:
    """Fail the test if any of ``pids`` still runs ``within`` seconds from now (those are killed first)."""
    deadline = time.monotonic() + within
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(pids)
    for pid in left:  # not for the next test to find
        os.kill(pid, 9)
    assert not left, f"left running: {left} of {pids}"


def start_launch(tmp_path, script: str, nproc: int, *flags, rdzv_timeout: int = 60, timeout: int = 30,
                 **env) -> subprocess.Popen:
    """``python -m meshviz.launch`` of ``script`` (dedented into ``tmp_path/script.py``) on ``nproc`` CPU workers with
    ``flags``; the workers see ``STARTED`` (``tmp_path``), the rendezvous and collective timeouts, and ``env``."""
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": str(rdzv_timeout), "MESHVIZ_TIMEOUT": str(timeout),
           "STARTED": str(tmp_path), **env}
    return subprocess.Popen([sys.executable, "-m", "meshviz.launch", "--nproc_per_node", str(nproc), "--devices",
                             "cpu", "--log_dir", str(tmp_path / "log"), *flags, "script.py"], cwd=str(tmp_path),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The launcher's (stdout, stderr) once it ended; killed if it still runs after ``timeout`` seconds."""
    try:
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def launch(tmp_path, script: str, nproc: int, *flags, wait: float = 75, **kw) -> tuple[int, str, str]:
    """:func:`start_launch`, then :func:`finish` within ``wait`` seconds: (exit code, stdout, stderr)."""
    p = start_launch(tmp_path, script, nproc, *flags, **kw)
    out, err = finish(p, wait)
    return p.returncode, out, err


def pids_written(tmp_path, ranks=None) -> list[int]:
    """The pids the workers wrote to ``tmp_path/pid<rank>`` (every ``pid*`` file where ``ranks`` is None)."""
    files = tmp_path.glob("pid*") if ranks is None else (tmp_path / f"pid{r}" for r in ranks)
    return [int(x) for f in files for x in f.read_text().split()]
