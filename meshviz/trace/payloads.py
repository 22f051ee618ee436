"""Typed payloads: what one kind of event carries beyond the common fields, as small frozen records."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "Payload", "Placed", "ReshardPlan", "ReshardStep", "Collective", "Transfer", "Compute", "PipelineStep", "Share",
    "Note", "PAYLOADS", "payload_from_dict", "from_legacy",
]


@dataclass(frozen=True)
class Payload:
    """Base of every payload. ``TYPE`` names it in JSON (``{"type": TYPE, ...fields}``); fields left at None are
    not written."""

    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict:
        d = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v is not False:
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Payload":
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                v = d[f.name]
                if isinstance(v, list) and "tuple" in str(f.type):
                    v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
                kw[f.name] = v
        return cls(**kw)

    def __repr__(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) not in (None, False)]
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(frozen=True, repr=False)
class Placed(Payload):
    """``placed``: the tensor's dtype ("float32")."""

    TYPE: ClassVar[str] = "placed"
    dtype: str | None = None


@dataclass(frozen=True, repr=False)
class ReshardPlan(Payload):
    """``reshard``: the target mesh (``ProcessMesh.to_dict()``) and the plan's step ops in order."""

    TYPE: ClassVar[str] = "reshard"
    target_mesh: dict | None = None
    ops: tuple | None = None


@dataclass(frozen=True, repr=False)
class _Issued(Payload):
    """Who issued a communication: the group's sequence number of it (1, 2, ... per group and rank), the user's
    ``file:line``, and the ``nn.Module`` whose forward (or backward) was running."""

    seq: int | None = None
    where: str | None = None
    module: str | None = None
    backward: bool = False


@dataclass(frozen=True, repr=False)
class ReshardStep(_Issued):
    """``reshard_step``: the tensor dims the step moves (``dim``, and ``dst_dim`` for an all-to-all) and its
    reduction ("sum", ...)."""

    TYPE: ClassVar[str] = "reshard_step"
    dim: int | None = None
    dst_dim: int | None = None
    reduce: str | None = None


@dataclass(frozen=True, repr=False)
class Collective(_Issued):
    """``collective`` (and a ``send``/``recv`` of the collective API): the reduction, the root (``src``/``dst``,
    global ranks), DataParallel's ``bucket`` index, whether it was one of a ``batched`` send/recv, and for a
    collective DTensor issued inside an op (``implicit``) the context it ran in (``inside``)."""

    TYPE: ClassVar[str] = "collective"
    reduce_op: str | None = None
    src: int | None = None
    dst: int | None = None
    bucket: int | None = None
    batched: bool = False
    implicit: bool = False
    inside: str | None = None


@dataclass(frozen=True, repr=False)
class Transfer(Payload):
    """A pipeline ``send``/``recv``: micro-batch, phase ("F" activations, "B" gradients), the stage that logged it,
    the stages it goes between, the step, and ``transfer``, a key both ends share."""

    TYPE: ClassVar[str] = "transfer"
    micro_batch: int | None = None
    phase: str | None = None
    stage: int | None = None
    src_stage: int | None = None
    dst_stage: int | None = None
    step: int | None = None
    transfer: str | None = None


@dataclass(frozen=True, repr=False)
class Compute(Payload):
    """A pipeline ``compute`` block: virtual stage, micro-batch, phase ("F", "B" or "W"), this rank's chunk, the
    step, and the activation bytes still held after it."""

    TYPE: ClassVar[str] = "compute"
    stage: int | None = None
    micro_batch: int | None = None
    phase: str | None = None
    chunk: int | None = None
    step: int | None = None
    live_activation_bytes: int | None = None


@dataclass(frozen=True, repr=False)
class PipelineStep(Payload):
    """A ``mark`` at each pipeline step: schedule, stages ``p``, micro-batches ``m``, virtual stages ``v``, the
    step number, this rank's stage, and whether it is an evaluation."""

    TYPE: ClassVar[str] = "pipeline_step"
    schedule: str | None = None
    p: int | None = None
    m: int | None = None
    v: int | None = None
    step: int | None = None
    stage: int | None = None
    eval: bool = False


@dataclass(frozen=True, repr=False)
class Share(Payload):
    """``ownership``: the parts a sharding level splits, the parameter's element count, how a flat plan splits it,
    every group rank's [lo, hi) range, and part -> [lo, hi) this rank holds (see :class:`Ownership`)."""

    TYPE: ClassVar[str] = "ownership"
    sharded: tuple = ()
    numel: int | None = None
    mode: str | None = None
    ranges: tuple | None = None
    holds: dict | None = None


@dataclass(frozen=True, repr=False)
class Note(Payload):
    """Free-form fields for a user's own marks (and what a recorded file from before the typed payloads carried
    that no payload above takes)."""

    TYPE: ClassVar[str] = "note"
    fields: dict | None = None


PAYLOADS: dict[str, type[Payload]] = {
    c.TYPE: c for c in (Placed, ReshardPlan, ReshardStep, Collective, Transfer, Compute, PipelineStep, Share, Note)
}


def payload_from_dict(d) -> Payload | None:
    """The payload a JSON object names by its ``type`` (an unknown type is kept as a :class:`Note`)."""
    if d is None or isinstance(d, Payload):
        return d
    cls = PAYLOADS.get(d.get("type"))
    if cls is None:
        return Note({k: v for k, v in d.items() if k != "type"})
    return cls.from_dict(d)


_PARTS = ("param", "grad", "state")


def from_legacy(kind: str, op, extra: dict | None) -> Payload | None:
    """The payload for an event recorded with the untyped ``extra`` dict of earlier versions."""
    if not extra:
        return None
    x = dict(extra)
    if kind == "placed":
        cls = Placed
    elif kind == "reshard":
        cls = ReshardPlan
    elif kind == "reshard_step":
        cls = ReshardStep
    elif kind == "collective" or (kind in ("send", "recv") and "transfer" not in x and "phase" not in x):
        cls = Collective
    elif kind in ("send", "recv"):
        cls = Transfer
    elif kind == "compute" and "phase" in x:
        cls = Compute
    elif kind == "mark" and op == "pipeline_step":
        cls = PipelineStep
    elif kind == "ownership":
        holds = {p: x.pop(p) for p in _PARTS if p in x}
        x["holds"] = holds or None
        cls = Share
    else:
        return Note(x)
    names = {f.name for f in dataclasses.fields(cls)}
    known = {k: v for k, v in x.items() if k in names}
    return cls.from_dict(known)
