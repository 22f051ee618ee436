"""shard_dataloader: a DataLoader's batches as dist tensors split along one mesh axis, as Paddle's ShardDataloader."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..core.layout import chunk
from ..core.mesh import ProcessMesh
from ..core.placements import Replicate, Shard
from ..runtime.agree import alone, same_or_refused
from ..runtime.devices import device
from ..runtime.dtensor import DistTensor
from ..runtime.world import init_parallel_env
from .api import dtensor_from_local, shard_tensor

__all__ = ["shard_dataloader", "ShardDataloader"]


class ShardDataloader:
    """Iterates a DataLoader and turns every batch tensor into a dist tensor split along one mesh axis."""

    def __init__(self, dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False,
                 dense_tensor_idx=None):
        try:
            self._set_up(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, dense_tensor_idx)
            refused = None
        except ValueError as e:
            refused = e
            if alone():
                raise
        init_parallel_env()
        # once, at set-up, on every rank (a refusing one too, so none waits for it): a rank whose loader or meshes
        # differ would split another batch, its rows lost or taken twice
        batches = getattr(dataloader, "batch_sampler", None)
        size = getattr(batches, "batch_size", getattr(dataloader, "batch_size", None))
        same_or_refused("shard_dataloader", {
            "batch_size": size if isinstance(size, int) else repr(size), "batches": _batch_count(dataloader),
            "drop_last": getattr(batches, "drop_last", getattr(dataloader, "drop_last", None)),
            "meshes": repr(meshes), "shard_dims": repr(shard_dims), "is_dataset_splitted": bool(is_dataset_splitted),
            "input_keys": repr(input_keys)}, refused)

    def _set_up(self, dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, dense_tensor_idx) -> None:
        meshes = list(meshes) if isinstance(meshes, (list, tuple)) else [meshes]
        if not meshes or not all(isinstance(m, ProcessMesh) or (isinstance(m, (list, tuple)) and m and all(
                isinstance(s, ProcessMesh) for s in m)) for m in meshes):
            raise ValueError(f"shard_dataloader: meshes must be a ProcessMesh or a list of them (an entry may be a "
                             f"list of meshes, one per tensor of a list input), got {meshes!r}")
        if is_dataset_splitted and shard_dims is None:
            raise ValueError("shard_dataloader: is_dataset_splitted=True needs shard_dims, the mesh axis the "
                             "loaders' parts are split along")
        if isinstance(shard_dims, (list, tuple)) and len(shard_dims) != len(meshes):
            raise ValueError(f"shard_dataloader: {len(shard_dims)} shard_dims for {len(meshes)} meshes")
        dims = list(shard_dims) if isinstance(shard_dims, (list, tuple)) else [shard_dims] * len(meshes)
        if input_keys is not None and not isinstance(input_keys, (list, tuple)):
            raise ValueError(f"shard_dataloader: input_keys must be a list of the batch's keys, one per mesh, got "
                             f"{input_keys!r}")
        if input_keys is not None and len(set(input_keys)) != len(input_keys):
            raise ValueError(f"shard_dataloader: input_keys {list(input_keys)} name a key twice (one key per input)")
        if input_keys is not None and len(meshes) > 1 and len(input_keys) != len(meshes):
            raise ValueError(f"shard_dataloader: {len(input_keys)} input_keys for {len(meshes)} meshes")
        self.dense_tensor_idx = _check_dense_idx(dense_tensor_idx, len(meshes))
        # per input: (mesh, axis), or a list of them for an input that is a list of tensors; raises on unknown axes
        self._specs = [_input_spec(m, d) for m, d in zip(meshes, dims)]
        init_parallel_env()
        sampler = _sampler_of(dataloader)
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            _check_split_sampler(sampler, self._specs, is_dataset_splitted)
        # (parts, index): the chunk of each batch's rows this rank's own loader holds in Paddle; None: all of them
        mesh, axis, _rank, coord = _own_spec(self._specs)
        self._part = None if is_dataset_splitted or axis is None else (mesh.shape[axis], coord[axis] if coord else 0)
        # a random order drawn from each rank's own RNG differs between ranks: each would split another batch
        own_rng = isinstance(sampler, _RANDOM_SAMPLERS) and sampler.generator is None
        self._shuffled = sampler if own_rng and not is_dataset_splitted else None
        self._epoch, self._next = 0, None
        self.dataloader, self.meshes = dataloader, meshes
        self.input_keys = list(input_keys) if input_keys is not None else None
        self.is_dataset_splitted = is_dataset_splitted
        # as Paddle's: the batch size of this rank's loader, and the batch sampler that draws this rank's rows
        batches = getattr(dataloader, "batch_sampler", None)
        size = getattr(batches, "batch_size", getattr(dataloader, "batch_size", None))
        self.batch_size = size if self._part is None or size is None else size // self._part[0]
        self.batch_sampler = batches if self._part is None or batches is None else _RankBatchSampler(self, batches)

    def _place(self, value, spec, cut, dense=False):
        if dense or not isinstance(value, torch.Tensor) or isinstance(value, DistTensor):
            return _own_rows(value, cut)
        if isinstance(spec, list):
            raise ValueError(f"shard_dataloader: an input given a list of {len(spec)} meshes or shard_dims is a "
                             f"tensor, not a list of {len(spec)} tensors")
        mesh, axis = spec
        pl = [Replicate()] * mesh.ndim
        if axis is not None and value.dim() > 0:
            pl[axis] = Shard(0)
        if self.is_dataset_splitted:
            return dtensor_from_local(value, mesh, pl)
        return shard_tensor(value, mesh, pl)

    def _convert(self, value, i: int | None, cut):
        """Input ``i`` (None: a dict value input_keys does not name, which goes to the first mesh)."""
        spec = self._specs[0 if i is None else min(i, len(self._specs) - 1)]
        dense = () if i is None or self.dense_tensor_idx is None else self.dense_tensor_idx[i]
        if i is None and isinstance(spec, list):
            spec = spec[0]
        if isinstance(value, (list, tuple)) and not _per_row(value):  # one input of several tensors (Paddle's ex. 2)
            specs = spec if isinstance(spec, list) else [spec] * len(value)
            if len(specs) != len(value):
                raise ValueError(f"shard_dataloader: an input of {len(value)} tensors for {len(specs)} meshes")
            return _like(value, [self._place(v, s, cut, j in dense) for j, (v, s) in enumerate(zip(value, specs))])
        return self._place(value, spec, cut, bool(dense))

    def _check_dense(self, inputs: list) -> None:
        """dense_tensor_idx against the batch's inputs, before any of them is placed."""
        idx = self.dense_tensor_idx
        if idx is None:
            return
        if len(idx) != len(inputs):
            raise ValueError(f"shard_dataloader: dense_tensor_idx has {len(idx)} entries for a batch of "
                             f"{len(inputs)} inputs (one list per input: the indices of a list input's tensors "
                             f"that stay dense, or any index to keep a tensor input dense)")
        for i, (value, js) in enumerate(zip(inputs, idx)):
            if isinstance(value, (list, tuple)) and not _per_row(value) and any(j >= len(value) for j in js):
                raise ValueError(f"shard_dataloader: dense_tensor_idx[{i}] = {list(js)} names a tensor past input "
                                 f"{i}'s {len(value)}")

    def _shard(self, batch):
        rows = None if self._part is None else _batch_rows(batch)
        cut = None if rows is None else (slice(*chunk(rows, *self._part)), rows)
        if isinstance(batch, Mapping):  # a dict, or a tokenizer's BatchEncoding
            keys = self.input_keys or list(batch)
            missing = [k for k in keys if k not in batch]
            if missing:
                raise ValueError(f"shard_dataloader: input_keys {missing} are not in the batch {list(batch)}")
            if self.input_keys is None and len(self.meshes) > 1 and len(batch) != len(self.meshes):
                raise ValueError(f"shard_dataloader: a dict batch of {len(batch)} keys for {len(self.meshes)} "
                                 f"meshes: pass input_keys, the key of each mesh's input ({list(batch)})")
            self._check_dense([batch[k] for k in keys])
            return {k: self._convert(v, keys.index(k) if k in keys else None, cut) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            if len(self.meshes) > 1 and len(batch) != len(self.meshes):
                raise ValueError(f"shard_dataloader: a batch of {len(batch)} inputs for {len(self.meshes)} meshes "
                                 f"(input i goes to meshes[i])")
            self._check_dense(list(batch))
            return _like(batch, [self._convert(v, i, cut) for i, v in enumerate(batch)])
        if not isinstance(batch, torch.Tensor):
            raise ValueError(f"shard_dataloader: a batch is a tensor, a dict or a list of them, got {type(batch)}")
        self._check_dense([batch])
        return self._convert(batch, 0, cut)

    def _seeded(self, items):
        """``items`` (the loader, or its batch sampler) drawn in the order of this pass."""
        if self._shuffled is not None:
            # as Paddle's DistributedBatchSampler: the order is seeded with the epoch, the same on every rank
            self._shuffled.generator = torch.Generator().manual_seed(self._epoch)
            self._epoch += 1
        try:
            yield from items
        finally:
            if self._shuffled is not None:
                self._shuffled.generator = None

    def _batches(self):
        for batch in self._seeded(self.dataloader):
            yield self._shard(batch)

    def first_batch(self):
        """The first batch of a new pass, read without moving the loader on: the next pass's shuffle order and a
        pass under way stay as they were (as Paddle's DistModel puts back its sampler's epoch after reading it)."""
        epoch, under_way = self._epoch, self._next
        generator = None if self._shuffled is None else self._shuffled.generator
        rng = torch.random.get_rng_state()
        batches = self._batches()
        try:
            return next(batches)
        finally:
            batches.close()
            self._epoch, self._next = epoch, under_way
            if self._shuffled is not None:
                self._shuffled.generator = generator
            torch.random.set_rng_state(rng)

    def __iter__(self):
        # as Paddle's: a new pass, which next(loader) continues (after a break, say)
        self._next = self._batches()
        return _Pass(self, self._next)

    def __next__(self):
        self._next = self._next or self._batches()
        return next(self._next)

    __call__ = __iter__

    def set_epoch(self, epoch: int) -> None:
        """The next pass's shuffle seed (each pass counts on), as Paddle's ``DistributedBatchSampler.set_epoch``."""
        self._epoch = int(epoch)
        getattr(_sampler_of(self.dataloader), "set_epoch", int)(epoch)  # a DistributedSampler's own too

    def __len__(self) -> int:
        return len(self.dataloader)

    def __repr__(self) -> str:
        axes = [[a for _, a in s] if isinstance(s, list) else s[1] for s in self._specs]
        return f"ShardDataloader(meshes={len(self.meshes)}, axes={axes})"


class _Pass:
    """One pass of a loop over the loader; a loop that breaks leaves the pass to ``next(loader)``."""

    def __init__(self, loader: ShardDataloader, batches):
        self._loader, self._batches = loader, batches

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._batches)
        except StopIteration:
            if self._loader._next is self._batches:  # a pass run to its end: next(loader) starts the next one
                self._loader._next = None
            raise


