"""Where ``fleet.distributed_model`` hands a pp_degree > 1 model to PipelineParallel (over the pipeline engine)."""

from __future__ import annotations

__all__ = ["_pipeline_model"]


def _pipeline_model(model, hcg, strategy):
    """Wrap ``model`` (a PipelineLayer) for pipeline-parallel training on ``hcg``'s pipe group.

    ``strategy.pipeline_configs`` gives micro_batch_size, accumulate_steps and schedule_mode; PipelineParallel
    hands them, with ``hcg``'s pipe group, stage id and degree, to the runtime's ``PipelineEngine``.
    """
    from ..pipeline import PipelineLayer, PipelineParallel

    if not isinstance(model, PipelineLayer):
        raise TypeError(f"fleet.distributed_model with pp_degree > 1 needs a PipelineLayer, got "
                        f"{type(model).__name__}")
    return PipelineParallel(model, hcg, strategy)
