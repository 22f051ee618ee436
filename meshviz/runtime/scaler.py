"""The loss-scaler engine: scale, unscale, the inf/NaN check agreed over a group, dynamic update."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from .. import compat
from .comm import Call, CollectiveOp, run
from .devices import device
from .dtensor import DistTensor
from .zero import local_tensor

__all__ = ["LossScaler", "agree_found_inf", "settings_of", "grad_scaler_settings", "unscale_local_blocks_",
           "unscale_blocks_", "grad_params"]


def agree_found_inf(flag: torch.Tensor, group=None) -> bool:
    """Whether any rank of ``group`` (None: the world) set its ``flag`` (a 1-element tensor): MAX all-reduced,
    so every rank skips a step together."""
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        run(Call(CollectiveOp.ALL_REDUCE, group,
                 lambda g: tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=g.process_group, async_op=True),
                 tensors=(flag,), traced=False))
    return bool(flag.item())


class LossScaler:
    """A loss scaler whose inf/nan check agrees over ``group`` (None: the world), with Paddle's settings and getters.

    Dynamic scaling: the scale is multiplied by ``decr_ratio`` after ``decr_every_n_nan_or_inf`` steps in a row
    that saw inf/nan (those steps are skipped), by ``incr_ratio`` after ``incr_every_n_steps`` clean steps in a row.
    """

    def __init__(self, init_loss_scaling=2.0**15, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=1000,
                 decr_every_n_nan_or_inf=1, use_dynamic_loss_scaling=True, enable=True, *, group=None,
                 who="LossScaler"):
        if incr_ratio <= 1.0 or not 0.0 < decr_ratio < 1.0:
            raise ValueError(f"{who}: incr_ratio must be > 1 and decr_ratio in (0, 1), got {incr_ratio}, "
                             f"{decr_ratio}")
        self._init = float(init_loss_scaling)
        self._scale = float(init_loss_scaling)
        self._incr, self._decr = float(incr_ratio), float(decr_ratio)
        self._every, self._decr_every = int(incr_every_n_steps), int(decr_every_n_nan_or_inf)
        self._dynamic = bool(use_dynamic_loss_scaling)
        self._good = 0
        self._bad = 0
        self._enable = bool(enable)
        self._states: dict[int, str] = {}  # id(optimizer) -> "unscaled" or "stepped" since the last update()
        self._found: dict[int, bool] = {}  # id(optimizer) -> whether its gradients held an inf or nan
        self._group = group

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
        return grad_params(optimizer)

    @property
    def _found_inf(self) -> bool:
        """Whether any optimizer unscaled since the last update() held an inf or nan (that update backs off)."""
        return any(self._found.values())

    @torch.no_grad()
    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, once per optimizer between updates (as Paddle's and
        torch's scalers: a second call raises)."""
        if not self._enable:
            return
        state = self._states.get(id(optimizer))
        if state == "unscaled":
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state == "stepped":
            raise RuntimeError("unscale_() is being called after step().")
        bad = torch.zeros(1, device=device())
        for p in self._params(optimizer):
            if p.grad is None:
                continue
            local = p.grad._local if isinstance(p.grad, DistTensor) else p.grad
            if local.numel() and not torch.isfinite(local).all():
                bad.fill_(1.0)
            p.grad.mul_(1.0 / self._scale)
        self._found[id(optimizer)] = agree_found_inf(bad, self._group)
        self._states[id(optimizer)] = "unscaled"

    def step(self, optimizer):
        """Unscale ``optimizer``'s gradients (unless unscale_ did) and step it unless they held an inf or nan on
        any rank; once per optimizer between updates."""
        if self._states.get(id(optimizer)) == "stepped":
            raise RuntimeError("step() has already been called since the last update().")
        if self._states.get(id(optimizer)) is None:
            self.unscale_(optimizer)
        if not self._found.get(id(optimizer), False):
            optimizer.step()
        if self._enable:
            self._states[id(optimizer)] = "stepped"

    def update(self) -> None:
        if self._enable and self._dynamic:
            if self._found_inf:
                self._good = 0
                self._bad += 1
                if self._bad == self._decr_every:
                    self._scale = max(self._scale * self._decr, 1.0)  # Paddle's update_loss_scaling: never below 1
                    self._bad = 0
            else:
                self._bad = 0
                self._good += 1
                if self._good == self._every:
                    self._scale *= self._incr
                    self._good = 0
        self._states.clear()
        self._found.clear()

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
        return (f"{type(self).__name__.lstrip('_')}(scale={self._scale}, incr_ratio={self._incr}, "
                f"decr_ratio={self._decr}, "
                f"incr_every_n_steps={self._every}, decr_every_n_nan_or_inf={self._decr_every}, "
                f"enable={self._enable})")


def settings_of(scaler) -> dict:
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


def grad_scaler_settings(scaler, device_type: str) -> dict:
    """A torch ``GradScaler``'s constructor arguments (its initial scale, factors, interval, enabled, device)."""
    return dict(
        device=getattr(scaler, "_device", device_type),
        init_scale=getattr(scaler, "_init_scale", 2.0**16),
        growth_factor=getattr(scaler, "_growth_factor", 2.0),
        backoff_factor=getattr(scaler, "_backoff_factor", 0.5),
        growth_interval=getattr(scaler, "_growth_interval", 2000),
        enabled=getattr(scaler, "_enabled", True),
    )


def grad_params(optimizer) -> list:
    """The parameters whose gradients backward filled for ``optimizer``: a sharded optimizer's own list (its inner
    optimizer may step stand-ins), else its param_groups'."""
    own = getattr(optimizer, "grad_params", None)
    if callable(own):
        return list(own())
    return [p for g in optimizer.param_groups for p in g["params"]]


def unscale_local_blocks_(optimizer, inv_scale, found_inf) -> dict:
    """:func:`unscale_blocks_` over ``optimizer``'s param_groups."""
    return unscale_blocks_([p for g in optimizer.param_groups for p in g["params"]], inv_scale, found_inf)


@torch.no_grad()
def unscale_blocks_(params, inv_scale, found_inf) -> dict:
    """Unscale the local block of every gradient of ``params`` (a dist tensor's, a torch DTensor's or a plain
    tensor), per device and dtype; one ``found_inf`` per rank, so every rank joins the same single agreement
    whatever devices its blocks live on."""
    per = {}
    for p in params:
        if p.grad is not None:
            g = p.grad._local if isinstance(p.grad, DistTensor) else local_tensor(p.grad)
            per.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), grads in per.items():
        fi = torch.zeros_like(found_inf, device=dev)
        compat.amp_unscale_(grads, fi, inv_scale.to(dev))
        found_inf += fi.to(found_inf.device)
    return {found_inf.device: found_inf}
