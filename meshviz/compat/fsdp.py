"""FSDP2's custom communication bases (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), torch 2.11-2.15."""

from __future__ import annotations

__all__ = ["comm_bases"]


def comm_bases() -> tuple[type, type]:
    """FSDP2's ``AllGather`` and ``ReduceScatter`` base classes (a private module on every supported torch)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter
