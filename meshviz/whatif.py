"""``meshviz.what_if``: run a training step on simulated ranks and see what every rank would hold and move."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .core.mesh import ProcessMesh
from .trace import Event, Mark
from .trace.commtable import CommTable, comm_table

__all__ = ["what_if", "WhatIf", "KEYS", "GB", "comm_bytes", "fmt_size"]

KEYS = ("params", "grads", "optimizer", "activations", "peak", "comm_bytes")
GB = 10**9
_COMM = ("collective", "reshard_step", "send", "recv")


def fmt_size(n: float) -> str:
    """Bytes in decimal units, as GPU memory is quoted (80 GB): ``"61.23 GB"``, ``"512 B"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def comm_bytes(events, rank: int) -> int:
    """The bytes ``rank`` received: the sum of its collective, reshard-step, send and recv events' ``bytes``."""
    return sum(int(e.bytes or 0) for e in events if e.rank == rank and e.kind in _COMM)


def _squeezed(mesh: ProcessMesh) -> ProcessMesh:
    """``mesh`` without its axes of one rank where it has more than two (fleet's topology: six, most of one)."""
    keep = [a for a in range(mesh.ndim) if mesh.shape[a] > 1]
    if mesh.ndim <= 2 or len(keep) == mesh.ndim:
        return mesh
    keep = keep or [0]
    ids = mesh.ids.squeeze(tuple(a for a in range(mesh.ndim) if a not in keep))
    return ProcessMesh(ids.tolist(), [mesh.dim_names[a] for a in keep])


@dataclass
class WhatIf:
    """What :func:`what_if` found. ``per_rank[r]``: rank ``r``'s bytes (``params``, ``grads``, ``optimizer``,
    ``activations``, ``peak``, ``comm_bytes``); ``events``: the events of the ranks simulated (``simulated``),
    which every view and :meth:`comm_table` draw, after one ``mark`` (op ``what_if``: ``nranks``, ``simulated``)
    saying they come from simulated ranks run one after another (their times are no schedule); ``like[r]``: the
    simulated rank whose run stands for rank ``r`` (itself when it was simulated); ``alone[r]``: why a simulated
    rank shared its run with no other. In a notebook it shows as a :class:`~meshviz.widgets.WhatIfView`
    (``limit`` marks the ranks over it)."""

    nranks: int
    per_rank: dict[int, dict[str, int]]
    events: list
    like: dict[int, int]
    simulated: list[int]
    alone: dict[int, list[str]] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)
    values: dict[int, object] = field(default_factory=dict)
    seconds: float = 0.0
    deciding: float = 0.0  # of ``seconds``, deciding which ranks are alike
    limit: float | None = 80 * GB

    # -- reading it ------------------------------------------------------------------------------------------
    def peak(self) -> int:
        """The highest peak of any rank."""
        return max((v["peak"] for v in self.per_rank.values()), default=0)

    def tightest(self, n: int = 5, key: str = "peak") -> list[int]:
        """The ``n`` ranks with the most ``key`` (lowest rank first among equals)."""
        return sorted(self.per_rank, key=lambda r: (-self.per_rank[r][key], r))[:n]

    def over(self, limit: float | None = None) -> list[int]:
        """The ranks whose peak is over ``limit`` bytes (default: the report's ``limit``)."""
        limit = self.limit if limit is None else limit
        if limit is None:
            return []
        return [r for r in sorted(self.per_rank) if self.per_rank[r]["peak"] > limit]

    def fits(self, limit: float | None = None) -> bool:
        return not self.over(limit)

    def classes(self) -> dict[int, list[int]]:
        """simulated rank -> every rank its run stands for."""
        out: dict[int, list[int]] = {r: [] for r in self.simulated}
        for r in sorted(self.like):
            out[self.like[r]].append(r)
        return out

    def comm_table(self, cell=None) -> CommTable:
        """The bytes each rank receives, per issuing module, collective and mesh axis (of the simulated ranks, whose
        rows stand for every rank alike)."""
        return comm_table(self.events, cell=cell)

    def mesh(self) -> ProcessMesh:
        """The largest mesh the run used; where none covers the world but meshes of one shape do without sharing a
        rank (a pipeline's stages), those stacked along a new first axis ``"mesh"``, in the order of their first
        ranks; else every rank in one row."""
        best = None
        shaped: dict = {}
        for e in self.events:
            if not e.mesh:
                continue
            if best is None or len(e.mesh["process_ids"]) > len(best["process_ids"]):
                best = e.mesh
            key = (tuple(e.mesh["shape"]), tuple(e.mesh.get("dim_names") or ()))
            shaped.setdefault(key, {})[tuple(e.mesh["process_ids"])] = e.mesh
        if best is not None and len(best["process_ids"]) == self.nranks:
            return _squeezed(ProcessMesh.from_dict(best))
        for (shape, names), meshes in shaped.items():
            ids = sorted(meshes, key=min)
            flat = [r for m in ids for r in m]
            if len(ids) > 1 and sorted(flat) == list(range(self.nranks)):
                grid = np.array(flat).reshape((len(ids),) + shape).tolist()
                return ProcessMesh(grid, ["mesh", *(names or [f"d{i}" for i in range(len(shape))])])
        return ProcessMesh(list(range(self.nranks)), ["rank"])

    def table(self, ranks=None) -> str:
        """Per-rank numbers as aligned text, one line per rank of ``ranks`` (default: the simulated ones)."""
        ranks = self.simulated if ranks is None else list(ranks)
        head = ["rank", *KEYS, "like"]
        rows = [[str(r), *(fmt_size(self.per_rank[r][k]) for k in KEYS), str(self.like[r])] for r in ranks]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        fmt = lambda row: "  ".join(x.rjust(w) for x, w in zip(row, widths))  # noqa: E731
        return "\n".join([fmt(head)] + [fmt(r) for r in rows])

    def __repr__(self) -> str:
        top = self.tightest(1)
        peak = f"peak {fmt_size(self.peak())} (rank {top[0]})" if top else "no ranks"
        over = "" if self.limit is None else f", {len(self.over())} over {self.limit / GB:g} GB"
        return f"WhatIf({self.nranks} ranks, {len(self.simulated)} simulated, {peak}{over})"

    def view(self, limit: float | None = None, rank: int | None = None):
        """The report drawn: :class:`~meshviz.widgets.WhatIfView`."""
        from .widgets.what_if_view import WhatIfView

        return WhatIfView(self, limit=self.limit if limit is None else limit, rank=rank)

    def _ipython_display_(self):
        self.view()._ipython_display_()


