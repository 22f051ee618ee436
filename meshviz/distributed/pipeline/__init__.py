"""Pipeline parallelism: Paddle's PipelineLayer / PipelineParallel on torch.distributed.pipelining, with events.

Events (``meshviz.trace``), one per block and per transfer, on the rank that ran it:

- ``compute``: ``op`` and ``extra['phase']`` 'F' (forward), 'B' (backward; input-grad only under ZBH1) or 'W'
  (weight-grad, ZBH1); ``extra`` also has ``stage`` (global virtual stage index), ``chunk`` (this rank's chunk,
  ``stage // pp_degree``), ``micro_batch``, ``step`` (train/eval call number) and, while tracing,
  ``live_activation_bytes`` (bytes saved for backward still held after the block). ``start``/``end`` measured.
- ``send`` / ``recv``: ``peer`` (the other global rank), ``bytes``, ``group`` [src, dst], ``extra``
  {micro_batch, phase ('F' activations, 'B' gradients), stage, src_stage, dst_stage, step, transfer}; the
  ``transfer`` string is the same on both sides and pairs them. A recv runs from posting to the wait's end.
- ``mark`` with ``op='pipeline_step'`` at each step: extra {schedule, p, m, v, step, stage, eval}.
- The final loss broadcast and dp / shared-weight gradient all-reduces are ``collective`` events.

Where meshviz follows Paddle rather than torch: micro-batches are rows ``[k*mbs, (k+1)*mbs)`` of a batch of
exactly ``micro_batch_size * accumulate_steps`` (torch's step would also split uneven batches); each micro loss
is divided by accumulate_steps before its backward (torch's ``scale_grads`` divides gradients afterwards, which
would scale a weight shared by two chunks twice); the returned loss is broadcast to every stage (torch returns
losses on the last stage only); ``SharedLayerDesc`` weights are broadcast at build time and their gradients summed
over the sharing stages (torch has no shared-layer notion).
"""

from .layers import BASE_SEED, LayerDesc, PipelineLayer, SharedLayerDesc, segment_layers
from .parallel import (
    SCHEDULE_MODES,
    ActivationMeter,
    PipelineParallel,
    check_pipeline_config,
    resolve_schedule,
)
from .timeline import bubble_formula, compute_order, measured_bubble, peak_activation_bytes, transfers


def __getattr__(name):
    if name == "TracedStage":  # imports torch.distributed.pipelining, which is slow: only when asked
        from .stage import TracedStage

        return TracedStage
    raise AttributeError(name)


__all__ = [
    "LayerDesc", "SharedLayerDesc", "PipelineLayer", "PipelineParallel", "TracedStage", "SCHEDULE_MODES",
    "resolve_schedule", "check_pipeline_config", "segment_layers", "ActivationMeter", "BASE_SEED",
    "bubble_formula", "measured_bubble", "compute_order", "peak_activation_bytes", "transfers",
]
