"""Where a rank's tensors live: its device, the check every collective's tensors pass, strict mode, placing layers."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as tdist

from .. import rank_context
from ..core.devices import DeviceNotice, RankDevices, plan_devices

__all__ = [
    "device", "initial_device", "strict", "set_strict", "strict_devices", "check", "place_module",
    "staged_send", "staged_recv", "p2p_through_host", "needs_host_p2p", "full_tensor", "visible_gpu_count",
    "visible_gpu_labels", "rank_env", "DeviceNotice", "STRICT_ENV", "DEVICE_ENV",
]

STRICT_ENV = "MESHVIZ_STRICT_DEVICES"
DEVICE_ENV = "MESHVIZ_DEVICE"  # "cpu" or "cuda:i": what spawn / launch / a Cluster decided for a rank


# -- this rank's device -----------------------------------------------------------------------------------------

def visible_gpu_count() -> int:
    """GPUs this process can see (without initialising CUDA)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


_device_for: tuple = (None, None)  # (default process group, this rank's device in it)


def device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL; under gloo the GPU meshviz bound it to (ranks that
    share GPUs), else the CPU. Tensors handed to collectives belong here."""
    global _device_for
    world = tdist.group.WORLD if tdist.is_initialized() else None
    if world is not None and _device_for[0] is world:
        return _device_for[1]
    if world is not None and tdist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    elif os.environ.get(DEVICE_ENV, "cpu").startswith("cuda") and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if world is not None:  # fixed for the life of a world (set at init_parallel_env)
        _device_for = (world, dev)
    return dev


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def initial_device(backend: str | None = None) -> tuple[str, torch.device]:
    """(backend, device) for this rank before its process group exists.

    What spawn / launch / a Cluster decided (``MESHVIZ_DEVICE``, ``MESHVIZ_BACKEND``); without those (plain
    torchrun, a script), the same decision they make, for LOCAL_WORLD_SIZE ranks on this machine's GPUs. A
    ``backend`` passed here must agree with the device (NCCL needs a GPU): ValueError before anything starts.
    """
    backend = backend or os.environ.get("MESHVIZ_BACKEND") or None
    spec = os.environ.get(DEVICE_ENV)
    if spec:
        dev = torch.device(spec)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", 0)
        if backend == "nccl" and dev.type != "cuda":
            raise ValueError(f"init_parallel_env: backend 'nccl' needs a GPU, but this rank was placed on {spec} "
                             f"({DEVICE_ENV}); leave the backend out or pass 'gloo'")
        return backend or ("nccl" if dev.type == "cuda" else "gloo"), dev
    local_world = _env_int("LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
    local = _env_int("LOCAL_RANK", _env_int("PADDLE_LOCAL_RANK", 0))
    plan = plan_devices(local_world, "auto", visible_gpu_count(), backend, who="init_parallel_env",
                        names={"n": "LOCAL_WORLD_SIZE", "backend": "MESHVIZ_BACKEND"})
    if plan.notice and local == 0:
        warnings.warn(plan.notice, DeviceNotice, stacklevel=3)
    gpu = plan.gpus[local % plan.n] if plan.gpus is not None else local
    return plan.backend, torch.device("cpu") if gpu is None else torch.device("cuda", gpu)


def rank_env(plan: RankDevices, rank: int, labels: list[str] | None = None, renumber: bool = False) -> dict:
    """The variables that tell local rank ``rank`` of ``plan`` its device and backend, set before torch starts
    CUDA in it: CPU ranks see no GPU; with ``renumber`` a GPU rank sees only its GPU, as ``cuda:0``
    (``labels``: the visible GPUs' ids, for CUDA_VISIBLE_DEVICES)."""
    env = {"MESHVIZ_BACKEND": plan.backend}
    if not plan.on_gpu:
        env.update(CUDA_VISIBLE_DEVICES="", **{DEVICE_ENV: "cpu"})
        return env
    gpu = rank if plan.gpus is None else plan.gpus[rank]
    if renumber:
        labels = labels or [str(i) for i in range(gpu + 1)]
        env["CUDA_VISIBLE_DEVICES"] = labels[gpu] if gpu < len(labels) else str(gpu)
        env[DEVICE_ENV] = "cuda:0"
    else:
        env[DEVICE_ENV] = f"cuda:{gpu}"
    return env


def visible_gpu_labels() -> list[str] | None:
    """The ids in this process's CUDA_VISIBLE_DEVICES (None when it is not set): what a child must be told to see
    the i-th GPU this process sees."""
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    if v is None:
        return None
    return [s.strip() for s in v.split(",") if s.strip()]


# -- strict mode ------------------------------------------------------------------------------------------------

class _Strict:
    """A rank's strict-mode override: None where ``MESHVIZ_STRICT_DEVICES``, as the rank sees it, decides."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on: bool | None = None


# per rank: ranks that are threads of one process (and a simulated rank running a stage on meta tensors) each
# keep their own mode
STRICT = rank_context.slot("strict_devices", _Strict)


def strict() -> bool:
    """Is strict device mode on for the calling rank? Then every tensor handed to a collective must be on this
    rank's device."""
    on = STRICT.get().on
    if on is not None:
        return on
    return (rank_context.getenv(STRICT_ENV) or "") not in ("", "0", "false", "False")


def set_strict(on: bool | None) -> None:
    """Turn strict device mode on or off for the calling rank (the process, outside rank threads); None: back to
    ``MESHVIZ_STRICT_DEVICES``."""
    STRICT.get().on = None if on is None else bool(on)


@contextlib.contextmanager
def strict_devices(on: bool = True):
    """``with strict_devices():`` strict device mode inside the block, for the calling rank only."""
    st = STRICT.get()
    before = st.on
    st.on = bool(on)
    try:
        yield
    finally:
        st.on = before


# -- the check in comm.run ----------------------------------------------------------------------------------------

def check(op: str, group, tensors) -> None:
    """ValueError when a tensor handed to collective ``op`` is not where ``group``'s backend needs it (NCCL: on a
    GPU), or, in strict mode, not on this rank's device. Costs a device test per tensor; nothing under gloo
    outside strict mode (gloo carries CPU and CUDA tensors for its main collectives)."""
    if group.backend == "nccl":
        for t in tensors:
            if t is not None and t.device.type != "cuda":
                raise ValueError(
                    f"{op}: a tensor on {t.device} cannot go into an NCCL collective (NCCL carries CUDA tensors "
                    f"only); put it on this rank's device first: t = t.to(dist.device())  # {device()}")
    if strict():
        want = device()
        for t in tensors:
            if t is not None and t.device != want and not _same(t.device, want):
                raise ValueError(
                    f"{op}: a tensor on {t.device} but this rank's device is {want} (strict device mode, "
                    f"{STRICT_ENV}=1): every tensor handed to a collective must be on dist.device(); "
                    f"move it with t.to(dist.device())")


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    ia = a.index if a.index is not None else (torch.cuda.current_device() if a.type == "cuda" else 0)
    ib = b.index if b.index is not None else (torch.cuda.current_device() if b.type == "cuda" else 0)
    return ia == ib


# -- gloo's point to point: host memory only ----------------------------------------------------------------------

def needs_host_p2p(t: torch.Tensor, pg=None) -> bool:
    """gloo's send/recv read raw host memory: a CUDA tensor must go through a CPU copy."""
    if t.device.type == "cpu":
        return False
    try:
        return tdist.get_backend(pg) == "gloo"
    except Exception:
        return False


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def _host_buffer(t: torch.Tensor):
    """(CPU buffer shaped like ``t``, finish): ``finish()`` copies the buffer into ``t``."""
    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")

    def finish():
        with torch.no_grad():  # a pipeline stage receives into leaves that require grad
            t.copy_(buf)

    return buf, finish


def staged_send(t: torch.Tensor, pg=None) -> torch.Tensor:
    """What to hand to ``isend``: ``t`` itself, or its CPU copy where gloo cannot read the device."""
    return _host_copy(t) if needs_host_p2p(t, pg) else t


def staged_recv(t: torch.Tensor, pg=None):
    """(buffer to hand to ``irecv``, finish): ``finish()`` copies a CPU staging buffer into ``t`` once the
    receive is done (a no-op when ``t`` is received into directly)."""
    if not needs_host_p2p(t, pg):
        return t, None
    return _host_buffer(t)


@contextlib.contextmanager
def p2p_through_host():
    """Inside, torch.distributed's blocking send/recv and object-list send/recv take CUDA tensors through CPU copies.

    torch's pipeline stages set themselves up with such calls on their own device, which gloo cannot read. The
    functions are swapped process-wide while inside: for a process that is one rank (gloo with CUDA tensors never
    runs with ranks as threads).
    """
    orig = {n: getattr(tdist, n) for n in ("send", "recv", "send_object_list", "recv_object_list")}
    cpu = torch.device("cpu")

    def send(tensor, *args, **kwargs):
        return orig["send"](_host_copy(tensor), *args, **kwargs)

    def recv(tensor, *args, **kwargs):
        buf, finish = _host_buffer(tensor)
        src = orig["recv"](buf, *args, **kwargs)
        finish()
        return src

    def send_object_list(objects, *args, device=None, **kwargs):
        return orig["send_object_list"](objects, *args, device=cpu, **kwargs)

    def recv_object_list(objects, *args, device=None, **kwargs):
        return orig["recv_object_list"](objects, *args, device=cpu, **kwargs)

    swapped = {"send": send, "recv": recv, "send_object_list": send_object_list, "recv_object_list": recv_object_list}
    for name, fn in swapped.items():
        setattr(tdist, name, fn)
    try:
        yield
    finally:
        for name, fn in orig.items():
            setattr(tdist, name, fn)


def full_tensor(t):
    """``DTensor.full_tensor()``, also for CUDA DTensors on a gloo mesh: torch's functional collectives crash there
    (SIGSEGV, torch 2.11), so those are gathered as CPU DTensors over the same groups and moved back."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    if t.device.type == "cpu" or tdist.get_backend(mesh.get_group(0)) != "gloo":
        return t.full_tensor()
    from torch.distributed.device_mesh import DeviceMesh

    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        cpu_mesh = DeviceMesh.from_group(mesh.get_group(0), "cpu", mesh_dim_names=names)
    else:
        groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        cpu_mesh = DeviceMesh.from_group(groups, "cpu", mesh=mesh.mesh, mesh_dim_names=names)
    local = t.to_local().detach().to("cpu")
    cpu = DTensor.from_local(local, cpu_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return cpu.full_tensor().to(t.device)


# -- layers on the rank's device ----------------------------------------------------------------------------------

@torch.no_grad()
def place_module(module, what: str = ""):
    """Paddle creates layers on the current device, torch on the CPU: on a GPU rank, the parameters and buffers of
    ``module`` still on the CPU move to ``device()`` here, in place (the parameters stay the same objects, so an
    optimizer built on them keeps working), before ``what`` wraps it. Nothing moves on a CPU rank, and nothing
    leaves a GPU. Returns ``module``."""
    want = device()
    if want.type == "cpu":
        return module
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.device.type == "cpu":
                p.data = p.data.to(want)
                if p.grad is not None:
                    p.grad = p.grad.to(want)
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type == "cpu":
                m._buffers[name] = b.to(want)
    return module
