"""An optimizer step on dist parameters run on their blocks: the update is elementwise, so each rank updates its own
block of every parameter with its blocks of the gradient and the states, with torch's foreach kernels."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..dtensor import DistTensor, contiguous_stride, new_dist
from .engine import settle_states

__all__ = ["step_on_blocks"]


def _lies_alike(p: DistTensor, t) -> bool:
    return (type(t) is DistTensor and t._mpl == p._mpl and t._local.shape == p._local.shape and t._pmesh == p._pmesh
            and t._local.device == p._local.device)  # a meta-device model's blocks (simulated ranks) do not


def _blockwise(optimizer) -> bool:
    """Whether every dist parameter's gradient and tensor states lie as the parameter does (then a step on the
    blocks is the step on the tensors)."""
    any_dist = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is not DistTensor:
                continue
            any_dist = True
            if p._torch_only or (p.grad is not None and not _lies_alike(p, p.grad)):
                return False
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and not _lies_alike(p, v):
                    return False
    return any_dist


def step_on_blocks(optimizer):
    """``optimizer.step()`` with each dist parameter (its gradient and states) stood in for by this rank's block; a
    state the step makes is kept as a dist tensor laid out as its parameter. Groups that leave ``foreach`` unset
    step with torch's foreach kernels. Where some gradient or state lies otherwise, the step runs on the dist
    tensors themselves."""
    settle_states(optimizer)
    if not _blockwise(optimizer):
        return optimizer.step()
    state = optimizer.state
    blocks: dict = defaultdict(dict)
    stood_in = []  # (group, its params, [(param, block)], foreach as set)
    for group in optimizer.param_groups:
        params = group["params"]
        pairs = []
        for p in params:
            if type(p) is not DistTensor:
                if p in state:
                    blocks[p] = state[p]
                continue
            blk = p._local
            blk.grad = None if p.grad is None else p.grad._local
            st = state.get(p)
            if st:
                blocks[blk] = {k: v._local if type(v) is DistTensor else v for k, v in st.items()}
            pairs.append((p, blk))
        if pairs:
            stood_in.append((group, params, pairs, group.get("foreach")))
            blk_of = {id(p): blk for p, blk in pairs}
            group["params"] = [blk_of.get(id(p), p) for p in params]
            if group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True
    optimizer.state = blocks
    try:
        return optimizer.step()
    finally:
        optimizer.state = state
        for group, params, pairs, foreach in stood_in:
            group["params"] = params
            group["foreach"] = foreach
            for p, blk in pairs:
                blk.grad = None
                new = blocks.get(blk)
                if not new:
                    continue
                old = state.get(p, {})
                kept = {}
                for k, v in new.items():
                    was = old.get(k)
                    if was is not None and (was._local if type(was) is DistTensor else was) is v:
                        kept[k] = was
                    elif isinstance(v, torch.Tensor) and type(v) is not DistTensor and v.dim() > 0 \
                            and v.shape == blk.shape:  # a plain or fake (simulated rank) block's state
                        kept[k] = new_dist(v, p._pmesh, p._mpl, p.shape, contiguous_stride(p.shape))
                    else:
                        kept[k] = v
                state[p] = kept

