"""GroupShardedOptimizer: drives the user's optimizer over this rank's shards; syncs gradients and parameters."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from ... import trace
from ...runtime.comm import all_reduce_mean_
from ...runtime.devices import device
from .group import ShardingGroup
from .slot import Slot, local_tensor
from .state import full_optimizer_state

__all__ = ["GroupShardedOptimizer"]


class GroupShardedOptimizer:
    """The sharded optimizer ``group_sharded_parallel`` returns; ``step``/``clear_grad`` like Paddle's.

    It drives the user's own optimizer, whose ``param_groups`` now hold only this rank's shards (so learning
    rate schedulers built on it keep working). ``ownership`` lists a ``Piece`` per parameter.
    """

    def __init__(self, inner, model, level, group: ShardingGroup, slots, offload, grad_clip, buffer_max_size):
        self._inner_opt = inner
        self._model = model
        self.level = level
        self._group = group
        self._slots = slots
        self._offload = offload
        self._grad_clip = grad_clip
        self._buffer_max_size = buffer_max_size
        self._dirty = False
        self._hooks = []

    # torch.optim.Optimizer look-alike, enough for GradScaler and LR schedulers
    @property
    def param_groups(self):
        return self._inner_opt.param_groups

    @property
    def state(self):
        return self._inner_opt.state

    @property
    def defaults(self):
        return self._inner_opt.defaults

    @property
    def ownership(self) -> list:
        return [s.piece for s in self._slots]

    @property
    def group_ranks(self) -> list:
        return list(self._group.ranks)

    def __repr__(self) -> str:
        name = type(self._inner_opt).__name__
        return f"GroupShardedOptimizer({name}, level={self.level!r}, group={self._group.ranks})"

    def get_lr(self) -> float:
        return self._inner_opt.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self._inner_opt.param_groups:
            g["lr"] = lr

    # gradients --------------------------------------------------------------------------------------------
    def _mark_dirty(self, _p=None):
        self._dirty = True

    def _reduce_to_owner(self, slot: Slot):
        """os_g backward hook: reduce this gradient so that only its owners keep their part, then free it."""
        p, g, grp = slot.param, slot.param.grad, self._group
        piece = slot.piece
        flat = g.detach().reshape(-1)
        if piece.mode == "slice":
            c = piece.ranges[0][1] - piece.ranges[0][0]
            if c * grp.size != flat.numel():
                flat = torch.cat([flat, flat.new_zeros(c * grp.size - flat.numel())])
            out = flat.new_empty(c)
            grp.reduce_scatter_into(out, flat.contiguous())
            mine = out[: slot.hi - slot.lo]
        else:
            owner = piece.owners()[0]
            flat = flat.clone() if owner == grp.rank else flat
            grp.reduce(flat, owner)
            mine = flat if owner == grp.rank else None
        if mine is not None:
            mine = mine.div_(grp.size)
            if self._offload and mine.device.type != "cpu":
                mine = mine.to("cpu")
            if slot.grad_buf is None:
                slot.grad_buf = mine
            else:
                slot.grad_buf.add_(mine)
            slot.shard.grad = slot.grad_buf
        p.grad = None

    def _sync_grads(self):
        """Average whole gradients over the group (os: all of them; p_g_os: the replicated small ones)."""
        if not self._dirty:
            return
        self._dirty = False
        grp = self._group
        slots = [s for s in self._slots if s.piece.mode in ("slice", "whole", "replicated")]
        if grp.size > 1:
            has = torch.tensor([s.param.grad is not None for s in slots], dtype=torch.uint8, device=device())
            grp.all_reduce(has, op=tdist.ReduceOp.MAX)
            live = [s for s, h in zip(slots, has.tolist()) if h]
            for s in live:
                if s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
            grads = [s.param.grad for s in live]
            itemsize = grads[0].element_size() if grads else 4
            all_reduce_mean_(grads, grp.group, bucket_bytes=self._buffer_max_size * itemsize)
        else:
            live = [s for s in slots if s.param.grad is not None]
        for s in live:
            if s.shard is None or s.shard is s.param or not s.owned:
                continue
            g = s.param.grad.detach().reshape(-1)[s.lo : s.hi]
            s.shard.grad = g.to("cpu") if s.shard.device != g.device else g

    def _clip(self):
        clip = self._grad_clip or getattr(self._inner_opt, "_grad_clip", None)
        if clip is None:
            return None
        sharded, replicated = [], []
        for s in self._slots:
            if s.piece.mode == "fsdp":
                g = s.param.grad
                if g is not None:
                    sharded.append(local_tensor(g))
            elif s.piece.mode == "replicated":
                replicated.append(s.shard.grad if s.shard is not s.param else s.param.grad)
            elif s.owned and s.shard is not None:
                sharded.append(s.shard.grad)
        return clip.clip_pieces(sharded, replicated, group=self._group.pg)

    # step -------------------------------------------------------------------------------------------------
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_grads()
        self._clip()
        with trace.span("compute", op="optimizer_step", group=self._group.ranks):
            self._inner_opt.step()
        if self.level in ("os", "os_g"):
            self._gather_params()
        elif self._offload:
            self._restore_whole()
        return loss

    @torch.no_grad()
    def _restore_whole(self):
        """p_g_os with offload: the small parameters were stepped as CPU copies; copy them back."""
        for s in self._slots:
            if s.shard is not None and s.shard is not s.param:
                s.param.detach().view(-1).copy_(s.shard.detach())

    @torch.no_grad()
    def _gather_params(self):
        grp = self._group
        for s in self._slots:
            p, piece = s.param, s.piece
            flat = p.detach().view(-1)
            if self._offload and s.shard is not None and s.owned and s.shard.device != p.device:
                flat[s.lo : s.hi].copy_(s.shard.detach(), non_blocking=False)
            if grp.size == 1:
                continue
            if piece.mode == "slice":
                c = piece.ranges[0][1] - piece.ranges[0][0]
                mine = flat.new_zeros(c)
                mine[: s.hi - s.lo] = flat[s.lo : s.hi]
                out = flat.new_empty(c * grp.size)
                grp.all_gather_into(out, mine)
                flat.copy_(out[: flat.numel()])
            else:
                owner = piece.owners()[0]
                grp.broadcast(flat, owner)

    def zero_grad(self, set_to_none: bool = True):
        for s in self._slots:
            s.param.grad = None
            s.grad_buf = None
            if s.shard is not None:
                s.shard.grad = None
        self._dirty = False

    clear_grad = zero_grad

    def minimize(self, loss):
        loss.backward()
        self.step()

    # state ------------------------------------------------------------------------------------------------
    def state_dict(self):
        """This rank's shard of the optimizer state (torch format over its shard parameters)."""
        return self._inner_opt.state_dict()

    def load_state_dict(self, state):
        self._inner_opt.load_state_dict(state)

    def full_state_dict(self, to_rank: int | None = 0):
        """The optimizer state of the whole model, in the unwrapped optimizer's format (collective)."""
        return full_optimizer_state(self._inner_opt, self._slots, self._group)
