"""ZeRO stage 1 over whole parameters: each one stepped, and its optimizer state kept, by one owner."""

from __future__ import annotations

import torch

from ...core.sharding import owners_by_size
from .engine import Zero, clear_grads
from .group import ShardingGroup

__all__ = ["OwnerZero"]


class OwnerZero(Zero):
    """``inner`` sharded over ``grp`` at stage 1 with whole parameters, as Paddle's ``DygraphShardingOptimizer``:
    owners by :func:`~meshviz.core.sharding.owners_by_size`; each gradient is averaged into its owner (a reduce),
    only the owner steps the parameter and holds its optimizer state, and the stepped value is broadcast from it.
    ``inner.param_groups`` keep only this rank's parameters; ``params`` are all of them, in the user's order.
    """

    def __init__(self, inner, grp: ShardingGroup):
        super().__init__(inner, "os")
        self._group = grp
        self.params = [p for g in inner.param_groups for p in g["params"]]
        owners = owners_by_size([p.numel() for p in self.params], grp.size)
        self.owner = {id(p): o for p, o in zip(self.params, owners)}
        self._group_sizes = [len(g["params"]) for g in inner.param_groups]
        # an optimizer that has stepped keeps the states of the parameters this rank steps (Paddle keeps their
        # accumulators); the others' go
        for p in [q for q in inner.state if self.owner.get(id(q)) != grp.rank]:
            del inner.state[p]
        for g in inner.param_groups:
            g["params"] = [p for p in g["params"] if self.owner[id(p)] == grp.rank]

    def local_state(self, state):
        """``state`` in the unwrapped optimizer's format for every parameter (a one-process optimizer's
        ``state_dict()``) cut down to the parameters this rank steps, as Paddle's ``set_state_dict`` keeps its own
        parameters' entries; this rank's own ``state_dict()`` (or anything else) is returned as it is."""
        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
            return state
        mine = [len(g["params"]) for g in self._inner_opt.param_groups]
        if [len(g.get("params", ())) for g in groups] != self._group_sizes or mine == self._group_sizes:
            return state
        params, kept_state, out_groups, new = iter(self.params), {}, [], 0
        for g in groups:
            first = new
            for i in g["params"]:
                if self.owner[id(next(params))] != self._group.rank:
                    continue
                if i in state["state"]:
                    kept_state[new] = state["state"][i]
                new += 1
            out_groups.append({**g, "params": list(range(first, new))})
        return {"state": kept_state, "param_groups": out_groups}

    def grad_params(self) -> list:
        return list(self.params)

    def owned(self) -> list:
        """The parameters this rank steps."""
        return [p for p in self.params if self.owner[id(p)] == self._group.rank]

    def _sync_grads(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self._group.size)
                    self._group.reduce(p.grad, self.owner[id(p)])

    def _gather(self) -> None:
        with torch.no_grad():
            for p in self.params:
                self._group.broadcast(p.data, self.owner[id(p)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.params, set_to_none)
