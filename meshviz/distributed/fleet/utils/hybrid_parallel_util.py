"""Paddle's ``fleet.utils.hybrid_parallel_util``: gradient and parameter sync helpers."""

from __future__ import annotations

from ....runtime.data_parallel import average_gradients
from ...parallel import fused_allreduce_gradients, sync_params_buffers

__all__ = ["fused_allreduce_gradients", "broadcast_dp_parameters", "broadcast_mp_parameters",
           "broadcast_sharding_parameters", "sync_params_buffers"]


def broadcast_dp_parameters(model, hcg):
    sync_params_buffers(model, hcg.get_data_parallel_group())


def broadcast_mp_parameters(model, hcg):
    """Make the parameters that are not model-parallel shards equal over the model-parallel group."""
    sync_params_buffers(model, hcg.get_model_parallel_group(), is_model_parallel=True)


def broadcast_sharding_parameters(model, hcg):
    sync_params_buffers(model, hcg.get_sharding_parallel_group())


def _sharding_mean(parameter_list, hcg):
    """Average the gradients over the sharding group (the bucketed mean fused_allreduce_gradients uses)."""
    average_gradients(parameter_list, hcg.get_sharding_parallel_group())
