"""Paddle's PipelineParallel on torch.distributed.pipelining: FThenB, 1F1B, interleaved (VPP), ZBH1, with events."""

from __future__ import annotations

import torch
from torch import nn

from ... import compat, trace
from ...core.schedule import fthenb_order, one_f_one_b_order
from ...runtime.devices import device, place_module
from ...trace import Event, Mark
from .layers import PipelineLayer

__all__ = ["PipelineParallel", "SCHEDULE_MODES", "resolve_schedule", "check_pipeline_config", "ActivationMeter"]

SCHEDULE_MODES = ("FThenB", "1F1B", "VPP", "ZBH1")

# (mode, interleaved?) -> torch.distributed.pipelining schedule class (imported on first use: it is slow)
_CLASSES = {
    ("FThenB", False): "ScheduleGPipe",
    ("FThenB", True): "ScheduleLoopedBFS",
    ("1F1B", False): "Schedule1F1B",
    ("1F1B", True): "ScheduleInterleaved1F1B",
    ("VPP", True): "ScheduleInterleaved1F1B",
    ("ZBH1", False): "ScheduleInterleavedZeroBubble",
    ("ZBH1", True): "ScheduleInterleavedZeroBubble",
}
_SINGLE = ("ScheduleGPipe", "Schedule1F1B")


def _schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, name)
_PHASE = {"F": "F", "B": "B", "I": "B", "W": "W"}  # torch action letter -> event phase


def resolve_schedule(mode: str, v: int):
    """(canonical mode name, torch schedule class name) for ``pipeline_configs['schedule_mode']`` and v chunks."""
    names = {m.lower(): m for m in SCHEDULE_MODES}
    if not isinstance(mode, str) or mode.lower() not in names:
        raise ValueError(f"pipeline_configs['schedule_mode'] = {mode!r}: use one of {list(SCHEDULE_MODES)}")
    mode = names[mode.lower()]
    if mode == "VPP" and v < 2:
        raise ValueError("schedule_mode 'VPP' needs PipelineLayer(num_virtual_pipeline_stages=v) with v > 1")
    if mode == "1F1B" and v > 1:
        mode = "VPP"
    return mode, _CLASSES[(mode, v > 1)]


def check_pipeline_config(p: int, m: int, v: int, mode: str) -> None:
    """ValueError for micro-batch counts the schedule cannot run (raised before any communication)."""
    if mode in ("VPP", "ZBH1") or (v > 1 and mode != "FThenB"):
        if v > 1 and m < p:
            raise ValueError(f"interleaved schedule {mode!r}: accumulate_steps ({m}) must be >= pp_degree ({p})")
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"schedule {mode!r}: accumulate_steps ({m}) must be a multiple of "
                             f"max(1, accumulate_steps // pp_degree) = {rounds} (torch's round structure); "
                             f"use a multiple of pp_degree ({p})")


class ActivationMeter:
    """Bytes saved for backward per (virtual stage, micro-batch), live from its forward until its backward.

    Parameters saved by autograd are not counted; a tensor saved twice in one micro-batch is counted once.
    """

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._held: dict = {}
        self._params: set = set()

    def watch(self, module: nn.Module) -> None:
        self._params |= {p.untyped_storage().data_ptr() for p in module.parameters()}

    def hooks(self, key):
        seen: set = set()
        total = [0]

        def pack(t):
            try:
                base, key = t.untyped_storage().data_ptr(), (t.data_ptr(), t.numel())
            except Exception:
                return t
            if base not in self._params and key not in seen:
                seen.add(key)
                total[0] += t.numel() * t.element_size()
            return t

        def done():
            self._held[key] = total[0]
            self.live += total[0]
            self.peak = max(self.peak, self.live)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), done

    def release(self, key) -> None:
        self.live -= self._held.pop(key, 0)

    def reset(self) -> None:
        self.live = self.peak = 0
        self._held.clear()


class _MicroLoss:
    """torch's loss_fn(output, target): the target is the micro-batch index; the label is looked up here.

    Each micro loss is divided by the number of micro-batches before its backward, as Paddle does, so the
    gradients are those of the mean loss; the unscaled-by-scaler values are kept for the returned loss.
    """

    def __init__(self, loss_fn, n: int):
        self.loss_fn = loss_fn
        self.n = n
        self.labels = None
        self.scaler = None
        self.values: dict = {}  # micro-batch -> loss (torch may call once more to infer shapes on a first step)

    def __call__(self, output, index):
        k = int(index.reshape(-1)[0])
        loss = self.loss_fn(output, self.labels[k]) / self.n
        self.values[k] = loss.detach()
        return self.scaler.scale(loss) if self.scaler is not None else loss


