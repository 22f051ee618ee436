"""Paddle's PipelineLayer, LayerDesc and SharedLayerDesc: a layer list cut into (virtual) pipeline stages."""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

__all__ = ["LayerDesc", "SharedLayerDesc", "PipelineLayer", "segment_layers", "BASE_SEED"]

BASE_SEED = 1234  # as in Paddle: layer i of the description is built under seed BASE_SEED + i


class LayerDesc:
    """A layer to build later, on the stage that owns it: ``LayerDesc(nn.Linear, 4, 8)``."""

    def __init__(self, layer_func, *inputs, **kwargs):
        if not (isinstance(layer_func, type) and issubclass(layer_func, nn.Module)):
            raise TypeError(f"LayerDesc: layer_func must be an nn.Module subclass, got {layer_func!r}")
        self.layer_func = layer_func
        self.inputs = inputs
        self.kwargs = kwargs

    def build_layer(self) -> nn.Module:
        return self.layer_func(*self.inputs, **self.kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.inputs] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{type(self).__name__}({self.layer_func.__name__}{''.join(', ' + a for a in args)})"


class SharedLayerDesc(LayerDesc):
    """A layer whose ``shared_weight_attr`` parameters (a name or a list of names) are one weight on every stage
    that uses ``key``.

    The first occurrence's stage rank broadcasts them at build time; after each backward their gradients are summed
    over the sharing stages (e.g. tied input embedding and output projection). As in Paddle, the first stage's
    copies are marked ``is_firstly_shared = True`` and the others' False (Paddle's global-norm clip counts only the
    first). The layer's other parameters are each stage's own. ``forward_func(layer, x)`` replaces ``layer(x)`` at
    that position when given.
    """

    def __init__(self, key, layer_func, forward_func=None, shared_weight_attr="weight", *inputs, **kwargs):
        super().__init__(layer_func, *inputs, **kwargs)
        attrs = [shared_weight_attr] if isinstance(shared_weight_attr, str) else shared_weight_attr
        if not isinstance(attrs, (list, tuple)) or not attrs or not all(isinstance(a, str) for a in attrs):
            raise TypeError(f"SharedLayerDesc {key!r}: shared_weight_attr must be a name or a list of names, got "
                            f"{shared_weight_attr!r}")
        self.layer_name = key
        self.forward_func = forward_func
        self.shared_weight_attr = list(attrs)  # Paddle keeps a list too

    def __repr__(self) -> str:
        return f"SharedLayerDesc(key={self.layer_name!r}, {self.layer_func.__name__})"


def _layer_name(desc) -> str | None:
    if isinstance(desc, nn.Module):
        return type(desc).__name__
    if isinstance(desc, LayerDesc):
        return desc.layer_func.__name__
    return getattr(desc, "__name__", None)


def segment_layers(descs, num_parts: int, method="uniform") -> list[int]:
    """Boundaries ``[0, b1, ..., len(descs)]`` of ``num_parts`` consecutive parts, as Paddle's SegmentLayers.

    ``'uniform'``: equal counts, the remainder going one each to the last parts; ``'layer:Regex'``: equal
    numbers of layers whose class name matches; a list: the boundaries themselves (with or without the end).
    """
    n = len(descs)
    if num_parts < 1:
        raise ValueError(f"segment_layers: num_parts must be >= 1, got {num_parts}")
    if n < num_parts:
        raise ValueError(f"PipelineLayer: {n} layers cannot fill {num_parts} (virtual) stages")
    if isinstance(method, (list, tuple)):
        parts = [int(b) for b in method]
        if parts and parts[-1] != n and len(parts) == num_parts:
            parts.append(n)
        if len(parts) != num_parts + 1 or parts[0] != 0 or parts[-1] != n or parts != sorted(parts):
            raise ValueError(f"seg_method {list(method)}: need {num_parts + 1} increasing boundaries from 0 to {n}")
        return parts
    if method == "uniform":
        out = [0] * (num_parts + 1)
        size, extra = n // num_parts, n % num_parts
        for i in range(1, num_parts):
            out[i] = min(out[i - 1] + size + (1 if i > num_parts - extra else 0), n)
        out[num_parts] = n
        return out
    if isinstance(method, str) and method.startswith("layer:"):
        regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        marks = [i for i, d in enumerate(descs) if (nm := _layer_name(d)) is not None and regex.search(nm)]
        if not marks:
            names = sorted({nm for d in descs if (nm := _layer_name(d)) is not None})
            raise ValueError(f"seg_method {method!r} names no layer: no layer's class name matches "
                             f"{regex.pattern!r} (the layers are {names})")
        if len(marks) % num_parts:
            raise ValueError(f"seg_method {method!r}: {len(marks)} matching layers do not split into "
                             f"{num_parts} equal parts")
        per = len(marks) // num_parts
        out = [0] * (num_parts + 1)
        for k in range(1, num_parts):
            out[k] = marks[k * per - 1] + 1
        out[num_parts] = n
        return out
    raise ValueError(f"seg_method {method!r} is not supported: use 'uniform', 'layer:Name' or a list of boundaries")


