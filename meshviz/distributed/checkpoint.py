"""Distributed checkpoints on torch.distributed.checkpoint: save sharded, load into any layout."""

from __future__ import annotations

import os
import warnings
import zlib

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp

from .. import compat, trace
from ..core.partial import partial_fill, summed
from ..runtime.zero import is_fresh_state

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


def _is_partial(value) -> bool:
    return getattr(value, "placements", None) is not None and any(p.is_partial() for p in value.placements)


def _settle_partial(value):
    """DCP stores blocks, not summands: a Partial dist tensor is reduced (Partial -> Replicate) before saving."""
    if _is_partial(value):
        from .api import reshard

        with torch.no_grad():
            return reshard(value, value.process_mesh, summed(value.placements))
    return value


def _load_target(value):
    """What DCP loads into for ``value``: a Partial dist tensor's block takes the reduced value (its placements with
    Replicate for Partial) in place; :func:`_fill_partial` then makes it a summand, as ``shard_tensor`` does."""
    if _is_partial(value):
        from ..runtime.dtensor import make_dtensor

        local = compat.dtensor_local(_dtensor_of(value))
        return make_dtensor(local, value.process_mesh, summed(value.placements), tuple(value.shape))
    return _to_dcp(value)


def _fill_partial(value):
    if _is_partial(value):
        coord = value.process_mesh.coordinate(tdist.get_rank() if tdist.is_initialized() else 0)
        fill = None if coord is None else partial_fill(value.placements, coord)
        if fill in ("zero", "one"):
            with torch.no_grad():
                compat.dtensor_local(_dtensor_of(value)).fill_(0 if fill == "zero" else 1)
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


def _holds_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor) or _dtensor_of(obj) is not None:
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    return isinstance(obj, (list, tuple)) and any(_holds_tensor(v) for v in obj)


def _walk(obj, fn):
    """``fn`` on every leaf of dicts and lists; a tuple holding tensors becomes a list (DCP saves a list element
    by element but pickles a tuple whole), a tuple without tensors stays one value."""
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, list) or isinstance(obj, tuple) and _holds_tensor(obj):
        return [_walk(v, fn) for v in obj]
    return fn(obj)


def _retuple(like: tuple, values: list) -> tuple:
    """``values`` as a tuple of ``like``'s type (a namedtuple takes them as fields)."""
    try:
        return type(like)(*values) if hasattr(like, "_fields") else type(like)(values)
    except Exception:  # a tuple subclass whose constructor takes other arguments
        return tuple(values)


def _write_back(target, loaded):
    """Put what DCP loaded into ``target``'s containers (dicts, lists and tuples, at any depth), keeping their
    values; a tuple is replaced by one of the same type holding them."""
    for k in range(len(target)) if isinstance(target, list) else list(target):
        o, got = target[k], loaded[k]
        if isinstance(o, tuple) and isinstance(got, list) and len(o) == len(got):
            items = list(o)
            _write_back(items, got)
            target[k] = _retuple(o, items)
        elif isinstance(o, dict) or isinstance(o, list) and isinstance(got, list) and len(o) == len(got):
            _write_back(o, got)
        else:  # also a list DCP stored whole (plain values) that comes back with another length
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


def _versions(path) -> list[int]:
    """The unique ids of the checkpoints under ``path``: 0 is ``path`` itself, k > 0 is ``path/k``."""
    path = str(path)
    found = [0] if os.path.exists(os.path.join(path, ".metadata")) else []  # DCP's metadata file
    if os.path.isdir(path):
        found += [int(n) for n in os.listdir(path) if n.isascii() and n.isdigit() and int(n) > 0
                  and os.path.exists(os.path.join(path, n, ".metadata"))]
    return sorted(found)


def _resolve(what: str, path, unique_id, saving: bool):
    """(the unique id to use, None) or (None, the exception saying why there is none)."""
    if unique_id is not None and (isinstance(unique_id, bool) or not isinstance(unique_id, int) or unique_id < 0):
        return None, ValueError(f"{what}: unique_id must be an int >= 0 or None, got {unique_id!r}")
    have = _versions(path)
    uid = unique_id if unique_id is not None else (have[-1] if have else 0 if saving else None)
    if not saving and uid not in have:
        held = f"it holds unique ids {have}" if have else "it holds none"
        return None, FileNotFoundError(f"{what}: no checkpoint {'' if uid is None else f'with unique_id {uid} '}"
                                       f"at {str(path)!r} ({held})")
    return uid, None


