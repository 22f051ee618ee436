"""Paddle's group API (new_group, get_group, get_backend, ...) and its rule: init_parallel_env comes first."""

from __future__ import annotations

import datetime
import functools
import operator
import sys

import torch.distributed as tdist

from ..runtime import groups, rollcall
from ..runtime.groups import Group
from ..runtime.world import is_initialized

__all__ = ["needs_init", "new_group", "get_group", "get_backend", "is_available", "destroy_process_group"]


def needs_init(fn):
    """``fn`` raises RuntimeError, before it communicates, when no default process group exists yet (Paddle's
    collectives and ``new_group`` raise then too: they need ``init_parallel_env`` first). What it refuses is kept
    in the roll-call (:func:`~meshviz.runtime.rollcall.refusing`)."""

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            if not tdist.is_initialized():
                raise RuntimeError(f"{fn.__name__}: the default process group is not initialized; call "
                                   "dist.init_parallel_env() first (or fleet.init(is_collective=True))")
            return fn(*args, **kwargs)
        except Exception as e:
            rollcall.refused(fn.__name__, e, sys._getframe(1))
            raise

    return checked


def _int_ranks(given) -> list[int]:
    try:
        ranks = list(given)
        if isinstance(given, (str, bytes)) or any(isinstance(r, bool) for r in ranks):
            raise TypeError
        return [operator.index(r) for r in ranks]  # ints, numpy ints; not floats or strings
    except TypeError:
        raise ValueError(f"new_group: ranks must be a list of int global ranks, got {given!r}") from None


@needs_init
def new_group(ranks=None, backend=None, timeout=None, nccl_comm_init_option=0, nccl_config=None) -> Group:
    """A group over ``ranks`` (sorted, like Paddle); every rank of the world must call it, in the same order.
    ``nccl_comm_init_option`` and ``nccl_config`` (Paddle's NCCL tuning) are accepted and left to torch's defaults."""
    world = tdist.get_world_size()
    ranks = list(range(world)) if ranks is None else _int_ranks(ranks)
    if not ranks:
        raise ValueError("new_group: ranks must not be empty")
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise ValueError(f"new_group: duplicate ranks {dup} in {ranks}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are outside the world 0..{world - 1}")
    if backend not in (None, "gloo", "nccl", "bkcl", "xccl"):
        raise ValueError(f"new_group: unknown backend {backend!r}")
    ranks = sorted(ranks)
    if tdist.get_backend() not in ("gloo", "nccl"):  # ranks as threads or simulated make groups of their own kind
        backend = None
    if backend is None and timeout is None:
        pg = groups.group_for_ranks(ranks)
    else:
        be = backend if backend in ("gloo", "nccl") else None
        to = None if timeout is None else (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout))
        pg = tdist.new_group(ranks, timeout=to, backend=be)
        if pg is tdist.GroupMember.NON_GROUP_MEMBER:
            pg = None
    return groups.register(ranks, pg)


def get_group(id: int = 0) -> Group | None:
    """The group ``new_group`` made with this id (10, 11, ... as Paddle's); 0: the global group (None before
    ``init_parallel_env`` and in a 1-process world, as Paddle's)."""
    if id == 0 and not is_initialized():
        return None
    return groups.lookup(id)


@needs_init
def get_backend(group=None) -> str:
    """The group's backend ("GLOO", "NCCL"); RuntimeError, as Paddle's, on a rank not in ``group``, and for the
    global group in a 1-process world (which has none)."""
    if group is None and not is_initialized():
        raise RuntimeError("get_backend: the global group is not initialized (a 1-process world has none, as in "
                           "Paddle); pass a group")
    g = groups.resolve(group)
    if not g.is_member():
        raise RuntimeError(f"get_backend: Invalid group specified (rank {tdist.get_rank()} is not in {g})")
    return tdist.get_backend(g.process_group).upper()


def is_available() -> bool:
    """Whether torch was built with distributed support (Paddle: compiled with it)."""
    return tdist.is_available()


def destroy_process_group(group=None) -> None:
    """Destroy ``group``; with None (or the world group) every group and the default process group, after which
    ``is_initialized()`` is False. Destroying a group twice raises ValueError."""
    if group is not None and not isinstance(group, Group):
        raise TypeError(f"destroy_process_group: group must be a Group from new_group or None, got "
                        f"{type(group).__name__}")
    if group is None or group.id == 0:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        groups.reset()
        return
    groups.release(group)
