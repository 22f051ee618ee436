"""The pipeline stage's methods meshviz overrides beyond the schedule's own, and its shape metadata."""

from __future__ import annotations

import functools

import torch

__all__ = ["more_stage_methods", "grad_metas_of", "forward_metas_of", "meta_summary", "check", "forget_losses",
           "drop_receive_buffers"]


@functools.cache
def _new_meta() -> bool:
    """Whether a stage's shape inference exchanges metadata through ``_send_meta`` / ``_recv_meta`` (torch 2.12.1,
    2.13 and later; before, one ``_shape_inference`` receives, runs and sends): asked of torch, not of its version."""
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, "_send_meta")


def forget_losses(schedule) -> None:
    """Drop the micro losses a schedule's step computed before it raised: torch keeps them (``_internal_losses``,
    torch 2.11 to 2.15) until the step ends, and the next step's backward would run the old ones again ("Trying to
    backward through the graph a second time")."""
    losses = getattr(schedule, "_internal_losses", None)
    if isinstance(losses, list):
        losses.clear()


def drop_receive_buffers(stage) -> None:
    """Let a stage whose step raised while receives were posted run again: torch 2.15 keeps each posted receive's
    buffer (``_RecvInfo.buffer``) until its block takes it, and refuses the next step while one is held (an abandoned
    receive may still be written to). Only for ranks as threads, whose abandoned receives are dropped with the failed
    round; a no-op before 2.15, which keeps no such buffers."""
    for infos in (*stage.args_recv_info.values(), *getattr(stage, "grad_recv_info", {}).values()):
        for info in infos if isinstance(infos, (tuple, list)) else ():
            if type(info).__name__ == "_RecvInfo" and getattr(info, "buffer", None) is not None and \
                    hasattr(info, "take_buffer"):
                info.buffer = None


def more_stage_methods() -> tuple[str, ...]:
    """A stage's backward (torch 2.11's input-only one differs), and the methods through which its shape inference
    exchanges metadata with its neighbours."""
    return ("backward_maybe_with_nosync",) + (("_send_meta", "_recv_meta") if _new_meta() else ("_shape_inference",))


def grad_metas_of(outputs: tuple):
    """What a stage receives from the next one as its outputs' gradients' metadata: the outputs' own shapes (plain
    tensors). torch's ``_StageBackwardMeta`` of ``_derive_grad_metas(outputs)``."""
    from torch.distributed.pipelining import stage

    return stage._StageBackwardMeta(backward_metas=stage._derive_grad_metas(tuple(outputs)))


def forward_metas_of(outputs: tuple):
    """What a stage sends the next one as its inputs' metadata: ``_StageForwardMeta`` of ``outputs``'s tensor
    metadata; before torch's ``_send_meta`` (:func:`_new_meta`), the outputs on the meta device."""
    if not _new_meta():
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

    for m in more_stage_methods():
        getattr(PipelineStage, m)
    if _new_meta():
        grad_metas_of(())
        forward_metas_of(())
