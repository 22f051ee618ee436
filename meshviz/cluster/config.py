"""Cluster settings: the arguments checked, ranks and GPUs counted, and what each rank is told at set-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["ClusterConfig", "DEFAULT_CPU_RANKS", "DEFAULT_HANG_AFTER", "LOOPBACK_HOSTS", "OUTPUT_WAIT", "RANKS_ENV",
           "gpu_count", "rank_configs", "ranks_kind"]

DEFAULT_CPU_RANKS = 4  # ranks when n=None and there is no GPU
DEFAULT_HANG_AFTER = 5.0  # seconds a rank may wait in a collective before the roll-call shows
OUTPUT_WAIT = 5.0  # seconds an ended cell waits for the ranks' output (engines send it apart from the reply)
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
    """A Cluster's checked arguments. ``mode``: ``"cpu"`` (gloo), ``"cuda"`` (rank r on GPU LOCAL_RANK) or
    ``"list"`` (rank r on GPU ``gpus[r]``, an index among the visible GPUs); ``backend`` the one backend of the
    world; ``notice`` the line said when the ranks run on the CPU for want of GPUs."""

    n: int
    mode: str
    gpus: tuple[int, ...] | None = None
    backend: str | None = None
    timeout: float = 60.0
    ipp_options: dict = field(default_factory=dict, compare=False)
    ranks: str = "engines"
    hang_after: float | None = DEFAULT_HANG_AFTER
    check_collectives: bool = True
    notice: str | None = None

    @classmethod
    def from_args(cls, n=None, devices="auto", backend=None, timeout=60, ipp_options=None, ranks=None,
                  hang_after=DEFAULT_HANG_AFTER, check_collectives=True, gpus: int | None = None) -> "ClusterConfig":
        """Check ``Cluster(...)``'s arguments and count ranks and GPUs (ValueError before anything starts).

        ``gpus``: the visible GPU count (default: counted here; not counted when ``ipp_options`` start the
        engines elsewhere and GPUs are asked for). The decision is :func:`meshviz.core.devices.plan_devices`'s.
        """
        from ..core.devices import plan_devices

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
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"Cluster: timeout must be a positive number of seconds, got {timeout!r}")
        if hang_after is not None and (isinstance(hang_after, bool) or not isinstance(hang_after, (int, float))
                                       or not hang_after > 0):
            raise ValueError(f"Cluster: hang_after must be a positive number of seconds or None, got {hang_after!r}")
        if not isinstance(check_collectives, bool):  # "no" or "0" would silently mean True
            raise ValueError(f"Cluster: check_collectives must be True or False, got {check_collectives!r}")
        if gpus is None:
            remote = "engines" in ipp_options and devices not in (None, "auto", "cpu")
            gpus = None if remote else gpu_count()
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"Cluster: n must be a positive int or None, got {n!r}")
        plan = plan_devices(n, devices, gpus, backend, default_cpu=DEFAULT_CPU_RANKS, who="Cluster")
        if not plan.on_gpu:
            mode, ids = "cpu", None
        elif plan.gpus is None:
            mode, ids = "cuda", None
        else:
            mode, ids = "list", plan.gpus
        return cls(n=plan.n, mode=mode, gpus=ids, backend=plan.backend, timeout=float(timeout),
                   ipp_options=ipp_options, ranks=ranks, hang_after=None if hang_after is None else float(hang_after),
                   check_collectives=bool(check_collectives), notice=plan.notice)

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
    rank sees only GPU ``gpus[r]`` (a list was given) or GPU LOCAL_RANK, as its ``cuda:0`` (ids through this
    process's own CUDA_VISIBLE_DEVICES, when it is set).
    """
    from ..runtime.devices import visible_gpu_labels
    from ..runtime.rendezvous import loopback_ifname, rank_env

    labels = visible_gpu_labels()
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
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MESHVIZ_DEVICE="cpu")
            threads = 1
        else:  # the rank sees only its GPU, as cuda:0 (an index among this process's visible GPUs)
            gpu = gpus[r] if gpus else lr
            env["CUDA_VISIBLE_DEVICES"] = labels[gpu] if labels is not None and gpu < len(labels) else str(gpu)
            env["MESHVIZ_DEVICE"] = "cuda:0"
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

