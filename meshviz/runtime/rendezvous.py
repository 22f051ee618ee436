"""Rendezvous: a port held until the store takes it, the process-group store on loopback, each rank's environment."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

__all__ = [
    "PortReservation",
    "reserve_port",
    "free_port",
    "serve_store",
    "connect_store",
    "process_group_store",
    "rank_env",
    "paddle_endpoints",
    "paddle_env",
    "is_loopback",
    "loopback_ifname",
    "mark_arrived",
    "arrived",
    "never_arrived",
    "await_arrivals",
    "attempt_store",
    "HOSTED",
    "ATTEMPT",
]

LOOPBACK = "127.0.0.1"
HOSTED = "TORCHELASTIC_USE_AGENT_STORE"  # torch's name for "the store is served elsewhere: every rank is a client"
_ARRIVED = "meshviz/arrived/{}"
_GAVE_UP = "meshviz/arrived/gave_up"  # which ranks had arrived when the first rank's wait ran out
ATTEMPT = "MESHVIZ_LAUNCH_ATTEMPT"  # a launched worker's restart count: its keys on the agent's store are that run's


class PortReservation:
    """A TCP port bound here and kept open until a store takes the socket over, so no other process can take
    the port in between (a port that is only looked up, then closed, can be).

    ``host`` is the address to bind: loopback unless the ranks span machines ("" binds every interface).
    """

    def __init__(self, host: str = LOOPBACK, port: int = 0):
        self.host = host
        self._sock: socket.socket | None = socket.socket()
        try:
            if port:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a previous store's TIME_WAIT
            self._sock.bind((host, port))
            # listening at once: a bound socket that does not listen yet can share its port with another
            # SO_REUSEADDR socket (torch's store sets it), a listening one cannot. Early clients wait in the backlog.
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]

    @property
    def held(self) -> bool:
        return self._sock is not None

    def listen(self, backlog: int = 128) -> "PortReservation":
        """Make room for ``backlog`` connections waiting to be served (it listens from the start)."""
        if self._sock is None:
            raise RuntimeError(f"port {self.port} was already handed over or released")
        if backlog > 128:
            self._sock.listen(backlog)
        return self

    def take(self, backlog: int = 128) -> int:
        """Hand the listening socket's descriptor over (to a TCPStore, which closes it); the reservation ends."""
        self.listen(backlog)
        fd = self._sock.detach()
        self._sock = None
        return fd

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"PortReservation({self.host or '*'}:{self.port}{'' if self.held else ', handed over'})"


def reserve_port(host: str = LOOPBACK) -> PortReservation:
    """A free port on ``host``, held until :func:`serve_store` takes it."""
    return PortReservation(host)


def free_port(host: str = LOOPBACK) -> int:
    """A port number nothing listens on right now, released at once: another process may take it before it is
    used. Only for naming a port to something outside this process; meshviz's own stores use
    :func:`reserve_port`."""
    with PortReservation(host) as res:
        return res.port


def _timeout(timeout) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))


def serve_store(reservation: PortReservation, world: int | None, timeout, multi_tenant: bool = False):
    """A TCPStore server on the reserved socket; it listens where the reservation was bound (torch's own server
    binds every interface). ``multi_tenant``: a later ``TCPStore(..., is_master=True, multi_tenant=True)`` on
    the same port in this process (torchrun's agent) uses this server instead of binding its own."""
    import torch.distributed as tdist

    host = reservation.host or LOOPBACK
    fd = reservation.take(world or 1)
    return tdist.TCPStore(host, reservation.port, world, True, timeout=_timeout(timeout), wait_for_workers=False,
                          multi_tenant=multi_tenant, master_listen_fd=fd)


def connect_store(host: str, port: int, world: int | None, timeout):
    """A client of the TCPStore served at ``host:port``."""
    import torch.distributed as tdist

    return tdist.TCPStore(host, int(port), world, False, timeout=_timeout(timeout))


