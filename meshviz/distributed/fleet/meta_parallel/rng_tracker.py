"""Named RNG states for tensor parallelism: a local seed per model-parallel rank beside the global one."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .... import rank_context

__all__ = ["RNGStatesTracker", "get_rng_state_tracker", "model_parallel_random_seed", "MODEL_PARALLEL_RNG"]

MODEL_PARALLEL_RNG = "model_parallel_rng"


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_seeded(seed: int) -> list:
    """Every GPU's generator state right after ``torch.manual_seed(seed)``."""
    out = []
    for i in range(torch.cuda.device_count()):
        g = torch.Generator(device=f"cuda:{i}")
        g.manual_seed(seed)
        out.append(g.get_state())
    return out


class RNGStatesTracker:
    """RNG states by name. ``with tracker.rng_state(name):`` draws from that state (torch's CPU generator and, when
    CUDA is in use, every GPU's) and keeps where it got to; outside it the global state goes on untouched."""

    def __init__(self):
        self.states_ = {}  # name -> [seed, cpu state, GPU states or None until CUDA is in use]
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
        g = torch.Generator()
        g.manual_seed(seed)
        self.states_[name] = [seed, g.get_state(), _cuda_seeded(seed) if _cuda_ready() else None]

    def get_states_tracker(self) -> dict:
        return {name: [seed, cpu.clone(), None if cuda is None else [c.clone() for c in cuda]]
                for name, (seed, cpu, cuda) in self.states_.items()}

    def set_states_tracker(self, states: dict) -> None:
        for name in states:
            if name not in self.states_:
                raise ValueError(f"state {name} does not exist")
        for name, (seed, cpu, cuda) in states.items():
            self.states_[name] = [seed, cpu.clone(), None if cuda is None else [c.clone() for c in cuda]]

    @contextlib.contextmanager
    def rng_state(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"state {name} does not exist")
        st = self.states_[name]
        cuda = _cuda_ready()
        orig_cpu = torch.get_rng_state()
        orig_cuda = torch.cuda.get_rng_state_all() if cuda else None
        torch.set_rng_state(st[1])
        if cuda:
            torch.cuda.set_rng_state_all(st[2] if st[2] is not None else _cuda_seeded(st[0]))
        try:
            yield
        finally:
            st[1] = torch.get_rng_state()
            torch.set_rng_state(orig_cpu)
            if cuda:
                st[2] = torch.cuda.get_rng_state_all()
                torch.cuda.set_rng_state_all(orig_cuda)


RNG = rank_context.slot("rng", RNGStatesTracker)


def get_rng_state_tracker() -> RNGStatesTracker:
    return RNG.get()


def model_parallel_random_seed(seed: int | None = None) -> None:
    """Seed for a ``fleet`` hybrid run, as Paddle does: the global RNG gets ``seed`` (the same on every data-parallel
    and sharding rank: parameters and dense dropout agree), the tracker's ``model_parallel_rng`` state gets
    ``seed + 1 + mp_rank * pp_size + pp_rank`` (different on every tensor-parallel rank: dropout on a split
    activation draws different masks for different parts). Without a seed each rank draws one from numpy.
    """
    from ..state import hybrid_group

    hcg = hybrid_group()
    mp_rank = hcg.get_model_parallel_rank()
    pp_rank, pp_size = hcg.get_stage_id(), hcg.get_pipe_parallel_world_size()
    global_seed = seed if seed else int(np.random.randint(0, 10000))
    local_seed = global_seed + 1 + mp_rank * pp_size + pp_rank
    tracker = RNG.get()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, local_seed)
    torch.manual_seed(global_seed)
