"""Paddle's ``dist.shard_scaler``: a loss scaler whose inf/nan check agrees on every rank."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from .. import compat
from ..runtime.comm import Call, CollectiveOp, run
from ..runtime.devices import device
from ..runtime.dtensor import DistTensor

__all__ = ["shard_scaler"]


class _ShardScaler:
    """A loss scaler whose inf/nan check agrees on every rank (Paddle's GradScaler: its settings, its getters).

    Dynamic scaling: the scale is multiplied by ``decr_ratio`` after ``decr_every_n_nan_or_inf`` steps in a row
    that saw inf/nan (those steps are skipped), by ``incr_ratio`` after ``incr_every_n_steps`` clean steps in a row.
    """

    def __init__(self, init_loss_scaling=2.0**15, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=1000,
                 decr_every_n_nan_or_inf=1, use_dynamic_loss_scaling=True, enable=True):
        if incr_ratio <= 1.0 or not 0.0 < decr_ratio < 1.0:
            raise ValueError(f"shard_scaler: incr_ratio must be > 1 and decr_ratio in (0, 1), got {incr_ratio}, "
                             f"{decr_ratio}")
        self._init = float(init_loss_scaling)
        self._scale = float(init_loss_scaling)
        self._incr, self._decr = float(incr_ratio), float(decr_ratio)
        self._every, self._decr_every = int(incr_every_n_steps), int(decr_every_n_nan_or_inf)
        self._dynamic = bool(use_dynamic_loss_scaling)
        self._good = 0
        self._bad = 0
        self._enable = bool(enable)
        self._found_inf = False
        self._unscaled = False

    @property
    def loss_scaling(self) -> float:
        return self._scale

    # Paddle's getters, and torch's names for the same settings
    def get_init_loss_scaling(self) -> float:
        return self._init

    def get_incr_ratio(self) -> float:
        return self._incr

    def get_decr_ratio(self) -> float:
        return self._decr

    def get_incr_every_n_steps(self) -> int:
        return self._every

    def get_decr_every_n_nan_or_inf(self) -> int:
        return self._decr_every

    def is_enable(self) -> bool:
        return self._enable

    def is_use_dynamic_loss_scaling(self) -> bool:
        return self._dynamic

    def get_scale(self) -> float:
        return self._scale if self._enable else 1.0

    get_growth_factor, get_backoff_factor, get_growth_interval = get_incr_ratio, get_decr_ratio, get_incr_every_n_steps
    is_enabled = is_enable

    def scale(self, loss):
        return loss * self._scale if self._enable else loss

    def _params(self, optimizer):
        for g in optimizer.param_groups:
            yield from g["params"]

    @torch.no_grad()
    def unscale_(self, optimizer) -> None:
        if not self._enable or self._unscaled:
            return
        bad = torch.zeros(1, device=device())
        for p in self._params(optimizer):
            if p.grad is None:
                continue
            local = compat.dtensor_local(p.grad._dtensor) if isinstance(p.grad, DistTensor) else p.grad
            if local.numel() and not torch.isfinite(local).all():
                bad.fill_(1.0)
            p.grad.mul_(1.0 / self._scale)
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            run(Call(CollectiveOp.ALL_REDUCE, None,
                     lambda g: tdist.all_reduce(bad, op=tdist.ReduceOp.MAX, group=g.process_group, async_op=True),
                     tensors=(bad,), traced=False))
        self._found_inf = bool(bad.item())
        self._unscaled = True

    def step(self, optimizer):
        self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()

    def update(self) -> None:
        if self._enable and self._dynamic:
            if self._found_inf:
                self._good = 0
                self._bad += 1
                if self._bad == self._decr_every:
                    self._scale *= self._decr
                    self._bad = 0
            else:
                self._bad = 0
                self._good += 1
                if self._good == self._every:
                    self._scale *= self._incr
                    self._good = 0
        self._found_inf = False
        self._unscaled = False

    def minimize(self, optimizer, loss=None):
        self.step(optimizer)
        self.update()

    def state_dict(self) -> dict:
        return {"scale": self._scale, "incr_ratio": self._incr, "decr_ratio": self._decr,
                "incr_every_n_steps": self._every, "decr_every_n_nan_or_inf": self._decr_every,
                "incr_count": self._good, "decr_count": self._bad, "use_dynamic_loss_scaling": self._dynamic}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._incr, self._decr = float(state["incr_ratio"]), float(state["decr_ratio"])
        self._every, self._decr_every = int(state["incr_every_n_steps"]), int(state["decr_every_n_nan_or_inf"])
        self._good, self._bad = int(state["incr_count"]), int(state["decr_count"])
        self._dynamic = bool(state["use_dynamic_loss_scaling"])

    def __repr__(self) -> str:
        return (f"ShardScaler(scale={self._scale}, incr_ratio={self._incr}, decr_ratio={self._decr}, "
                f"incr_every_n_steps={self._every}, decr_every_n_nan_or_inf={self._decr_every}, "
                f"enable={self._enable})")


def _scaler_settings(scaler) -> dict:
    """The settings of a Paddle-style scaler (``get_incr_ratio`` ...) or a torch ``GradScaler``."""
    def ask(*names, default=None):
        for n in names:
            v = getattr(scaler, n, None)
            if callable(v):
                try:
                    return v()
                except (AttributeError, RuntimeError):
                    continue
        return default

    enabled = ask("is_enable", "is_enabled", default=True)
    scale = ask("get_init_loss_scaling") if hasattr(scaler, "get_init_loss_scaling") else None
    if scale is None:
        # torch: the current scale (its initial one until the first step); 1.0 when disabled, so look past it
        scale = getattr(scaler, "_init_scale", None) if not enabled else ask("get_scale")
    return dict(
        init_loss_scaling=float(scale if scale is not None else 2.0**15),
        incr_ratio=ask("get_incr_ratio", "get_growth_factor", default=2.0),
        decr_ratio=ask("get_decr_ratio", "get_backoff_factor", default=0.5),
        incr_every_n_steps=ask("get_incr_every_n_steps", "get_growth_interval", default=1000),
        decr_every_n_nan_or_inf=ask("get_decr_every_n_nan_or_inf", default=1),
        use_dynamic_loss_scaling=ask("is_use_dynamic_loss_scaling", default=True),
        enable=bool(enabled),
    )


def shard_scaler(scaler=None):
    """A loss scaler for dist parameters: every rank skips the step when any rank saw inf/nan.

    Keeps the given scaler's settings (scale, growth and backoff factors, interval, enabled), from a torch
    ``GradScaler`` or a Paddle-style one; with none, Paddle's defaults but a starting scale of 2**15.
    """
    if isinstance(scaler, _ShardScaler):
        return scaler
    if scaler is None:
        return _ShardScaler()
    return _ShardScaler(**_scaler_settings(scaler))


# -- shard_dataloader --------------------------------------------------------------------------------------
