"""Per-rank state: one context (with its typed :class:`RankState`) per rank thread, one for the process otherwise."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["RankContext", "RankState", "Slot", "current", "process", "bound", "slot", "state", "getenv",
           "in_rank_thread"]

T = TypeVar("T")


class Slot(Generic[T]):
    """One concern's per-rank state: :meth:`get` is the calling rank's ``factory()``, made on first use."""

    __slots__ = ("name", "factory")

    def __init__(self, name: str, factory: Callable[[], T]):
        self.name = name
        self.factory = factory

    def get(self, ctx: RankContext | None = None) -> T:
        """The value of the calling rank (or of ``ctx``)."""
        if ctx is None:
            ctx = _tls.ctx or _PROCESS
        return ctx.state.get(self)

    def reset(self) -> T:
        """Give the calling rank a fresh value; returns it."""
        return (_tls.ctx or _PROCESS).state.reset(self)

    def __repr__(self) -> str:
        return f"Slot({self.name!r}, {getattr(self.factory, '__qualname__', self.factory)})"


_slots: dict[str, Slot] = {}  # name -> Slot, every concern's, in registration order


def slot(name: str, factory: Callable[[], T]) -> Slot[T]:
    """Register the per-rank state of one concern (once, at the owner's import): ``GROUPS = slot("groups",
    GroupsState)``; the owner reads it with ``GROUPS.get()``."""
    old = _slots.get(name)
    if old is not None and _owner(old.factory) != _owner(factory):  # its owner again (a reload) is fine
        raise ValueError(f"rank state slot {name!r} is already registered by {_slots[name]!r}")
    s = _slots[name] = Slot(name, factory)
    return s


def _owner(factory: Callable) -> tuple:
    return getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)


class RankState:
    """One rank's state, one value per registered :class:`Slot` (``slots()`` names them all)."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    @staticmethod
    def slots() -> dict[str, Slot]:
        """Every registered slot by name (what a rank may hold)."""
        return dict(_slots)

    def get(self, s: Slot[T]) -> T:
        try:
            return self._values[s.name]
        except KeyError:
            v = self._values[s.name] = s.factory()
            return v

    def reset(self, s: Slot[T]) -> T:
        v = self._values[s.name] = s.factory()
        return v

    def __getattr__(self, name: str) -> Any:
        """``state().groups``: this rank's value of the slot ``name``."""
        s = _slots.get(name)
        if s is None:
            raise AttributeError(f"no rank state slot {name!r} (registered: {', '.join(_slots)})")
        return self.get(s)

    def __repr__(self) -> str:
        made = [n for n in _slots if n in self._values]
        rest = [n for n in _slots if n not in self._values]
        return f"RankState({', '.join(made)}" + (f"; not made yet: {', '.join(rest)})" if rest else ")")


class RankContext:
    """What one rank keeps apart from the others: ``state`` (its :class:`RankState`), ``env`` (variables
    that read as this rank's, before ``os.environ``) and ``init`` (how this rank joins its process group, when
    the usual rendezvous does not apply)."""

    __slots__ = ("rank", "env", "state", "init", "__weakref__")

    def __init__(self, rank: int | None = None, env: dict | None = None, init: Callable | None = None):
        self.rank = rank
        self.env = dict(env or {})
        self.state = RankState()
        self.init = init

    def __repr__(self) -> str:
        return f"RankContext(rank={self.rank})" if self.rank is not None else "RankContext(process)"


class _Local(threading.local):
    ctx: RankContext | None = None  # a class default: reading it outside rank threads raises nothing (0.6 us)


_PROCESS = RankContext()
_tls = _Local()


def current() -> RankContext:
    """The calling thread's rank context (the process's, outside rank threads)."""
    return _tls.ctx or _PROCESS


def process() -> RankContext:
    """The process's own context (what threads outside rank threads see)."""
    return _PROCESS


def in_rank_thread() -> bool:
    return _tls.ctx is not None


@contextlib.contextmanager
def bound(ctx: RankContext):
    """Run the block with ``ctx`` as the calling thread's rank context."""
    prev = _tls.ctx
    _tls.ctx = ctx
    try:
        yield ctx
    finally:
        _tls.ctx = prev


def getenv(name: str, default: str | None = None) -> str | None:
    """An environment variable as this rank sees it: its context's value, else ``os.environ``'s."""
    env = current().env
    if name in env:
        return env[name]
    return os.environ.get(name, default)


def state() -> RankState:
    """The calling rank's state."""
    return (_tls.ctx or _PROCESS).state
