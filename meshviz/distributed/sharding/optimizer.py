"""GroupShardedOptimizer: Paddle's sharded optimizer over the ZeRO engine's flat owner slots."""

from __future__ import annotations

import torch

from ...runtime.zero import FlatZero, create_states, gather_object
from ...trace.status import name_ranks

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
        """Load this rank's shard (what ``state_dict()`` gave), or the whole model's optimizer state in the unwrapped
        optimizer's format (``save_group_sharded_model``'s ``model.pdopt``, a one-process optimizer's
        ``state_dict()``), of which each rank loads its part, hyperparameters included (as torch's
        ``load_state_dict``). Collective: every rank of the group calls it, with states of one format."""
        try:
            whole, refused = self._whole_format(state), None
        except (TypeError, ValueError) as e:  # said on every rank, not here alone: the others would wait for it
            whole, refused = "refused", e
        said = gather_object(whole, self._group)
        if refused is not None:
            raise refused
        if "refused" in said:
            ranks = name_ranks([r for r, k in zip(self._group.ranks, said) if k == "refused"])
            raise ValueError(f"{type(self).__name__}.load_state_dict: {ranks} of the group {self._group.ranks} "
                             f"refused the state given there (each says why); nothing was loaded")
        kinds = set(said) - {None}
        if len(kinds) > 1:
            raise ValueError(f"{type(self).__name__}.load_state_dict: some ranks of the group {self._group.ranks} were "
                             f"given the whole model's optimizer state and others their own shard's; give every rank "
                             f"the same kind")
        # foreach / fused stay as sharding set them (one foreach call cannot mix FSDP's DTensors with whole tensors)
        kernels = [{k: g[k] for k in ("foreach", "fused") if k in g} for g in self._inner_opt.param_groups]
        if True not in kinds:
            self._inner_opt.load_state_dict(state)
        else:
            groups = state["param_groups"]
            for mine, saved in zip(self._inner_opt.param_groups, groups):
                mine.update({k: v for k, v in saved.items() if k != "params"})
            at = _slot_of(groups)
            self.load_full_state_dict({at.get(k, k): v for k, v in state["state"].items()})
        for g, kept in zip(self._inner_opt.param_groups, kernels):
            g.update(kept)

    set_state_dict = load_state_dict  # Paddle's name

    def _whole_format(self, state) -> bool | None:
        """Whether ``state`` is the whole model's (True), this rank's shard's (False) or either, read alike (None:
        every piece this rank holds is whole here, in the same order)."""
        if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) or "state" not in state:
            raise TypeError(f"{type(self).__name__}.load_state_dict: expected an optimizer state dict "
                            f"({{'state': ..., 'param_groups': [...]}}), got {type(state).__name__}")
        counts = [len(g.get("params", ())) for g in state["param_groups"]]
        whole = [sum(s.group_index == gi for s in self._slots) for gi in range(len(self._inner_opt.param_groups))]
        mine = [len(g["params"]) for g in self._inner_opt.param_groups]
        if counts != whole and counts != mine:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state's parameter groups hold {counts} "
                             f"parameters; this rank's shard's hold {mine} and the whole model's {whole}")
        if counts != whole:
            return False
        if counts != mine:
            return True
        at = _slot_of(state["param_groups"])
        for key, st in state["state"].items():
            if at.get(key) is None or not isinstance(st, dict):
                continue
            s = self._slots[at[key]]
            for v in st.values():
                if not torch.is_tensor(v) or v.dim() == 0 or hasattr(v, "to_local"):
                    continue
                if s.piece.mode == "fsdp" or (s.piece.mode == "slice" and s.hi - s.lo != s.piece.numel):
                    return v.numel() == s.piece.numel  # a plain tensor of the whole parameter
        return None


def _slot_of(groups) -> dict:
    """A saved state's parameter index -> its place in the order of ``groups``' parameters (the slots' order)."""
    return {i: n for n, i in enumerate(j for g in groups for j in g["params"])}