class _Chunk(nn.Module):
    """The run functions of one (virtual) stage, called as Paddle calls them: one input, or a tuple of them."""

    def __init__(self, funcs, recompute_interval: int = 0):
        super().__init__()
        self.run_function = list(funcs)
        self.recompute_interval = int(recompute_interval)
        for i, f in enumerate(self.run_function):
            if isinstance(f, nn.Module):
                self.add_module(str(i), f)
            elif isinstance(f, partial) and f.args and isinstance(f.args[0], nn.Module):
                self.add_module(f"{i}_shared", f.args[0])

    @staticmethod
    def _run(funcs, *x):
        x = x[0] if len(x) == 1 else x
        for f in funcs:
            x = f(x)
        return x

    def forward(self, *x):
        funcs, k = self.run_function, self.recompute_interval
        if k <= 0:
            return self._run(funcs, *x)
        from ..fleet.utils import recompute  # replays with the RNG tracker's states too (tensor-parallel dropout)

        for s in range(0, len(funcs), k):
            part = funcs[s:s + k]
            needs = any(isinstance(t, torch.Tensor) and t.requires_grad for t in x) and torch.is_grad_enabled()
            has_params = any(next(iter(m.parameters()), None) is not None for m in part if isinstance(m, nn.Module))
            out = recompute(self._run, part, *x) if needs and has_params else self._run(part, *x)
            x = out if isinstance(out, tuple) else (out,)
        return x[0] if len(x) == 1 else x


def _hcg():
    from ..fleet import topology

    return topology.hybrid_group()


