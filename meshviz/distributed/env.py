"""Process-group set-up: init_parallel_env, ranks, spawn."""

from __future__ import annotations

import datetime
import os
import pickle
import socket

import torch
import torch.distributed as tdist

from .. import trace
from ..core.mesh import set_rank_getter

__all__ = [
    "init_parallel_env",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "barrier",
    "spawn",
    "default_timeout",
    "device",
    "ParallelEnv",
    "destroy_process_group",
    "RankError",
]

DEFAULT_TIMEOUT_S = 60.0


def default_timeout() -> datetime.timedelta:
    """Collective timeout: ``MESHVIZ_TIMEOUT`` seconds, default 60."""
    return datetime.timedelta(seconds=float(os.environ.get("MESHVIZ_TIMEOUT", DEFAULT_TIMEOUT_S)))


def _env_int(*names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def _gpu_for_this_rank() -> int | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    local = _env_int("LOCAL_RANK", "PADDLE_LOCAL_RANK", default=0)
    return local % torch.cuda.device_count()


def device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_parallel_env(backend: str | None = None, timeout: float | None = None):
    """Initialise the default process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Gloo on CPU, NCCL when this rank has a GPU. Idempotent. Without any variables it starts a 1-rank group.
    ``MESHVIZ_TRACE=path/{rank}.jsonl`` records this rank's events to a file.
    """
    if not tdist.is_initialized():
        rank = _env_int("RANK", "PADDLE_TRAINER_ID", default=0)
        world = _env_int("WORLD_SIZE", "PADDLE_TRAINERS_NUM", default=1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world != 1:
                raise RuntimeError("init_parallel_env: WORLD_SIZE > 1 but MASTER_PORT is not set")
            os.environ["MASTER_PORT"] = str(free_port())
        gpu = _gpu_for_this_rank()
        if backend is None:
            backend = os.environ.get("MESHVIZ_BACKEND") or ("nccl" if gpu is not None else "gloo")
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(gpu)
            kwargs["device_id"] = torch.device("cuda", gpu)
        to = datetime.timedelta(seconds=timeout) if timeout is not None else default_timeout()
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if _is_loopback(os.environ["MASTER_ADDR"]) and not agent_store:
            # one machine: the store and gloo listen on loopback only, not on every interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            kwargs["store"] = _loopback_store(rank, world, int(os.environ["MASTER_PORT"]), to)
        tdist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=to, **kwargs)
    set_rank_getter(get_rank)
    trace.set_rank(tdist.get_rank())
    path = os.environ.get("MESHVIZ_TRACE")
    if path and not any(isinstance(s, trace.JSONLSink) and s.path == path for s in trace.recorder._sinks):
        trace.add_sink(trace.JSONLSink(path))
    return tdist.group.WORLD


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _loopback_store(rank: int, world: int, port: int, timeout: datetime.timedelta):
    """A TCPStore whose server (rank 0) listens on 127.0.0.1 only; torch's own binds every interface."""
    if rank != 0:
        return tdist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(max(128, world))
    return tdist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, master_listen_fd=sock.detach(),
                          wait_for_workers=False)


def destroy_process_group(group=None) -> None:
    from .collective import destroy_process_group as _destroy

    _destroy(group)


def is_initialized() -> bool:
    return tdist.is_initialized()


def get_rank(group=None) -> int:
    """This process's rank (in ``group`` when given); 0 before any process group exists, like Paddle."""
    if not tdist.is_initialized():
        return _env_int("RANK", "PADDLE_TRAINER_ID", default=0)
    if group is None:
        return tdist.get_rank()
    pg = getattr(group, "process_group", group)
    return tdist.get_rank(pg)


def get_world_size(group=None) -> int:
    if not tdist.is_initialized():
        return _env_int("WORLD_SIZE", "PADDLE_TRAINERS_NUM", default=1)
    if group is None:
        return tdist.get_world_size()
    return tdist.get_world_size(getattr(group, "process_group", group))


def barrier(group=None) -> None:
    from .collective import barrier as _barrier

    _barrier(group)


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
        gpu = _gpu_for_this_rank()
        return -1 if gpu is None else gpu

    dev_id = device_id
    nranks = world_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_quietly(code: int = 0) -> None:
    """End a rank process once its work is done: wait for the peers, flush, and leave without interpreter
    teardown, where torch's gloo/DDP threads can abort the process ("terminate called without an active
    exception") after training has already succeeded."""
    import sys

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


def _spawn_entry(index, func, args, world, port, env):
    os.environ.update(env)
    os.environ.update(
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(int(env.get("MESHVIZ_THREADS", "1")))
    func(*args)
    exit_quietly(0)


def _importable(func) -> bool:
    """Can a fresh interpreter find ``func`` by name? Not so for one typed into a REPL or notebook."""
    import sys

    mod = getattr(func, "__module__", None)
    if mod == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        return False
    try:
        pickle.dumps(func)
    except Exception:
        return False
    return True


class SpawnContext:
    """What ``spawn(join=False)`` returns: ``join()`` waits; ``processes`` are the children."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.processes = ctx.processes

    def join(self, timeout: float | None = None) -> bool:
        while not self._ctx.join(timeout):
            if timeout is not None:
                return False
        return True


def spawn(func, args=(), nprocs: int = -1, join: bool = True, daemon: bool = False, **options):
    """Run ``func(*args)`` in ``nprocs`` new processes, ranks 0..nprocs-1, with the process-group variables set.

    ``nprocs=-1`` uses one process per GPU, or 2 on a CPU-only machine. If one rank raises, the others are
    stopped and the error names that rank. ``options``: ``backend``, ``timeout`` (seconds), ``trace`` (a JSONL
    path, ``{rank}`` filled in), ``threads`` (torch threads per rank, default 1), ``start_method``.
    """
    import torch.multiprocessing as mp

    if nprocs == -1:
        nprocs = torch.cuda.device_count() or 2
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int or -1, got {nprocs!r}")
    env = {}
    if options.get("backend"):
        env["MESHVIZ_BACKEND"] = options["backend"]
    if options.get("timeout") is not None:
        env["MESHVIZ_TIMEOUT"] = str(options["timeout"])
    if options.get("trace"):
        env["MESHVIZ_TRACE"] = str(options["trace"])
    env["MESHVIZ_THREADS"] = str(options.get("threads", 1))
    method = options.get("start_method")
    if method is None:
        method = "spawn" if _importable(func) else "fork"
    ctx = mp.start_processes(
        _spawn_entry,
        args=(func, tuple(args), nprocs, free_port(), env),
        nprocs=nprocs,
        join=False,
        daemon=daemon,
        start_method=method,
    )
    if not join:
        return SpawnContext(ctx)
    try:
        while not ctx.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise _root_cause(ctx, e) from None
    return None


def _root_cause(ctx, e) -> "RankError":
    """The rank that failed first. torch names whichever process it saw exit first, which is often a peer that
    only failed because the first one's connection closed."""
    written = [(os.path.getmtime(f), i, f) for i, f in enumerate(ctx.error_files) if f and os.access(f, os.R_OK)]
    if written:
        _, index, path = min(written)
        with open(path, "rb") as fh:
            return RankError(index, f"rank {index} raised:\n{pickle.load(fh)}")
    return RankError(e.error_index, f"rank {e.error_index} died: {e}")


class RankError(RuntimeError):
    """A spawned rank raised or died; ``rank`` names it, the message carries its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank
