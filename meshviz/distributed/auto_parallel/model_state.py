"""DistModel's state_dict / set_state_dict: the layer's tensors, the optimizer's states, its learning rate and
float16's loss scale."""

from __future__ import annotations

import math
import struct

import torch
from torch.distributed.tensor import DTensor

from ...runtime.zero import create_states
from ..api import is_dist_tensor
from . import program as prog
from .amp import LossScaling

__all__ = ["state_dict", "set_state_dict", "LearningRates", "learning_rates"]


def _is_dist(t) -> bool:
    return is_dist_tensor(t) or isinstance(t, DTensor)


def _float32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _shortest(v: float) -> float:
    """The shortest decimal that a float32 ``v`` was rounded from (0.1, not 0.10000000149): a learning rate
    loaded from Paddle's float32 tensor steps as the one saved, not one float32 rounding off it."""
    for digits in range(1, 10):
        c = float(f"{v:.{digits}g}")
        if _float32(c) == v:
            return c
    return v


class LearningRates:
    """Paddle's ``learning_rate_0``: the learning rate the optimizer's next step uses, a float32 0-dim tensor (one
    per param group: ``learning_rate_<i>``). A value loaded into it (``set_state_dict``, or in place by
    ``dist.load_state_dict``) reaches the param group before the next step; otherwise it follows the group's rate,
    as a torch LR scheduler sets it."""

    def __init__(self, optimizer):
        self.groups = optimizer.param_groups
        self.tensors = [torch.tensor(self._lr(g), dtype=torch.float32) for g in self.groups]
        self.seen = [(float(t), self._lr(g)) for t, g in zip(self.tensors, self.groups)]

    @staticmethod
    def _lr(group) -> float:
        return float(group["lr"])

    def keys(self) -> list:
        return [f"learning_rate_{i}" for i in range(len(self.groups))]

    def scheduled(self) -> bool:
        """Whether a torch LR scheduler drives the rates (it marks each group's ``initial_lr``): Paddle's state
        then holds the rate among the parameters ('param'), else among the optimizer's states ('opt')."""
        return any("initial_lr" in g for g in self.groups)

    def sync(self) -> None:
        for i, (t, g) in enumerate(zip(self.tensors, self.groups)):
            loaded, lr = float(t), self._lr(g)
            if loaded != self.seen[i][0]:
                lr = _shortest(loaded)
                if torch.is_tensor(g["lr"]):
                    g["lr"].fill_(lr)
                else:
                    g["lr"] = lr
            elif lr != self.seen[i][1]:
                t.fill_(lr)
            self.seen[i] = (float(t), self._lr(g))

    def tensors_dict(self) -> dict:
        self.sync()
        return dict(zip(self.keys(), self.tensors))

    def values_of(self, sd: dict) -> dict:
        """The rates ``sd`` holds under this optimizer's keys, as numbers; ValueError naming the key for one that
        is not one finite number >= 0 (before anything is written)."""
        out = {}
        for k in self.keys():
            if k not in sd:
                continue
            v = sd[k]
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            elif not torch.is_tensor(v) and hasattr(v, "__array__"):
                v = torch.as_tensor(v)
            if torch.is_tensor(v) and v.numel() == 1 and v.dtype != torch.bool and not v.is_complex():
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 3.4e38:
                shown = f"a tensor of shape {list(v.shape)}" if torch.is_tensor(v) else repr(v)
                raise ValueError(f"set_state_dict: {k} takes one learning rate (a finite number >= 0; state_dict "
                                 f"gives a float32 0-dim tensor), got {shown}")
            out[k] = _float32(float(v))
        return out

    def load(self, values: dict) -> None:
        for i, k in enumerate(self.keys()):
            if k in values:
                self.tensors[i].fill_(values[k])
                self.seen[i] = (math.nan, self.seen[i][1])  # taken as loaded, even where it holds that value
        self.sync()


def learning_rates(dm) -> LearningRates | None:
    """``dm``'s LearningRates (made at the first use; again where param groups were added); None without an
    optimizer with param groups."""
    groups = getattr(dm._optimizer, "param_groups", None)
    if not groups:
        return None
    lrs = getattr(dm, "_lrs", None)
    if lrs is None or lrs.groups is not groups or len(lrs.tensors) != len(groups):
        lrs = dm._lrs = LearningRates(dm._optimizer)
    return lrs


def state_dict(dm, mode="all") -> dict:
    """'param': the layer's state dict; 'opt': optimizer states as ``{param}.{state}`` keys and, under float16's
    dynamic loss scaling, Paddle's ``loss_scaling_0`` / ``num_good_steps_0`` / ``num_bad_steps_0``; 'all': both.
    Paddle's ``learning_rate_0`` (the next step's rate, float32, 0-dim) is in 'opt', or in 'param' where a torch LR
    scheduler drives it, as Paddle places it with an LRScheduler."""
    if mode not in ("all", "param", "opt"):
        raise ValueError(f"state_dict: mode must be 'all', 'param' or 'opt', got {mode!r}")
    out = {}
    lrs = learning_rates(dm) if dm._optimizer is not None else None
    if mode in ("all", "param"):
        out.update(dm._layer.state_dict())
        if lrs is not None and lrs.scheduled():
            out.update(lrs.tensors_dict())
    if mode in ("all", "opt") and dm._optimizer is not None:
        out.update(opt_state(dm))
        if dm._scaler is not None:
            out.update(dm._scaling.tensors())
        if lrs is not None and not lrs.scheduled():
            out.update(lrs.tensors_dict())
    return out