class PipelineLayer(nn.Module):
    """A sequence of layers (modules, ``LayerDesc``, ``SharedLayerDesc`` or plain callables) cut into stages.

    Each rank builds only its own stage's layers (layer ``i`` under seed ``1234 + i``, as Paddle does, so every
    layout of the same description starts from the same weights). ``num_stages`` defaults to the pipe degree of
    ``fleet``'s hybrid group (or of ``topology``); with ``num_virtual_pipeline_stages = v > 1`` the layers are cut
    into ``num_stages * v`` parts and stage ``s`` holds parts ``s, s + num_stages, ...`` (interleaved).
    Calling the layer runs this rank's stage (chunk ``chunk_id`` for v > 1); with one stage it is the model.
    ``loss_fn(output, label)``: the pipeline's loss, or a list of them (Paddle's: each computed, the one
    ``train_batch(loss_fn_idx=...)`` names backpropagated); kept as a list in ``_loss_fn``, as Paddle keeps it.
    meshviz also accepts ``seg_method='uniform'`` with v > 1 (Paddle requires ``'layer:...'`` there).
    """

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seg_method="uniform",
                 recompute_interval=0, recompute_ctx=None, num_virtual_pipeline_stages=None):
        super().__init__()
        from ...runtime.world import get_rank, get_world_size, is_initialized

        layers = list(layers)
        if not layers:
            raise ValueError("PipelineLayer: layers is empty")
        v = 1 if num_virtual_pipeline_stages is None else num_virtual_pipeline_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"PipelineLayer: num_virtual_pipeline_stages must be a positive int, got {v!r}")
        fns = loss_fn if isinstance(loss_fn, list) else [loss_fn]
        if not fns or (not all(callable(f) for f in fns) and fns != [None]):
            raise TypeError(f"PipelineLayer: loss_fn must be a callable loss_fn(output, label), a list of them, or "
                            f"None, got {loss_fn!r}")
        if isinstance(recompute_interval, bool) or not isinstance(recompute_interval, int) or recompute_interval < 0:
            raise ValueError(f"PipelineLayer: recompute_interval must be an int >= 0, got {recompute_interval!r}")
        world = get_world_size() if is_initialized() else 1
        rank = get_rank() if is_initialized() else 0
        if topology is None and _hcg() is not None:
            topology = _hcg().topology()
        if topology is not None:
            pp = topology.get_dim("pipe")
            if num_stages is not None and num_stages != pp:
                raise ValueError(f"PipelineLayer: num_stages={num_stages} but the hybrid topology has "
                                 f"pp_degree={pp}; they must be equal")
            stage_id = topology.get_coord(rank).pipe if pp > 1 else 0
        else:
            if num_stages is None:
                raise ValueError("PipelineLayer: give num_stages or topology (or call fleet.init first)")
            if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
                raise ValueError(f"PipelineLayer: num_stages must be a positive int, got {num_stages!r}")
            if world % num_stages:
                raise ValueError(f"PipelineLayer: num_stages={num_stages} does not divide the world size {world}")
            from ..fleet.topology import CommunicateTopology

            pp = num_stages
            topology = CommunicateTopology(["data", "pipe", "model"], [world // pp, pp, 1])
            stage_id = topology.get_coord(rank).pipe
        self._topo = topology
        self._num_stages = pp
        self._stage_id = stage_id
        self._num_virtual_pipeline_stages = v
        self._loss_fn = fns  # a list, as Paddle's: PipelineParallel's loss_fn_idx picks the one to backpropagate
        self._recompute_interval = recompute_interval
        self.recompute_ctx = recompute_ctx
        self._layers_desc = layers
        self.segment_parts = segment_layers(layers, pp * v, seg_method)
        # virtual stage index (global) of every chunk this rank holds, in chunk order
        self._virtual_stages = [stage_id + c * pp for c in range(v)]
        self.shared_layers = nn.ModuleDict()
        self.shared_weight_attrs: dict[str, list[str]] = {}
        self._chunks: list[_Chunk] = []
        for vs in self._virtual_stages:
            funcs = self._build(self.segment_parts[vs], self.segment_parts[vs + 1])
            self._chunks.append(_Chunk(funcs, recompute_interval))
        if v == 1:
            self.run_function = self._chunks[0].run_function
        self._shared_comm = self._construct_shared_comm()
        self._synchronize_shared_weights()

    # -- building ------------------------------------------------------------------------------------
    def _build(self, start, end):
        funcs = []
        for i in range(start, end):
            d = self._layers_desc[i]
            if isinstance(d, SharedLayerDesc):
                if d.layer_name not in self.shared_layers:
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(BASE_SEED + i)
                        self.shared_layers[d.layer_name] = d.build_layer()
                    self.shared_weight_attrs[d.layer_name] = d.shared_weight_attr
                    for name in d.shared_weight_attr:
                        p = getattr(self.shared_layers[d.layer_name], name, None)
                        if not isinstance(p, nn.Parameter):
                            raise ValueError(f"SharedLayerDesc {d.layer_name!r}: {d.layer_func.__name__} has no "
                                             f"parameter {name!r} (shared_weight_attr)")
                        p.is_firstly_shared = True  # type: ignore[attr-defined]
                layer = self.shared_layers[d.layer_name]
                funcs.append(layer if d.forward_func is None else partial(d.forward_func, layer))
            elif isinstance(d, LayerDesc):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(BASE_SEED + i)
                    layer = d.build_layer()
                self.add_module(str(i), layer)
                funcs.append(layer)
            elif isinstance(d, nn.Module):
                self.add_module(str(i), d)
                funcs.append(d)
            elif callable(d):
                funcs.append(d)
            else:
                raise TypeError(f"PipelineLayer: layer {i} ({d!r}) is not a module, LayerDesc or callable")
        return funcs

    def meta_forward(self, vs: int, inputs: tuple):
        """Virtual stage ``vs``'s layers run on ``inputs`` (meta tensors) with meta parameters: its outputs' shapes,
        dtypes and whether they need a gradient, on any rank (whichever stage it holds) and allocating nothing.
        Nothing is registered here: a LayerDesc is built again on the meta device, a module runs on meta copies of
        its parameters and buffers. For simulated ranks only (``what_if``): the collectives of tensor-parallel layers
        run on meta tensors, untraced."""
        from torch.func import functional_call

        from ... import trace
        from ...runtime.devices import strict_devices

        shared: dict = {}

        def meta_of(m: nn.Module) -> dict:
            return {k: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                    for k, t in [*m.named_parameters(), *m.named_buffers()]}

        def func(d):
            if isinstance(d, SharedLayerDesc):
                if d.layer_name not in shared:
                    with torch.device("meta"):
                        shared[d.layer_name] = d.build_layer()
                layer = shared[d.layer_name]
                return layer if d.forward_func is None else partial(d.forward_func, layer)
            if isinstance(d, LayerDesc):
                with torch.device("meta"):
                    return d.build_layer()
            if isinstance(d, nn.Module):
                return partial(lambda m, params, x: functional_call(m, params, (x,)), d, meta_of(d))
            return d

        listening = trace.sinks()
        for sink in listening:
            trace.remove_sink(sink, close=False)
        try:
            with torch.random.fork_rng(devices=[]), strict_devices(False):
                x = inputs[0] if len(inputs) == 1 else tuple(inputs)
                for i in range(self.segment_parts[vs], self.segment_parts[vs + 1]):
                    x = func(self._layers_desc[i])(x)
        finally:
            for sink in listening:
                trace.add_sink(sink)
        return x

    def get_stage_from_index(self, layer_idx: int) -> int:
        """The pipe stage (rank position, not virtual stage) holding layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layers_desc):
            raise ValueError(f"layer index {layer_idx} out of range 0..{len(self._layers_desc) - 1}")
        for vs in range(len(self.segment_parts) - 1):
            if self.segment_parts[vs] <= layer_idx < self.segment_parts[vs + 1]:
                return vs % self._num_stages
        raise AssertionError("unreachable")

    def _construct_shared_comm(self) -> dict:
        """One group per shared key and per (data, sharding, model) coordinate: the ranks of the sharing stages.

        Every rank creates every group, in the same order (sorted keys), as the process-group API requires.
        """
        out: dict = {}
        if self._num_stages == 1:
            return out
        from ...runtime.world import get_rank
        from ..collective import new_group

        me = get_rank()
        keys = sorted({d.layer_name for d in self._layers_desc if isinstance(d, SharedLayerDesc)}, key=str)
        topo = self._topo
        for key in keys:
            stages = sorted({self.get_stage_from_index(i) for i, d in enumerate(self._layers_desc)
                             if isinstance(d, SharedLayerDesc) and d.layer_name == key})
            if len(stages) < 2:
                continue
            for line in topo.get_comm_list("pipe"):
                ranks = [line[s] for s in stages]
                g = new_group(ranks)
                if me in ranks:
                    out[key] = {"ranks": ranks, "group": g, "weight_attr": self.shared_weight_attrs[key],
                                "layer": self.shared_layers[key]}
        return out

    @torch.no_grad()
    def _synchronize_shared_weights(self) -> None:
        from ...runtime.world import get_rank
        from ..collective import broadcast

        me = get_rank()
        for _key, comm in self._shared_comm.items():
            for name in comm["weight_attr"]:
                p = getattr(comm["layer"], name)
                broadcast(p.data, src=min(comm["ranks"]), group=comm["group"])
                p.is_firstly_shared = me == min(comm["ranks"])

    @torch.no_grad()
    def allreduce_shared_weight_gradients(self) -> None:
        """Sum the shared weights' gradients over the stages that share them (Paddle's rule)."""
        from ..collective import all_reduce

        for _key, comm in self._shared_comm.items():
            for name in comm["weight_attr"]:
                p = getattr(comm["layer"], name)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                all_reduce(p.grad, group=comm["group"])

    # -- Paddle accessors ----------------------------------------------------------------------------
    def get_num_virtual_stages(self) -> int:
        return self._num_virtual_pipeline_stages

    def get_model_chunks(self):
        return None if self._num_virtual_pipeline_stages == 1 else list(self._chunks)

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def stage_id(self) -> int:
        return self._stage_id

    @property
    def virtual_stages(self) -> list[int]:
        """Global (virtual) stage indices of this rank's chunks."""
        return list(self._virtual_stages)

    def forward(self, input, chunk_id=None):
        if chunk_id is None:
            if self._num_virtual_pipeline_stages > 1:
                raise ValueError("PipelineLayer with virtual stages: pass chunk_id")
            chunk_id = 0
        if not 0 <= chunk_id < len(self._chunks):
            raise ValueError(f"chunk_id {chunk_id} outside 0..{len(self._chunks) - 1}")
        args = input if isinstance(input, tuple) else (input,)
        return self._chunks[chunk_id](*args)

    def extra_repr(self) -> str:
        return (f"stage {self._stage_id} of {self._num_stages}, virtual stages {self._virtual_stages}, "
                f"segments {self.segment_parts}")
