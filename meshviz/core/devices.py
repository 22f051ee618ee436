"""Ranks and GPUs: the device and backend of every rank of one machine, decided before anything starts (pure)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankDevices", "plan_devices", "parse_devices", "BACKENDS", "DeviceNotice"]

BACKENDS = (None, "gloo", "nccl")
_NAMES = {"n": "n", "devices": "devices", "backend": "backend"}


class DeviceNotice(UserWarning):
    """Said once when ranks run on the CPU although the machine has GPUs (fewer GPUs than ranks)."""


@dataclass(frozen=True)
class RankDevices:
    """What the ranks of one machine run on: one ``backend`` for all of them (a world never mixes NCCL and gloo),
    and ``gpus[r]``, the index of rank r's GPU among the visible ones (``None`` entries: the CPU).

    ``gpus`` is ``None`` as a whole when rank r takes GPU LOCAL_RANK of a machine whose GPUs are not counted
    here (engines started elsewhere). ``notice``: the one line to say when ranks run on the CPU although the
    machine has GPUs (fewer GPUs than ranks).
    """

    n: int
    backend: str
    gpus: tuple | None
    notice: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.gpus is None or any(g is not None for g in self.gpus)

    @property
    def device_type(self) -> str:
        return "cuda" if self.on_gpu else "cpu"

    @property
    def devices(self) -> list[str]:
        """Each rank's device as it sees the visible GPUs: ``"cpu"`` or ``"cuda:i"`` (``"cuda"`` when uncounted)."""
        if self.gpus is None:
            return ["cuda"] * self.n
        return ["cpu" if g is None else f"cuda:{g}" for g in self.gpus]

    @property
    def shared(self) -> bool:
        """Do several ranks share a GPU (gloo only)?"""
        used = [g for g in (self.gpus or ()) if g is not None]
        return len(used) != len(set(used))

    def __repr__(self) -> str:
        return f"RankDevices({self.backend}, {self.devices})"


