"""``dist.parallelize``: one call that applies the pipeline, tensor-parallel and data-parallel configs."""

from __future__ import annotations

import warnings

import torch

from ....core.mesh import ProcessMesh
from ....runtime import groups
from ....runtime.dtensor import DistTensor
from ....runtime.world import init_parallel_env
from ....runtime.zero import Zero, check_elementwise, gather_per_unit, laid_out_states
from ...api import reshard, shard_tensor
from ..interface import _state, get_mesh, set_mesh
from .conv_parallel import ConvParallel
from .parallel_base import param_holders, remap_optimizer, shard_all_params
from .pipeline_parallel import (
    assign_stages,
    register_pipeline_hooks,
    register_stage_transfers,
    resolve_split_spec,
    stage_indices,
    stage_mesh,
)
from .sharded_data_parallel import check_dp_config, shard_optimizer_with
from .tensor_parallel import _SP_REGION, _matches, _ShardParams, check_plan

__all__ = ["parallelize", "parallelize_model", "parallelize_optimizer"]

_CONFIG_KEYS = ("dp_config", "mp_config", "pp_config")


def _use_mesh(mesh, who: str) -> None:
    if mesh is None:
        return
    if not isinstance(mesh, ProcessMesh):
        raise ValueError(f"The mesh must be an instance of ProcessMesh, got {type(mesh).__name__}: {mesh!r}")
    g_mesh = get_mesh()
    if g_mesh is not None and g_mesh != mesh:
        warnings.warn(f"The mesh set by `dist.auto_parallel.set_mesh` is different with the mesh pass to `{who}`. "
                      f"Will overwrite the previous mesh", stacklevel=3)
    set_mesh(mesh)


def _check_config(config, who: str) -> dict:
    if not isinstance(config, dict):
        raise ValueError(f"{who}: config should be a dict with dp_config / mp_config / pp_config, got "
                         f"{type(config).__name__}")
    if config.get("cp_config") is not None:
        raise NotImplementedError(f"{who}: cp_config (context parallel: ContextParallel / PrepareContextParallel "
                                  f"along a 'sep' mesh axis) is not supported")
    unknown = set(config) - set(_CONFIG_KEYS) - {"cp_config"}
    if unknown:
        raise ValueError(f"{who}: unknown config keys {sorted(unknown)}; the keys are {list(_CONFIG_KEYS)}")
    return config


def _need_mesh():
    mesh = get_mesh()
    if mesh is None:
        raise ValueError("global mesh must not be None, please call dist.auto_parallel.set_mesh(global_mesh) "
                         "firstly or pass mesh=")
    return mesh


