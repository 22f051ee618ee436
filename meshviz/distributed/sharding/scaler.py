"""GroupShardedScaler: a GradScaler that syncs sharded gradients first and agrees on inf/NaN over the group."""

from __future__ import annotations

import torch

from ...runtime.scaler import agree_found_inf, grad_scaler_settings, unscale_local_blocks_
from ...runtime.zero import ShardingGroup

__all__ = ["GroupShardedScaler", "make_scaler"]


class GroupShardedScaler(torch.amp.GradScaler):
    """GradScaler for sharded training: syncs gradients first, agrees on inf/NaN over ``group`` (a meshviz group;
    None: the world) through the comm layer, so every rank skips a step together.

    Paddle's ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` works as in torch;
    ``minimize(optimizer, scaled_loss)`` is Paddle's step + update.
    """

    def __init__(self, group=None, **settings):
        super().__init__(**settings)
        self._group = group

    def unscale_(self, optimizer):
        sync = getattr(optimizer, "_sync_grads", None)
        if sync is not None:
            sync()
        return super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        per_device = unscale_local_blocks_(optimizer, inv_scale, found_inf)
        agree_found_inf(found_inf, self._group)
        return per_device

    def minimize(self, optimizer, *args, **kwargs):
        self.step(optimizer)
        self.update()


def make_scaler(scaler, grp: ShardingGroup, device_type: str):
    """The user's GradScaler (or None) as a GroupShardedScaler over ``grp`` with the same settings."""
    if scaler is None or isinstance(scaler, GroupShardedScaler):
        return scaler
    return GroupShardedScaler(grp.group, **grad_scaler_settings(scaler, device_type))
