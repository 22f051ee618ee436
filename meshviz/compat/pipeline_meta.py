"""The pipeline stage's methods meshviz overrides beyond the schedule's own, and its shape metadata (torch 2.13 on)."""

from __future__ import annotations

import re

import torch

__all__ = ["MORE_STAGE_METHODS", "grad_metas_of", "check"]

_NEW_META = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 13)
# a stage's backward (torch 2.11's input-only one differs), and, torch 2.13 on, the methods through which its shape
# inference exchanges metadata with its neighbours
MORE_STAGE_METHODS = ("backward_maybe_with_nosync",) + (("_send_meta", "_recv_meta") if _NEW_META else ())


def grad_metas_of(outputs: tuple):
    """What a stage receives from the next one as its outputs' gradients' metadata: the outputs' own shapes (plain
    tensors). torch's ``_StageBackwardMeta`` of ``_derive_grad_metas(outputs)``."""
    from torch.distributed.pipelining import stage

    return stage._StageBackwardMeta(backward_metas=stage._derive_grad_metas(tuple(outputs)))


def check() -> None:
    """Raise where this torch lacks what meshviz's stage overrides or calls."""
    from torch.distributed.pipelining import PipelineStage

    for m in MORE_STAGE_METHODS:
        getattr(PipelineStage, m)
    if _NEW_META:
        grad_metas_of(())
