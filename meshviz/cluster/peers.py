"""A rank's TCP connections to its peers: shut down so that a gloo collective blocked on them fails at once."""

from __future__ import annotations

import os
import socket

__all__ = ["broke_process_group", "close_peer_sockets"]


def broke_process_group(value: BaseException) -> bool:
    """Did this error come out of a collective (peer gone, timeout)? Then this rank's process group is unusable."""
    try:
        import torch.distributed as tdist

        if isinstance(value, getattr(tdist, "DistError", ())):
            return True
    except Exception:
        return False
    try:
        text = str(value)
    except Exception:  # a user's exception whose __str__ raises
        return False
    return any(k in text for k in ("gloo/transport", "Connection closed by peer", "Connection reset", "NCCL"))


def close_peer_sockets(peer_pids) -> int:
    """Shut down this process's TCP connections to the other ranks' processes (on this machine).

    Aborting a gloo group does not close its sockets while anything (a user's dist tensor, a traceback) still
    holds the group, and a rank blocked in a gloo collective waits for its peers' sockets; shutting them down
    makes every pending collective on both ends fail at once. Returns how many were shut down.
    """
    if not peer_pids:
        return 0
    try:
        import psutil

        mine = [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.fd not in (-1, None)]
    except Exception:
        return 0
    theirs = set()  # the peers' own addresses, asked of each peer (not of every process: fast on a busy machine)
    for pid in peer_pids:
        try:
            theirs.update((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp") if c.laddr)
        except Exception:
            continue
    n = 0
    for c in mine:
        if (c.raddr.ip, c.raddr.port) in theirs:
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
