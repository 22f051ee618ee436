"""Per-rank state: one context per rank thread when the ranks are threads, one for the whole process otherwise."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RankContext", "PerRank", "current", "bound", "per_rank", "getenv", "in_rank_thread"]


class RankContext:
    """What one rank keeps apart from the others: ``values`` (the :class:`PerRank` globals), ``env`` (variables
    that read as this rank's, before ``os.environ``) and ``init`` (how this rank joins its process group, when
    the usual rendezvous does not apply)."""

    __slots__ = ("rank", "env", "values", "init", "__weakref__")

    def __init__(self, rank: int | None = None, env: dict | None = None, init: Callable | None = None):
        self.rank = rank
        self.env = dict(env or {})
        self.values: dict = {}
        self.init = init

    def __repr__(self) -> str:
        return f"RankContext(rank={self.rank})" if self.rank is not None else "RankContext(process)"


_PROCESS = RankContext()
_tls = threading.local()


def current() -> RankContext:
    """The calling thread's rank context (the process's, outside rank threads)."""
    return getattr(_tls, "ctx", _PROCESS)


def in_rank_thread() -> bool:
    return getattr(_tls, "ctx", None) is not None


@contextlib.contextmanager
def bound(ctx: RankContext):
    """Run the block with ``ctx`` as the calling thread's rank context."""
    prev = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    try:
        yield ctx
    finally:
        if prev is None:
            del _tls.ctx
        else:
            _tls.ctx = prev


def getenv(name: str, default: str | None = None) -> str | None:
    """An environment variable as this rank sees it: its context's value, else ``os.environ``'s."""
    env = current().env
    if name in env:
        return env[name]
    return os.environ.get(name, default)


_keys = itertools.count()


class PerRank:
    """A module global with one value per rank context, made by ``factory()`` on first use.

    Reads and writes through it (attributes, items, ``len``, ``iter``, ``next``, ``bool``) reach the calling
    rank's value; ``here()`` is that value itself and ``replace(v)`` swaps it.
    """

    __slots__ = ("_factory", "_key")

    def __init__(self, factory: Callable[[], Any]):
        object.__setattr__(self, "_factory", factory)
        object.__setattr__(self, "_key", next(_keys))

    def here(self):
        values = getattr(_tls, "ctx", _PROCESS).values
        try:
            return values[self._key]
        except KeyError:
            v = values[self._key] = self._factory()
            return v

    def replace(self, value) -> None:
        getattr(_tls, "ctx", _PROCESS).values[self._key] = value

    def __getattr__(self, name):
        return getattr(self.here(), name)

    def __setattr__(self, name, value):
        setattr(self.here(), name, value)

    def __getitem__(self, key):
        return self.here()[key]

    def __setitem__(self, key, value):
        self.here()[key] = value

    def __delitem__(self, key):
        del self.here()[key]

    def __contains__(self, key) -> bool:
        return key in self.here()

    def __iter__(self):
        return iter(self.here())

    def __len__(self) -> int:
        return len(self.here())

    def __bool__(self) -> bool:
        return bool(self.here())

    def __next__(self):
        return next(self.here())

    def __eq__(self, other) -> bool:
        return self.here() == (other.here() if isinstance(other, PerRank) else other)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"PerRank({self.here()!r})"


def per_rank(factory: Callable[[], Any]) -> PerRank:
    """A per-rank global: ``_registry = per_rank(dict)`` instead of ``_registry = {}``."""
    return PerRank(factory)