def process_group_store(rank: int, world: int, host: str, port: int, timeout, reservation=None):
    """The store a rank joins its process group on, or None to leave it to torch (``env://``).

    - The store is served elsewhere (``spawn``, ``run_ranks``, torchrun's agent: ``TORCHELASTIC_USE_AGENT_STORE``):
      connect as a client and mark this rank as arrived.
    - ``reservation`` given (a port this process holds): rank 0 serves on it, the others connect.
    - Rank 0 on a loopback master: serve on ``127.0.0.1:port`` only; the others connect.
    - Otherwise (several machines): torch's own rendezvous.
    """
    if os.environ.get(HOSTED, "") == "True":
        store = attempt_store(connect_store(host, port, world, timeout))
    elif reservation is not None:
        if rank == 0:
            store = serve_store(reservation, world, timeout)
        else:
            reservation.close()
            store = _rank0_store(host, port, world, timeout)
    elif not is_loopback(host):
        return None
    elif rank == 0:
        store = serve_store(PortReservation(LOOPBACK, int(port)), world, timeout)
    else:
        store = _rank0_store(LOOPBACK, port, world, timeout)
    mark_arrived(store, rank)
    return store


def _rank0_store(host: str, port: int, world: int, timeout):
    """A client of the store rank 0 serves, once it does: until then the port is tried from Python (torch's own
    connect loop is one C++ call, deaf to Ctrl-C up to the timeout)."""
    import torch.distributed as tdist

    end, pause = time.monotonic() + _timeout(timeout).total_seconds(), 0.01
    try:
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                break
            except OSError as exc:
                if time.monotonic() > end:
                    raise tdist.DistNetworkError(str(exc)) from exc
                time.sleep(pause)
                pause = min(0.2, pause * 2)
        return connect_store(host, port, world, timeout)
    except tdist.DistNetworkError as exc:  # nothing served there in time
        raise RuntimeError(
            f"init_parallel_env: rank 0 never served the rendezvous store at {host}:{port} (waited "
            f"{_timeout(timeout).total_seconds():g} s; WORLD_SIZE={world}): start rank 0 too, with the same "
            "MASTER_ADDR and MASTER_PORT, or start the ranks with dist.spawn or meshviz.launch") from exc


def never_arrived(store, world: int, host: str, port: int, timeout, came: list[bool] | None = None
                  ) -> RuntimeError | None:
    """An error naming the ranks that never reached the rendezvous of ``store`` (``came``: which did, as another
    rank saw it; asked of the store otherwise), or None when every rank did (a failed ``init_process_group`` then
    has another cause)."""
    came = arrived(store, world) if came is None else came
    if all(came):
        return None
    from ..trace.status import name_ranks

    names = name_ranks(r for r, c in enumerate(came) if not c)
    there = [r for r, c in enumerate(came) if c]
    return RuntimeError(
        f"init_parallel_env: {names} never reached the rendezvous at {host}:{port} (waited "
        f"{_timeout(timeout).total_seconds():g} s; WORLD_SIZE={world}; arrived: {there or 'none'}): start every "
        "rank with the same MASTER_ADDR and MASTER_PORT, or start them with dist.spawn or meshviz.launch")


