"""The pieces a thread group's calls are made of (a group's identity, meetings, posted receives, works, the
reductions); simulated groups share the identity and the works."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as tdist

__all__: list[str] = []  # private to meshviz.backends.threads and .simulated


class _InProcessGroup(tdist.ProcessGroup):
    """A c10d group of ranks in this process: its identity (``BACKEND``: the backend name it reports; ``LABEL``:
    its repr's name). It is its own backend on every device: torch asks a group's backend whether it coalesces
    (batch_isend_irecv does for any ProcessGroup since torch 2.14); its sends are buffered one by one."""

    BACKEND = ""
    LABEL = ""
    supports_coalescing = False

    def __init__(self, group_rank: int, size: int, name: str, ranks: list[int]):
        super().__init__(group_rank, size)
        self._group_rank = group_rank
        self._size = size
        self._name = name
        self.ranks = ranks  # global ranks in group order
        self.me = ranks[group_rank]

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._group_rank

    def getBackendName(self) -> str:
        return self.BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def pg_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"{self.LABEL}({self._name!r}, ranks={self.ranks}, rank={self.me})"

    def _get_backend(self, device=None):
        return self


# -- meetings, receives and works ------------------------------------------------------------------------------

class _Meeting:
    """One collective call of one group: what each member brought; the last to arrive does the work."""

    __slots__ = ("op", "ranks", "data", "here", "arrived", "done", "error", "what", "differ")

    def __init__(self, op: str, ranks: list[int], what: str):
        self.op = op
        self.ranks = ranks  # global ranks, in group order
        self.data: list = [None] * len(ranks)
        self.here = [False] * len(ranks)
        self.arrived = 0
        self.done = False
        self.error: BaseException | None = None
        self.what = what
        self.differ = False  # the members called it with different dtypes, shapes, reduce ops or roots


class _Recv:
    __slots__ = ("rank", "tensor", "src", "filled", "error", "what", "source")

    def __init__(self, rank: int, tensor, src: int | None, what: str):
        self.rank = rank  # global rank of the receiver
        self.tensor = tensor
        self.src = src  # group rank, None for any
        self.filled = False
        self.error: BaseException | None = None
        self.what = what
        self.source = src

    def fill(self, data, source: int) -> None:
        t = self.tensor
        if data.dtype != t.dtype or data.numel() != t.numel():  # gloo would garble (or abort on) what copy_ casts
            self.error = ValueError(
                f"{self.what}: the sender's {_desc(data)} does not fit this rank's {_desc(t)} (a receive takes "
                "the sent dtype and number of elements)")
        else:
            with torch.no_grad():
                t.detach().copy_(data.view(t.shape))
        self.filled = True
        self.source = source


def _desc(t) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


class _Work(tdist.Work):
    """What a thread group's call returns: done at once (collectives finish when the last member arrives), or a
    receive whose ``wait`` hands the baton on until a sender fills it."""

    def __init__(self, result=(), recv: _Recv | None = None, group=None):
        super().__init__()
        self._result = list(result)
        self._recv = recv
        self._group = group
        self._fut = torch.futures.Future()
        if recv is None:
            self._fut.set_result(self._result)

    def wait(self, timeout=None) -> bool:
        if self._recv is not None and not self._fut.done():
            self._group._wait_recv(self._recv)
            self._fut.set_result([self._recv.tensor])
        return True

    def is_completed(self) -> bool:
        return self._recv is None or self._recv.filled

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self):
        return self._fut

    def result(self):
        return self._result if self._recv is None else [self._recv.tensor]

    def source_rank(self) -> int:
        return self._recv.source if self._recv is not None else -1

    _source_rank = source_rank


# -- reductions (in group-rank order, so every run sums alike) --------------------------------------------------

def _reducer(rop) -> Callable:
    op = getattr(rop, "op", rop)
    R = tdist.ReduceOp
    if op == R.SUM or op == R.AVG:
        return lambda a, b: a.add_(b)
    if op == R.PRODUCT:
        return lambda a, b: a.mul_(b)
    if op == R.MIN:
        return lambda a, b: torch.minimum(a, b, out=a)
    if op == R.MAX:
        return lambda a, b: torch.maximum(a, b, out=a)
    if op == R.BAND:
        return lambda a, b: a.bitwise_and_(b)
    if op == R.BOR:
        return lambda a, b: a.bitwise_or_(b)
    if op == R.BXOR:
        return lambda a, b: a.bitwise_xor_(b)
    raise NotImplementedError(f"the threads backend has no reduction {op}")


def _is_avg(rop) -> bool:
    return getattr(rop, "op", rop) == tdist.ReduceOp.AVG


@torch.no_grad()
def _reduce(tensors: list, rop):
    combine = _reducer(rop)
    acc = tensors[0].detach().clone()
    for t in tensors[1:]:
        combine(acc, t)
    if _is_avg(rop):
        if acc.is_floating_point() or acc.is_complex():
            acc.div_(len(tensors))
        else:
            acc.div_(len(tensors), rounding_mode="trunc")
    return acc


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.is_sparse:  # a sparse copy_ resizes the tensor it is called on: a detached alias would take the result
        with torch.no_grad():
            dst.copy_(src)
        return
    dst.detach().copy_(src)  # detach: c10d's signatures do not tell autograd about the write


def _splits(buf: torch.Tensor, sizes, n: int) -> list[int]:
    if sizes is None or len(sizes) == 0:
        return [buf.shape[0] // n] * n
    return [int(s) for s in sizes]


def _pieces(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(buf, sizes, dim=0)) if buf.dim() else [buf]