def _version(what: str, path, unique_id, process_group, saving: bool, problem=None, prints=None) -> str:
    """The directory of checkpoint ``unique_id`` (None: the newest, as Paddle; a first save makes 0), agreed by
    every rank of the group in one exchange: a rank's error (``problem``: one in its arguments), ranks naming
    different ids, or plain tensors, values or blocks differing across ranks (``prints``: :func:`_prints`) raise."""
    uid, err = _resolve(what, path, unique_id, saving)
    got = [(uid, problem or err, prints or {}, tdist.get_rank() if tdist.is_initialized() else 0)]
    if tdist.is_initialized():  # each rank sends its global rank: the group's own numbering is not what errors name
        pg = _group(process_group)
        mine, got = got[0], [None] * tdist.get_world_size(pg)
        tdist.all_gather_object(got, mine, group=pg)
    failed = [(r, e) for _, e, _, r in got if e is not None]
    if failed:
        r, e = failed[0]
        raise type(e)(f"{e} (rank {r})") if tdist.is_initialized() else e
    if len({g[0] for g in got}) > 1:
        raise ValueError(f"{what}: the ranks name different unique ids {[g[0] for g in got]}")
    _check_plain(what, [(r, p) for _, _, p, r in got])
    return _directory(path, uid)


def _directory(path, uid: int) -> str:
    return str(path) if uid == 0 else os.path.join(str(path), str(uid))


def _checksum(t: torch.Tensor):
    """A cheap fingerprint of ``t``'s bytes: crc32 on the CPU; elsewhere a position-weighted sum computed on the
    device in chunks (a 0-d tensor, read with the others in one transfer); None where there are no bytes to read."""
    t = t.detach()
    if t.numel() == 0:
        return 0
    if t.is_sparse or t.device.type == "meta":
        return None
    if t.is_floating_point() or t.is_complex():
        t = t + 0.0  # -0.0 and 0.0 are one value: their bytes differ, (-0.0) + 0.0 is 0.0
    b = t.contiguous().reshape(-1).view(torch.uint8)
    if b.device.type == "cpu":
        return zlib.crc32(b.numpy())
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for i in range(0, b.numel(), 1 << 24):
        c = b[i:i + (1 << 24)].to(torch.int64)
        total += (c * (torch.arange(i, i + c.numel(), device=b.device) % 65521 + 1)).sum()
    return total


def _splits(obj) -> bool:
    """Whether DCP stores the list or tuple ``obj`` element by element (as :func:`_walk` hands it over): a tuple when
    it holds tensors (it became a list), a list when an element is a tensor, a dict or such a list."""
    if isinstance(obj, tuple):
        return _holds_tensor(obj)
    return isinstance(obj, list) and any(isinstance(v, dict) or _holds_tensor(v) or _splits(v) for v in obj)


def _leaves(obj, key: str = ""):
    """(key, value) of every leaf of ``obj``, keyed as DCP names them (dotted, list positions as numbers; a list
    of plain values is one value)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif _splits(obj):
        for k, v in enumerate(obj):
            yield from _leaves(v, f"{key}.{k}")
    else:
        yield key, obj


def _saved_meta(path, unique_id):
    """Key -> DCP's metadata of each entry of the checkpoint ``unique_id`` at ``path``, as this rank finds it (None
    where there is none or it cannot be read: the ranks' agreement or DCP's load then says why)."""
    uid, err = _resolve("load_state_dict", path, unique_id, saving=False)
    if err is not None:
        return None
    try:
        return dict(dcp.FileSystemReader(_directory(path, uid)).read_metadata().state_dict_metadata)
    except Exception:
        return None


def _kind_problem(state_dict, meta):
    """A tensor in ``state_dict`` where the checkpoint holds a plain value (DCP would hand the value back in its
    place, or fail once other tensors are loaded), or a tensor of another dtype than the saved one (DCP would cast
    it silently, float to int truncated): the error to raise on every rank before anything is read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    tensors = [(k, v) for k, v in _leaves(state_dict) if isinstance(v, torch.Tensor) or _dtensor_of(v) is not None]
    bad = [k for k, _ in tensors if isinstance(meta.get(k), BytesStorageMetadata)]
    if bad:
        return ValueError(f"load_state_dict: the checkpoint holds plain values, not tensors, under {_named(bad)}, "
                          f"where the state_dict holds tensors")
    cast = [f"{k} (saved {meta[k].properties.dtype}, here {v.dtype})" for k, v in tensors
            if isinstance(meta.get(k), TensorStorageMetadata) and meta[k].properties.dtype != v.dtype]
    return ValueError(f"load_state_dict: the state_dict's tensors have other dtypes than the saved ones under "
                      f"{_named(cast)}; load into tensors of the saved dtypes and cast them after (t.copy_(loaded))"
                      ) if cast else None


