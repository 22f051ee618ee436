"""Paddle's ``dist.shard_scaler``: a loss scaler whose inf/nan check agrees on every rank."""

from __future__ import annotations

import functools

import torch

from ..runtime.devices import device
from ..runtime.scaler import LossScaler, agree_found_inf, grad_params, settings_of, unscale_blocks_

__all__ = ["shard_scaler", "unscale_for_step"]


class _ShardScaler(LossScaler):
    """A loss scaler whose inf/nan check agrees on every rank (Paddle's GradScaler: its settings, its getters).

    Dynamic scaling: the scale is multiplied by ``decr_ratio`` after ``decr_every_n_nan_or_inf`` steps in a row
    that saw inf/nan (those steps are skipped), by ``incr_ratio`` after ``incr_every_n_steps`` clean steps in a row.
    """

    def __init__(self, **settings):
        super().__init__(**settings, who="shard_scaler")


class _ShardScaling:
    """What ``shard_scaler`` gives a torch ``GradScaler``, in place (Paddle replaces its scaler's ``_unscale``):
    the gradients unscaled are those backward filled (a sharded optimizer's inner one steps stand-ins), block by
    block, and the inf/nan check is all-reduced (MAX) over the world, so every rank skips a step together; and
    Paddle's getters."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        per_device = unscale_blocks_(grad_params(optimizer), inv_scale, found_inf)
        agree_found_inf(found_inf)
        return per_device

    def _check_scale_growth_tracker(self, funcname):
        if self._scale is None:  # a rank that scaled no loss (a pipeline stage before the last): the initial scale
            self._lazy_init_scale_growth_tracker(device())
        return super()._check_scale_growth_tracker(funcname)

    def is_enable(self) -> bool:
        return self.is_enabled()

    def is_use_dynamic_loss_scaling(self) -> bool:
        return True

    def get_init_loss_scaling(self) -> float:
        return float(self._init_scale)

    def get_incr_ratio(self) -> float:
        return self.get_growth_factor()

    def get_decr_ratio(self) -> float:
        return self.get_backoff_factor()

    def get_incr_every_n_steps(self) -> int:
        return self.get_growth_interval()

    def get_decr_every_n_nan_or_inf(self) -> int:
        return 1  # torch backs off at every step that saw inf/nan

    def minimize(self, optimizer, *args, **kwargs) -> None:
        self.step(optimizer)
        self.update()


class _ShardGradScaler(_ShardScaling, torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` after ``shard_scaler``."""


@functools.cache
def _shard_class(cls: type) -> type:
    if cls is torch.amp.GradScaler:
        return _ShardGradScaler
    return type(cls.__name__, (_ShardScaling, cls), {"__doc__": f"A {cls.__name__} after shard_scaler."})


def shard_scaler(scaler=None):
    """Make ``scaler`` agree on inf/nan over every rank, in place, and return it (as Paddle's, which replaces the
    scaler's unscale): every rank skips a step when any rank saw inf/nan.

    A torch ``GradScaler`` keeps its settings, state and API, and gains Paddle's getters; one that unscales its own
    way (a ``GroupShardedScaler``, agreeing over its group) and a scaler from ``shard_scaler`` are returned as
    they are. With none, Paddle's defaults but a starting scale of 2**15; a scaler of another kind is read for its
    settings (scale, growth and backoff factors, interval, enabled) and a new one returned.
    """
    if scaler is None:
        return _ShardScaler()
    if isinstance(scaler, LossScaler):
        scaler._group = None
        return scaler
    if isinstance(scaler, torch.amp.GradScaler):
        cls = type(scaler)
        if not issubclass(cls, _ShardScaling) and cls._unscale_grads_ is torch.amp.GradScaler._unscale_grads_:
            scaler.__class__ = _shard_class(cls)
        return scaler
    return _ShardScaler(**settings_of(scaler))


@torch.no_grad()
def unscale_for_step(optimizer, grad_scaler) -> bool:
    """What a torch ``GradScaler`` leaves to an optimizer with ``_step_supports_amp_scaling``, which it hands itself
    to (``optimizer.step(grad_scaler=...)``, on every rank, instead of unscaling and checking the param_groups'
    gradients alone): every gradient backward made for ``optimizer`` unscaled (what ``unscale_()`` left scaled),
    the inf/nan check agreed over every rank and recorded as the scaler's, so that its ``update()`` backs off on
    every rank alike. Returns whether the step is skipped (inf/nan on some rank)."""
    from torch.amp.grad_scaler import OptState

    state = grad_scaler._per_optimizer_states[id(optimizer)]
    found = torch.zeros((), dtype=torch.float32, device=grad_scaler._scale.device)
    todo = grad_params(optimizer)
    if state["stage"] is OptState.UNSCALED:  # unscale_() ran: torch's own unscaled the param_groups' gradients only
        for v in state["found_inf_per_device"].values():
            found += v.to(found.device)
        if type(grad_scaler)._unscale_grads_ is torch.amp.GradScaler._unscale_grads_:
            stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
            todo = [p for p in todo if id(p) not in stepped]
        else:  # a scaler that unscales its own way (shard_scaler's) unscaled every gradient
            todo = []
    if todo:
        unscale_blocks_(todo, grad_scaler._scale.double().reciprocal().float(), found)
    flag = found.to(device())  # on the device the rank's backend reduces (a "cpu" scaler of a GPU rank too)
    agree_found_inf(flag)
    found.copy_(flag)
    state["found_inf_per_device"] = {found.device: found}
    return bool(found.item())
