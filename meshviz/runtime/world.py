"""The world: init_parallel_env, this rank, the world size, the collective timeout."""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
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
from .group_type import Group

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
    group: Any = None  # the global Group on it


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
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"the environment variable {n}={v!r} is not an int") from None
    return default


def _check_place(rank: int, world: int) -> None:
    """ValueError, before any rendezvous, when this rank's number does not fit the world (else rank 0 is waited
    for, or the others wait for a rank that never comes, until the timeout)."""
    rname = next((n for n in ("RANK", "PADDLE_TRAINER_ID") if _getenv(n)), "RANK")
    wname = next((n for n in ("WORLD_SIZE", "PADDLE_TRAINERS_NUM") if _getenv(n)), "WORLD_SIZE")
    if world < 1:
        raise ValueError(f"init_parallel_env: {wname}={world}: the number of ranks must be at least 1")
    if not 0 <= rank < world:
        raise ValueError(f"init_parallel_env: {rname}={rank} with {wname}={world}: a rank is one of 0..{world - 1}")


def _paddle_env_as_torch() -> None:
    """Paddle's variables as torchrun's where torchrun's are not set (``paddle.distributed.launch`` and ``spawn`` set
    Paddle's, and so does a cluster scheduler for ``init_parallel_env``): RANK from PADDLE_TRAINER_ID, WORLD_SIZE
    from PADDLE_TRAINERS_NUM, LOCAL_RANK and LOCAL_WORLD_SIZE from PADDLE_LOCAL_RANK / PADDLE_LOCAL_SIZE (else the
    endpoints on this endpoint's host); the master is MASTER_ADDR:MASTER_PORT when both are set, else PADDLE_MASTER,
    else the first of PADDLE_TRAINER_ENDPOINTS, as Paddle's ``init_parallel_env`` reads them."""
    env = os.environ
    endpoints = [e.strip() for e in env.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e.strip()]
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        name = "PADDLE_MASTER" if env.get("PADDLE_MASTER") else "PADDLE_TRAINER_ENDPOINTS"
        master = env.get("PADDLE_MASTER") or (endpoints[0] if endpoints else "")
        if master:
            host, _, port = master.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"init_parallel_env: {name} must hold ip:port, got {master!r}")
            env["MASTER_ADDR"], env["MASTER_PORT"] = host, port
    for torch_name, paddle_names in (("RANK", ("PADDLE_TRAINER_ID",)), ("WORLD_SIZE", ("PADDLE_TRAINERS_NUM",)),
                                     ("LOCAL_RANK", ("PADDLE_LOCAL_RANK", "PADDLE_RANK_IN_NODE")),
                                     ("LOCAL_WORLD_SIZE", ("PADDLE_LOCAL_SIZE",))):
        given = next((env[n] for n in paddle_names if env.get(n)), None)
        if not env.get(torch_name) and given is not None:
            env[torch_name] = given
    here = env.get("PADDLE_CURRENT_ENDPOINT", "")
    if here in endpoints:  # the endpoints on this host: this rank's place among them
        host = here.rpartition(":")[0]
        local = [e for e in endpoints if e.rpartition(":")[0] == host]
        env.setdefault("LOCAL_RANK", str(local.index(here)))
        env.setdefault("LOCAL_WORLD_SIZE", str(len(local)))


def _paddle_backend() -> str | None:
    """PADDLE_DISTRI_BACKEND (Paddle's spawn and launch set it), when meshviz's launchers left MESHVIZ_BACKEND
    unset: "gloo" or "nccl"; "auto" or unset: None (meshviz decides)."""
    if os.environ.get("MESHVIZ_BACKEND"):
        return None
    be = os.environ.get("PADDLE_DISTRI_BACKEND", "auto").strip().lower()
    if be in ("", "auto"):
        return None
    if be not in ("gloo", "nccl"):
        raise ValueError(f"init_parallel_env: PADDLE_DISTRI_BACKEND={be!r}: meshviz runs 'gloo' (CPU) and 'nccl' "
                         "(GPU); leave it unset or 'auto' to have meshviz pick")
    return be