class _Prepared:
    """Everything parallelize will do, worked out and checked before anything changes or communicates."""

    def __init__(self, model, mesh, config):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"parallelize expects a torch.nn.Module, got {type(model).__name__}")
        if getattr(model, "_mv_parallelized", False):
            again = [k for k in ("pp_config", "mp_config") if config.get(k) is not None]
            if again:
                raise ValueError(f"this model has been parallelized already: a second {' and '.join(again)} would "
                                 f"add its hooks to those of the first call (Paddle then runs both). Pass the whole "
                                 f"config in one call; a second call may carry dp_config only, to shard a new "
                                 f"optimizer of the parallelized model")
        self.model, self.mesh = model, mesh
        pp_config, mp_config, dp_config = (config.get(k) for k in ("pp_config", "mp_config", "dp_config"))
        self.spec = self.global_spec = self.pipeline_layers = None
        if pp_config is not None:
            self.spec, self.global_spec, self.pipeline_layers = resolve_split_spec(model, mesh, pp_config)
        self.stages = self._stages()
        self.plan, self.split_ids = None, set()  # ids of the parameters a plan splits
        if mp_config is not None:
            if not isinstance(mp_config, dict):
                raise ValueError(f"mp_config should be a dict, got {type(mp_config).__name__}")
            unknown = set(mp_config) - {"parallelize_plan"}
            if unknown:
                raise ValueError(f"mp_config has unknown keys {sorted(unknown)}; it takes 'parallelize_plan'")
            plan = mp_config.get("parallelize_plan")
            if plan is None:
                warnings.warn("No parallelize plan, tensor parallel won't do anything.", stacklevel=3)
            else:
                if "mp" not in mesh.dim_names:
                    raise ValueError(f"mp_config needs a mesh axis named 'mp'; the mesh {mesh} has {mesh.dim_names}")
                self.plan = check_plan(plan)
        self.matches = self._match() if self.plan is not None else {}
        self.dp = check_dp_config(dp_config, mesh) if dp_config is not None else None

    def _stages(self) -> dict:
        return {} if self.spec is None else stage_indices(self.model, self.spec)

    def _match(self) -> dict:
        """name -> (layer, [(plan, param names)]), every parameter placement checked; a key that matches
        nothing is an error."""
        out, used = {}, set()
        for name, layer in self.model.named_modules():
            if not name:
                continue
            found = _matches(self.plan, layer, name)
            if not found:
                continue
            smesh = stage_mesh(self.mesh, self.stages.get(name, 0))
            entries = []
            for key, plans, params in found:
                used.add(key)
                for p in plans:
                    if isinstance(p, ConvParallel):
                        p.check_layer(layer, name)
                    if isinstance(p, _ShardParams):
                        placed = p.param_placements(layer, smesh, params, name)
                        self.split_ids.update(id(getattr(layer, pname)) for pname in placed)
                    entries.append((p, params))
            out[name] = (layer, entries)
        missing = [k for k in self.plan if k not in used]
        if missing:
            names = [n for n, _ in self.model.named_modules() if n]
            raise ValueError(f"parallelize_plan keys {missing} match no layer of {type(self.model).__name__}; its "
                             f"layers are named like {names[:6] + (['...'] if len(names) > 6 else [])} (a key is a "
                             f"regular expression matching a whole name, or a name followed by .weight / .bias)")
        return out

    def apply(self) -> torch.nn.Module:
        model, mesh = self.model, self.mesh
        init_parallel_env()
        groups.check_mesh_in_world(mesh)
        for name, layer in model.named_modules():
            layer._mv_layer_name = name
        if self.spec is not None:
            assign_stages(model, self.stages)
            register_pipeline_hooks(model, mesh, self.spec, self.global_spec, self.pipeline_layers)
        layer_param_placements = {}
        if self.matches:
            counts = {k: len(v) for k, v in param_holders(model).items()}
            sp_layers = [n for n, (_, entries) in self.matches.items() if any(isinstance(p, _SP_REGION)
                                                                            for p, _ in entries)]
            for name, (layer, entries) in self.matches.items():
                layer._mv_in_sp_region = any(name.startswith(s + ".") for s in sp_layers)
                smesh = stage_mesh(mesh, getattr(layer, "pipeline_stage_index", 0))
                for p, params in entries:
                    p.share_param_list = counts
                    deferred = p.apply(layer, smesh, params)
                    if deferred:
                        layer_param_placements.setdefault(layer, {}).update(deferred)
        if self.spec is not None:
            register_stage_transfers(model, mesh, self.spec)
        shard_all_params(model, mesh, layer_param_placements)
        model._mv_parallelized = True
        model._mv_pipelined = getattr(model, "_mv_pipelined", False) or self.spec is not None
        return model