def _batch_of(x, what: str):
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError(f"{what} is a scalar; it needs a batch dimension to split into micro-batches")
        return x.shape[0]
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        sizes = {t.shape[0] if t.dim() else None for t in x}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"{what}: tensors with different batch sizes {sorted(map(str, sizes))}")
        return sizes.pop()
    raise ValueError(f"{what} must be a tensor or a tuple of tensors, got {type(x).__name__}")


def _to_device(x):
    """A batch (a tensor, or a tuple of them) on this rank's device; None stays None."""
    if x is None:
        return None
    dev = device()
    if isinstance(x, torch.Tensor):
        return x if x.device == dev else x.to(dev)
    return type(x)(t if t.device == dev else t.to(dev) for t in x)


def _split(x, m: int):
    if isinstance(x, torch.Tensor):
        return list(x.tensor_split(m))
    return [tuple(p) for p in zip(*(t.tensor_split(m) for t in x))]


class PipelineParallel(nn.Module):
    """``fleet.distributed_model(PipelineLayer)`` with pp_degree > 1: ``train_batch`` / ``eval_batch``.

    Stage i runs on the ranks of pipe position i of the hybrid group. A batch ``(inputs, labels)`` of
    ``micro_batch_size * accumulate_steps`` rows is split into ``accumulate_steps`` micro-batches (rows
    ``[k*mbs, (k+1)*mbs)``); each micro loss is divided by accumulate_steps before its backward; the returned loss
    is their sum (the mean micro loss), broadcast from the last stage to every stage. Layers and batches left on the
    CPU of a GPU rank move to its GPU (``dist.device()``), as Paddle places them. The schedule is torch's:
    ``schedule_mode`` 'FThenB' (ScheduleGPipe; ScheduleLoopedBFS with virtual stages), '1F1B' (Schedule1F1B;
    ScheduleInterleaved1F1B with virtual stages), 'VPP' (ScheduleInterleaved1F1B), 'ZBH1'
    (ScheduleInterleavedZeroBubble: backward split into input-grad B and weight-grad W blocks).

    Events (``meshviz.trace``), one per block and per transfer, on the rank that ran it:

    - ``compute``: ``op`` and ``payload.phase`` 'F' (forward), 'B' (backward; input-grad only under ZBH1) or 'W'
      (weight-grad, ZBH1); the :class:`~meshviz.trace.Compute` payload also has ``stage`` (global virtual stage
      index), ``chunk`` (this rank's chunk, ``stage // pp_degree``), ``micro_batch``, ``step`` (train/eval call
      number) and, while tracing, ``live_activation_bytes`` (bytes saved for backward still held after the
      block). ``start``/``end`` measured.
    - ``send`` / ``recv``: ``peer`` (the other global rank), ``bytes``, ``group`` [src, dst], a
      :class:`~meshviz.trace.Send` / :class:`~meshviz.trace.Recv` payload (micro_batch, phase ('F' activations,
      'B' gradients), stage, src_stage, dst_stage, step, transfer); the ``transfer`` string is the same on both
      sides and pairs them. A recv runs from posting to the wait's end.
    - ``mark`` with ``op='pipeline_step'`` at each step: a :class:`~meshviz.trace.Mark` payload (schedule,
      p, m, v, step, stage, eval).
    - The final loss broadcast and dp / shared-weight gradient all-reduces are ``collective`` events.

    Where meshviz follows Paddle rather than torch: micro-batches are rows ``[k*mbs, (k+1)*mbs)`` of a batch of
    exactly ``micro_batch_size * accumulate_steps`` (torch's step would also split uneven batches); each micro loss
    is divided by accumulate_steps before its backward (torch's ``scale_grads`` divides gradients afterwards, which
    would scale a weight shared by two chunks twice); the returned loss is broadcast to every stage (torch returns
    losses on the last stage only); ``SharedLayerDesc`` weights are broadcast at build time and their gradients summed
    over the sharing stages (torch has no shared-layer notion).
    """

    def __init__(self, layers, hcg=None, strategy=None):
        super().__init__()
        if not isinstance(layers, PipelineLayer):
            raise TypeError(f"PipelineParallel needs a PipelineLayer, got {type(layers).__name__}")
        from ..fleet.state import current
        from ..fleet.strategy import DistributedStrategy

        hcg = hcg if hcg is not None else current()._hcg
        strategy = strategy if strategy is not None else (current()._strategy or DistributedStrategy())
        if hcg is None:
            raise ValueError("PipelineParallel: call fleet.init(is_collective=True, strategy=...) first")
        p = hcg.get_pipe_parallel_world_size()
        if layers.num_stages != p:
            raise ValueError(f"PipelineLayer has num_stages={layers.num_stages} but pp_degree is {p}")
        cfg = strategy.pipeline_configs
        self._layers = layers
        self._hcg = hcg
        self._strategy = strategy
        self.micro_batch_size = int(cfg["micro_batch_size"])
        self.accumulate_steps = int(cfg["accumulate_steps"])
        self.num_stages = p
        self.stage_id = hcg.get_stage_id()
        self.num_virtual_stages = layers.get_num_virtual_stages()
        self.schedule_mode, self._cls = resolve_schedule(cfg.get("schedule_mode", "1F1B"), self.num_virtual_stages)
        check_pipeline_config(p, self.accumulate_steps, self.num_virtual_stages, self.schedule_mode)
        line = next(ln for ln in hcg.topology().get_comm_list("pipe") if hcg.get_global_rank() in ln)
        self._ranks = list(line)
        self._group = hcg.get_pipe_parallel_group()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == p - 1
        self._cache: dict = {}
        self._step = 0
        self.meter = ActivationMeter()
        self._opt_wrappers: dict = {}
        from ..parallel import sync_params_buffers

        place_module(layers, "PipelineParallel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
        if hcg.get_model_parallel_world_size() > 1:
            sync_params_buffers(layers, hcg.get_model_parallel_group(), is_model_parallel=True)
        if hcg.get_sharding_parallel_world_size() > 1:
            sync_params_buffers(layers, hcg.get_sharding_parallel_group())
        if hcg.get_data_parallel_world_size() > 1:
            sync_params_buffers(layers, hcg.get_data_parallel_group())

    # -- schedules -----------------------------------------------------------------------------------
    def _build(self, kind: str, compute_loss: bool, shapes):
        key = (kind, compute_loss, shapes)
        if key in self._cache:
            return self._cache[key]
        from .stage import TracedStage

        p, v, m = self.num_stages, self.num_virtual_stages, self.accumulate_steps
        stages = [TracedStage(chunk, vs, p * v, device(), self._group.process_group, self._ranks,
                              lambda: self._step, self.meter)
                  for chunk, vs in zip(self._layers._chunks, self._layers.virtual_stages)]
        loss = _MicroLoss(self._layers._loss_fn, m) if compute_loss else None
        name = self._cls if kind == "train" else ("ScheduleGPipe" if v == 1 else "ScheduleLoopedBFS")
        multi = name not in _SINGLE
        sched = _schedule_class(name)(stages if multi else stages[0], m, loss_fn=loss, scale_grads=False)
        self._cache[key] = (sched, stages, loss)
        return self._cache[key]

    def schedule_order(self, pipe_rank: int | None = None) -> list[tuple[str, int, int]]:
        """The compute blocks ``(phase, virtual stage, micro-batch)`` the train schedule runs on a pipe position.

        Phases F, B (full or input-grad backward), W. For the multi-chunk and zero-bubble schedules this is
        torch's schedule IR, which its runtime executes (no communication); torch's single-stage GPipe and 1F1B
        loop over micro-batches directly (their IR is only a drawing), so those orders come from
        ``meshviz.core.schedule``, which the views draw too.
        """
        d = self.stage_id if pipe_rank is None else pipe_rank
        p, m = self.num_stages, self.accumulate_steps
        if self._cls == "ScheduleGPipe":
            return fthenb_order(p, m, d)
        if self._cls == "Schedule1F1B":
            return one_f_one_b_order(p, m, d)
        sched, _, _ = self._build("train", True, None)
        out = []
        for a in compat.pipeline_order(sched)[d]:
            if a is None:
                continue
            ct, stage, mb = compat.action_fields(a)
            if ct in _PHASE:
                out.append((_PHASE[ct], stage, mb))
        return out

    # -- data ----------------------------------------------------------------------------------------
    def _check_data(self, data, need_labels: bool):
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise ValueError("train_batch/eval_batch: data must be (inputs, labels)")
        inputs, labels = data
        want = self.micro_batch_size * self.accumulate_steps
        for x, what, needed in ((inputs, "inputs", self.is_first_stage), (labels, "labels",
                                                                          need_labels and self.is_last_stage)):
            if x is None:
                if needed:
                    raise ValueError(f"pipeline stage {self.stage_id}: {what} is None but this stage needs it")
                continue
            n = _batch_of(x, what)
            if n != want:
                raise ValueError(f"{what} batch size {n} != micro_batch_size ({self.micro_batch_size}) * "
                                 f"accumulate_steps ({self.accumulate_steps}) = {want}")
        return inputs, labels

    def _shapes(self, inputs):
        if inputs is None:
            return None
        ts = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return tuple((tuple(t.shape), str(t.dtype)) for t in ts)

    def _run(self, sched, loss, inputs, labels, eval_mode: bool):
        m = self.accumulate_steps
        inputs, labels = _to_device(inputs), _to_device(labels)  # where the stage computes (its GPU), as in Paddle
        if loss is not None:
            loss.values = {}
            loss.labels = _split(labels, m) if self.is_last_stage else None
        args = () if not self.is_first_stage else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        target = torch.arange(m) if (loss is not None and self.is_last_stage) else None
        if trace.active():
            trace.emit(Event(kind="mark", op="pipeline_step", name=f"{self.schedule_mode} step {self._step}",
                             group=list(self._ranks),
                             payload=Mark(schedule="FThenB" if eval_mode else self.schedule_mode,
                                          p=self.num_stages, m=m, v=self.num_virtual_stages, step=self._step,
                                          stage=self.stage_id, eval=eval_mode)))
        self.meter.reset()
        run = sched.eval if (eval_mode and loss is not None) else sched.step
        return run(*args, target=target)

    def _final_loss(self, loss):
        """Start broadcasting the summed micro losses from the last stage; returns (0-d tensor, task to wait)."""
        from ..collective import broadcast

        if self.is_last_stage and loss.values:
            total = torch.stack([loss.values[k] for k in sorted(loss.values)]).sum()
        else:
            total = torch.zeros(())
        buf = total.detach().to(device(), copy=True).reshape(1)  # broadcast from this rank's device
        task = broadcast(buf, src=self._ranks[-1], group=self._group, sync_op=False)
        return buf.reshape(()), task

    # -- Paddle API ----------------------------------------------------------------------------------
    def train_batch(self, data, optimizer, lr_scheduler=None, scaler=None):
        """One pipelined step: forward/backward every micro-batch, sum shared-weight grads, optimizer step.

        ``optimizer`` may be a torch optimizer; it is wrapped as ``fleet.distributed_optimizer`` would (Paddle
        requires the wrapped one), so gradients are averaged over the data-parallel group before the step.
        """
        from ..fleet.optimizer import HybridParallelOptimizer

        inputs, labels = self._check_data(data, need_labels=True)
        if self._layers._loss_fn is None:
            raise ValueError("train_batch: the PipelineLayer has no loss_fn")
        if not isinstance(optimizer, HybridParallelOptimizer):
            optimizer = self._opt_wrappers.setdefault(
                id(optimizer), HybridParallelOptimizer(optimizer, self._hcg, self._strategy))
        self._layers.train()
        sched, _, loss = self._build("train", True, self._shapes(inputs))
        loss.scaler = scaler
        self._run(sched, loss, inputs, labels, eval_mode=False)
        self._layers.allreduce_shared_weight_gradients()
        out, task = self._final_loss(loss)  # overlaps the optimizer step
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.clear_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
        task.wait()
        self._step += 1
        return out

    def eval_batch(self, data, compute_loss=False):
        """Forward every micro-batch (FThenB order, no backward). With ``compute_loss`` the mean micro loss on
        every stage; without, the last stage's list of micro-batch outputs (other stages: an empty list)."""
        inputs, labels = self._check_data(data, need_labels=compute_loss)
        if compute_loss and self._layers._loss_fn is None:
            raise ValueError("eval_batch(compute_loss=True): the PipelineLayer has no loss_fn")
        self._layers.eval()
        sched, stages, loss = self._build("eval", bool(compute_loss), self._shapes(inputs))
        with torch.no_grad():
            self._run(sched, loss, inputs, labels, eval_mode=True)
        self._step += 1
        if compute_loss:
            out, task = self._final_loss(loss)
            task.wait()
            return out
        last = [s for s in stages if s.is_last]
        return list(last[0].output_chunks) if last else []

    def forward(self, *inputs, **kwargs):
        """This rank's stage on its own (chunk 0), as Paddle's wrapper calls its layers."""
        return self._layers(*inputs, **kwargs)

    def __repr__(self) -> str:
        return (f"PipelineParallel({self.schedule_mode}, stage {self.stage_id}/{self.num_stages}, "
                f"v={self.num_virtual_stages}, micro_batch_size={self.micro_batch_size}, "
                f"accumulate_steps={self.accumulate_steps}, ranks={self._ranks})")
