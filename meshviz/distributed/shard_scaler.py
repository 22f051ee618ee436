"""Paddle's ``dist.shard_scaler``: a loss scaler whose inf/nan check agrees on every rank."""

from __future__ import annotations

from ..runtime.scaler import LossScaler, settings_of

__all__ = ["shard_scaler"]


class _ShardScaler(LossScaler):
    """A loss scaler whose inf/nan check agrees on every rank (Paddle's GradScaler: its settings, its getters).

    Dynamic scaling: the scale is multiplied by ``decr_ratio`` after ``decr_every_n_nan_or_inf`` steps in a row
    that saw inf/nan (those steps are skipped), by ``incr_ratio`` after ``incr_every_n_steps`` clean steps in a row.
    """

    def __init__(self, **settings):
        super().__init__(**settings, who="shard_scaler")


def shard_scaler(scaler=None):
    """A loss scaler for dist parameters: every rank skips the step when any rank saw inf/nan.

    Keeps the given scaler's settings (scale, growth and backoff factors, interval, enabled), from a torch
    ``GradScaler`` or a Paddle-style one; with none, Paddle's defaults but a starting scale of 2**15.
    """
    if isinstance(scaler, _ShardScaler):
        return scaler
    if scaler is None:
        return _ShardScaler()
    return _ShardScaler(**settings_of(scaler))
