"""Paddle's ``fleet.utils``: ``hybrid_parallel_util`` and ``recompute``."""

from torch.utils.checkpoint import checkpoint as _checkpoint

from . import hybrid_parallel_util
from .hybrid_parallel_util import fused_allreduce_gradients

__all__ = ["hybrid_parallel_util", "fused_allreduce_gradients", "recompute"]


def recompute(function, *args, preserve_rng_state=True, use_reentrant=False, **kwargs):
    """Run ``function`` without keeping its activations; recompute them in backward (torch checkpointing).

    With ``preserve_rng_state`` the replay draws what the forward drew: torch restores the global RNG, and the RNG
    tracker's states (``get_rng_state_tracker()``, the tensor-parallel dropout's) are set back to where the forward
    found them for the replay and restored after it, as Paddle's ``switch_rng_state_tracker``.
    """
    if not preserve_rng_state:
        return _checkpoint(function, *args, preserve_rng_state=False, use_reentrant=use_reentrant, **kwargs)
    from ..meta_parallel.rng_tracker import get_rng_state_tracker

    tracker = get_rng_state_tracker()
    at_forward = tracker.get_states_tracker()
    calls = [0]

    def run(*a, **k):
        calls[0] += 1
        if calls[0] == 1:  # the forward itself
            return function(*a, **k)
        now = tracker.get_states_tracker()
        tracker.set_states_tracker(at_forward)
        try:
            return function(*a, **k)
        finally:
            tracker.set_states_tracker(now)

    return _checkpoint(run, *args, preserve_rng_state=True, use_reentrant=use_reentrant, **kwargs)