class _RankBatchSampler:
    """The indices of this rank's rows of each batch, as the DistributedBatchSampler of Paddle's ShardDataloader
    (``batch_sampler.set_epoch(e)`` is the loader's ``set_epoch``)."""

    def __init__(self, loader: ShardDataloader, batches):
        self._loader, self._batches = loader, batches
        self.nranks, self.local_rank = loader._part
        self.num_replicas = self.nranks
        self.batch_size = loader.batch_size
        self.drop_last = getattr(batches, "drop_last", False)
        self.shuffle = isinstance(_sampler_of(loader.dataloader), _RANDOM_SAMPLERS)

    @property
    def epoch(self) -> int:
        return self._loader._epoch

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    def __iter__(self):
        for idx in self._loader._seeded(self._batches):
            idx = list(idx)
            yield idx[slice(*chunk(len(idx), self.nranks, self.local_rank))]

    def __len__(self) -> int:
        return len(self._loader)


_RANDOM_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
                    torch.utils.data.WeightedRandomSampler)


def _check_dense_idx(idx, n_meshes: int):
    if idx is None:
        return None
    if not isinstance(idx, (list, tuple)) or not all(
            isinstance(js, (list, tuple)) and all(isinstance(j, int) and not isinstance(j, bool) and j >= 0
                                                  for j in js) for js in idx):
        raise ValueError(f"shard_dataloader: dense_tensor_idx must be a list of one list of indices per input "
                         f"(which tensors of a list input stay dense; a tensor input stays dense when its list is "
                         f"not empty), got {idx!r}")
    if n_meshes > 1 and len(idx) != n_meshes:
        raise ValueError(f"shard_dataloader: {len(idx)} dense_tensor_idx entries for {n_meshes} meshes (one per "
                         f"input)")
    return [list(js) for js in idx]


