"""Cluster settings: the arguments checked, ranks and GPUs counted, and what each rank is told at set-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["ClusterConfig", "DEFAULT_CPU_RANKS", "DEFAULT_HANG_AFTER", "LOOPBACK_HOSTS", "RANKS_ENV", "gpu_count",
           "rank_configs", "ranks_kind"]

DEFAULT_CPU_RANKS = 4  # ranks when n=None and there is no GPU
DEFAULT_HANG_AFTER = 5.0  # seconds a rank may wait in a collective before the roll-call shows
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
RANKS_ENV = "MESHVIZ_RANKS"  # "threads": Clusters run their ranks inside this process unless told otherwise


def ranks_kind(ranks: str | None = None) -> str:
    """Where a Cluster's ranks run: ``"engines"`` (ipyparallel engines, one process each) or ``"threads"`` (threads
    of this process); ``None`` reads ``MESHVIZ_RANKS`` (default engines)."""
    ranks = ranks or os.environ.get(RANKS_ENV) or "engines"
    kind = {"engines": "engines", "processes": "engines", "threads": "threads"}.get(ranks)
    if kind is None:
        raise ValueError(f"Cluster: ranks must be 'engines' or 'threads', got {ranks!r}")
    return kind


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


@dataclass(frozen=True)
class ClusterConfig:
    """A Cluster's checked arguments. ``mode``: ``"cpu"`` (gloo), ``"cuda"`` (rank r on GPU LOCAL_RANK, NCCL) or
    ``"list"`` (rank r on GPU ``gpus[r]``)."""

    n: int
    mode: str
    gpus: tuple[int, ...] | None = None
    backend: str | None = None
    timeout: float = 60.0
    ipp_options: dict = field(default_factory=dict, compare=False)
    ranks: str = "engines"
    hang_after: float | None = DEFAULT_HANG_AFTER
    check_collectives: bool = True

    @classmethod
    def from_args(cls, n=None, devices="auto", backend=None, timeout=60, ipp_options=None, ranks=None,
                  hang_after=DEFAULT_HANG_AFTER, check_collectives=True) -> "ClusterConfig":
        """Check ``Cluster(...)``'s arguments (ValueError before anything starts) and decide the devices."""
        ipp_options = dict(ipp_options or {})
        # -- ranks as threads: CPU only, no ipyparallel options, the process group's backend is the thread one ----
        ranks = ranks_kind(ranks)
        if ranks == "threads":
            if devices not in ("auto", "cpu"):
                raise ValueError(f"Cluster: ranks='threads' run on the CPU; devices={devices!r} needs ranks='engines'")
            if backend not in (None, "threads"):
                raise ValueError(f"Cluster: ranks='threads' use the 'threads' backend, not {backend!r}")
            if ipp_options:
                raise ValueError(f"Cluster: {sorted(ipp_options)} are ipyparallel options; ranks='threads' takes none")
            devices, backend = "cpu", None
        # -------------------------------------------------------------------------------------------------------
        gpus = None
        if devices == "auto":
            gpus = gpu_count()
            mode = "cuda" if gpus else "cpu"
        elif devices in ("cpu",):
            mode = "cpu"
        elif devices in ("cuda", "gpu"):
            mode = "cuda"
        elif isinstance(devices, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in devices):
            mode = "list"
        else:
            raise ValueError(f"Cluster: devices must be 'auto', 'cpu', 'cuda' or a list of GPU ids, got {devices!r}")
        if n is None:
            if mode == "list":
                n = len(devices)
            elif mode == "cuda":
                n = gpus if gpus is not None else gpu_count()
                if not n:
                    raise ValueError("Cluster: devices='cuda' but no GPU is visible")
            else:
                n = DEFAULT_CPU_RANKS
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Cluster: n must be a positive int or None, got {n!r}")
        if mode == "list" and len(devices) != n:
            raise ValueError(f"Cluster: {len(devices)} devices given for {n} ranks")
        if mode == "cuda" and "engines" not in ipp_options:  # all ranks on this machine: one GPU each
            gpus = gpus if gpus is not None else gpu_count()
            if n > gpus:
                raise ValueError(f"Cluster: {n} ranks but {gpus} GPUs here; pass devices='cpu' or n <= {gpus}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"Cluster: timeout must be a positive number of seconds, got {timeout!r}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"Cluster: backend must be None, 'gloo' or 'nccl', got {backend!r}")
        if hang_after is not None and (isinstance(hang_after, bool) or not isinstance(hang_after, (int, float))
                                       or hang_after <= 0):
            raise ValueError(f"Cluster: hang_after must be a positive number of seconds or None, got {hang_after!r}")
        return cls(n=n, mode=mode, gpus=tuple(devices) if mode == "list" else None, backend=backend,
                   timeout=float(timeout), ipp_options=ipp_options, ranks=ranks,
                   hang_after=None if hang_after is None else float(hang_after),
                   check_collectives=bool(check_collectives))

    @property
    def host(self) -> str:
        """Where the controller listens: loopback unless ``controller_ip`` says otherwise."""
        return self.ipp_options.get("controller_ip") or "127.0.0.1"

    @property
    def multi_machine(self) -> bool:
        return self.host not in LOOPBACK_HOSTS


def rank_configs(probes: list[dict], mode: str, gpus, master: str, loopback: bool, timeout: float,
                 backend: str | None, ncpu: int | None = None) -> list[dict]:
    """What each rank's engine is told at set-up: rank r is ``probes[r]``'s engine (engines sorted by id).

    LOCAL_RANK counts the ranks before r on the same host. A CPU rank hides the GPUs and uses one thread; a GPU
    rank sees only GPU ``gpus[r]`` (a list was given) or GPU LOCAL_RANK, as its ``cuda:0``.
    """
    from ..distributed.rendezvous import loopback_ifname, rank_env

    n = len(probes)
    hosts = [p["host"] for p in probes]
    ncpu = ncpu or os.cpu_count() or 1
    port = probes[0]["port"]
    cfgs = []
    for r, h in enumerate(hosts):
        lr = hosts[:r].count(h)
        env = rank_env(r, n, master, port, local_rank=lr, local_world=hosts.count(h))
        env["MESHVIZ_TIMEOUT"] = str(timeout)
        if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = loopback_ifname()  # gloo's sockets too
        if mode == "cpu":
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            threads = 1
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(gpus[r] if gpus else lr)
            threads = max(1, ncpu // hosts.count(h))
            env["OMP_NUM_THREADS"] = str(threads)
            # a timed-out NCCL collective aborts its communicators and raises in the rank (the default, 3, ends
            # the whole process): the engine lives on and the cluster re-creates the group before the next cell
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        cfgs.append({
            "rank": r, "world": n, "port": port, "loopback": loopback, "env": env, "threads": threads,
            "peer_pids": [p["pid"] for i, p in enumerate(probes) if i != r and hosts[i] == h],
            "timeout": timeout, "backend": backend or ("gloo" if mode == "cpu" else "nccl"),
        })
    return cfgs

