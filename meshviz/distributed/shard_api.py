"""Auto-parallel training helpers: shard_layer, shard_optimizer (ShardingStage1/2/3), shard_dataloader."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.layout import chunk
from ..core.mesh import ProcessMesh
from ..core.placements import Replicate, Shard
from ..core.sharding import STAGES
from ..runtime.devices import device
from ..runtime.dtensor import DistTensor
from ..runtime.world import init_parallel_env
from ..runtime.zero import (
    PlacedZero,
    Zero,
    check_elementwise,
    create_states,
    dist_params_for_dist_grads,
    grads_as_params,
    sharded_placements,
)
from .api import dtensor_from_local, reshard, shard_tensor
from .shard_scaler import shard_scaler

__all__ = [
    "shard_layer",
    "shard_optimizer",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "shard_scaler",
    "shard_dataloader",
    "ShardDataloader",
]


# -- shard_layer --------------------------------------------------------------------------------------------


def _holders(layer: torch.nn.Module) -> dict:
    """id(parameter) -> (the parameter, every ``(sublayer, name, qualified name)`` that holds it)."""
    out: dict = {}
    for mod_name, mod in layer.named_modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), (p, []))[1].append((mod, pname, f"{mod_name}.{pname}" if mod_name else pname))
    return out


def _keep_ties(held: dict) -> None:
    """A parameter two sublayers held before ``shard_fn`` ran (an embedding tied to the output layer) stays one
    parameter: the dist parameter ``shard_fn`` put in one holder goes to the holders it left alone (Paddle 3.3.1
    makes each holder a parameter of its own, each stepped on its own gradient)."""
    for p, where in held.values():
        if len(where) < 2:
            continue
        now = [m._parameters.get(n) for m, n, _ in where]
        made = {id(q): q for q in now if isinstance(q, DistTensor) and q is not p}
        if not made:
            continue
        first = next(iter(made.values()))
        if any(q.process_mesh != first.process_mesh or list(q.placements) != list(first.placements)
               for q in made.values()):
            raise ValueError(f"shard_layer: {[q for _, _, q in where]} are one parameter (tied weights), and "
                             f"shard_fn placed it in more than one way: "
                             f"{sorted({repr(list(q.placements)) for q in made.values()})}; place it once (a tied "
                             f"parameter is one tensor)")
        for (m, n, _), q in zip(where, now):
            if q is p or id(q) in made:
                m._parameters[n] = first


def _replicate_rest(layer: torch.nn.Module, mesh: ProcessMesh) -> None:
    done: dict = {}  # id(dense parameter) -> its dist parameter: a tied one stays one
    for mod_name, mod in layer.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if not isinstance(p, DistTensor):
                new = done.get(id(p))
                if new is None:
                    new = done[id(p)] = shard_tensor(p, mesh, [Replicate()] * mesh.ndim,
                                                     name=f"{mod_name}.{pname}" if mod_name else pname)
                setattr(mod, pname, new)
            elif p.name is None:
                p.name = f"{mod_name}.{pname}" if mod_name else pname
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DistTensor):
                mod._buffers[bname] = shard_tensor(b, mesh, [Replicate()] * mesh.ndim)


def shard_layer(layer: torch.nn.Module, process_mesh: ProcessMesh, shard_fn=None, input_fn=None, output_fn=None):
    """Convert every parameter and buffer of ``layer`` to a dist tensor on ``process_mesh``.

    ``shard_fn(name, sublayer, mesh)`` runs for every sub-layer (itself included) and may shard its parameters;
    whatever it leaves dense becomes Replicate. ``input_fn(inputs, mesh)`` / ``output_fn(outputs, mesh)`` run
    before / after ``forward``.
    """
    if not isinstance(layer, torch.nn.Module):
        raise ValueError(f"shard_layer expects an nn.Module, got {type(layer).__name__}")
    if not isinstance(process_mesh, ProcessMesh):
        raise ValueError(f"shard_layer expects a ProcessMesh, got {process_mesh!r}")
    for what, fn in (("shard_fn", shard_fn), ("input_fn", input_fn), ("output_fn", output_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"shard_layer: {what} must be callable or None, got {type(fn).__name__}")
    init_parallel_env()
    # a shard_fn that raises part way leaves the layer as it was, not half sharded
    kept = [(m, dict(m._parameters), dict(m._buffers)) for m in layer.modules()]
    try:
        if shard_fn is not None:
            held = _holders(layer)
            for name, sub in list(layer.named_modules()):
                shard_fn(name, sub, process_mesh)
            _keep_ties(held)
        _replicate_rest(layer, process_mesh)
    except BaseException:
        for m, params, buffers in kept:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        raise
    if input_fn is not None:
        layer.register_forward_pre_hook(lambda _m, inputs: input_fn(inputs, process_mesh))
    if output_fn is not None:
        layer.register_forward_hook(lambda _m, inputs, outputs: output_fn(outputs, process_mesh))
    return layer


# -- shard_optimizer ----------------------------------------------------------------------------------------


class _ShardingStage:
    stage = 0

    def __init__(self, sharding_mesh_dim=0, mesh: ProcessMesh | None = None, **kwargs):
        # Paddle: ShardingStage1(sharding_mesh_dim, mesh=None); older scripts pass the mesh first or mesh_dim=
        if "mesh_dim" in kwargs:
            sharding_mesh_dim = kwargs.pop("mesh_dim")
        if kwargs:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {sorted(kwargs)}")
        if isinstance(sharding_mesh_dim, ProcessMesh):
            sharding_mesh_dim, mesh = (mesh if mesh is not None else 0), sharding_mesh_dim
        if mesh is not None and not isinstance(mesh, ProcessMesh):
            raise ValueError(f"{type(self).__name__}: mesh must be a ProcessMesh, got {mesh!r}")
        if isinstance(sharding_mesh_dim, bool) or not isinstance(sharding_mesh_dim, (int, str)):
            raise ValueError(f"{type(self).__name__}: sharding_mesh_dim must be a mesh axis name or index, "
                             f"got {sharding_mesh_dim!r}")
        if mesh is not None:
            mesh.axis(sharding_mesh_dim)  # an unknown name raises here, on every rank
        self.axis = sharding_mesh_dim
        self.mesh = mesh

    @property
    def sharding_mesh_dim(self):
        return self.axis

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sharding_mesh_dim={self.axis!r})"

    def sharded(self, p: DistTensor) -> list | None:
        """Placements that shard ``p`` along the sharding axis, or None when it cannot be (Paddle's
        ``get_placement_with_sharding``: the first tensor dim no other mesh axis shards)."""
        return sharded_placements(p, self.axis, self.mesh)


class ShardingStage1(_ShardingStage):
    """Optimizer states sharded along one mesh axis; gradients all-reduced, parameters all-gathered after the step."""

    stage = 1


class ShardingStage2(ShardingStage1):
    """Stage 1 and gradients reduce-scattered: each rank keeps only the gradient shard it updates."""

    stage = 2


class ShardingStage3(ShardingStage2):
    """Stage 2 and parameters themselves sharded; they are gathered when an op needs them."""

    stage = 3


@torch.no_grad()
def _place_plain(optimizer) -> None:
    """Dense parameters left on the CPU of a GPU rank move to its GPU, in place (their gradients, as dist tensors,
    come back on the GPU, where the dist parameters' blocks already are; Paddle creates them there)."""
    want = device()
    if want.type == "cpu":
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, DistTensor) or p.device.type != "cpu":
                continue
            p.data = p.data.to(want)
            if p.grad is not None:
                p.grad = p.grad.to(want)
            st = optimizer.state.get(p)
            if st:
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        st[k] = v.to(want)


