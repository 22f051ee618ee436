"""Typed payloads: what one kind of event carries beyond the common fields, one small frozen record per kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "Payload", "Placed", "ReshardPlan", "ReshardStep", "Issued", "Collective", "Send", "Recv", "Compute", "Mark",
    "Share", "OpRule", "PAYLOAD_OF", "PAYLOADS", "payload_from_dict",
]

P = TypeVar("P", bound="Payload")


@dataclass(frozen=True)
class Payload:
    """Base of every payload. ``KIND`` is the kind of event it goes with (an event's kind is its payload's);
    ``TYPE`` names it in JSON (``{"type": TYPE, ...fields}``), ``LOADS`` the other types a file of this version
    wrote for this kind; fields left at None (or False) are not written."""

    KIND: ClassVar[str] = ""
    TYPE: ClassVar[str] = ""
    LOADS: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v is not False:
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls: type[P], d: dict[str, Any]) -> P:
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

    KIND: ClassVar[str] = "placed"
    TYPE: ClassVar[str] = "placed"
    dtype: str | None = None


@dataclass(frozen=True, repr=False)
class ReshardPlan(Payload):
    """``reshard``: the target mesh (``ProcessMesh.to_dict()``) and the plan's step ops in order."""

    KIND: ClassVar[str] = "reshard"
    TYPE: ClassVar[str] = "reshard"
    target_mesh: dict | None = None
    ops: tuple | None = None


@dataclass(frozen=True, repr=False)
class Issued(Payload):
    """Who issued a communication: the group's sequence number of it (1, 2, ... per group and rank; None for a
    send or recv), the user's ``file:line``, and the ``nn.Module`` whose forward (or backward) was running."""

    seq: int | None = None
    where: str | None = None
    module: str | None = None
    backward: bool = False


@dataclass(frozen=True, repr=False)
class ReshardStep(Issued):
    """``reshard_step``: the tensor dims the step moves (``dim``, and ``dst_dim`` for an all-to-all) and its
    reduction ("sum", ...)."""

    KIND: ClassVar[str] = "reshard_step"
    TYPE: ClassVar[str] = "reshard_step"
    dim: int | None = None
    dst_dim: int | None = None
    reduce: str | None = None


@dataclass(frozen=True, repr=False)
class Collective(Issued):
    """``collective``: the reduction, the root (``src``/``dst``, global ranks), DataParallel's ``bucket`` index,
    for a collective DTensor issued inside an op (``implicit``) the context it ran in (``inside``), and ``sizes``,
    (elements, bytes per element) of each tensor this rank passed (what its received ``bytes`` were reckoned
    from)."""

    KIND: ClassVar[str] = "collective"
    TYPE: ClassVar[str] = "collective"
    reduce_op: str | None = None
    src: int | None = None
    dst: int | None = None
    bucket: int | None = None
    batched: bool = False
    implicit: bool = False
    inside: str | None = None
    sizes: tuple | None = None


@dataclass(frozen=True, repr=False)
class _PointToPoint(Issued):
    """A ``send``/``recv``. Of the collective API: the root (``src``/``dst``, global ranks) and whether it was one
    of a ``batched`` send/recv. Of a pipeline stage: micro-batch, phase ("F" activations, "B" gradients), the
    stage that logged it, the stages it goes between, the step, and ``transfer``, a key both ends share."""

    LOADS: ClassVar[tuple[str, ...]] = ("transfer", "collective")
    src: int | None = None
    dst: int | None = None
    batched: bool = False
    micro_batch: int | None = None
    phase: str | None = None
    stage: int | None = None
    src_stage: int | None = None
    dst_stage: int | None = None
    step: int | None = None
    transfer: str | None = None


@dataclass(frozen=True, repr=False)
class Send(_PointToPoint):
    """``send``: see the fields of a point-to-point transfer above."""

    KIND: ClassVar[str] = "send"
    TYPE: ClassVar[str] = "send"


@dataclass(frozen=True, repr=False)
class Recv(_PointToPoint):
    """``recv``: see the fields of a point-to-point transfer above."""

    KIND: ClassVar[str] = "recv"
    TYPE: ClassVar[str] = "recv"


@dataclass(frozen=True, repr=False)
class Compute(Payload):
    """``compute``: for a pipeline block, the virtual stage, micro-batch, phase ("F", "B" or "W"), this rank's
    chunk, the step, and the activation bytes still held after it."""

    KIND: ClassVar[str] = "compute"
    TYPE: ClassVar[str] = "compute"
    stage: int | None = None
    micro_batch: int | None = None
    phase: str | None = None
    chunk: int | None = None
    step: int | None = None
    live_activation_bytes: int | None = None


@dataclass(frozen=True, repr=False)
class Mark(Payload):
    """``mark``: a user's own free-form ``fields``; at each pipeline step (op ``pipeline_step``) the schedule,
    stages ``p``, micro-batches ``m``, virtual stages ``v``, the step number, this rank's stage, and whether it is
    an evaluation."""

    KIND: ClassVar[str] = "mark"
    TYPE: ClassVar[str] = "mark"
    LOADS: ClassVar[tuple[str, ...]] = ("note", "pipeline_step")
    fields: dict | None = None
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

    KIND: ClassVar[str] = "ownership"
    TYPE: ClassVar[str] = "ownership"
    sharded: tuple = ()
    numel: int | None = None
    mode: str | None = None
    ranges: tuple | None = None
    holds: dict | None = None


@dataclass(frozen=True, repr=False)
class OpRule(Payload):
    """``op``: an op whose placements meshviz decided itself: ``rule`` is "default" (Paddle's default rule: inputs
    made Replicate, output Replicate), "corrected" (torch's rule gives a wrong value; run as its decomposition) or
    "paddle" (Paddle's SPMD rule where torch's differs); ``why`` says why."""

    KIND: ClassVar[str] = "op"
    TYPE: ClassVar[str] = "op"
    rule: str | None = None
    why: str | None = None


_CLASSES: tuple[type[Payload], ...] = (Placed, ReshardPlan, ReshardStep, Collective, Send, Recv, Compute, Mark, Share,
                                       OpRule)
PAYLOAD_OF: dict[str, type[Payload]] = {c.KIND: c for c in _CLASSES}  # kind of event -> its payload class
PAYLOADS: dict[str, type[Payload]] = {c.TYPE: c for c in _CLASSES}  # JSON type -> payload class


def payload_from_dict(d: dict[str, Any], kind: str) -> Payload:
    """The payload of a ``kind`` event from its JSON object. The object's ``type`` must be the kind's payload or
    one it loads (``LOADS``); a ``mark`` keeps an unknown type's fields as free-form ``fields``, never executed."""
    cls = PAYLOAD_OF.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r} (known: {', '.join(PAYLOAD_OF)})")
    t = d.get("type")
    if t == cls.TYPE or t in cls.LOADS:
        return cls.from_dict(d)
    if cls is Mark and t not in PAYLOADS:
        return Mark({k: v for k, v in d.items() if k != "type"})
    raise ValueError(f"a {kind!r} event carries a {cls.__name__} payload, not one of type {t!r}")