def init_parallel_env(backend: str | None = None, timeout: float | None = None) -> Group:
    """Initialise the default process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) or
    Paddle's (PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ENDPOINTS: the first is the master); returns
    the global :class:`~meshviz.runtime.groups.Group` (id 0), the same one every call, as Paddle's.

    NCCL when this rank has a GPU of its own, else gloo on the CPU (see ``meshviz.core.devices``: ranks and GPUs
    are counted before anything starts). Idempotent. Without any variables it starts a 1-rank group.
    ``MESHVIZ_TRACE=path/{rank}.jsonl`` records this rank's events to a file.
    """
    set_up(backend, timeout)
    return global_group()


def global_group() -> Group:
    """The global group (id 0, every rank in rank order, on the default process group): one object per world."""
    st = _state()
    g, pg, n = st.group, tdist.group.WORLD, tdist.get_world_size()
    if g is None or g.process_group is not pg or g.nranks != n:
        g = st.group = Group(tdist.get_rank(), 0, range(n), pg, name="_default_pg")
    return g


def set_up(backend: str | None = None, timeout: float | None = None) -> None:
    """What :func:`init_parallel_env` does before it returns the global group (meshviz's own callers need none)."""
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
        return  # every shard_tensor / reshard asks: once set up, nothing to do
    if not initialized:
        rank = _env_int("RANK", "PADDLE_TRAINER_ID", default=0)
        world = _env_int("WORLD_SIZE", "PADDLE_TRAINERS_NUM", default=1)
        _check_place(rank, world)
        _paddle_env_as_torch()
        os.environ.setdefault("MASTER_ADDR", rendezvous.LOOPBACK)
        reservation = None
        if "MASTER_PORT" not in os.environ:
            if world != 1:
                raise RuntimeError(
                    f"init_parallel_env: {world} ranks but no master: set MASTER_ADDR and MASTER_PORT (or Paddle's "
                    "PADDLE_TRAINER_ENDPOINTS, whose first is the master), or start the ranks with dist.spawn or "
                    "python -m meshviz.launch")
            reservation = rendezvous.reserve_port()  # held until this rank's store serves on it
            os.environ["MASTER_PORT"] = str(reservation.port)
        backend, dev = initial_device(backend or _paddle_backend())  # what spawn / launch decided, or the same here
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
            if world > 1:
                rendezvous.await_arrivals(store, rank, world, master, port, to)
        try:
            tdist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=to, **kwargs)
        except Exception as exc:
            named = None if store is None else rendezvous.never_arrived(store, world, master, port, to)
            if named is None:
                raise
            raise named from exc
        _destroy_at_exit.register()
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


