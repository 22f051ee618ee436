"""Named RNG states for tensor parallelism: a local seed per model-parallel rank beside the global one."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

__all__ = ["RNGStatesTracker", "get_rng_state_tracker", "model_parallel_random_seed", "MODEL_PARALLEL_RNG"]

MODEL_PARALLEL_RNG = "model_parallel_rng"


def _get_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class RNGStatesTracker:
    """RNG states by name. ``with tracker.rng_state(name):`` draws from that state (torch's CPU generator and, once
    CUDA is in use, every GPU's) and keeps where it got to; outside it the global state goes on untouched."""

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed``; a seed or a name already used raises ValueError."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise ValueError(f"state {name} already exists")
        orig = _get_state()
        torch.manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(orig)

    def get_states_tracker(self) -> dict:
        return {name: (cpu.clone(), None if cuda is None else [c.clone() for c in cuda])
                for name, (cpu, cuda) in self.states_.items()}

    def set_states_tracker(self, states: dict) -> None:
        for name, state in states.items():
            if name not in self.states_:
                raise ValueError(f"state {name} does not exist")
            self.states_[name] = state

    @contextlib.contextmanager
    def rng_state(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"state {name} does not exist")
        orig = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(orig)


_TRACKER = RNGStatesTracker()


def get_rng_state_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_random_seed(seed: int | None = None) -> None:
    """Seed for a ``fleet`` hybrid run, as Paddle does: the global RNG gets ``seed`` (the same on every data-parallel
    and sharding rank: parameters and dense dropout agree), the tracker's ``model_parallel_rng`` state gets
    ``seed + 1 + mp_rank * pp_size + pp_rank`` (different on every tensor-parallel rank: dropout on a split
    activation draws different masks for different parts). Without a seed each rank draws one from numpy.
    """
    from .. import get_hybrid_communicate_group

    hcg = get_hybrid_communicate_group()
    mp_rank = hcg.get_model_parallel_rank()
    pp_rank, pp_size = hcg.get_stage_id(), hcg.get_pipe_parallel_world_size()
    global_seed = seed if seed else int(np.random.randint(0, 10000))
    local_seed = global_seed + 1 + mp_rank * pp_size + pp_rank
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, local_seed)
    torch.manual_seed(global_seed)