def _input_spec(mesh, dim):
    if isinstance(mesh, ProcessMesh) and not isinstance(dim, (list, tuple)):
        return mesh, None if dim is None else mesh.axis(dim)
    meshes = list(mesh) if isinstance(mesh, (list, tuple)) else None
    dims = list(dim) if isinstance(dim, (list, tuple)) else None
    if meshes is not None and dims is not None and len(meshes) != len(dims):
        raise ValueError(f"shard_dataloader: {len(dims)} shard_dims for an input on {len(meshes)} meshes")
    meshes = meshes or [mesh] * len(dims)
    dims = dims or [dim] * len(meshes)
    return [(m, None if d is None else m.axis(d)) for m, d in zip(meshes, dims)]


def _own_spec(specs):
    """As Paddle picks the part each rank's loader reads: the first mesh holding this rank, else the first one."""
    rank, flat = torch.distributed.get_rank(), [s for sp in specs for s in (sp if isinstance(sp, list) else [sp])]
    mesh, axis = next((s for s in flat if s[0].contains(rank)), flat[0])
    return mesh, axis, rank, mesh.coordinate(rank)


def _per_row(value) -> bool:
    """A list of one value per row (collated strings, lists of ids ...): no tensors, unlike an input of several."""
    return isinstance(value, (list, tuple)) and bool(value) and not any(isinstance(v, torch.Tensor) for v in value)


