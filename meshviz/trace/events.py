"""Event records: plain, JSON-serialisable dataclasses that the runtime emits and the widgets draw."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..rank_context import per_rank
from .payloads import Payload, from_legacy, payload_from_dict

__all__ = ["Event", "KINDS", "MAX_VALUES", "small_values", "to_json", "from_json", "now"]

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
}

# kind of event -> the payload type it carries (``mark``: a PipelineStep at a pipeline step, else none or a Note)
PAYLOAD_OF = {
    "placed": "Placed",
    "reshard": "ReshardPlan",
    "reshard_step": "ReshardStep",
    "collective": "Collective",
    "send": "Transfer (a pipeline stage) or Collective (the collective API)",
    "recv": "Transfer (a pipeline stage) or Collective (the collective API)",
    "compute": "Compute (a pipeline block)",
    "ownership": "Share",
    "mark": "PipelineStep (op 'pipeline_step') or Note",
}

MAX_VALUES = 64  # tensor elements an event may carry

_seq = per_rank(itertools.count)  # each rank numbers its own events from 0
now = time.time


@dataclass
class Event:
    kind: str
    rank: int = -1
    seq: int = field(default_factory=lambda: next(_seq))
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
        """The event a dict from :meth:`to_dict` (or JSON) describes; a file recorded before the typed payloads
        (an ``extra`` dict) loads with the matching payload."""
        kw = {k: v for k, v in d.items() if k in _NAMES}
        if "payload" in kw:
            kw["payload"] = payload_from_dict(kw["payload"])
        elif "extra" in d:
            kw["payload"] = from_legacy(d.get("kind", ""), d.get("op"), d.get("extra"))
        return cls(**kw)


def small_values(tensor, limit: int = MAX_VALUES) -> list | None:
    """Up to ``limit`` leading elements of a tensor-like as a flat list of Python numbers."""
    if tensor is None:
        return None
    try:
        flat = tensor.reshape(-1)
        n = flat.shape[0]
        head = flat[: min(n, limit)]
        if hasattr(head, "detach"):
            head = head.detach().cpu()
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
