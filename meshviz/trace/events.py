"""Event records: plain, JSON-serialisable dataclasses that the runtime emits and the widgets draw."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .payloads import PAYLOAD_OF, Payload, payload_from_dict
from .state import trace_state

__all__ = ["Event", "EventTemplate", "KINDS", "MAX_VALUES", "small_values", "to_json", "from_json", "now"]

P = TypeVar("P", bound=Payload)

# kind of event -> what it describes
KINDS = {
    "placed": "a tensor got a layout (shard_tensor, dtensor_from_local, a parameter sharded)",
    "reshard": "a whole reshard: before/after layout and the plan id its steps share",
    "reshard_step": "one step of a reshard plan, as it ran on this rank",
    "collective": "a collective call (all_reduce, all_gather, ..., also ones DTensor issues inside an op)",
    "send": "a point-to-point send",
    "recv": "a point-to-point receive",
    "compute": "a block of compute (pipeline forward/backward of a micro-batch, a training step)",
    "ownership": "which rank owns which parameter/gradient/optimizer-state shard",
    "mark": "a free-form marker (cell start, step boundary)",
    "op": "an op whose placements meshviz decided itself (Paddle's default rule, a corrected or a Paddle rule)",
}

MAX_VALUES = 64  # tensor elements an event may carry

now = time.time


@dataclass
class Event:
    """One event. Its kind is its payload's (``Event(payload=Placed(...))`` is a ``placed`` event); ``kind`` alone
    makes the kind's payload with its defaults; a ``kind`` that is not the payload's raises ValueError."""

    kind: str = ""
    rank: int = -1
    seq: int = field(default_factory=lambda: next(trace_state().seq))
    start: float = field(default_factory=time.time)
    end: float | None = None
    name: str | None = None  # user-visible tensor / op name
    tensor_id: int | None = None
    op: str | None = None  # collective or step operation
    mesh: dict | None = None  # ProcessMesh.to_dict()
    axis: int | None = None  # mesh axis
    group: list | None = None  # ranks talking, in mesh order
    peer: int | None = None  # send/recv partner
    bytes: int = 0
    placements_before: list | None = None  # short strings, e.g. ["S(0)", "R"]
    placements_after: list | None = None
    shape_before: list | None = None  # global shapes
    shape_after: list | None = None
    local_shape: list | None = None
    values: list | None = None  # at most MAX_VALUES elements of the local value, row-major
    plan_id: int | None = None
    step: int | None = None  # index of the step in its plan
    cell: int | None = None  # the notebook cell (a Cluster's execution on this rank) that emitted it
    payload: Payload | None = None  # what this kind of event carries beyond these fields (meshviz.trace.payloads)

    def __post_init__(self) -> None:
        p = self.payload
        if p is None:
            self.payload = _default_payload(self.kind)
        elif not isinstance(p, Payload) or not p.KIND:
            raise ValueError(f"Event: payload must be a typed payload of meshviz.trace.payloads, got {p!r}")
        elif not self.kind:
            self.kind = p.KIND
        elif self.kind != p.KIND:
            raise ValueError(f"Event: kind {self.kind!r} does not match its payload {type(p).__name__}, "
                             f"which is a {p.KIND!r} event's")

    def payload_as(self, cls: type[P]) -> P:
        """The payload, which must be a ``cls`` (TypeError naming both otherwise: no silent empty payload)."""
        p = self.payload
        if not isinstance(p, cls):
            raise TypeError(f"a {self.kind!r} event carries a {type(p).__name__}, not a {cls.__name__}")
        return p

    @property
    def duration(self) -> float:
        return 0.0 if self.end is None else self.end - self.start

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        if self.payload is not None:
            d["payload"] = self.payload.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        """The event a dict from :meth:`to_dict` (or JSON) describes."""
        if "extra" in d:
            raise ValueError("Event.from_dict: a record with an untyped 'extra' dict comes from before meshviz 0.1, "
                             "which reads only the typed payloads it writes")
        kw = {k: v for k, v in d.items() if k in _NAMES}
        p = kw.get("payload")
        if isinstance(p, dict):
            kw["payload"] = payload_from_dict(p, kw.get("kind") or "")
        return cls(**kw)


class EventTemplate:
    """The fields of an event that stay the same from call to call (a reshard plan's, one of its steps'), checked
    once: :meth:`stamp` makes each call's Event of them and the fields that change, as ``Event(...)`` would, at a
    fraction of its cost. Stamped events share the template's lists and dicts: events are records, read, never
    changed."""

    __slots__ = ("_fields", "_kind")

    def __init__(self, **fields) -> None:
        proto = Event(seq=-1, **fields)  # checks kind and payload; takes no number from the rank's count
        self._fields = dict(proto.__dict__)  # in the fields' order, as any Event's
        self._kind = proto.kind

    def _made(self, fields: dict) -> Event:
        event = _new_event(Event)  # the fields were checked once, in __init__: no __init__ per event
        event.__dict__ = fields
        return event

    def stamp(self, seq: int, **changes) -> Event:
        """A new Event numbered ``seq`` (the next of the rank's count, which the caller takes), started now unless
        ``changes`` gives ``start``."""
        unknown = changes.keys() - _NAMES
        if unknown:
            raise TypeError(f"EventTemplate.stamp: no Event field {', '.join(sorted(unknown))}")
        fields = self._fields.copy()
        fields["seq"], fields["start"] = seq, time.time()
        fields.update(changes)
        if "payload" in changes or "kind" in changes:
            return Event(**fields)  # checked again, as Event(...) would
        return self._made(fields)

    def stamp_run(self, seq: int, start: float, end: float, rank: int, cell, name, tensor_id, plan_id, local_shape,
                  values, payload=None) -> Event:
        """:meth:`stamp` of the fields a reshard's run sets (``payload``: the template's where None; one of the
        template's kind)."""
        fields = self._fields.copy()
        fields["seq"] = seq
        fields["start"] = start
        fields["end"] = end
        fields["rank"] = rank
        fields["cell"] = cell
        fields["name"] = name
        fields["tensor_id"] = tensor_id
        fields["plan_id"] = plan_id
        fields["local_shape"] = local_shape
        fields["values"] = values
        if payload is not None:
            if payload.KIND != self._kind:
                raise ValueError(f"EventTemplate: a {self._kind!r} event cannot carry a {type(payload).__name__}")
            fields["payload"] = payload
        return self._made(fields)


_new_event = object.__new__


_defaults: dict[str, Payload] = {}  # payloads are frozen: one default instance per kind serves every event


def _default_payload(kind: str) -> Payload:
    p = _defaults.get(kind)
    if p is None:
        cls = PAYLOAD_OF.get(kind)
        if cls is None:
            raise ValueError(f"Event: unknown kind {kind!r} (known: {', '.join(PAYLOAD_OF)})")
        try:
            p = _defaults[kind] = cls()
        except TypeError:
            raise ValueError(f"Event: a {kind!r} event needs its {cls.__name__} payload") from None
    return p


def leading_rows(tensor, limit: int = MAX_VALUES):
    """``tensor``; of a strided one, only its leading rows that hold the first ``limit`` elements, so that
    flattening it for them does not copy the whole tensor."""
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        shape = tensor.shape
        if len(shape) > 1 and shape[0]:
            per = math.prod(shape[1:])
            if per:
                return tensor[: -(-limit // per)]
    return tensor


def small_values(tensor, limit: int = MAX_VALUES) -> list | None:
    """Up to ``limit`` leading elements of a tensor-like as a flat list of Python numbers."""
    if tensor is None:
        return None
    if getattr(tensor, "fake_mode", None) is not None and getattr(tensor, "constant", None) is None:
        return None  # a simulated rank's tensor: a shape without values
    try:
        flat = leading_rows(tensor, limit).reshape(-1)
        n = flat.shape[0]
        head = flat[: min(n, limit)]
        if hasattr(head, "detach"):
            head = head.detach().cpu()
            if head.is_complex():
                return None
            return head.tolist()  # Python ints, floats or bools already
        return [v if isinstance(v, (int, float, bool)) else float(v) for v in head.tolist()]
    except Exception:
        return None


_NAMES = frozenset(f.name for f in dataclasses.fields(Event))


def _default(o: Any):
    if isinstance(o, Payload):
        return o.to_dict()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def to_json(event: Event) -> str:
    return json.dumps(event.to_dict(), default=_default, separators=(",", ":"))


def from_json(line: str) -> Event:
    return Event.from_dict(json.loads(line))
