"""memory_stats: the bytes of parameters, gradients and optimizer states one rank holds."""

from __future__ import annotations

import torch

from ...runtime.zero import local_tensor
from .optimizer import GroupShardedOptimizer

__all__ = ["memory_stats"]


def memory_stats(model, optimizer=None) -> dict:
    """Bytes this rank holds now: parameters, gradients, optimizer states (each storage counted once)."""
    seen = set()

    def nbytes(tensors):
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            st = local_tensor(t).untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    params = list(model.parameters())
    out = {"params": nbytes(params)}
    grads = [p.grad for p in params]
    inner = optimizer
    if isinstance(optimizer, GroupShardedOptimizer):
        slots = optimizer._slots
        grads += [s.grad_buf for s in slots] + [s.shard.grad for s in slots if s.shard is not None]
        inner = optimizer._inner_opt
    out["grads"] = nbytes(grads)
    states = []
    if inner is not None:
        for st in inner.state.values():
            states += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    out["states"] = nbytes(states)
    out["total"] = out["params"] + out["grads"] + out["states"]
    return out
