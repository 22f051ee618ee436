"""ZeRO-style group sharding (Paddle's group_sharded_parallel): levels os, os_g and p_g_os."""

from __future__ import annotations

import torch.nn as nn

from ... import trace
from ...core.sharding import LEVELS, SHARDED, plan_pieces
from ...nn import ClipGradByGlobalNorm
from ...runtime.devices import place_module
from ...runtime.world import device, init_parallel_env
from .fsdp import apply_fsdp, unmix_foreach
from .group import ShardingGroup, broadcast_module, resolve_group
from .optimizer import GroupShardedOptimizer
from .scaler import make_scaler
from .slot import Slot

__all__ = ["group_sharded_parallel"]


def _validate(model, optimizer, level, scaler, segment_size, buffer_max_size, grad_clip):
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
    if isinstance(optimizer, GroupShardedOptimizer):
        raise ValueError("group_sharded_parallel: this optimizer is already sharded")
    for name, v in (("segment_size", segment_size), ("buffer_max_size", buffer_max_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"group_sharded_parallel: {name} must be a positive int, got {v!r}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "step", "update")):
        raise ValueError("group_sharded_parallel: scaler must be a GradScaler (scale/step/update)")
    if grad_clip is not None and not isinstance(grad_clip, ClipGradByGlobalNorm):
        raise ValueError("group_sharded_parallel: grad_clip must be a meshviz.nn.ClipGradByGlobalNorm")
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


def _emit_ownership(level, grp: ShardingGroup, slots):
    if not trace.active():
        return
    for s in slots:
        piece = s.piece
        lo, hi = piece.ranges[grp.rank]
        trace.emit(trace.Ownership(
            s.name, level, SHARDED[level], tuple(piece.shape), group=tuple(grp.ranks), held=(lo, hi),
            ranges=piece.ranges, mode=piece.mode, local_shape=(hi - lo,), nbytes=(hi - lo) * s.param.element_size(),
        ).to_event())


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
    *,
    grad_clip=None,
):
    """Shard optimizer states ('os'), also gradients ('os_g'), also parameters ('p_g_os') over ``group``.

    Returns ``(model, optimizer, scaler)``. Every rank of the group calls it. Parameters start from the group's
    first rank; a model on the CPU moves to this rank's GPU first when the ranks compute on GPUs (as Paddle creates
    layers on the current device). ``segment_size``: parameters with fewer elements stay whole (os/os_g: owned by
    one rank, chosen greedily by size; p_g_os: replicated). 'os' averages whole gradients once per step; 'os_g' reduces
    each gradient to its owners as soon as backward produces it and frees it; 'p_g_os' is torch FSDP2
    (``fully_shard``) on each child module and the root. ``offload`` keeps every optimizer state (and, for p_g_os,
    the sharded parameters) on the CPU when the ranks compute on GPUs, small parameters included: the optimizer
    steps CPU copies of them (on CPU ranks everything already is there). ``grad_clip`` (or ``optimizer._grad_clip``): a
    ``meshviz.nn.ClipGradByGlobalNorm`` applied to the sharded gradients with the true global norm.
    ``buffer_max_size`` bounds the fused all-reduce of 'os' (elements); ``sync_comm`` is accepted for
    compatibility (torch orders its own communication).
    """
    names = _validate(model, optimizer, level, scaler, segment_size, buffer_max_size, grad_clip)
    init_parallel_env()
    grp = resolve_group(group)
    dev = device()
    place_module(model, "group_sharded_parallel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
    broadcast_module(model, grp)

    order = [p for g in optimizer.param_groups for p in g["params"]]
    pieces = plan_pieces([(names[id(p)], tuple(p.shape)) for p in order], level, grp.size, segment_size)
    piece_of = {pc.name: pc for pc in pieces}

    if level == "p_g_os":
        apply_fsdp(model, piece_of, grp, dev, offload)
        new_params = dict(model.named_parameters())
        for g in optimizer.param_groups:
            g["params"] = [new_params[names[id(p)]] for p in g["params"]]
        order = [p for g in optimizer.param_groups for p in g["params"]]
        unmix_foreach(optimizer)

    gidx = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
    slots = [Slot(pc.name, p, pc, grp.rank, gi) for p, pc, gi in zip(order, pieces, gidx)]
    slot_of = {id(s.param): s for s in slots}
    optimizer.state.clear()
    offload = bool(offload) and dev.type != "cpu"  # on a CPU rank every state already lives on the CPU
    if level in ("os", "os_g"):
        for g in optimizer.param_groups:
            shards = []
            for p in g["params"]:
                s = slot_of[id(p)]
                if not s.owned:
                    continue
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
                view = p.detach().view(-1)[s.lo : s.hi]
                s.shard = nn.Parameter(view.to("cpu", copy=True) if offload else view)
                shards.append(s.shard)
            g["params"] = shards
    else:
        # FSDP2's CPUOffloadPolicy keeps the sharded parameters (and their states) on the CPU; the small, whole
        # ones it ignores are offloaded here: the optimizer steps a CPU copy, copied back after each step
        for s in slots:
            whole = s.piece.mode == "replicated"
            s.shard = nn.Parameter(s.param.detach().reshape(-1).to("cpu", copy=True)) if offload and whole \
                else s.param
        if offload:
            swap = {id(s.param): s.shard for s in slots}
            for g in optimizer.param_groups:
                g["params"] = [swap.get(id(p), p) for p in g["params"]]

    opt = GroupShardedOptimizer(optimizer, model, level, grp, slots, offload, grad_clip, buffer_max_size)
    for s in slots:
        if level == "os_g":
            hook = (lambda slot: (lambda p: opt._reduce_to_owner(slot)))(s)
        elif level == "os" or s.piece.mode == "replicated":
            hook = opt._mark_dirty
        else:
            continue
        opt._hooks.append(s.param.register_post_accumulate_grad_hook(hook))
    if sync_buffers:
        model.register_forward_pre_hook(lambda m, args: broadcast_module(m, grp, "buffers"))
    _emit_ownership(level, grp, slots)
    return model, opt, make_scaler(scaler, grp, dev.type)
