"""The pipeline stage's methods meshviz overrides beyond the schedule's own, and its shape metadata (torch 2.13 on)."""

from __future__ import annotations

import re

import torch

__all__ = ["MORE_STAGE_METHODS", "grad_metas_of", "forward_metas_of", "meta_summary", "check"]

_NEW_META = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 13)
# a stage's backward (torch 2.11's input-only one differs), and the methods through which its shape inference
# exchanges metadata with its neighbours (torch 2.13 on; before, one method receives, runs and sends)
MORE_STAGE_METHODS = ("backward_maybe_with_nosync",) + (("_send_meta", "_recv_meta") if _NEW_META
                                                         else ("_shape_inference",))


def grad_metas_of(outputs: tuple):
    """What a stage receives from the next one as its outputs' gradients' metadata: the outputs' own shapes (plain
    tensors). torch's ``_StageBackwardMeta`` of ``_derive_grad_metas(outputs)``."""
    from torch.distributed.pipelining import stage

    return stage._StageBackwardMeta(backward_metas=stage._derive_grad_metas(tuple(outputs)))


def forward_metas_of(outputs: tuple):
    """What a stage sends the next one as its inputs' metadata (torch 2.13 on): ``_StageForwardMeta`` of
    ``outputs``'s tensor metadata; before 2.13, the outputs on the meta device."""
    if not _NEW_META:
        return tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in outputs)
    from torch.distributed.pipelining import stage

    return stage._StageForwardMeta(forward_metas=stage.extract_tensor_metas(tuple(outputs)))


def meta_summary(meta) -> list:
    """``(shape, stride, dtype, requires_grad)`` of each tensor a stage's forward metadata describes (what
    :func:`forward_metas_of` returns), comparable across ranks."""
    items = getattr(meta, "forward_metas", meta)
    return [(tuple(m.shape), tuple(m.stride() if callable(m.stride) else m.stride), str(m.dtype),
             bool(m.requires_grad)) if m is not None else None for m in items]


def check() -> None:
    """Raise where this torch lacks what meshviz's stage overrides or calls."""
    from torch.distributed.pipelining import PipelineStage

    for m in MORE_STAGE_METHODS:
        getattr(PipelineStage, m)
    if _NEW_META:
        grad_metas_of(())
        forward_metas_of(())