def _like(value, items):
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def _batch_rows(value, top=True):
    """The batch's row count: its first tensor's length, or its first per-row list's (not the batch's own)."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    if not top and _per_row(value):
        return len(value)
    items = list(value.values()) if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else []
    return next((n for n in (_batch_rows(v, False) for v in items) if n is not None), None)


def _own_rows(value, cut):
    """A value left dense (a nested dict's tensors, a list of strings): this rank's rows of each tensor or list the
    batch's length long, as each rank's own loader yields them in Paddle; tensors on this rank's device."""
    if isinstance(value, Mapping):
        return {k: _own_rows(v, cut) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and not isinstance(value, DistTensor):
        return (value[cut[0]] if cut and value.dim() and value.shape[0] == cut[1] else value).to(device())
    if isinstance(value, (list, tuple)):
        per_row = cut and _per_row(value) and len(value) == cut[1]
        return _like(value, value[cut[0]] if per_row else [_own_rows(v, cut) for v in value])
    return value


def _batch_count(loader):
    try:
        return len(loader)
    except TypeError:  # an iterable dataset's loader has no length
        return None


def _sampler_of(loader):
    batches = getattr(loader, "batch_sampler", None)
    return getattr(batches, "sampler", None) if batches is not None else getattr(loader, "sampler", None)


def _check_split_sampler(sampler, specs, is_dataset_splitted) -> None:
    """A DistributedSampler gives each rank its own part: the data is split already, into as many parts as the
    mesh axis has ranks, part i on the ranks at coordinate i along it."""
    if not is_dataset_splitted:
        raise ValueError("shard_dataloader: the loader's DistributedSampler gives each rank its own part of the "
                         "data; pass is_dataset_splitted=True, or a loader over the whole dataset to split its "
                         "batches")
    sizes = {m.shape[a] for spec in specs for m, a in (spec if isinstance(spec, list) else [spec]) if a is not None}
    if sampler.num_replicas not in sizes:
        raise ValueError(f"shard_dataloader: the loader's DistributedSampler splits the data into "
                         f"{sampler.num_replicas} parts, the mesh axis shard_dims names has {sorted(sizes)} ranks")
    _mesh, axis, rank, coord = _own_spec(specs)
    if axis is not None and coord is not None and sampler.rank != coord[axis]:
        raise ValueError(f"shard_dataloader: rank {rank}'s DistributedSampler reads part {sampler.rank}, but the "
                         f"rank sits at {coord[axis]} along the mesh axis shard_dims names: pass rank= its "
                         f"coordinate there (the ranks along the other axes hold the same part)")


def shard_dataloader(dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False,
                     dense_tensor_idx=None):
    """Split every batch along the mesh axis ``shard_dims`` names (batch dim 0), Replicate on the other axes.

    With several meshes (pipelines), element i of a tuple batch (or ``input_keys[i]`` of a dict batch) goes to
    ``meshes[i]``; a single tensor, or a dict value ``input_keys`` does not name, goes to the first mesh. An input
    that is a list of tensors may have a list of meshes and of shard_dims, one per tensor. Unlike Paddle, the axis
    named is the axis used, and the loader's batch is the global batch (split unevenly when it must be). What stays
    dense (a nested dict's tensors, a list of strings) holds this rank's rows, as each rank's loader does in Paddle.
    A loader shuffled by torch's global RNG is shuffled with the epoch as seed, the same on every rank, as Paddle's
    DistributedBatchSampler does (``set_epoch``). ``is_dataset_splitted=True`` (needs ``shard_dims``): each rank's
    loader already yields its own part, e.g. through a ``DistributedSampler`` of as many parts as the axis has ranks.
    ``next(loader)`` continues the pass a ``for`` loop left (after a break), as in Paddle. ``dense_tensor_idx``, one
    list per input: the indices of a list input's tensors that stay dense, or any index to keep a tensor input dense
    (this rank's rows, as the rest left dense). ``batch_size`` and ``batch_sampler`` are those of this rank's loader
    in Paddle: where batches are split, the batch size over the axis's ranks (rounded down) and a sampler of this
    rank's indices (its ``set_epoch`` the loader's).
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, dense_tensor_idx)
