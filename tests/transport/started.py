"""Waiting for ranks that say they started by touching ``prefix + str(rank)``."""

import os
import time

__all__ = ["wait_for_files"]


def wait_for_files(prefix: str, n: int, timeout: float = 30) -> None:
    """Wait until ranks 0..n-1 have each touched ``prefix + str(rank)``; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while sum(os.path.exists(f"{prefix}{r}") for r in range(n)) < n:
        assert time.monotonic() < deadline, f"the ranks did not start within {timeout} s"
        time.sleep(0.01)
