"""The world: init_parallel_env, this rank, the world size, the collective timeout."""

from __future__ import annotations

import atexit
import datetime
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from .. import rank_context, trace
from ..core.mesh import set_rank_getter
from ..errors import RankError
from ..rank_context import current as _rank_context
from ..rank_context import getenv as _getenv
from ..trace.state import trace_state
from . import rendezvous, rollcall, watchdog
from .devices import device, initial_device

__all__ = [
    "init_parallel_env",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "default_timeout",
    "device",
    "ParallelEnv",
    "RankError",
]


@dataclass
class WorldState:
    set_up_for: Any = None  # the default group init_parallel_env last set this rank up for (rank getter, trace)


WORLD = rank_context.slot("world", WorldState)


def _state() -> WorldState:
    return WORLD.get()


DEFAULT_TIMEOUT_S = 60.0

free_port = rendezvous.free_port  # its old home; a port only named, see rendezvous.reserve_port


def default_timeout() -> datetime.timedelta:
    """Collective timeout: ``MESHVIZ_TIMEOUT`` seconds, default 60."""
    return datetime.timedelta(seconds=float(_getenv("MESHVIZ_TIMEOUT", DEFAULT_TIMEOUT_S)))


def _env_int(*names, default=None):
    for n in names:
        v = _getenv(n)
        if v not in (None, ""):
            return int(v)
    return default


def init_parallel_env(backend: str | None = None, timeout: float | None = None):
    """Initialise the default process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    NCCL when this rank has a GPU of its own, else gloo on the CPU (see ``meshviz.core.devices``: ranks and GPUs
    are counted before anything starts). Idempotent. Without any variables it starts a 1-rank group.
    ``MESHVIZ_TRACE=path/{rank}.jsonl`` records this rank's events to a file.
    """
    # -- ranks as threads: the rank's context knows how it joins (its thread world) -----------------------------
    join = _rank_context().init
    if join is not None and not tdist.is_initialized():
        join()
        rec = rollcall.current()
        rec.rank, rec.thread = tdist.get_rank(), threading.get_ident()
    # --------------------------------------------------------------------------------------------------------
    st = _state()
    initialized = tdist.is_initialized()
    if initialized and st.set_up_for is not None and st.set_up_for is tdist.group.WORLD:
        return st.set_up_for  # every shard_tensor / reshard asks: once set up, nothing to do
    if not initialized:
        rank = _env_int("RANK", "PADDLE_TRAINER_ID", default=0)
        world = _env_int("WORLD_SIZE", "PADDLE_TRAINERS_NUM", default=1)
        os.environ.setdefault("MASTER_ADDR", rendezvous.LOOPBACK)
        reservation = None
        if "MASTER_PORT" not in os.environ:
            if world != 1:
                raise RuntimeError("init_parallel_env: WORLD_SIZE > 1 but MASTER_PORT is not set")
            reservation = rendezvous.reserve_port()  # held until this rank's store serves on it
            os.environ["MASTER_PORT"] = str(reservation.port)
        backend, dev = initial_device(backend)  # what spawn / launch decided, or the same decision made here
        kwargs = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            if backend == "nccl":
                kwargs["device_id"] = dev
        to = datetime.timedelta(seconds=timeout) if timeout is not None else default_timeout()
        master = os.environ["MASTER_ADDR"]
        if rendezvous.is_loopback(master):
            # one machine: gloo's sockets listen on loopback only, not on every interface (and so does the store)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", rendezvous.loopback_ifname())
        port = int(os.environ["MASTER_PORT"])
        store = rendezvous.process_group_store(rank, world, master, port, to, reservation)
        if store is not None:
            kwargs["store"] = store
        try:
            tdist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=to, **kwargs)
        except Exception as exc:
            named = None if store is None else rendezvous.never_arrived(store, world, master, port, to)
            if named is None:
                raise
            raise named from exc
        rec = rollcall.current()
        rec.rank = rank
        if not rec.running:
            rec.start()
        watchdog.start_rank_watch(rank, world)
    set_rank_getter(get_rank)
    trace.set_rank(tdist.get_rank())
    path = _getenv("MESHVIZ_TRACE")
    if path and not any(isinstance(s, trace.JSONLSink) and s.path == path for s in trace.sinks()):
        trace.add_sink(trace.JSONLSink(path))
        atexit.register(trace.flush, trace_state())  # the last deferred events reach the file
    st.set_up_for = tdist.group.WORLD
    return st.set_up_for


def is_initialized() -> bool:
    return tdist.is_initialized()


def get_rank(group=None) -> int:
    """This process's rank (in ``group`` when given, -1 when it is not a member); 0 before any process group exists,
    like Paddle."""
    if not tdist.is_initialized():
        return _env_int("RANK", "PADDLE_TRAINER_ID", default=0)
    if group is None:
        return tdist.get_rank()
    if hasattr(group, "process_group"):  # a Group; a non-member's process_group is None, which torch reads as WORLD
        return group.rank
    return tdist.get_rank(group)


def get_world_size(group=None) -> int:
    """The number of ranks (in ``group`` when given, -1 when this rank is not a member, as Paddle)."""
    if not tdist.is_initialized():
        return _env_int("WORLD_SIZE", "PADDLE_TRAINERS_NUM", default=1)
    if group is None:
        return tdist.get_world_size()
    if hasattr(group, "process_group"):
        return group.world_size
    return tdist.get_world_size(group)


class ParallelEnv:
    """Paddle's ``ParallelEnv``: rank, world size, device id of this process."""

    @property
    def rank(self) -> int:
        return get_rank()

    @property
    def world_size(self) -> int:
        return get_world_size()

    @property
    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK", default=0)

    @property
    def device_id(self) -> int:
        dev = device() if tdist.is_initialized() else initial_device()[1]
        return -1 if dev.type != "cuda" else dev.index

    dev_id = device_id
    nranks = world_size


def exit_quietly(code: int = 0, note: str = "its function returned") -> None:
    """End a rank process once its work is done: wait for the peers, flush, and leave without interpreter
    teardown, where torch's gloo/DDP threads can abort the process ("terminate called without an active
    exception") after training has already succeeded. ``note``: what the roll-call says of it meanwhile."""
    import sys

    rollcall.current().finish(note)
    try:
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            tdist.barrier()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    trace.clear_sinks()  # closes trace files
    os._exit(code)
