"""Paddle's ``fleet.distributed_scaler``: a loss scaler whose inf/nan check agrees across the hybrid world."""

from __future__ import annotations

from .topology import ParallelMode

__all__ = ["distributed_scaler"]


def distributed_scaler(scaler):
    """The scaler for a ``fleet`` run. Pure data parallel: ``scaler`` itself (the gradients are already averaged
    when it looks at them). With mp, pp or sharding: a scaler with the same settings whose inf/nan check is
    all-reduced over every rank, so all ranks skip a step together (Paddle patches the scaler in place; a torch
    ``GradScaler`` cannot see dist tensors' blocks, so this returns ``shard_scaler(scaler)``)."""
    from ..shard_scaler import shard_scaler
    from .state import current

    hcg = current()._hcg
    if hcg is None:
        raise RuntimeError("fleet.distributed_scaler: call fleet.init(is_collective=True, strategy=...) first")
    if hcg.get_parallel_mode() == ParallelMode.DATA_PARALLEL:
        return scaler
    return shard_scaler(scaler)
