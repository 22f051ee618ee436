"""Distributed checkpoints on torch.distributed.checkpoint: save sharded, load into any layout."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp

from .. import trace

__all__ = ["save_state_dict", "load_state_dict"]


def _dtensor_of(value):
    """The torch DTensor behind a meshviz dist tensor (or a DTensor itself); None for anything else."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value
    for attr in ("_dtensor", "dtensor"):
        inner = getattr(value, attr, None)
        if isinstance(inner, DTensor):
            return inner
    to = getattr(value, "_to_dtensor", None)
    if callable(to):
        return to()
    return None


def _to_dcp(value):
    """What DCP stores for ``value``: a DTensor for dist tensors (each rank writes its block), else the value."""
    dt = _dtensor_of(value)
    if dt is not None:
        return dt
    return value


def _settle_partial(value):
    """DCP stores blocks, not summands: a Partial dist tensor is reduced (Partial -> Replicate) before saving."""
    if getattr(value, "placements", None) is not None and any(p.is_partial() for p in value.placements):
        from ..core.partial import summed
        from .api import reshard

        with torch.no_grad():
            return reshard(value, value.process_mesh, summed(value.placements))
    return value


def _from_dcp(original, loaded):
    """Put a loaded value back into ``original``'s place; returns the value the caller's dict should hold."""
    if original is loaded:
        return original
    dt = _dtensor_of(original)
    if dt is not None:
        if dt is not loaded:  # DCP loads DTensors in place; copy if it handed back another one
            with torch.no_grad():
                dt.to_local().copy_(loaded.to_local())
        return original
    if isinstance(original, torch.Tensor) and isinstance(loaded, torch.Tensor):
        with torch.no_grad():
            original.copy_(loaded)
        return original
    return loaded


def _walk(obj, fn):
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, fn) for v in obj)
    return fn(obj)


def _write_back(target, original, loaded):
    for k in original:
        o, got = original[k], loaded[k]
        if isinstance(o, dict):
            _write_back(target[k], o, got)
        elif isinstance(o, list):
            for i, (oi, gi) in enumerate(zip(o, got)):
                target[k][i] = _from_dcp(oi, gi)
        else:
            target[k] = _from_dcp(o, got)


def _group(process_group):
    pg = getattr(process_group, "process_group", process_group)
    return pg if tdist.is_initialized() else None


def _nbytes(sd) -> int:
    total = 0

    def add(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
        return v

    _walk(sd, add)
    return total


def save_state_dict(state_dict: dict, path: str, process_group=None, coordinator_rank: int = 0,
                    unique_id=None, async_save: bool = False) -> None:
    """Save ``state_dict`` (nested dicts of tensors, dist tensors and plain values) to the directory ``path``.

    Every rank calls it; each writes only the blocks it holds (replicated values once). ``path`` must be
    visible to every rank (a shared file system across machines).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"save_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
    sd = _walk(_walk(state_dict, _settle_partial), _to_dcp)
    with trace.span("mark", op="save_state_dict", name=str(path), bytes=_nbytes(sd)):
        with warnings.catch_warnings():  # one process without a group is a supported case, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(sd, checkpoint_id=path, process_group=_group(process_group), no_dist=not tdist.is_initialized())


def load_state_dict(state_dict: dict, path: str, process_group=None, coordinator_rank: int = 0,
                    unique_id=None, offload: bool = False) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, resharding to each tensor's layout.

    The values in ``state_dict`` say where the data goes: a dist tensor gets its own block whatever mesh and
    placements it was saved with; a plain tensor gets the whole value.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
    sd = _walk(state_dict, _to_dcp)
    with trace.span("mark", op="load_state_dict", name=str(path), bytes=_nbytes(sd)):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=path, process_group=_group(process_group), no_dist=not tdist.is_initialized())
    _write_back(state_dict, _walk(state_dict, lambda v: v), sd)
