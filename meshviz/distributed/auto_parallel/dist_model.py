"""Paddle's ``dist.to_static`` / ``DistModel``: train, eval and predict steps over a torch layer, with programs."""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ... import compat, trace
from ...core.sharding import STAGES
from ...runtime.data_parallel import average_gradients
from ..api import is_dist_tensor
from ..collective import all_gather_object, all_reduce, broadcast
from . import model_state
from . import program as prog
from .amp import LossScaling, PureLowPrecision, amp_dtype, autocast, check_lists, pure_low_precision
from .pipeline_schedule import Pipeline
from .program import Program, count_inputs, local_of, meta_from_spec, shape_str, skeleton, split_feeds, split_input_spec
from .recorder import DispatchRecorder, graph_from_records
from .strategy import Strategy

__all__ = ["to_static", "DistModel", "MODES"]

MODES = ("train", "eval", "predict")


def _is_dist(t) -> bool:
    return is_dist_tensor(t) or isinstance(t, DTensor)


def _world() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else 1


class DistModel:
    """A layer, loss and optimizer as one step function per mode (Paddle's DistModel; use ``to_static``).

    ``train()``: ``__call__(inputs..., labels...)`` runs forward, backward and (every ``k_steps`` calls) the
    optimizer, and returns the loss: one tensor, ``loss(*outputs, *labels)`` as Paddle's (a model's outputs spread).
    ``eval()``: returns the loss. ``predict()``: ``__call__(inputs...)`` returns ``{"out0": ..., "out1": ...}`` (a
    dist-tensor output as its global value). With ``return_numpy`` (Paddle's default) values come back as numpy
    arrays in their dtype (bfloat16 as float32), else tensors. On more than one rank with plain (not dist)
    parameters the ranks train as data parallel: parameters start from rank 0, each rank feeds its own part of the
    batch, gradients are averaged, and the loss returned is the mean over the ranks (the loss of the whole batch). A
    loss per sample (not a scalar) trains on the gradient of its sum over the whole batch and comes back as every
    sample's loss (data parallel ranks' in rank order), as Paddle's. With ``strategy.sharding`` fed dist batches
    (``shard_dataloader``'s) each rank runs its rows of the inputs and the loss is the whole batch's, as one
    process's on it. With ``strategy.pipeline`` each call runs the batch as micro-batches through the stages' meshes
    (``pipeline_schedule.Pipeline``).
    """

    def __init__(self, layer, loader=None, loss=None, optimizer=None, strategy=None, input_spec=None):
        if not isinstance(layer, nn.Module):
            raise ValueError(f"to_static: layer must be a torch.nn.Module, got {type(layer).__name__}")
        if loss is not None and not callable(loss):
            raise ValueError(f"to_static: loss must be callable, got {type(loss).__name__}")
        if optimizer is not None and not hasattr(optimizer, "step"):
            raise ValueError(f"to_static: optimizer must be a torch optimizer, got {type(optimizer).__name__}")
        if strategy is None:
            strategy = Strategy()
        if not isinstance(strategy, Strategy):
            raise ValueError(f"to_static: strategy must be a dist.Strategy, got {type(strategy).__name__}")
        self._pipe = Pipeline(strategy, _world(), layer) if strategy.pipeline.enable else None
        gm = strategy.gradient_merge
        k = gm.k_steps if gm.enable else 1  # a positive int: checked when set
        amp = strategy.amp
        if amp.enable and str(amp.dtype) not in ("float16", "bfloat16"):
            raise ValueError(f"to_static: amp.dtype must be 'float16' or 'bfloat16', got {amp.dtype!r}")
        if amp.enable and str(amp.level).lower() not in ("o0", "o1", "o2"):
            raise ValueError(f"to_static: amp.level must be 'O0', 'O1' or 'O2', got {amp.level!r}")
        if amp.enable:
            check_lists(amp)
        o2 = pure_low_precision(strategy, optimizer)
        sh = strategy.sharding
        if sh.enable and optimizer is not None and sh.stage not in (1, 2, 3):
            raise ValueError(f"to_static: sharding.stage must be 1, 2 or 3, got {sh.stage}")
        if sh.enable and optimizer is not None and any(_is_dist(p) for p in layer.parameters()):
            raise ValueError(f"to_static: strategy.sharding with dist-tensor parameters is not supported; pass dist."
                             f"shard_optimizer(optimizer, dist.ShardingStage{sh.stage}(axis, mesh)) as the optimizer")
        world = _world()
        if sh.enable and optimizer is not None and not (sh.degree == 8 and world < 8) and int(sh.degree) != world:
            # before the parameters are broadcast below
            raise ValueError(f"to_static: sharding.degree ({sh.degree}) must equal the number of ranks ({world})")

        self._serial_layer = skeleton(layer)
        self._layer = layer
        self._loss = loss
        self._optimizer = optimizer
        self._strategy = strategy
        self._loader = loader
        self._input_spec, self._label_spec = split_input_spec(input_spec)
        self._k, self._avg = k, bool(gm.avg)
        self._micro = 0
        self._scaler = None
        self._programs = {}
        self._examples = {}
        self._n_inputs = count_inputs(layer, self._input_spec)
        self._names = {}
        self._sharded = False
        self._dp = False
        self._rows = None
        self._lrs = None  # model_state.LearningRates: Paddle's learning_rate_0

        if world > 1:
            from ...runtime.devices import place_module

            place_module(layer, "DistModel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
            plain = [p for p in layer.parameters() if not _is_dist(p)]
            with torch.no_grad():
                # data parallel starts from rank 0's parameters and buffers
                for p in plain + [b for b in layer.buffers() if plain and not _is_dist(b)]:
                    broadcast(p.data, src=0)
            self._dp = bool(plain)
        self._device_type = next((p.device.type for p in layer.parameters()), "cpu")
        self._o2 = PureLowPrecision(layer, amp_dtype(amp.dtype), strategy.fused_passes.enable) if o2 else None
        self._scaling = LossScaling(amp)
        if amp.enable and str(amp.dtype) == "float16" and amp.use_dynamic_loss_scaling and optimizer is not None:
            self._scaler = torch.amp.GradScaler(
                self._device_type, init_scale=float(amp.init_loss_scaling), growth_factor=float(amp.incr_ratio),
                backoff_factor=float(amp.decr_ratio), growth_interval=int(amp.incr_every_n_steps),
            )
            if any(is_dist_tensor(p) for p in layer.parameters()):
                from ..shard_scaler import shard_scaler

                # torch's scaler unscales the param_groups' gradients; a sharded optimizer's hold stand-ins
                self._scaler = shard_scaler(self._scaler)
        if sh.enable and optimizer is not None:
            from ..sharding import group_sharded_parallel

            level = STAGES[sh.stage]
            self._layer, self._optimizer, self._scaler = group_sharded_parallel(
                layer, optimizer, level, scaler=self._scaler, segment_size=1 if level == "p_g_os" else 2**20)
            self._sharded, self._dp = True, False
        self._forward = self._layer
        if strategy.fused_passes.enable:
            self._forward = torch.compile(self._layer)

        self._mode = None
        if optimizer is not None and loss is not None:
            self.train()
        elif loss is not None:
            self.eval()
        else:
            self.predict()

    # modes ------------------------------------------------------------------------------------------------
    def train(self):
        """Set "train" mode: ``__call__`` updates the parameters and returns the loss."""
        self._mode = "train"
        self._layer.train()

    def eval(self):
        """Set "eval" mode: ``__call__`` returns the loss."""
        self._mode = "eval"
        self._layer.eval()

    def predict(self):
        """Set "predict" mode: ``__call__`` returns ``{"out0": ...}``."""
        self._mode = "predict"
        self._layer.eval()

    @property
    def mode(self):
        return self._mode

    def _validate_mode(self, mode):
        if mode is None and self._mode is None:
            raise ValueError("Please set the mode or call train()/eval()/predict() first.")
        mode = self._mode if mode is None else mode
        if mode not in MODES:
            raise ValueError("mode can only be 'train', 'eval' or 'predict'.")
        return mode

    # the step ---------------------------------------------------------------------------------------------
    def __call__(self, *args):
        if self._mode is None:
            raise ValueError("Please call train()/eval()/predict() first.")
        if self._mode == "train" and (self._optimizer is None or self._loss is None):
            raise ValueError("Please set optimizer and loss function before training.")
        if self._mode == "eval" and self._loss is None:
            raise ValueError("Please set loss function before evaluation.")
        for item in args:
            if not isinstance(item, (list, tuple, torch.Tensor)):
                raise TypeError(f"The inputs of DistModel should be list or tensor, but got {type(item)}")
        n = self._n_inputs
        inputs, labels = split_feeds(list(args), n, self._mode != "predict")
        # before any communication: the same on every rank
        self._rows = prog.row_split(inputs, labels, _world(), "DistModel") if self._sharded else None
        if self._mode == "predict" and n is not None and len(inputs) != n:
            raise ValueError(f"predict takes the model's {n} input(s), got {len(inputs)} tensors")
        if self._mode != "predict" and not (inputs and labels):
            got = len(inputs) + len(labels)
            what = "the model's" if n is None else n
            raise ValueError(f"{self._mode} takes {what} input(s) and then the label(s), got {got} tensors")
        self._examples.setdefault(self._mode, (inputs, labels))
        record = self._mode not in self._programs
        rec = DispatchRecorder() if record else None
        # a pipeline's blocks are its compute events: the step is no block of its own
        with trace.span("compute", op=f"dist_model_{self._mode}") if self._pipe is None else self._pipe.quiet():
            if rec is not None:
                fwd, self._forward = self._forward, self._layer  # record eager ops; compile skips under a mode
                try:
                    with rec:
                        out = self._step(inputs, labels)
                finally:
                    self._forward = fwd
                self._programs[self._mode] = (rec.records, self._local_names())
            else:
                out = self._step(inputs, labels)
        return out

    def _autocast(self):
        return autocast(self._strategy.amp, self._device_type)

    def _run(self, inputs):
        if self._rows is not None:  # sharding trains each rank on its rows; the loss is the whole batch's
            inputs = [local_of(t).detach() if _is_dist(t) else t for t in inputs]
        out = self._forward(*inputs) if self._o2 is None else \
            self._o2.run(self._layer, inputs, eager=self._forward is self._layer)
        return out if self._rows is None else prog.rows_as_dist(out, self._rows)

    def _step(self, inputs, labels):
        if self._pipe is not None:
            return self._pipe.run(self, inputs, labels)
        if self._mode == "predict":
            with torch.no_grad(), self._autocast():
                got = self._run(inputs)
            outs = got if isinstance(got, (tuple, list)) else [got]
            bad = [type(o).__name__ for o in outs if not isinstance(o, torch.Tensor)]
            if bad:  # the same on every rank: every rank runs the same forward
                held = f" holding {', '.join(bad)}" if outs is got else ""
                raise TypeError(f"predict: the model must return a tensor or a list/tuple of tensors (each "
                                f"returned as out<i>), got {type(got).__name__}{held}")
            return {f"out{i}": self._out(o) for i, o in enumerate(outs)}
        if self._mode == "eval":
            with torch.no_grad(), self._autocast():
                loss = self._loss_of(self._run(inputs), labels)
            return self._out(self._global_loss(loss))
        loss = self._train_loss(inputs, labels)
        self._backward(loss, self._k, self._avg)
        self._micro += 1
        if self._micro % self._k == 0:
            self._update()
        return self._out(self._global_loss(loss.detach()))

    def _loss_of(self, out, labels):
        """The loss of the forward's ``out``, as Paddle's ``loss(*outputs, *labels)``: a model's outputs (a tuple or
        list) come as arguments of their own. ValueError (every rank runs the same loss) unless it is one tensor."""
        loss = self._loss(*(list(out) if isinstance(out, (tuple, list)) else [out]), *labels)
        if not isinstance(loss, torch.Tensor):
            what = f"{type(loss).__name__} of {len(loss)}" if isinstance(loss, (tuple, list)) else type(loss).__name__
            raise ValueError(f"DistModel: the loss must return one tensor, the loss to train on (Paddle's loss is "
                             f"one value), got a {what}")
        return loss

    def _train_loss(self, inputs, labels):
        with self._autocast():
            loss = self._loss_of(self._run(inputs), labels)
        if self._o2 is not None and loss.is_floating_point():
            loss = loss.float()  # O2's loss in float32, as Paddle's
        return loss

    def _backward(self, loss, k, avg):
        """Backward of ``loss``, one of ``k`` micro-steps whose gradients accumulate (averaged with ``avg``)."""
        scaled = loss
        if loss.dim():  # a loss per sample: the gradient of its sum over the whole batch, as in Paddle
            # the ranks' gradients are averaged: a local sum times the ranks is their sum
            scaled = loss.sum() * (_world() if self._split(loss) else 1)
        scaled = scaled / k if (k > 1 and avg) else scaled
        if self._rows is not None:  # the ranks' gradients are averaged: each block's counts once in their sum
            scaled = scaled * self._rows.parts
        if self._scaler is not None:
            self._scaling.sync(self._scaler)  # a scale loaded into state_dict()'s tensor in place
            scaled = self._scaler.scale(scaled)
        scaled.backward()

    def _update(self):
        lrs = model_state.learning_rates(self)
        if lrs is not None:
            lrs.sync()  # a rate loaded into state_dict()'s learning_rate_0 in place
        if self._dp:
            # every dense parameter, a rank without its gradient counting zeros: ranks whose branches used
            # different parameters still pack the same buffers
            average_gradients([p for p in self._layer.parameters() if not (_is_dist(p) or _is_dist(p.grad))], None)
        if self._scaler is not None:
            self._scaling.step(self._scaler, self._optimizer)
        else:
            self._optimizer.step()
        self._optimizer.zero_grad()

    def _split(self, loss) -> bool:
        """Whether ``loss`` is this rank's part of the batch's: each rank fed its own data (a plain loss)."""
        return not _is_dist(loss) and (self._dp or self._sharded) and _world() > 1 and self._strategy.split_data

    def _global_loss(self, loss):
        if _is_dist(loss):
            return loss.full_tensor()
        if self._split(loss):
            if loss.dim():  # a loss per sample: every rank's samples, in rank order (the ranks' batches may differ)
                parts: list = []
                all_gather_object(parts, loss.detach().cpu())
                return torch.cat(parts).to(loss.device)
            loss = loss.detach().to(torch.promote_types(loss.dtype, torch.float32)).clone()
            all_reduce(loss)
            return loss / _world()
        return loss

    def _out(self, t, local=False):
        if _is_dist(t):
            t = t._local_value() if (local and hasattr(t, "_local_value")) else t.full_tensor()
        t = t.detach()  # a numpy array in the tensor's own dtype, as Paddle fetches it (numpy has no bfloat16)
        return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() if self._strategy.return_numpy else t

    # programs ---------------------------------------------------------------------------------------------
    def _local_names(self) -> dict:
        names = {}
        for n, p in self._layer.named_parameters():
            loc = p
            if isinstance(p, DTensor):
                loc = compat.dtensor_local(p)
            elif is_dist_tensor(p):
                loc = p._local
            names[id(loc)] = n
            names[id(p)] = n
        return names

    def dist_main_program(self, mode=None) -> Program:
        """This rank's program for ``mode``: the ops it ran on its local blocks, collectives included.

        Recorded from the first call in that mode (run one step first).
        """
        mode = self._validate_mode(mode)
        if mode not in self._programs:
            raise ValueError(f"dist_main_program({mode!r}): run one {mode} step first; the dist program is "
                             f"recorded from what this rank actually runs")
        records, names = self._programs[mode]
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        header = [f"rank {rank} of {_world()}", f"parameters: {len(list(self._layer.parameters()))}"]
        return Program("dist main", mode, graph_from_records(records, names), header)

    def serial_main_program(self, mode=None) -> Program:
        """The whole model's program for ``mode`` (global shapes, no communication), traced with torch.fx."""
        mode = self._validate_mode(mode)
        inputs, labels = self._global_examples(mode)
        layer = self._serial_layer
        params = dict(layer.named_parameters())
        loss_fn = self._loss

        def step(params, inputs, labels):
            out = torch.func.functional_call(layer, params, tuple(inputs))
            if mode == "predict":
                return out
            loss = loss_fn(*(list(out) if isinstance(out, (tuple, list)) else [out]), *labels)
            if mode == "eval":
                return loss
            trained = [p for p in params.values() if p.requires_grad]
            grads = torch.autograd.grad(loss.sum() if loss.dim() else loss, trained)
            return loss, grads

        from torch.fx.experimental.proxy_tensor import make_fx

        header = [f"{n}: {shape_str(p)}" for n, p in params.items()]
        if mode == "train" and self._optimizer is not None:
            header.append(f"then {type(self._optimizer).__name__} updates {len(params)} parameters")
        try:
            gm = make_fx(step)(params, inputs, labels)
            for n in gm.graph.nodes:
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor):
                    n.meta["shape"] = shape_str(val)
            return Program("serial main", mode, gm.graph, header)
        except Exception as e:  # a forward that calls distributed ops cannot run serially on meta tensors
            return Program("serial main", mode, None, header, note=f"not traceable serially: {e}")

    def _global_examples(self, mode):
        spec = self._input_spec
        if spec is not None:
            inputs = [meta_from_spec(s) for s in spec]
            if self._label_spec is not None:
                return inputs, [meta_from_spec(s) for s in self._label_spec] if mode != "predict" else []
            ex = self._examples.get(mode) or next(iter(self._examples.values()), ([], []))
            labels = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in ex[1]]
            return inputs, labels
        if mode in self._examples or self._examples:
            inputs, labels = self._examples.get(mode) or next(iter(self._examples.values()))
        elif self._loader is not None:
            batch = prog.first_batch(self._loader)
            batch = list(batch.values()) if isinstance(batch, dict) else batch
            inputs, labels = split_feeds(list(batch) if isinstance(batch, (list, tuple)) else [batch], self._n_inputs,
                                         True)  # a loader's batch holds the labels: predict leaves them out below
        else:
            raise ValueError("serial program: pass input_spec or a loader to to_static, or run one step first")
        # dist parameters (not sharding's own): every rank feeds the whole batch
        has_dist = not self._sharded and any(_is_dist(p) for p in self._layer.parameters())
        scale = _world() if ((self._dp or self._sharded) and self._strategy.split_data and not has_dist) else 1

        def meta(t):
            shape = list(t.shape)
            if shape and scale > 1 and not _is_dist(t):  # a dist feed's shape is the whole batch's
                shape[0] *= scale
            return torch.empty(shape, dtype=t.dtype, device="meta")

        return [meta(t) for t in inputs], [meta(t) for t in labels] if mode != "predict" else []

    def dist_startup_program(self, mode=None) -> Program:
        """How this rank's parameters and optimizer states start: local shapes, where they come from."""
        mode = self._validate_mode(mode)
        header = []
        for n, p in self._layer.named_parameters():
            where = "sliced from the full tensor (no communication)" if _is_dist(p) else (
                "broadcast from rank 0" if self._dp else "initialised locally")
            local = local_of(p)
            placements = getattr(p, "placements", None)
            header.append(f"{n}: global {list(p.shape)} local {list(local.shape)}"
                          f"{' ' + str(placements) if placements is not None else ''}; {where}")
        if self._sharded and mode == "train":
            for pc in self._optimizer.ownership:
                header.append(f"opt state of {pc.name}: {pc.mode}, ranges {list(pc.ranges)}")
        return Program("dist startup", mode, None, header)

    def serial_startup_program(self, mode=None) -> Program:
        """The parameters (and, in train mode, optimizer states) the whole model starts with."""
        mode = self._validate_mode(mode)
        header = [f"{n}: {shape_str(p)}" for n, p in self._serial_layer.named_parameters()]
        if mode == "train" and self._optimizer is not None:
            header.append(f"optimizer: {type(self._optimizer).__name__}")
        return Program("serial startup", mode, None, header)

    # state ------------------------------------------------------------------------------------------------
    def state_dict(self, mode="all") -> dict:
        """'param': the layer's state dict; 'opt': optimizer states as ``{param}.{state}`` keys (and, under float16's
        dynamic loss scaling, Paddle's ``loss_scaling_0``, ``num_good_steps_0``, ``num_bad_steps_0``); 'all': both.
        Paddle's ``learning_rate_0``, the next step's rate, is in 'opt', or in 'param' under a torch LR scheduler."""
        return model_state.state_dict(self, mode)

    def set_state_dict(self, state_dict: dict) -> None:
        """Load values (as ``state_dict`` gives them) into the layer's parameters, the optimizer and the loss scale.
        Every key is checked before anything is written (an unknown one raises ``ValueError``)."""
        model_state.set_state_dict(self, state_dict)


def to_static(layer, loader=None, loss=None, optimizer=None, strategy=None, input_spec=None):
    """Turn ``layer`` (its parameters may be dist tensors) with ``loss`` and ``optimizer`` into a DistModel.

    Mode by default: loss and optimizer -> "train"; loss only -> "eval"; neither -> "predict".
    ``loader`` and ``input_spec`` describe the inputs for the programs: Paddle's ``[[input specs], [label specs]]``
    or a list of the inputs' specs, each a tensor, an InputSpec-like object (``shape``, ``dtype``) or a
    ``(shape, dtype)`` pair. With ``strategy.full_graph`` False, Paddle's SOT mode, the layer itself comes back.
    """
    if isinstance(strategy, Strategy) and not strategy.full_graph:
        return layer
    return DistModel(layer, loader, loss, optimizer, strategy, input_spec)
