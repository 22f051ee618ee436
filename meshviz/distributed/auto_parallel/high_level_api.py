"""Paddle's ``dist.to_distributed``: named, not implemented (it matches Paddle static-graph op patterns)."""

from __future__ import annotations

__all__ = ["to_distributed"]


def to_distributed(model, optimizer, dataloader, device_num, node_num=1, config=None):
    """Paddle chooses a mesh from ``device_num`` and finds its Llama patterns in a traced static program; meshviz
    has no such pattern matcher. Write the plan once and call ``dist.parallelize`` (same result, and visible)."""
    raise NotImplementedError(
        "to_distributed is not implemented in meshviz: it needs Paddle's static-graph pattern matching. Use "
        "dist.parallelize(model, optimizer, mesh, config={'dp_config': ..., 'mp_config': {'parallelize_plan': ...}}) "
        "with the plan written out (see notebooks/12_parallelize.ipynb), and dist.shard_dataloader for the data.")