def what_if(fn: Callable, nranks: int, *args, share: bool = True, timeout: float = 600.0, limit: float | None = 80 * GB,
            **kwargs) -> WhatIf:
    """Run ``fn(*args, **kwargs)`` — the function you would hand to ``dist.spawn`` — on ``nranks`` simulated ranks
    and report what each would hold and receive.

    A simulated rank runs your code through meshviz's runtime as a real rank does, on tensors that have shapes
    and dtypes but no storage (torch's fake tensors), in a process group whose collectives move nothing but are
    traced as any rank's are (:class:`~meshviz.ranks.simulated.SimulatedWorld`). Its memory is every storage
    its tensors allocate while they live; its ``comm_bytes`` the sum of its communication events' ``bytes``,
    each what it receives (:mod:`meshviz.core.traffic`).

    ``share``: ranks that provably behave alike share one simulation (:class:`~meshviz.ranks.alike.Facts` says
    how that is decided): rank 0 is simulated, every rank whose facts match its run takes its numbers, then the
    lowest rank left is simulated, and so on. ``share=False`` simulates every rank. ``timeout``: seconds for the
    whole run. ``limit``: the bytes per rank the report's view marks ranks over (None: no limit).

    A rank that raises ends the run with a :class:`~meshviz.errors.RankError` naming it, its line and its
    traceback, as a real run does. Where your code asks for a value (``loss.item()``) it reads 0; an op whose
    output's shape depends on values (``masked_select``) gives its largest output.
    """
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"what_if: nranks must be a positive int, got {nranks!r}")
    from .ranks.alike import Facts
    from .ranks.simulated import SimulatedWorld, keep_rngs

    t0 = time.monotonic()
    began = time.time()
    deadline = t0 + timeout
    like: dict[int, int] = {}
    runs: dict = {}
    deciding = 0.0
    alone: dict[int, list[str]] = {}
    world = SimulatedWorld(nranks, timeout=timeout).start()
    try:
        with keep_rngs():
            left = list(range(nranks))
            while left:
                rep = left[0]
                job = world.submit(lambda r: fn(*args, **kwargs), ranks=[rep])
                late = not job.wait(max(0.0, deadline - time.monotonic()))
                if late:
                    world.interrupt()  # where it was is in the interrupted rank's traceback, chained below
                    job.wait(10)
                err = job.error()
                if late or not job.done():
                    raise TimeoutError(f"what_if: rank {rep} was still simulating after {timeout:g} s") from err
                if err is not None:
                    raise err
                run = runs[rep] = job.runs[rep]
                if share:
                    t1 = time.monotonic()
                    facts = Facts(rep, nranks, run.events, run.layouts, run.reads)
                    group = facts.alike(left)
                    deciding += time.monotonic() - t1
                    if facts.alone:
                        alone[rep] = list(dict.fromkeys(facts.alone))
                else:
                    group = [rep]
                for r in group:
                    like[r] = rep
                taken = set(group)
                left = [r for r in left if r not in taken]
    finally:
        world.stop()
    per_rank = {}
    for rep, run in runs.items():
        held = run.held.as_dict()
        held["comm_bytes"] = comm_bytes(run.events, rep)
        runs[rep] = (run, held)
    for r in range(nranks):
        per_rank[r] = dict(runs[like[r]][1])
    mark = Event(kind="mark", op="what_if", rank=min(runs), seq=-1, start=began, name="what_if",
                 payload=Mark(fields={"nranks": nranks, "simulated": sorted(runs)}))
    events = [mark] + [e for rep in sorted(runs) for e in runs[rep][0].events]
    return WhatIf(nranks, per_rank, events, like, sorted(runs), alone,
                  outputs={rep: run.stdout for rep, (run, _) in runs.items()},
                  values={rep: run.outcome.value for rep, (run, _) in runs.items()},
                  seconds=time.monotonic() - t0, deciding=deciding, limit=limit)
