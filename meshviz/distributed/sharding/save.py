"""save_group_sharded_model: the full model and optimizer state, gathered, written by the group's first rank."""

from __future__ import annotations

import os

import torch

from ...runtime.agree import same_or_refused
from ...runtime.devices import full_tensor
from ...runtime.zero.group import gather_object
from .group_sharded import resolve_group, sharding_group_of
from .optimizer import GroupShardedOptimizer

__all__ = ["save_group_sharded_model", "MODEL_FILE", "OPT_FILE"]

MODEL_FILE = "model.pdmodel"
OPT_FILE = "model.pdopt"


def save_group_sharded_model(model, output, optimizer=None):
    """Write the full model (``output/model.pdmodel``) and optimizer (``output/model.pdopt``) with torch.save.

    Every rank of the sharding group calls it (it gathers), each with or each without the optimizer; the group's
    first rank writes, and a failure to write, or an argument one rank refuses, raises on every rank. The files hold
    plain tensors: ``model.load_state_dict(torch.load(".../model.pdmodel"))`` on an unwrapped model, and
    ``opt.load_state_dict(torch.load(".../model.pdopt"))`` on its unwrapped optimizer, or (every rank) on the one
    ``group_sharded_parallel`` returned (``set_state_dict`` too), where each rank loads its part.
    """
    refused = None
    if os.path.isfile(output):
        refused = ValueError(f"save_group_sharded_model: output ({output}) must be a directory, not a file")
    elif optimizer is not None and not isinstance(optimizer, GroupShardedOptimizer):
        refused = ValueError("save_group_sharded_model: optimizer must be the one group_sharded_parallel returned")
    own = sharding_group_of(model)  # without the optimizer, the model's own group (one of several, say) writes
    if refused is None and optimizer is not None and own is not None and own.ranks != optimizer._group.ranks:
        refused = ValueError(f"save_group_sharded_model: the model was sharded over ranks {own.ranks} and the "
                             f"optimizer over {optimizer._group.ranks}; pass the optimizer group_sharded_parallel "
                             f"returned with it")
    grp = own if own is not None else optimizer._group if refused is None and optimizer is not None else \
        resolve_group(None)
    # a rank that refused, or that gathers no optimizer where the others do, would leave them waiting in the
    # gathers below: every rank raises, before any
    same_or_refused("save_group_sharded_model", {"optimizer given": optimizer is not None}, refused, grp.pg,
                    grp.ranks)
    sd = {}
    for k, v in model.state_dict().items():
        v = full_tensor(v)
        sd[k] = v.detach().cpu().clone()
    osd = optimizer.full_state_dict() if optimizer is not None else None
    failed = None
    if grp.rank == 0:
        try:
            os.makedirs(output, exist_ok=True)
            torch.save(sd, os.path.join(output, MODEL_FILE))
            if osd is not None:
                torch.save(osd, os.path.join(output, OPT_FILE))
        except Exception as e:  # the others would wait for it: every rank raises instead
            failed = (type(e), f"save_group_sharded_model: rank {grp.ranks[0]} could not write {output!r}: {e}")
    failed = gather_object(failed, grp)[0]  # also the barrier: the files are there when any rank returns
    if failed is not None:
        kind, msg = failed
        try:
            error = kind(msg)
        except Exception:  # a type whose constructor takes other arguments
            error = RuntimeError(msg)
        raise error
