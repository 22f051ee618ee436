"""Control messages between a Cluster and its ranks: frozen records, made dicts (and back) only on the wire."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Message", "Failure", "Stuck", "StatusReply", "PeerFailed", "Abort", "StatusRequest", "FROM_RANKS",
           "TO_RANKS", "decode"]


@dataclass(frozen=True)
class Message:
    """Base of every control message; ``TYPE`` is its ``"type"`` on the wire, ``OPTIONAL`` the fields left out of
    the wire dict while None."""

    TYPE: ClassVar[str] = ""
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None or f.name not in self.OPTIONAL:
                d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Message":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# -- from a rank to the cluster -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Failure(Message):
    """A rank raised: the error and its traceback, the collective it came out of (its roll-call record's
    ``failed``), a collective mismatch (``line``, ``ranks``), whether the rank tore its process group down
    (``aborted``), and when the cluster got it (``received``)."""

    TYPE: ClassVar[str] = "failed"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset(
        {"cell", "time", "error", "traceback", "aborted", "collective", "mismatch", "received"})
    rank: int | None = None
    cell: int | None = None
    time: float | None = None
    error: str | None = None
    traceback: str | None = None
    aborted: bool | None = None
    collective: dict | None = None
    mismatch: dict | None = None
    received: float | None = None


@dataclass(frozen=True)
class Stuck(Message):
    """A rank still running cell ``cell`` a moment after rank ``failed`` failed."""

    TYPE: ClassVar[str] = "stuck"
    rank: int | None = None
    cell: int | None = None
    failed: int | None = None


@dataclass(frozen=True)
class StatusReply(Message):
    """A rank's answer to roll-call ``id``: its ``RankStatus.to_dict()``."""

    TYPE: ClassVar[str] = "status"
    id: int | None = None
    rank: int | None = None
    status: dict | None = None


# -- from the cluster to every rank -------------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerFailed(Message):
    """Rank ``rank`` failed (a rank still running soon after reports itself stuck)."""

    TYPE: ClassVar[str] = "failed"
    rank: int | None = None


@dataclass(frozen=True)
class Abort(Message):
    """Tear the process group down now (``origin``: the failed rank, or None)."""

    TYPE: ClassVar[str] = "abort"
    origin: Any = None


@dataclass(frozen=True)
class StatusRequest(Message):
    """Roll-call ``id``: every rank answers with its record (``stacks``: with its Python stack)."""

    TYPE: ClassVar[str] = "status"
    id: int | None = None
    stacks: bool = False


FROM_RANKS: dict[str, type[Message]] = {c.TYPE: c for c in (Failure, Stuck, StatusReply)}
TO_RANKS: dict[str, type[Message]] = {c.TYPE: c for c in (PeerFailed, Abort, StatusRequest)}


def decode(table: dict[str, type[Message]], d: Any) -> Message | None:
    """The message a wire dict is, read with ``table`` (:data:`FROM_RANKS` or :data:`TO_RANKS`); None for anything
    else (an unknown type is ignored, as before the messages were typed)."""
    if not isinstance(d, dict):
        return None
    t = d.get("type")
    cls = table.get(t) if isinstance(t, str) else None
    return None if cls is None else cls.from_dict(d)
