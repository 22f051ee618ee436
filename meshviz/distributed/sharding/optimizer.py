"""GroupShardedOptimizer: Paddle's sharded optimizer over the ZeRO engine's flat owner slots."""

from __future__ import annotations

from ...runtime.zero import FlatZero, create_states

__all__ = ["GroupShardedOptimizer"]


class GroupShardedOptimizer(FlatZero):
    """The sharded optimizer ``group_sharded_parallel`` returns; ``step``/``clear_grad`` like Paddle's.

    It drives the user's own optimizer, whose ``param_groups`` now hold only this rank's shards (so learning
    rate schedulers built on it keep working). ``ownership`` lists a ``Piece`` per parameter.
    """

    # torch.optim.Optimizer look-alike, enough for GradScaler and LR schedulers
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

    def minimize(self, *args, **kwargs):
        raise RuntimeError("optimizer.minimize() not support now, please use optimizer.step()")  # Paddle's words

    def state_dict(self):
        """This rank's shard of the optimizer state (torch format over its shard parameters); before training the
        states are made first (zeros, as ``shard_optimizer``'s), so that ``dist.load_state_dict`` has tensors to
        load a checkpoint into (collective then)."""
        create_states(self, self.grad_params())
        return self._inner_opt.state_dict()

    def load_state_dict(self, state):
        self._inner_opt.load_state_dict(state)
