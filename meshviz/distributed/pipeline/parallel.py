"""Paddle's PipelineParallel: reads fleet's hybrid group and strategy and runs the runtime's pipeline engine."""

from __future__ import annotations

from torch import nn

from ...runtime.agree import same_on_every_rank
from ...runtime.devices import device, place_module
from ...runtime.pipeline import SCHEDULE_MODES, ActivationMeter, PipelineEngine, check_pipeline_config, resolve_schedule
from .layers import PipelineLayer

__all__ = ["PipelineParallel", "SCHEDULE_MODES", "resolve_schedule", "check_pipeline_config", "ActivationMeter"]


class PipelineParallel(nn.Module):
    """``fleet.distributed_model(PipelineLayer)`` with pp_degree > 1: ``train_batch`` / ``eval_batch``.

    Stage i runs on the ranks of pipe position i of the hybrid group. A batch ``(inputs, labels)`` of
    ``micro_batch_size * accumulate_steps`` rows is split into ``accumulate_steps`` micro-batches (rows
    ``[k*mbs, (k+1)*mbs)``; a list of ``accumulate_steps`` micro-batches is taken too, as in Paddle). With fewer
    micro-batches than stages, '1F1B' runs GPipe's order (torch's 1F1B refuses them; same gradients). Each micro
    loss is divided by accumulate_steps before its backward; the returned loss is their sum (the mean micro loss),
    broadcast from the last stage to every stage. Layers and batches left on the
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
        from ..fleet.state import configured
        from ..fleet.strategy import DistributedStrategy

        fleet_hcg, fleet_strategy = configured()
        hcg = hcg if hcg is not None else fleet_hcg
        strategy = strategy if strategy is not None else (fleet_strategy or DistributedStrategy())
        if hcg is None:
            raise ValueError("PipelineParallel: call fleet.init(is_collective=True, strategy=...) first")
        p = hcg.get_pipe_parallel_world_size()
        if layers.num_stages != p:
            raise ValueError(f"PipelineLayer has num_stages={layers.num_stages} but pp_degree is {p}")
        cfg = strategy.pipeline_configs
        self._layers = layers
        self._hcg = hcg
        self._strategy = strategy
        micro_batch_size, accumulate_steps = int(cfg["micro_batch_size"]), int(cfg["accumulate_steps"])
        mode = cfg.get("schedule_mode", "1F1B")
        # ranks set up differently wait on each other forever, or cut the layers differently and leave some out
        same_on_every_rank("PipelineParallel", {
            "micro_batch_size": micro_batch_size, "accumulate_steps": accumulate_steps,
            "schedule_mode": mode.lower() if isinstance(mode, str) else mode,
            "num_virtual_pipeline_stages": layers.get_num_virtual_stages(), "layers": len(layers._layers_desc),
            "segment_parts": list(layers.segment_parts)})
        line = next(ln for ln in hcg.topology().get_comm_list("pipe") if hcg.get_global_rank() in ln)
        self._engine = PipelineEngine(
            layers._chunks, layers.virtual_stages, group=hcg.get_pipe_parallel_group(), ranks=line,
            stage_id=hcg.get_stage_id(), num_stages=p, num_virtual_stages=layers.get_num_virtual_stages(),
            micro_batch_size=micro_batch_size, accumulate_steps=accumulate_steps,
            schedule_mode=mode, device=device(), loss_fn=layers._loss_fn,
            stage_meta=layers.meta_forward)
        self._opt_wrappers: dict = {}
        from ..parallel import sync_params_buffers

        place_module(layers, "PipelineParallel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
        if hcg.get_model_parallel_world_size() > 1:
            sync_params_buffers(layers, hcg.get_model_parallel_group(), is_model_parallel=True)
        if hcg.get_sep_parallel_world_size() > 1:  # Paddle's order: mp, sep, sharding, dp
            sync_params_buffers(layers, hcg.get_sep_parallel_group())
        if hcg.get_sharding_parallel_world_size() > 1:
            sync_params_buffers(layers, hcg.get_sharding_parallel_group())
        if hcg.get_data_parallel_world_size() > 1:
            sync_params_buffers(layers, hcg.get_data_parallel_group())

    # -- what the engine was given ---------------------------------------------------------------------
    @property
    def micro_batch_size(self) -> int:
        return self._engine.micro_batch_size

    @property
    def accumulate_steps(self) -> int:
        return self._engine.accumulate_steps

    @property
    def num_stages(self) -> int:
        return self._engine.num_stages

    @property
    def stage_id(self) -> int:
        return self._engine.stage_id

    @property
    def num_virtual_stages(self) -> int:
        return self._engine.num_virtual_stages

    @property
    def schedule_mode(self) -> str:
        return self._engine.schedule_mode

    @property
    def is_first_stage(self) -> bool:
        return self._engine.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self._engine.is_last_stage

    @property
    def meter(self) -> ActivationMeter:
        """Live activation bytes of this rank's chunks (reset at each step)."""
        return self._engine.meter

    def schedule_order(self, pipe_rank: int | None = None) -> list[tuple[str, int, int]]:
        """The compute blocks ``(phase, virtual stage, micro-batch)`` the train schedule runs on a pipe position
        (this rank's by default): :meth:`meshviz.runtime.pipeline.PipelineEngine.schedule_order`."""
        return self._engine.schedule_order(pipe_rank)

    # -- Paddle API ----------------------------------------------------------------------------------
    def _check_loss_fn(self, loss_fn_idx, what: str) -> None:
        fns = self._layers._loss_fn
        if isinstance(loss_fn_idx, bool) or not isinstance(loss_fn_idx, int) or not 0 <= loss_fn_idx < len(fns):
            raise ValueError(f"{what}: loss_fn_idx={loss_fn_idx!r}, but the PipelineLayer has {len(fns)} loss "
                             f"function(s)")
        if fns[loss_fn_idx] is None:
            raise ValueError(f"{what}: the PipelineLayer has no loss_fn")

    def train_batch(self, data, optimizer, lr_scheduler=None, scaler=None, loss_fn_idx=0,
                    return_micro_batch_loss=False):
        """One pipelined step: forward/backward every micro-batch, sum shared-weight grads, optimizer step.

        ``optimizer`` may be a torch optimizer; it is wrapped as ``fleet.distributed_optimizer`` would (Paddle
        requires the wrapped one), so gradients are averaged over the data-parallel group before the step. Returns
        the mean micro loss (``return_micro_batch_loss``: each micro loss, divided by accumulate_steps, as Paddle's)
        on every stage; with a list of loss functions, a list of those, ``loss_fn_idx`` naming the one whose
        gradients are taken.
        """
        from ..fleet.optimizer import HybridParallelOptimizer

        self._check_loss_fn(loss_fn_idx, "train_batch")
        inputs, labels = self._engine.check_data(data, need_labels=True)
        if not isinstance(optimizer, HybridParallelOptimizer):
            # wrapped once: with sharding, wrapping again would drop the optimizer's state and its other parameters
            kept = self._opt_wrappers.get(id(optimizer))
            if kept is None or kept[0] is not optimizer:
                kept = self._opt_wrappers[id(optimizer)] = (
                    optimizer, HybridParallelOptimizer(optimizer, self._hcg, self._strategy))
            optimizer = kept[1]
        self._layers.train()
        loss = self._engine.forward_backward(inputs, labels, scaler, loss_fn_idx)
        self._layers.allreduce_shared_weight_gradients()
        per_micro = bool(return_micro_batch_loss)
        buf, task = self._engine.reduce_loss(loss, per_micro)  # overlaps the optimizer step
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.clear_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
        task.wait()
        self._engine.end_step()
        return self._engine.loss_value(buf, per_micro)

    def eval_batch(self, data, compute_loss=False, loss_fn_idx=0):
        """Forward every micro-batch (FThenB order, no backward). With ``compute_loss`` the mean micro loss on
        every stage (a list of them with a list of loss functions); without, the last stage's list of micro-batch
        outputs (other stages: an empty list)."""
        if compute_loss:
            self._check_loss_fn(loss_fn_idx, "eval_batch(compute_loss=True)")
        inputs, labels = self._engine.check_data(data, need_labels=compute_loss)
        self._layers.eval()
        return self._engine.forward_only(inputs, labels, compute_loss, loss_fn_idx)

    def forward(self, *inputs, **kwargs):
        """This rank's stage on its own (chunk 0), as Paddle's wrapper calls its layers."""
        return self._layers(*inputs, **kwargs)

    def __repr__(self) -> str:
        e = self._engine
        return (f"PipelineParallel({e.schedule_mode}, stage {e.stage_id}/{e.num_stages}, "
                f"v={e.num_virtual_stages}, micro_batch_size={e.micro_batch_size}, "
                f"accumulate_steps={e.accumulate_steps}, ranks={e.ranks})")