def _parallelize(model, optimizer, config, who):
    mesh = _need_mesh()
    prepared = _Prepared(model, mesh, config)
    if optimizer is not None and (not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Zero)):
        raise ValueError(f"{who}: optimizer should be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    holders = param_holders(model)
    if optimizer is not None and _steps_parts(prepared, optimizer):
        check_elementwise(optimizer, who)  # shard_optimizer's check, made before the model changes
    model = prepared.apply()
    _state().parallelized = (model, not model._mv_pipelined)
    if optimizer is not None:
        mapping = {k: getattr(*hold[0]) for k, hold in holders.items()}
        states = [(p, optimizer.state.pop(p)) for p in list(optimizer.state)]
        remap_optimizer(optimizer, mapping)
        _carry_states(optimizer, states, mapping)
        level, dim = prepared.dp if prepared.dp is not None else (None, "dp")
        optimizer = shard_optimizer_with(optimizer, level, dim, mesh)
        _gather_per_layer(optimizer)
    return model, optimizer


@torch.no_grad()
def _carry_states(optimizer, states: list, mapping: dict) -> None:
    """The states of an optimizer that has stepped, keyed by the parallelized parameters and laid out as they are
    (each rank holds the whole value of every state, as every rank stepped the same model); ``shard_optimizer``
    then shards them as Paddle shards the accumulators it finds."""
    for p, st in states:
        new = mapping.get(id(p), p)
        if isinstance(new, DistTensor):
            with torch.no_grad():
                st = laid_out_states(st, new, list(new.placements), reshard, shard_tensor)
        optimizer.state[new] = st


def _steps_parts(prepared, optimizer) -> bool:
    """Whether each rank will step only a part of some parameter of ``optimizer``: a sharding level, a plan that
    splits one, or one split already."""
    if prepared.dp is not None and prepared.dp[0] is not None:
        return True
    return any(id(p) in prepared.split_ids or (isinstance(p, DistTensor) and any(not q.is_replicated()
                                                                                 for q in p.placements))
               for group in optimizer.param_groups for p in group["params"])


def _gather_per_layer(optimizer) -> None:
    """Sharding level 3 on a model without pipeline stages: each layer gathers its parameters once before its
    forward (FSDP2's units), instead of every op gathering the weights it reads."""
    model, whole = _state().parallelized or (None, False)
    full = getattr(optimizer, "full_placements", None)
    if model is not None and whole and full:
        gather_per_unit(model, full)


def _begin(config, mesh, who: str, needs_a_part: bool = True) -> bool:
    """What the three entry points check first: the config and the mesh. False, after Paddle's warning, when
    there is nothing to do (no config; with ``needs_a_part``, none of dp_config, mp_config, pp_config)."""
    if config is None:
        warnings.warn(f"The `{who}` will do nothing since the config is `None`.", stacklevel=3)
        return False
    _check_config(config, who)
    _use_mesh(mesh, who)
    if needs_a_part and all(config.get(k) is None for k in _CONFIG_KEYS):
        warnings.warn(f"{who} won't do anything: the config has no dp_config, mp_config or pp_config.",
                      stacklevel=3)
        return False
    return True


def parallelize(model, optimizer=None, mesh=None, config=None):
    """Parallelize ``model`` (and ``optimizer``) on ``mesh`` (default: the global mesh of ``set_mesh``).

    ``config`` has up to three keys:

    * ``pp_config = {'split_spec': ..., 'global_spec': 'llama.rotary' | [names]}``: pipeline stages on the
      sub-meshes along ``pp``. ``split_spec`` is a prefix (``'llama.layers'``: ``llama.layers.0``, ...) or a list
      of prefixes and layer names, whose layers are split evenly (the first stages hold one more when the pp
      degree does not divide them), or ``{'llama.layers.1': SplitPoint.END, ...}``. A ``global_spec`` layer's
      output is Replicate on the whole mesh, and moved onto the stage of each layer that takes it;
    * ``mp_config = {'parallelize_plan': {name regex: plan or [plans]}}``: tensor parallel along ``mp``;
    * ``dp_config = {'sharding_level': 0..3}``: data parallel along ``dp``, with ShardingStage1/2/3 optimizers.

    ``cp_config`` (context parallel) is not supported. Returns ``(model, optimizer)``: the same module with dist
    parameters and forward hooks, and the optimizer wrapped by ``shard_optimizer``. Everything is checked on every
    rank before anything changes. A second call on the same model may carry ``dp_config`` only.
    """
    if not _begin(config, mesh, "parallelize"):
        return model, optimizer
    return _parallelize(model, optimizer, config, "parallelize")


def parallelize_model(model, mesh=None, config=None):
    """The model half of ``parallelize``; build the optimizer from its result, then ``parallelize_optimizer``."""
    if not _begin(config, mesh, "parallelize_model"):
        return model
    model, _ = _parallelize(model, None, config, "parallelize_model")
    _state().model_done = True
    return model


def parallelize_optimizer(optimizer, mesh=None, config=None):
    """The optimizer half: ``shard_optimizer`` with the sharding stage ``config['dp_config']`` names."""
    if not _begin(config, mesh, "parallelize_optimizer", needs_a_part=False):
        return optimizer
    if not _state().model_done:
        raise ValueError("Please parallelize the model before parallelize optimizer.")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Zero):
        raise ValueError(f"parallelize_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DistTensor):
                raise ValueError("Please use model after parallelize to create optimizer: a parameter of shape "
                                 f"{list(p.shape)} is not a dist tensor.")
    mesh = _need_mesh()
    dp_config = config.get("dp_config")
    level, dim = check_dp_config(dp_config, mesh) if dp_config is not None else (None, "dp")
    optimizer = shard_optimizer_with(optimizer, level, dim, mesh)
    _gather_per_layer(optimizer)
    return optimizer
