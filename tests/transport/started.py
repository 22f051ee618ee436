"""Waiting for ranks that say they started by touching ``prefix + str(rank)``; checking that none is left running."""

import os
import time

__all__ = ["wait_for_files", "alive", "none_left"]


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