def is_initialized() -> bool:
    """Whether the global group exists: False before ``init_parallel_env`` and, as Paddle's, in a 1-process world,
    where ``init_parallel_env`` makes none (meshviz's collectives still run there)."""
    return tdist.is_initialized() and tdist.get_world_size() > 1


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
    """Paddle's ``ParallelEnv``: this process's rank, world size, device and endpoints (Paddle's variables, which
    ``spawn`` and ``launch`` set)."""

    @property
    def rank(self) -> int:
        return get_rank()

    @property
    def world_size(self) -> int:
        return get_world_size()

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (Paddle's is the global rank under another name: the same on one)."""
        return _env_int("LOCAL_RANK", "PADDLE_LOCAL_RANK", default=0)

    @property
    def device_id(self) -> int:
        """The index of this rank's GPU; -1 on the CPU (Paddle's CPU build has none: it raises AttributeError)."""
        dev = device() if tdist.is_initialized() else initial_device()[1]
        return -1 if dev.type != "cuda" else dev.index

    @property
    def device_type(self) -> str:
        """The custom device type, as Paddle's: "" (CPUs and CUDA GPUs are not custom devices)."""
        return ""

    @property
    def current_endpoint(self) -> str:
        """This rank's ``ip:port`` (PADDLE_CURRENT_ENDPOINT), "" when not set."""
        return _getenv("PADDLE_CURRENT_ENDPOINT") or ""

    @property
    def trainer_endpoints(self) -> list[str]:
        """Every rank's ``ip:port`` (PADDLE_TRAINER_ENDPOINTS), ``[""]`` when not set, as Paddle's."""
        return (_getenv("PADDLE_TRAINER_ENDPOINTS") or "").split(",")

    @property
    def nrings(self) -> int:
        return int(_getenv("FLAGS_nccl_nrings") or 1)

    @property
    def pg_timeout(self) -> int:
        """The collective timeout in milliseconds (meshviz's: ``MESHVIZ_TIMEOUT``)."""
        return int(default_timeout().total_seconds() * 1000)

    dev_id = device_id
    nranks = world_size


def _waited_in_thread(fn, limit: float | None = None) -> None:
    """``fn()`` in a daemon thread, waited for from this one in 0.2 s slices, for at most ``limit`` seconds (None:
    until it returns): a C++ wait inside ``fn`` is deaf to a SIGINT, which this thread hears between slices. ``fn``'s
    errors are dropped."""
    over = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            pass
        finally:
            over.set()

    threading.Thread(target=run, name="meshviz-exit", daemon=True).start()
    end = None if limit is None else time.monotonic() + limit
    while not over.wait(0.2):
        if end is not None and time.monotonic() >= end:
            return


def _wait_for_peers() -> None:
    """torch's own barrier (not one recorded in the roll-call: ranks.patches), waited on from a thread: gloo's
    wait is one C++ call, in which a SIGINT to the process is handled only once the wait is over."""
    barrier = getattr(tdist.barrier, "__wrapped__", tdist.barrier)
    # a thread's CUDA device is its own (0 when new): NCCL's barrier runs on the rank's
    cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def wait() -> None:
        if cuda is not None:
            torch.cuda.set_device(cuda)
        barrier()

    _waited_in_thread(wait)


class _DestroyAtExit:
    """At the interpreter's exit of a process that made its process group here (a rank started by hand; spawn's
    and launch's ranks leave through :func:`exit_quietly`): the group destroyed, in a thread given ``wait_s``
    seconds (a collective still queued could hold it), then ``settle_s`` seconds without the GIL, in which gloo's
    threads let go of the last collectives' tensors. Left to the interpreter's teardown, a gloo thread releasing
    one found the interpreter finalizing and aborted the process about one exit in ten ("terminate called without
    an active exception", exit code -6) after its script had succeeded, as torch's own scripts that never call
    ``destroy_process_group`` do."""

    wait_s = 5.0
    settle_s = 0.05

    def __init__(self):
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            self._registered = True
            atexit.register(self)

    def __call__(self) -> None:
        if tdist.is_initialized():  # else the script destroyed it itself
            _waited_in_thread(tdist.destroy_process_group, self.wait_s)
        time.sleep(self.settle_s)


_destroy_at_exit = _DestroyAtExit()


def exit_quietly(code: int = 0, note: str = "its function returned") -> None:
    """End a rank process once its work is done: wait for the peers, flush, and leave without interpreter
    teardown, where torch's gloo/DDP threads can abort the process ("terminate called without an active
    exception") after training has already succeeded. ``note``: what the roll-call says of it meanwhile."""
    import sys

    rollcall.current().finish(note)
    try:
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            _wait_for_peers()
    except KeyboardInterrupt:  # Ctrl-C (a launcher passes its SIGINT on) while it waited: it ends now
        code = 130
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    trace.clear_sinks()  # closes trace files
    os._exit(code)
