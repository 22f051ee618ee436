"""Paddle's ``HybridParallelOptimizer``: a torch optimizer whose step first averages what Paddle averages."""

from __future__ import annotations

from ...runtime.data_parallel import average_gradients
from ...runtime.zero import Zero
from .topology import ParallelMode

__all__ = ["HybridParallelOptimizer"]


class HybridParallelOptimizer(Zero):
    """Wraps a torch optimizer: ``step()`` first averages what Paddle averages, then steps.

    With mp, sharding or pp > 1 and dp > 1, the gradients are averaged over the data-parallel group (in pure
    data parallel, ``DataParallel`` already did it during backward); with sharding > 1 over the sharding group.
    The ZeRO step at no level: every rank steps every parameter (the sharding group only averages gradients).
    """

    def __init__(self, optimizer, hcg, strategy):
        super().__init__(optimizer, None)
        self._hcg = hcg
        self._strategy = strategy

    def _params(self):
        return [p for g in self._inner_opt.param_groups for p in g["params"]]

    def _sync_grads(self):
        hcg = self._hcg
        if hcg is None:
            return
        mode = hcg.get_parallel_mode()
        if hcg.get_sharding_parallel_world_size() > 1:
            average_gradients(self._params(), hcg.get_sharding_parallel_group())
        if mode != ParallelMode.DATA_PARALLEL and hcg.get_data_parallel_world_size() > 1:
            average_gradients(self._params(), hcg.get_data_parallel_group())

    def clear_grad(self, set_to_zero=True):
        self._inner_opt.zero_grad(set_to_none=not set_to_zero)

    def zero_grad(self, set_to_none=True):
        self._inner_opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self._inner_opt.state_dict()

    def set_state_dict(self, state_dict):
        return self._inner_opt.load_state_dict(state_dict)

    load_state_dict = set_state_dict

    def __getattr__(self, name):
        if name.startswith("__") or name == "_inner_opt":
            raise AttributeError(name)
        return getattr(self._inner_opt, name)

    def __repr__(self) -> str:
        return f"HybridParallelOptimizer({type(self._inner_opt).__name__})"
