"""GroupShardedScaler: a GradScaler that syncs sharded gradients first and agrees on inf/NaN over the group."""

from __future__ import annotations

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ... import compat
from .group import ShardingGroup
from .slot import local_tensor

__all__ = ["GroupShardedScaler", "make_scaler"]


class GroupShardedScaler(ShardedGradScaler):
    """GradScaler for sharded training: syncs gradients first, agrees on inf/NaN over the group.

    Paddle's ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` works as in torch;
    ``minimize(optimizer, scaled_loss)`` is Paddle's step + update.
    """

    def unscale_(self, optimizer):
        sync = getattr(optimizer, "_sync_grads", None)
        if sync is not None:
            sync()
        return super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        # local blocks of DTensor gradients and plain gradients together; one found_inf per rank, so every
        # rank joins the same single all-reduce whatever devices its shards live on
        per = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = local_tensor(p.grad)
                        per.setdefault((g.device, g.dtype), []).append(g)
            for (dev, _), grads in per.items():
                fi = torch.zeros(1, device=dev)
                compat.amp_unscale_(grads, fi, inv_scale.to(dev))
                found_inf += fi.to(found_inf.device)
        return {found_inf.device: found_inf}

    def minimize(self, optimizer, *args, **kwargs):
        self.step(optimizer)
        self.update()


def make_scaler(scaler, grp: ShardingGroup, device_type: str):
    """The user's GradScaler (or None) as a GroupShardedScaler over ``grp`` with the same settings."""
    if scaler is None or isinstance(scaler, GroupShardedScaler):
        return scaler
    kw = dict(
        init_scale=getattr(scaler, "_init_scale", 2.0**16),
        growth_factor=getattr(scaler, "_growth_factor", 2.0),
        backoff_factor=getattr(scaler, "_backoff_factor", 0.5),
        growth_interval=getattr(scaler, "_growth_interval", 2000),
        enabled=getattr(scaler, "_enabled", True),
    )
    return GroupShardedScaler(device=getattr(scaler, "_device", device_type), process_group=grp.pg, **kw)
