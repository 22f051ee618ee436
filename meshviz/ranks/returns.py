"""What each spawned rank's function returned, read as Paddle's ``context.return_queues[rank].get()``."""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import time

__all__ = ["ReturnQueue", "Returns", "put_return"]


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.ret")


def put_return(folder: str, rank: int, value) -> None:
    """In the rank: leave ``value`` for the parent (a value that cannot be pickled fails the rank, as in Paddle)."""
    try:
        blob = pickle.dumps(value)
    except Exception as e:
        raise TypeError(f"spawn: rank {rank}'s function returned {type(value).__name__}, which cannot be sent back "
                        f"to the parent ({e})") from None
    path = _path(folder, rank)
    with open(path + ".tmp", "wb") as fh:
        fh.write(blob)
    os.replace(path + ".tmp", path)


class ReturnQueue:
    """Rank ``rank``'s return value: ``get()`` waits for it (Paddle's queue of one item). Where the rank ended without
    returning, or its value was taken already, ``get()`` raises :class:`queue.Empty` saying so instead of waiting
    for ever."""

    def __init__(self, folder: str, rank: int, process):
        self.rank = rank
        self._path = _path(folder, rank)
        self._process = process
        self._items: list = []
        self._taken = False

    def keep(self) -> None:
        """Read the value into memory (before the folder is removed)."""
        if not self._items and not self._taken and os.path.exists(self._path):
            with open(self._path, "rb") as fh:
                self._items.append(pickle.load(fh))

    def empty(self) -> bool:
        self.keep()
        return not self._items

    def get(self, block: bool = True, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.keep()
            if self._items:
                self._taken = True
                return self._items.pop()
            if self._taken:
                raise queue.Empty(f"spawn: rank {self.rank}'s return value was taken already")
            if self._process.exitcode is not None:
                self.keep()  # written just before it exited
                if self._items:
                    continue
                raise queue.Empty(f"spawn: rank {self.rank} ended without returning (it raised or died: "
                                  f"join() names why)")
            if not block or (deadline is not None and time.monotonic() >= deadline):
                raise queue.Empty(f"spawn: rank {self.rank} has not returned yet")
            time.sleep(0.02)

    def __repr__(self) -> str:
        return f"ReturnQueue(rank={self.rank})"


class Returns:
    """The folder spawned ranks leave their values in, and one :class:`ReturnQueue` per rank."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="meshviz-returns-")
        self.queues: list[ReturnQueue] = []

    def watch(self, processes) -> list[ReturnQueue]:
        self.queues = [ReturnQueue(self.folder, r, p) for r, p in enumerate(processes)]
        return self.queues

    def returned(self) -> set[int]:
        """The ranks that left a value (their function returned)."""
        return {q.rank for q in self.queues if q._items or q._taken or os.path.exists(q._path)}

    def close(self) -> None:
        """Read what the ranks left, then remove the folder."""
        for q in self.queues:
            q.keep()
        shutil.rmtree(self.folder, ignore_errors=True)