class _ShardOptimizer(PlacedZero):
    """Wraps a torch optimizer whose parameters are dist tensors (Paddle's shard_optimizer result)."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Zero):
            raise ValueError(f"shard_optimizer expects a torch.optim.Optimizer (not one sharded already), got "
                             f"{type(optimizer).__name__}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps}")
        if shard_fn is not None and not isinstance(shard_fn, _ShardingStage):
            raise ValueError(f"shard_fn must be ShardingStage1/2/3, got {shard_fn!r}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if shard_fn is not None or any(isinstance(p, DistTensor) and any(not isinstance(q, Replicate)
                                                                         for q in p.placements) for p in params):
            check_elementwise(optimizer, "shard_optimizer")
        self._inner_opt = optimizer
        self._stage = shard_fn
        self._told = False  # about a stage with nothing to shard
        # as in Paddle, only recorded: every step() updates; the training loop decides how often to call it
        self.gradient_accumulation_steps = gradient_accumulation_steps
        _place_plain(optimizer)
        if shard_fn is None:
            super().__init__(optimizer, None, reshard=reshard, place=shard_tensor)
        else:
            super().__init__(optimizer, STAGES[shard_fn.stage], shard_fn.axis, shard_fn.mesh, reshard=reshard,
                             place=shard_tensor)

    def __getattr__(self, name):
        if name == "_inner_opt":
            raise AttributeError(name)
        return getattr(self._inner_opt, name)

    @torch.no_grad()
    def step(self, closure=None):
        if self._stage is not None and not self._told:
            self._told = True
            params = [p for g in self._inner_opt.param_groups for p in g["params"]]
            if not any(isinstance(p, DistTensor) or isinstance(p.grad, DistTensor) for p in params):
                warnings.warn(f"shard_optimizer: {self._stage!r} shards the states of dist parameters (or of dense "
                              "ones whose gradients are dist, from dist inputs); every parameter and gradient here "
                              "is dense, so nothing is sharded and each rank steps its own copy", stacklevel=2)
        return super().step(closure)

    def state_dict(self):
        """This rank's states; before training they are made first (zeros, as Paddle's), so that
        ``dist.load_state_dict`` has tensors to load a checkpoint into (collective then)."""
        create_states(self, self.grad_params())
        return self._inner_opt.state_dict()

    def load_state_dict(self, sd) -> None:
        self._inner_opt.load_state_dict(sd)

    set_state_dict = load_state_dict

    def __repr__(self) -> str:
        return f"ShardOptimizer({type(self._inner_opt).__name__}, stage={self._stage!r})"


def shard_optimizer(optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
    """Make ``optimizer`` step dist parameters: Partial gradients are reduced once before the update; dense
    parameters on the CPU of a GPU rank move to its GPU (in place). With
    ``ShardingStage1/2/3(sharding_mesh_dim, mesh)`` optimizer states (then gradients, then parameters) are sharded
    along that mesh axis. ``gradient_accumulation_steps`` is recorded as Paddle records it: every ``step()``
    updates, so a loop that accumulates k micro-batches calls ``step()`` once per k."""
    return _ShardOptimizer(optimizer, shard_fn, gradient_accumulation_steps)



def _plain_optimizer_step(optimizer, args, kwargs) -> None:
    """Any torch optimizer's step, as Paddle's optimizer steps: a dense parameter whose gradient is a dist tensor
    becomes a dist parameter, Replicate on the gradient's mesh, and Partial gradients are reduced once first
    (an optimizer from shard_optimizer has done both before its inner optimizer steps)."""
    if dist_params_for_dist_grads(optimizer, shard_tensor) or any(
            isinstance(p, DistTensor) for group in optimizer.param_groups for p in group["params"]):
        grads_as_params(optimizer, reshard)


register_optimizer_step_pre_hook(_plain_optimizer_step)


class ShardDataloader:
    """Iterates a DataLoader and turns every batch tensor into a dist tensor split along one mesh axis."""

    def __init__(self, dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False):
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
        if input_keys is not None and len(meshes) > 1 and len(input_keys) != len(meshes):
            raise ValueError(f"shard_dataloader: {len(input_keys)} input_keys for {len(meshes)} meshes")
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

    def _place(self, value, spec, cut):
        if not isinstance(value, torch.Tensor) or isinstance(value, DistTensor):
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
        if i is None and isinstance(spec, list):
            spec = spec[0]
        if isinstance(value, (list, tuple)) and not _per_row(value):  # one input of several tensors (Paddle's ex. 2)
            specs = spec if isinstance(spec, list) else [spec] * len(value)
            if len(specs) != len(value):
                raise ValueError(f"shard_dataloader: an input of {len(value)} tensors for {len(specs)} meshes")
            return _like(value, [self._place(v, s, cut) for v, s in zip(value, specs)])
        return self._place(value, spec, cut)

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
            return {k: self._convert(v, keys.index(k) if k in keys else None, cut) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            if len(self.meshes) > 1 and len(batch) != len(self.meshes):
                raise ValueError(f"shard_dataloader: a batch of {len(batch)} inputs for {len(self.meshes)} meshes "
                                 f"(input i goes to meshes[i])")
            return _like(batch, [self._convert(v, i if len(self.meshes) > 1 else 0, cut) for i, v in enumerate(batch)])
        if not isinstance(batch, torch.Tensor):
            raise ValueError(f"shard_dataloader: a batch is a tensor, a dict or a list of them, got {type(batch)}")
        return self._convert(batch, 0, cut)

    def _batches(self):
        if self._shuffled is not None:
            # as Paddle's DistributedBatchSampler: the order is seeded with the epoch, the same on every rank
            self._shuffled.generator = torch.Generator().manual_seed(self._epoch)
            self._epoch += 1
        try:
            for batch in self.dataloader:
                yield self._shard(batch)
        finally:
            if self._shuffled is not None:
                self._shuffled.generator = None

    def __iter__(self):
        self._next = None  # as Paddle's: a new pass restarts what next(loader) continues
        return self._batches()

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


_RANDOM_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
                    torch.utils.data.WeightedRandomSampler)


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


def shard_dataloader(dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False):
    """Split every batch along the mesh axis ``shard_dims`` names (batch dim 0), Replicate on the other axes.

    With several meshes (pipelines), element i of a tuple batch (or ``input_keys[i]`` of a dict batch) goes to
    ``meshes[i]``; a single tensor, or a dict value ``input_keys`` does not name, goes to the first mesh. An input
    that is a list of tensors may have a list of meshes and of shard_dims, one per tensor. Unlike Paddle, the axis
    named is the axis used, and the loader's batch is the global batch (split unevenly when it must be). What stays
    dense (a nested dict's tensors, a list of strings) holds this rank's rows, as each rank's loader does in Paddle.
    A loader shuffled by torch's global RNG is shuffled with the epoch as seed, the same on every rank, as Paddle's
    DistributedBatchSampler does (``set_epoch``). ``is_dataset_splitted=True`` (needs ``shard_dims``): each rank's
    loader already yields its own part, e.g. through a ``DistributedSampler`` of as many parts as the axis has ranks.
    ``next(loader)`` continues one pass, as in Paddle.
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted)
