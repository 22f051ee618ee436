"""Paddle's ``fleet.distributed_scaler``: a loss scaler whose inf/nan check agrees across the hybrid world."""

from __future__ import annotations

from .topology import ParallelMode

__all__ = ["distributed_scaler"]


def distributed_scaler(scaler):
    """The scaler for a ``fleet`` run: ``scaler`` itself, as Paddle's. Pure data parallel: left as it is (the
    gradients are already averaged when it looks at them). With mp, pp or sharding: its inf/nan check is made to
    be all-reduced over every rank, in place (``shard_scaler(scaler)``), so all ranks skip a step together."""
    from ..shard_scaler import shard_scaler
    from .state import current

    hcg = current()._hcg
    if hcg is None:
        raise RuntimeError("fleet.distributed_scaler: call fleet.init(is_collective=True, strategy=...) first")
    if hcg.get_parallel_mode() == ParallelMode.DATA_PARALLEL:
        return scaler
    return shard_scaler(scaler)
