"""A rank's TCP connections to its peers: shut down so that a gloo collective blocked on them fails at once."""

from __future__ import annotations

from ..runtime.closed import shut_sockets

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
    """Shut down this process's TCP connections to the other ranks' processes (on this machine): every pending gloo
    collective on both ends fails at once (:func:`meshviz.runtime.closed.shut_sockets`). Returns how many."""
    return shut_sockets(peer_pids)