def parse_devices(devices):
    """``"auto"``, ``"cpu"``, ``"cuda"`` or a tuple of GPU indices, from what a caller accepts: None/"auto",
    "cpu", "cuda"/"gpu", a list of ints, or a comma-separated string of them ("0,1", Paddle's ``gpus=``)."""
    if devices is None:
        return "auto"
    if isinstance(devices, str):
        s = devices.strip().lower()
        if s in ("auto", "cpu"):
            return s
        if s in ("cuda", "gpu"):
            return "cuda"
        parts = [p.strip() for p in s.split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
        raise ValueError(f"devices must be 'auto', 'cpu', 'cuda' or GPU ids such as '0,1', got {devices!r}")
    if isinstance(devices, (list, tuple)) and devices and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
        return tuple(devices)
    raise ValueError(f"devices must be 'auto', 'cpu', 'cuda' or a non-empty list of GPU ids, got {devices!r}")


def _gpus_text(g: int) -> str:
    return "no GPU is visible" if g == 0 else f"{g} GPU{'s' if g != 1 else ''} {'are' if g != 1 else 'is'} visible"


def plan_devices(n, devices="auto", gpus: int | None = 0, backend: str | None = None, *,
                 default_cpu: int | None = None, who: str = "meshviz", names: dict | None = None) -> RankDevices:
    """Decide every rank's device and the one backend for ``n`` ranks on a machine with ``gpus`` visible GPUs.

    - ``devices="auto"``: one GPU per rank with NCCL when there are at least ``n`` GPUs; otherwise every rank on
      the CPU with gloo, and a ``notice`` when the machine has GPUs (there are too few).
    - ``"cpu"``: every rank on the CPU with gloo.
    - ``"cuda"`` (the user insists on GPUs): one GPU per rank with NCCL, an error when there are fewer GPUs than
      ranks; with ``backend="gloo"`` the ranks share the GPUs round robin (rank r on GPU r % gpus).
    - a list of GPU indices: rank r on ``devices[r]``; one id per rank, each visible; an id named twice needs
      ``backend="gloo"`` (NCCL cannot put two ranks of one communicator on one GPU).
    - ``backend="nccl"`` with ``"auto"`` insists on GPUs too; with ``"cpu"`` it is an error.

    ``n=None``: one rank per listed id, one per GPU, or ``default_cpu`` on the CPU. ``gpus=None``: the GPUs are
    not counted here (ranks start on other machines): GPU modes bind rank r to GPU LOCAL_RANK. Errors are
    ``ValueError`` naming the fix, prefixed with ``who``; ``names`` renames the arguments in them (a launcher's
    flags).
    """
    nm = {**_NAMES, **(names or {})}
    p = f"{who}: " if who else ""
    try:
        spec = parse_devices(devices)
    except ValueError as e:
        raise ValueError(f"{p}{str(e).replace('devices', nm['devices'], 1)}") from None
    if backend not in BACKENDS:
        raise ValueError(f"{p}{nm['backend']} must be None, 'gloo' or 'nccl', got {backend!r}")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        raise ValueError(f"{p}the GPU count must be a non-negative int, got {gpus!r}")
    if spec == "auto" and backend == "nccl":
        spec = "cuda"
    if n is None:
        if isinstance(spec, tuple):
            n = len(spec)
        elif spec == "cuda" or (spec == "auto" and gpus):
            if gpus == 0:
                raise ValueError(f"{p}{nm['devices']}='cuda' but {_gpus_text(0)}; pass {nm['devices']}='cpu'")
            if gpus is None:
                raise ValueError(f"{p}the number of ranks is needed when the GPUs are not counted here")
            n = gpus
        elif default_cpu is not None:
            n = default_cpu
        else:
            raise ValueError(f"{p}the number of ranks is needed")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{p}{nm['n']} must be a positive int, got {n!r}")

    if spec == "cpu":
        if backend == "nccl":
            raise ValueError(f"{p}{nm['backend']}='nccl' needs GPUs but {nm['devices']}='cpu'; "
                             f"pass {nm['backend']}='gloo' (or leave it out)")
        return RankDevices(n, "gloo", (None,) * n)
    if spec == "auto":
        if gpus is None:  # uncounted: as many GPUs as ranks are assumed, as "cuda" does
            return RankDevices(n, backend or "nccl", None)
        if gpus >= n:
            return RankDevices(n, backend or "nccl", tuple(range(n)))
        notice = None
        if gpus:
            notice = (f"{p}{n} ranks but {_gpus_text(gpus)}: the ranks run on the CPU with gloo "
                      f"({nm['n']} <= {gpus} puts one rank on each GPU with NCCL; {nm['devices']}='cuda', "
                      f"{nm['backend']}='gloo' shares the GPUs)")
        return RankDevices(n, "gloo", (None,) * n, notice)
    if spec == "cuda":
        if gpus is None:
            return RankDevices(n, backend or "nccl", None)
        if gpus == 0:
            raise ValueError(f"{p}{nm['devices']}='cuda' but {_gpus_text(0)}; pass {nm['devices']}='cpu'")
        if backend == "gloo":
            return RankDevices(n, "gloo", tuple(r % gpus for r in range(n)))
        if n > gpus:
            raise ValueError(f"{p}{n} ranks on GPUs but {_gpus_text(gpus)}, and NCCL needs one GPU per rank; "
                             f"pass {nm['n']} <= {gpus}, {nm['devices']}='cpu' (gloo), or {nm['backend']}='gloo' "
                             f"to share the GPUs")
        return RankDevices(n, "nccl", tuple(range(n)))
    ids = spec
    if len(ids) != n:
        raise ValueError(f"{p}{n} ranks but {len(ids)} GPU ids in {nm['devices']}={list(ids)}: "
                         f"name one GPU per rank")
    if gpus is not None:
        bad = sorted({i for i in ids if i >= gpus})
        if bad:
            where = f" (ids 0..{gpus - 1})" if gpus else f"; pass {nm['devices']}='cpu'"
            raise ValueError(f"{p}{nm['devices']}={list(ids)} names GPU {', '.join(map(str, bad))} but "
                             f"{_gpus_text(gpus)}{where}")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup and backend != "gloo":
        raise ValueError(f"{p}{nm['devices']}={list(ids)} names GPU {', '.join(map(str, dup))} more than once; "
                         f"NCCL needs a GPU per rank (pass {nm['backend']}='gloo' to share a GPU between ranks)")
    return RankDevices(n, backend or "nccl", ids)