def opt_state(dm) -> dict:
    if dm._sharded:
        create_states(dm._optimizer, dm._optimizer.grad_params())
        full = dm._optimizer.full_state_dict()
        order = [pc.name for pc in dm._optimizer.ownership]
        return {f"{order[i]}.{k}": v for i, st in full["state"].items() for k, v in st.items()}
    # before training the states are made first, as Paddle's program holds them from its start: a checkpoint
    # loaded into this dict (dist.load_state_dict) then reaches the optimizer
    create_states(dm._optimizer, dm._layer.parameters())
    by_id = {id(p): n for n, p in dm._layer.named_parameters()}
    return {f"{by_id.get(id(p), '?')}.{k}": v for p, st in dm._optimizer.state.items() for k, v in st.items()}


def _unknown(key, pname, index, known) -> ValueError:
    if pname not in index:
        return ValueError(f"set_state_dict: unknown key {key!r}")
    have = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == pname)
    return ValueError(f"set_state_dict: unknown key {key!r}: the optimizer holds no state "
                      f"{key.rpartition('.')[2]!r} for {pname} (it holds {have})")


def set_state_dict(dm, sd: dict) -> None:
    """Load values (as ``state_dict`` gives them) into the layer's parameters, the optimizer and the loss scale.
    Every key is checked before anything is written: one that names no tensor of the model raises ``ValueError``
    (Paddle's NotFound), also a state the optimizer does not hold for a parameter it steps."""
    if not isinstance(sd, dict):
        raise TypeError(f"set_state_dict: expected a dict (as state_dict gives), got {type(sd).__name__}")
    own = dm._layer.state_dict()
    params = {k: v for k, v in sd.items() if k in own}
    for k, v in params.items():
        if _is_dist(own[k]) and not _is_dist(v):
            raise ValueError(f"set_state_dict: {k} is a dist tensor; pass a dist tensor for it")
        prog.check_shape(k, v, own[k])
    scale = {k: v for k, v in sd.items() if k in LossScaling.KEYS and k not in own}
    if scale and dm._scaler is None:
        raise ValueError(f"set_state_dict: {sorted(scale)} are float16's dynamic loss scaling, which this DistModel "
                         f"does not run (strategy.amp: float16 with use_dynamic_loss_scaling, and an optimizer)")
    scale = {k: LossScaling.value_of(k, v) for k, v in scale.items()}
    lrs = learning_rates(dm) if dm._optimizer is not None else None
    rates = lrs.values_of({k: v for k, v in sd.items() if k not in own}) if lrs is not None else {}
    rest = {k: v for k, v in sd.items() if k not in own and k not in scale and k not in rates}
    if rest and dm._optimizer is None:
        raise ValueError(f"set_state_dict: unknown keys {sorted(rest)[:5]} (no optimizer to load them into)")
    # optimizer keys are "{parameter}.{state}": a sharded optimizer names its parameters as its pieces
    names = [pc.name for pc in dm._optimizer.ownership] if dm._sharded else \
        [n for n, _ in dm._layer.named_parameters()] if rest else []
    index = {n: i for i, n in enumerate(names)}
    known = set(opt_state(dm)) if rest else set()  # the states made first, as Paddle's program holds them
    states: dict = {}
    for key, v in rest.items():
        pname, _, skey = key.rpartition(".")
        if key not in known:
            raise _unknown(key, pname, index, known)
        states.setdefault(index[pname], {})[skey] = v
    by_index = list(dm._layer.parameters())
    for i, st_in in states.items():
        for skey, v in st_in.items():
            if dm._sharded:  # the same check on every rank: the piece's whole shape, not this rank's shard
                prog.check_piece(f"{names[i]}.{skey}", v, dm._optimizer.ownership[i])
            else:
                prog.check_shape(f"{names[i]}.{skey}", v, dm._optimizer.state.get(by_index[i], {}).get(skey))
    with torch.no_grad():
        for k, v in params.items():
            own[k].copy_(v)
    if scale:
        dm._scaling.load(scale, dm._scaler)
    if rates:
        lrs.load(rates)
    if not states:
        return
    if dm._sharded:
        dm._optimizer.load_full_state_dict(states)
        return
    for i, st_in in states.items():
        st = dm._optimizer.state[by_index[i]]
        for skey, v in st_in.items():
            if torch.is_tensor(st.get(skey)):
                st[skey].copy_(v)
            else:
                st[skey] = v.clone() if torch.is_tensor(v) else v
