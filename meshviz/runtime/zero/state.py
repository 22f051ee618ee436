"""The whole model's optimizer state, merged from the ranks' shards into the unwrapped optimizer's format."""

from __future__ import annotations

import torch

from ..devices import full_tensor
from .group import ShardingGroup, gather_object

__all__ = ["full_optimizer_state", "load_full_optimizer_state"]


def _cpu(st: dict) -> dict:
    return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in st.items()}


def full_optimizer_state(inner, slots, grp: ShardingGroup) -> dict:
    """``{"state", "param_groups"}`` for the whole model from every group rank's shards (collective)."""
    # index of each slot in the unwrapped optimizer's flat parameter order
    local = {}
    for i, s in enumerate(slots):
        if s.piece.mode == "fsdp":
            st = inner.state.get(s.param, {})
            full = {}
            for k in sorted(st):
                v = st[k]
                full[k] = full_tensor(v)
            if grp.rank == 0:
                local[i] = ("full", _cpu(full))
        elif s.piece.mode == "replicated":  # stepped as a flat CPU copy (s.shard) under offload
            if grp.rank == 0:
                local[i] = ("full", _cpu(inner.state.get(s.shard if s.shard is not None else s.param, {})))
        elif s.owned:
            local[i] = ((s.lo, s.hi), _cpu(inner.state.get(s.shard, {})))
    parts = gather_object(local, grp)
    state = {}
    for i, s in enumerate(slots):
        n, shape = s.piece.numel, s.piece.shape
        merged = {}
        for part in parts:
            if i not in part:
                continue
            where, st = part[i]
            for k, v in st.items():
                if where == "full" or not torch.is_tensor(v) or v.dim() == 0 or v.numel() != where[1] - where[0]:
                    merged.setdefault(k, v)
                    continue
                buf = merged.get(k)
                if buf is None or buf.dim() == 0 or buf.numel() != n:
                    buf = merged[k] = torch.zeros(n, dtype=v.dtype)
                buf[where[0] : where[1]] = v.reshape(-1)
        for k, v in list(merged.items()):
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n and len(shape) != 1:
                merged[k] = v.view(shape)
        if merged:
            state[i] = merged
    groups = []
    for gi, g in enumerate(inner.param_groups):
        idx = [i for i, s in enumerate(slots) if s.group_index == gi]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": idx})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_full_optimizer_state(inner, slots, grp: ShardingGroup, state: dict) -> None:
    """Load ``state`` (``{slot index: {name: whole value}}``, as :func:`full_optimizer_state` gives it) into this
    rank's shards of ``inner``'s states, which must exist (no communication)."""
    for i, s in enumerate(slots):
        whole = state.get(i)
        if not whole:
            continue
        if s.piece.mode == "fsdp":
            have = inner.state.get(s.param, {})
        elif s.piece.mode == "replicated":
            have = inner.state.get(s.shard if s.shard is not None else s.param, {})
        elif s.owned:
            have = inner.state.get(s.shard, {})
        else:
            continue
        for k, v in whole.items():
            cur = have.get(k)
            if not torch.is_tensor(cur) or not torch.is_tensor(v):
                have[k] = v
                continue
            if hasattr(cur, "to_local"):  # FSDP2's state: dim 0 split as torch.chunk splits it
                local = cur.to_local()
                parts = torch.chunk(v, grp.size, dim=0) if v.dim() else [v] * grp.size
                part = parts[grp.rank] if grp.rank < len(parts) else v[:0]
                local.copy_(part.reshape(local.shape))
            elif cur.dim() == 0 or tuple(v.shape) == tuple(cur.shape):
                cur.copy_(v)
            else:  # this rank's flat elements of the parameter
                cur.copy_(v.reshape(-1)[s.lo : s.hi].reshape(cur.shape))