def await_arrivals(store, rank: int, world: int, host: str, port: int, timeout) -> None:
    """Wait until ranks 0..world-1 have all reached the rendezvous of ``store`` (their :func:`mark_arrived`), in
    Python: a process group's own wait for its peers is one C++ call, in which a SIGINT (Ctrl-C, or the one a
    launcher passes on) is handled only once the wait is over, up to the timeout. When ``timeout`` runs out,
    raises :func:`never_arrived`'s error naming the ranks that never came, on every rank that waits: the first to
    give up leaves what it saw on the store for the others (rank 0, where it serves the store, stays a moment
    for them to read it)."""
    import torch.distributed as tdist

    keys, pause = [_ARRIVED.format(r) for r in range(world)], 0.002
    # a torchrun restart's ranks share the store with the run before's (meshviz's launcher gives each run a prefix)
    gave_up = f"{_GAVE_UP}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    most = min(0.2, 0.05 + world / 1000)  # a look each 50 ms at 8 ranks, each 200 ms at 150 and more: the store's load
    end = time.monotonic() + _timeout(timeout).total_seconds()
    hosted = os.environ.get(HOSTED, "") == "True"

    def verdict(came: list[bool]) -> RuntimeError:
        return never_arrived(store, world, host, port, timeout, came) or RuntimeError(
            f"init_parallel_env: the rendezvous at {host}:{port} timed out (waited "
            f"{_timeout(timeout).total_seconds():g} s; WORLD_SIZE={world})")

    try:
        while True:
            if store.check([gave_up]):  # first: a rank that came after the verdict finds its run over too
                raise verdict([c == "1" for c in store.get(gave_up).decode()])
            if store.check(keys):
                return
            if time.monotonic() > end:
                came = arrived(store, world)
                store.set(gave_up, "".join("1" if c else "0" for c in came))
                if rank == 0 and not hosted:
                    time.sleep(0.5)  # the store goes with this process: the others' next look finds the verdict
                raise verdict(came)
            time.sleep(pause)
            pause = min(most, pause * 2)  # ranks started together arrive within milliseconds
    except tdist.DistNetworkError as exc:
        whose, why = (("the rendezvous store at", "the process that started the ranks, which served it, ended")
                      if hosted else ("rank 0's rendezvous store at", "rank 0 ended; its output says why"))
        raise RuntimeError(f"init_parallel_env: {whose} {host}:{port} went away while rank {rank} waited for the "
                           f"others (WORLD_SIZE={world}): {why}") from exc


def rank_env(rank: int, world: int, master_addr: str, master_port: int, local_rank: int | None = None,
             local_world: int | None = None, hosted: bool = False) -> dict[str, str]:
    """The variables torch and Paddle code read to find their place: RANK, LOCAL_RANK, WORLD_SIZE, ...

    ``hosted``: the store at ``master_addr:master_port`` is already served (by the launching process), so every
    rank connects to it as a client, rank 0 included.
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if hosted:
        env[HOSTED] = "True"
    return env


def paddle_endpoints(host: str, port: int, n: int) -> list[str]:
    """Paddle's names for ``n`` ranks, ``host:port`` for the first (the master, as in Paddle's ``spawn``) and the
    next ports for the others: names only (meshviz's ranks meet at the master's store, not at their endpoints)."""
    port = int(port)
    ports = [port + i if port + n - 1 <= 65535 else (port - 1024 + i) % (65536 - 1024) + 1024 for i in range(n)]
    return [f"{host}:{p}" for p in ports]


def paddle_env(rank: int, endpoints: list[str]) -> dict[str, str]:
    """The variables Paddle's ``spawn`` gives rank ``rank`` of the ranks at ``endpoints`` (its launch, more)."""
    return {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
    }


def is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def loopback_ifname() -> str:
    """The loopback interface's name, for ``GLOO_SOCKET_IFNAME``: gloo's sockets then stay on this machine."""
    return "lo0" if sys.platform == "darwin" else "lo"


def attempt_store(store, attempt: str | int | None = None):
    """``store`` as one run of a launched job sees it: its keys under that run's prefix (``attempt``, default
    ``MESHVIZ_LAUNCH_ATTEMPT``), so that a restart (``--max_restart``) on the same agent store never reads what the
    run before left there (gloo's addresses, arrivals, leave markers); ``store`` itself outside a launched job."""
    attempt = os.environ.get(ATTEMPT, "") if attempt is None else str(attempt)
    if attempt == "":
        return store
    import torch.distributed as tdist

    return tdist.PrefixStore(f"meshviz/attempt/{attempt}", store)


def mark_arrived(store, rank: int) -> None:
    """Record on the store that ``rank`` reached the rendezvous (its launcher can then name one that never did)."""
    store.set(_ARRIVED.format(rank), "1")


def arrived(store, world: int) -> list[bool]:
    """Which ranks 0..world-1 reached the rendezvous of ``store``; all False when the store cannot be asked."""
    try:
        return [bool(store.check([_ARRIVED.format(r)])) for r in range(world)]
    except Exception:
        return [False] * world
