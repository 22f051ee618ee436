"""Paddle's ``fleet.utils``: ``hybrid_parallel_util`` and ``recompute``."""

from torch.utils.checkpoint import checkpoint as _checkpoint

from . import hybrid_parallel_util
from .hybrid_parallel_util import fused_allreduce_gradients

__all__ = ["hybrid_parallel_util", "fused_allreduce_gradients", "recompute"]


def recompute(function, *args, preserve_rng_state=True, use_reentrant=False, **kwargs):
    """Run ``function`` without keeping its activations; recompute them in backward (torch checkpointing)."""
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, use_reentrant=use_reentrant,
                       **kwargs)