def _missing_fresh_states(state_dict, saved) -> list:
    """The keys the checkpoint lacks (``saved``: the keys it holds), when each holds an optimizer state that
    ``state_dict()`` made before training and nothing was loaded into (a parameter without a gradient when the
    checkpoint was saved has no state there); [] otherwise, and then a missing key raises as DCP's."""
    if saved is None:
        return []
    missing = [(k, v) for k, v in _leaves(state_dict) if torch.is_tensor(v) and k not in saved]
    if missing and all(is_fresh_state(v) for _, v in missing):
        return [k for k, _ in missing]
    return []


def _named(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _canon(value):
    """Text that two ranks share exactly when their plain ``value`` is the same; None for a type whose text may
    differ for equal values (a set's order, an object's address): such a value is not compared."""
    if isinstance(value, (float, complex)):  # -0.0 and 0.0 are one value (adding 0 makes both 0.0)
        return f"{type(value).__name__}:{value + (0j if isinstance(value, complex) else 0.0)!r}"
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts = [(_canon(k) if isinstance(value, dict) else "", _canon(v)) for k, v in items]
        if any(a is None or b is None for a, b in parts):
            return None
        parts = sorted(parts) if isinstance(value, dict) else parts
        return f"{type(value).__name__}[{','.join(f'{a}={b}' for a, b in parts)}]"
    return None


def _prints(state_dict) -> dict:
    """Key (dotted, as DCP names it) -> (shape, dtype, checksum) of each plain (not dist) tensor in ``state_dict``,
    and (None, type, checksum) of each plain value of Python's own types; (key, offsets, sizes) -> (shape, dtype,
    checksum) of this rank's block of each dist tensor not Partial (ranks that hold one block must hold one value)."""
    found: dict = {}
    for key, obj in _leaves(state_dict):
        dt = _dtensor_of(obj)
        if dt is not None and not _is_partial(obj) and compat.dtensor_local(dt).numel():
            chunk = dt.__create_chunk_list__()[0]
            obj, key = compat.dtensor_local(dt), (key, tuple(chunk.offsets), tuple(chunk.sizes))
        if isinstance(obj, torch.Tensor) and _dtensor_of(obj) is None:
            try:
                found[key] = [tuple(obj.shape), str(obj.dtype), _checksum(obj)]
            except Exception:  # a tensor whose bytes cannot be read (a fake one): its shape is still compared
                found[key] = [tuple(obj.shape), str(obj.dtype), None]
        elif not isinstance(obj, torch.Tensor) and (text := _canon(obj)) is not None:
            found[key] = [None, type(obj).__name__, zlib.crc32(text.encode())]
    pending = [v for v in found.values() if isinstance(v[2], torch.Tensor)]
    if pending:
        for v, s in zip(pending, torch.stack([v[2].to(pending[0][2].device) for v in pending]).tolist()):
            v[2] = s
    return {k: tuple(v) for k, v in found.items()}


def _check_plain(what: str, prints: list) -> None:
    """Refuse plain tensors or values, or a dist tensor's block, that differ across the ranks holding them under one
    key: a checkpoint keeps one copy of each (a replicated value), so the others' values would be lost."""
    seen: dict = {}
    for rank, p in prints:
        for k, v in p.items():
            seen.setdefault(k, {})[rank] = v
    bad = sorted((k for k, by in seen.items() if len(set(by.values())) > 1), key=str)
    if not bad:
        return

    def why(k):
        shapes = {r: v[0] for r, v in seen[k].items()}
        if len(set(shapes.values())) > 1:
            shown = ", ".join(f"{'a plain value' if s is None else list(s)} on rank {r}" for r, s in shapes.items())
            return f"{k!r} (shapes {shown})"
        kinds = "types" if None in shapes.values() else "dtypes"
        differ = f"{kinds if len({v[1] for v in seen[k].values()}) > 1 else 'values'} differ"
        where = "" if isinstance(k, str) else f": the block at {list(k[1])}, ranks {[*seen[k]]}"
        return f"{k if isinstance(k, str) else k[0]!r} ({differ}{where})"

    if all(not isinstance(k, str) for k in bad):
        raise ValueError(
            f"{what}: dist tensors' blocks differ across the ranks that hold them under {', '.join(map(why, bad[:4]))}"
            f"{' and more' if len(bad) > 4 else ''}; a checkpoint keeps one copy of each block, so the others would "
            f"be lost. Give each mesh's tensor a key of its own (pipeline stages that all name one 'layers.0.weight'), "
            f"or make the blocks equal (dist.dtensor_from_local of unequal blocks as Replicate: Shard or Partial)")
    bad = [k for k in bad if isinstance(k, str)]
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    raise ValueError(
        f"{what}: plain (not distributed) tensors or values differ across ranks under "
        f"{', '.join(map(why, bad[:4]))}{more}; a checkpoint keeps one copy of each, so the other ranks' values "
        f"would be lost. Make them equal first where one copy is meant (dist.broadcast(t, src=0); a DataParallel "
        f"model's BatchNorm buffers, which follow each rank's batches: dist.parallel.sync_params_buffers(model)), "
        f"put per-rank values under keys of their own (f'rng.{{rank}}'), save them with torch.save on each rank, "
        f"or make them dist tensors (dist.shard_tensor, dist.dtensor_from_local), whose blocks are saved per rank; "
        f"group_sharded_parallel's optimizer states are dist tensors at level 'p_g_os' only")


def _plain_error(e, what: str, path, pg=None) -> Exception:
    """DCP's CheckpointException (a BaseException whose text is every rank's traceback) as one exception, raised
    on every rank: the first failure's type, each distinct cause once with the ranks it came from (``pg``'s
    ranks, as DCP numbers them, named by their global ranks)."""
    causes: dict = {}
    for rank, failure in sorted(e.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        causes.setdefault((type(exc), str(exc)), []).append(rank if pg is None else tdist.get_global_rank(pg, rank))
    msg = f"{what}({str(path)!r}): " + "; ".join(
        f"{text} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for (_, text), rs in causes.items())
    kind = next(iter(causes))[0] if causes else RuntimeError
    try:
        return kind(msg) if issubclass(kind, Exception) else RuntimeError(msg)
    except Exception:  # a type whose constructor takes other arguments
        return RuntimeError(msg)


def _dcp(what: str, path, fn, *args, **kwargs) -> None:
    with warnings.catch_warnings():  # one process without a group is a supported case, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # a version is overwritten
        try:
            fn(*args, **kwargs)
        except dcp.CheckpointException as e:
            raise _plain_error(e, what, path, kwargs.get("process_group")) from e


def _state_dict_problem(what: str, state_dict):
    """What is wrong with ``state_dict`` itself, found on this rank alone (raised on every rank by the exchange)."""
    if not isinstance(state_dict, dict):
        return TypeError(f"{what}: state_dict must be a dict, got {type(state_dict).__name__}")
    lazy = [k for k, v in _leaves(state_dict) if isinstance(v, torch.Tensor) and v.is_meta]
    if lazy:  # Paddle's load skips them without a word
        return ValueError(f"{what}: {_named(lazy)} hold no values (on the meta device: built under LazyGuard and "
                          f"not initialized yet); call initialize() on them first "
                          f"(for p in model.parameters(): p.initialize())")
    return None


_COMM_METHODS = ("send_recv", "broadcast", "multi_group_broadcast", "grouped_send_recv", "parallel_broadcast")


def _save_problem(safetensors, save_replicas):
    if safetensors:
        return NotImplementedError("save_state_dict: safetensors=True is not supported; meshviz writes "
                                   "torch.distributed.checkpoint's format (leave safetensors=False)")
    if save_replicas:
        return NotImplementedError("save_state_dict: save_replicas=True is not supported; meshviz writes one copy of "
                                   "each replicated block (leave save_replicas=False)")
    return None


def _load_problem(aoa_config, safetensors, worker_groups, comm_method):
    if comm_method not in _COMM_METHODS:
        return ValueError(f"load_state_dict: comm_method must be one of {list(_COMM_METHODS)}, got {comm_method!r}")
    if safetensors:
        return NotImplementedError("load_state_dict: safetensors=True is not supported; meshviz reads "
                                   "torch.distributed.checkpoint's format (leave safetensors=False)")
    if aoa_config:
        return NotImplementedError("load_state_dict: aoa_config is not supported; rename or reshape the keys of the "
                                   "state_dict before loading (leave aoa_config=None)")
    if worker_groups is not None and not isinstance(worker_groups, (list, tuple)):
        return ValueError(f"load_state_dict: worker_groups must be a list of groups or None, "
                          f"got {type(worker_groups).__name__}")
    return None


def save_state_dict(state_dict: dict, path: str, process_group=None, coordinator_rank: int = 0,
                    unique_id=None, async_save: bool = False, safetensors: bool = False,
                    save_replicas: bool = False) -> None:
    """Save ``state_dict`` (nested dicts of tensors, dist tensors and plain values) to the directory ``path``.

    Every rank calls it; each writes only the blocks it holds (replicated values once). ``path`` must be
    visible to every rank (a shared file system across machines). ``unique_id`` names the version, as in Paddle:
    None overwrites the newest one (0 when there is none); 0 lives in ``path``, k in ``path/k``. The save is
    synchronous also with ``async_save``; ``coordinator_rank`` is accepted for Paddle's signature. Lists and tuples
    holding tensors are saved element by element. A plain tensor or value (an int, a string, a list of them) must
    be the same on every rank (one copy is kept): one that differs raises ``ValueError`` on every rank before
    anything is written, as does a tensor of a model built under ``LazyGuard`` and not initialized, a
    ``state_dict`` that is no dict on some rank (``TypeError``), or ``safetensors`` or ``save_replicas``
    (``NotImplementedError``). A Partial dist tensor is saved reduced (Paddle saves one rank's summand).
    """
    problem = _state_dict_problem("save_state_dict", state_dict) or _save_problem(safetensors, save_replicas)
    where = _version("save_state_dict", path, unique_id, process_group, saving=True, problem=problem,
                     prints=_prints(state_dict) if isinstance(state_dict, dict) else None)
    sd = _walk(_walk(state_dict, _settle_partial), _to_dcp)
    with trace.span("mark", op="save_state_dict", name=str(path), bytes=_nbytes(sd)):
        _dcp("save_state_dict", path, dcp.save, sd, checkpoint_id=where, process_group=_group(process_group),
             no_dist=not tdist.is_initialized())


def load_state_dict(state_dict: dict, path: str, process_group=None, coordinator_rank: int = 0,
                    unique_id=None, offload: bool = False, mw_name_compatibility: bool = True, aoa_config=None,
                    safetensors: bool = False, worker_groups=None, comm_method: str = "broadcast") -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, resharding to each tensor's layout.

    The values in ``state_dict`` say where the data goes: a dist tensor gets its own block whatever mesh and
    placements it was saved with (a Partial one the value where ``shard_tensor`` would put it); a plain tensor
    gets the whole value; a tuple is replaced by one of its type holding the loaded values. ``unique_id``: the
    version (None: the newest). A key the checkpoint lacks, a shape or dtype other than the saved one, a tensor
    where it holds a plain value, or a tensor not initialized (``LazyGuard``) raises on every rank before anything
    is read; keys it holds that ``state_dict`` lacks are named in a warning, as Paddle's "Unexpected keys" (e.g. a
    torch optimizer's states: it has none to load into before its first step). ``offload`` changes nothing here:
    each block is read into the tensor that holds it; nor do ``mw_name_compatibility``, ``worker_groups`` and
    ``comm_method`` (each rank reads its blocks from the files). ``safetensors`` and ``aoa_config`` raise
    ``NotImplementedError`` on every rank.
    """
    meta = _saved_meta(path, unique_id) if isinstance(state_dict, dict) else None
    problem = (_state_dict_problem("load_state_dict", state_dict)
               or _load_problem(aoa_config, safetensors, worker_groups, comm_method)
               or (_kind_problem(state_dict, meta) if meta is not None else None))
    where = _version("load_state_dict", path, unique_id, process_group, saving=False, problem=problem)
    saved = set(meta) if meta is not None else None
    fresh = _missing_fresh_states(state_dict, saved)
    if fresh:
        warnings.warn(f"load_state_dict: the checkpoint has no {_named(fresh)}: optimizer states made before "
                      f"training for parameters that had no gradient when it was saved; they are left as made "
                      f"(as before any step)", stacklevel=2)
    unread = saved - {k for k, _ in _leaves(state_dict)} if saved is not None else ()
    if unread:  # as Paddle's "Unexpected keys": e.g. a torch optimizer's states, which it makes at its first step
        warnings.warn(f"load_state_dict: the checkpoint at {where!r} holds keys the state_dict has no place for, "
                      f"left unread: {_named(unread)} (an optimizer that has not stepped yet has no states in its "
                      f"state_dict() to load them into)", stacklevel=2)
    sd = _walk(state_dict, _load_target)
    with trace.span("mark", op="load_state_dict", name=str(path), bytes=_nbytes(sd)):
        _dcp("load_state_dict", path, dcp.load, sd, checkpoint_id=where, process_group=_group(process_group),
             no_dist=not tdist.is_initialized(),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True) if fresh else None)
    _write_back(state_dict, sd)
    _walk(state_dict, _fill_partial)
