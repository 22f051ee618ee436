"""DistModel's state_dict / set_state_dict: the layer's tensors, the optimizer's states and float16's loss scale."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ...runtime.zero import create_states
from ..api import is_dist_tensor
from . import program as prog
from .amp import LossScaling

__all__ = ["state_dict", "set_state_dict"]


def _is_dist(t) -> bool:
    return is_dist_tensor(t) or isinstance(t, DTensor)


def state_dict(dm, mode="all") -> dict:
    """'param': the layer's state dict; 'opt': optimizer states as ``{param}.{state}`` keys and, under float16's
    dynamic loss scaling, Paddle's ``loss_scaling_0`` / ``num_good_steps_0`` / ``num_bad_steps_0``; 'all': both."""
    if mode not in ("all", "param", "opt"):
        raise ValueError(f"state_dict: mode must be 'all', 'param' or 'opt', got {mode!r}")
    out = {}
    if mode in ("all", "param"):
        out.update(dm._layer.state_dict())
    if mode in ("all", "opt") and dm._optimizer is not None:
        out.update(opt_state(dm))
        if dm._scaler is not None:
            out.update(dm._scaling.tensors())
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
    rest = {k: v for k, v in sd.items() if k not in own and k not in scale}
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
