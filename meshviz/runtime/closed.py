"""The peers this rank process closed its connections to after a pipeline stage failed, and the closing itself."""

from __future__ import annotations

import os
import socket

__all__ = ["close", "closed", "check", "shut_sockets"]

_CLOSED: dict[int, str] = {}  # peer's global rank -> why this rank's connections to it are closed
_world: list = [None]  # id() of the default process group they were closed in: a new world has them again


def _world_id():
    import torch.distributed as tdist

    return id(tdist.group.WORLD) if tdist.is_initialized() else None


def close(peers, why: str) -> None:
    """From now on a collective of this rank with any of ``peers`` raises naming ``why`` (:func:`check`), until a
    new world starts."""
    closed()
    _world[0] = _world_id()
    for r in peers:
        _CLOSED.setdefault(int(r), why)


def closed() -> dict[int, str]:
    """peer rank -> why this rank's connections to it are closed, in this world."""
    if _CLOSED and _world[0] != _world_id():
        _CLOSED.clear()
    return dict(_CLOSED)


def check(op: str, ranks, me: int) -> None:
    """RuntimeError when this rank closed its connections to a rank of ``ranks`` (before any communication)."""
    if not _CLOSED or me not in ranks or not closed():
        return
    gone = [r for r in ranks if r in _CLOSED]
    if gone:
        raise RuntimeError(f"{op} on group {list(ranks)}: rank {me}'s connections to rank"
                           f"{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} were closed after "
                           f"{_CLOSED[gone[0]]}; no collective with {'them' if len(gone) > 1 else 'it'} can run in "
                           f"this world (start the ranks again)")


def shut_sockets(pids, keep_ports=()) -> int:
    """Shut down this process's TCP connections to the processes ``pids`` (on this machine), but those with an end
    on one of ``keep_ports`` (the store's): gloo sends and receives pending on them, at either end, fail at once.
    Aborting or destroying a gloo group closes nothing while anything (a dist tensor, a traceback, the pipeline's
    stages) still holds it. Returns how many were shut down."""
    if not pids:
        return 0
    try:
        import psutil

        mine = [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.fd not in (-1, None)]
    except Exception:
        return 0
    theirs = set()
    for pid in pids:
        try:
            theirs.update((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp") if c.laddr)
        except Exception:
            continue
    keep = set(keep_ports)
    n = 0
    for c in mine:
        if (c.raddr.ip, c.raddr.port) not in theirs or c.raddr.port in keep or c.laddr.port in keep:
            continue
        try:
            s = socket.socket(fileno=os.dup(c.fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            finally:
                s.close()
        except OSError:
            pass
    return n
