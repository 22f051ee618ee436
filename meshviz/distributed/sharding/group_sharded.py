"""ZeRO-style group sharding (Paddle's group_sharded_parallel): levels os, os_g and p_g_os."""

from __future__ import annotations

import weakref

import torch.distributed as tdist
import torch.nn as nn

from ...core.sharding import LEVELS
from ...nn import ClipGradByGlobalNorm, fleet_mp_group
from ...runtime.agree import alone, same_on_every_rank, same_or_refused
from ...runtime.devices import place_module
from ...runtime.groups import resolve
from ...runtime.world import device, init_parallel_env
from ...runtime.zero import ShardingGroup, check_elementwise, layout_settings
from .optimizer import GroupShardedOptimizer
from .scaler import make_scaler

__all__ = ["group_sharded_parallel", "resolve_group", "sharding_group_of"]

_GROUP_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the ShardingGroup it was sharded over


def _validate(model, optimizer, level, scaler, segment_size, buffer_max_size, grad_clip, offload, dp_group,
              exclude_layer):
    if level not in LEVELS:
        raise ValueError(
            f"group_sharded_parallel: level must be one of {', '.join(repr(v) for v in LEVELS)}, got {level!r}"
        )
    if not isinstance(model, nn.Module):
        raise ValueError(f"group_sharded_parallel: model must be a torch.nn.Module, got {type(model).__name__}")
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
        raise ValueError(
            f"group_sharded_parallel: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, GroupShardedOptimizer) or getattr(optimizer, "_meshviz_sharded", False):
        raise ValueError("group_sharded_parallel: this optimizer is already sharded (an earlier call made it step "
                         "this rank's shards); pass a fresh torch optimizer over the model's parameters")
    if isinstance(segment_size, bool) or not isinstance(segment_size, int) or segment_size < 0:
        raise ValueError(f"group_sharded_parallel: segment_size must be an int >= 0, got {segment_size!r}")
    if isinstance(buffer_max_size, bool) or not isinstance(buffer_max_size, int) or buffer_max_size < 1:
        raise ValueError(f"group_sharded_parallel: buffer_max_size must be a positive int, got {buffer_max_size!r}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "step", "update")):
        raise ValueError("group_sharded_parallel: scaler must be a GradScaler (scale/step/update)")
    if grad_clip is not None and not isinstance(grad_clip, ClipGradByGlobalNorm):
        raise ValueError("group_sharded_parallel: grad_clip must be a meshviz.nn.ClipGradByGlobalNorm")
    if dp_group is not None and offload and level in ("os", "os_g"):
        raise ValueError("group_sharded_parallel: offload with dp_group is not supported at levels 'os' and 'os_g' "
                         "(as in Paddle's sharding stage 2); use offload without dp_group, or dp_group without offload")
    if level == "p_g_os" and exclude_layer is not None and (
            not isinstance(exclude_layer, (list, tuple))
            or not all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in exclude_layer)):
        raise ValueError(f"group_sharded_parallel: exclude_layer must be a list of layer class names or id(layer)s, "
                         f"got {exclude_layer!r}")
    names = {id(p): n for n, p in model.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("group_sharded_parallel: the optimizer holds a parameter that is not in the model")
    seen = set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) in seen:
                raise ValueError(f"group_sharded_parallel: parameter {names[id(p)]} appears twice in the optimizer")
            seen.add(id(p))
    return names


def group_sharded_parallel(
    model,
    optimizer,
    level,
    scaler=None,
    group=None,
    offload=False,
    sync_buffers=False,
    buffer_max_size=2**23,
    segment_size=2**20,
    sync_comm=False,
    dp_group=None,
    exclude_layer=None,
    *,
    grad_clip=None,
):
    """Shard optimizer states ('os'), also gradients ('os_g'), also parameters ('p_g_os') over ``group``.

    Returns ``(model, optimizer, scaler)``. Every rank of the group calls it. Parameters start from the group's
    first rank; a model on the CPU moves to this rank's GPU first when the ranks compute on GPUs (as Paddle creates
    layers on the current device). ``segment_size``: parameters with fewer elements stay whole (os/os_g: owned by
    one rank, chosen greedily by size; p_g_os: replicated). 'os' averages whole gradients once per step; 'os_g' reduces
    each gradient to its owners during backward and frees it, in one order on every rank (the model's parameters
    in reverse; one this rank's backward does not reach goes as zeros at its turn); 'p_g_os' is torch FSDP2
    (``fully_shard``) on each child module and the root. A gradient some ranks did not make (a branch one rank took;
    at 'os' and 'os_g' also a rank that ran no backward) is averaged with zeros from them, as in a dense run; at
    'p_g_os' every rank must still run each sharded sublayer's forward (with collective checking on, every rank
    raises where one does not). ``offload`` keeps every optimizer state (and, for p_g_os, the sharded parameters) on
    the CPU when the ranks compute on GPUs, small parameters included: the optimizer steps CPU copies of them (on
    CPU ranks everything already is there). ``grad_clip`` (or ``optimizer._grad_clip``): a
    ``meshviz.nn.ClipGradByGlobalNorm`` applied to the sharded gradients with the true global norm.
    Under fleet's model parallelism the squares of the split weights' gradients (``is_distributed``) are added
    over the mp group too, the others counted once, so that every rank clips with the norm of the whole model;
    a parameter with ``need_clip = False`` is neither counted nor scaled, as in Paddle.
    ``buffer_max_size`` bounds the fused all-reduce of 'os' (elements); ``sync_comm`` is accepted for
    compatibility (torch orders its own communication).
    ``dp_group``: data parallelism across sharding groups, as Paddle's: the parameters also start from its first
    rank, and each gradient (the part this rank steps) is averaged over it too, so a step averages the gradients of
    every rank of both groups. Its ranks must hold the same place in their own sharding groups (the same shards).
    ``exclude_layer`` (p_g_os): layers, by class name or ``id(layer)``, whose own parameters stay whole.
    """
    refused = None
    try:
        names = _validate(model, optimizer, level, scaler, segment_size, buffer_max_size, grad_clip, offload,
                          dp_group, exclude_layer)
        check_elementwise(optimizer, "group_sharded_parallel")
    except ValueError as e:
        if alone():  # no other rank can wait for this one: before starting a process group
            raise
        refused, names = e, {}
    try:  # also where this rank refused: the others would wait for it in the settings check below
        init_parallel_env()
    except Exception:
        if refused is None:
            raise
        raise refused from None  # what was wrong with the arguments says more than the start that failed
    grp = resolve_group(group)
    dp = None
    try:
        dp = _resolve_dp_group(dp_group, grp)
    except ValueError as e:
        refused = refused or e
    excluded = _excluded_params(model, exclude_layer, names) if level == "p_g_os" and refused is None else set()
    clip = grad_clip or getattr(optimizer, "_grad_clip", None)
    clip = "None" if clip is None else f"{type(clip).__name__}({getattr(clip, 'clip_norm', '')})"
    # what the ranks' collectives follow from: where one rank differs, the others would wait in another collective;
    # a rank whose arguments were refused takes part too, so that every rank raises, not that one alone
    settings = same_or_refused("group_sharded_parallel", {
        "level": level, "offload": bool(offload), "sync_buffers": bool(sync_buffers), "segment_size": segment_size,
        "dp_group size": 1 if dp is None else dp.size, "buffer_max_size": buffer_max_size, "grad_clip": clip,
        "exclude_layer": ", ".join(sorted(excluded)) or "none", **layout_settings(model, optimizer, names)},
        refused, grp.pg, grp.ranks)
    if dp is not None:  # a dp peer steps the same shards: it must hold the same place in a group of the same size
        same_on_every_rank("group_sharded_parallel (over dp_group)",
                           {**settings, "sharding group size": grp.size, "place in the sharding group": grp.rank},
                           dp.pg, dp.ranks)
    dev = device()
    place_module(model, "group_sharded_parallel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
    # ``is True``: a torch tensor's own ``is_distributed`` is a method
    split = {n for n, p in model.named_parameters() if getattr(p, "is_distributed", False) is True}
    no_clip = {n for n, p in model.named_parameters() if getattr(p, "need_clip", True) is False}
    # 0 (Paddle: slice every parameter) plans as 1: a parameter with no elements stays whole
    opt = GroupShardedOptimizer(optimizer, model, level, grp, names, dev, offload=offload,
                                segment_size=max(segment_size, 1),
                                grad_clip=grad_clip, buffer_max_size=buffer_max_size, sync_buffers=sync_buffers,
                                dp=dp, exclude=excluded, clip_kinds=(split, no_clip),
                                mp=fleet_mp_group() if split else None)
    optimizer._meshviz_sharded = True  # its param_groups hold this rank's shards now, not the model's parameters
    _GROUP_OF[model] = grp
    return model, opt, make_scaler(scaler, grp, dev.type)


def _resolve_dp_group(dp_group, grp: ShardingGroup) -> ShardingGroup | None:
    """The data-parallel group across sharding groups (None where not given or of one rank)."""
    if dp_group is None:
        return None
    g = resolve(dp_group)
    me = tdist.get_rank()
    if g.rank < 0:
        raise ValueError(f"group_sharded_parallel: rank {me} is not in the dp_group {list(g.ranks)}")
    if set(g.ranks) & set(grp.ranks) != {me}:
        raise ValueError(f"group_sharded_parallel: the dp_group {list(g.ranks)} and the sharding group "
                         f"{list(grp.ranks)} must have only this rank ({me}) in common: dp_group joins ranks of "
                         f"different sharding groups that hold the same shards")
    return ShardingGroup(g) if g.nranks > 1 else None


def _excluded_params(model, exclude_layer, names: dict) -> set:
    """The names of the parameters that layers named in ``exclude_layer`` (class name or id) hold themselves."""
    if not exclude_layer:
        return set()
    return {names[id(p)] for m in model.modules() if id(m) in exclude_layer or type(m).__name__ in exclude_layer
            for p in m.parameters(recurse=False)}


def sharding_group_of(model) -> ShardingGroup | None:
    """The group ``group_sharded_parallel`` last sharded ``model`` over (None where it did not)."""
    return _GROUP_OF.get(model)


def resolve_group(group) -> ShardingGroup:
    """The sharding group ``group`` names (None: the world); this rank must be in it."""
    g = resolve(group)
    if g.rank < 0:
        raise ValueError(f"group_sharded_parallel: rank {tdist.get_rank()} is not in the group {list(g.ranks)}")
    return ShardingGroup(g)
