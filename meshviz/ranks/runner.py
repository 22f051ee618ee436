"""The one contract every way of making ranks keeps: a Runner makes ``n`` ranks, a Job is code running on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

from ..errors import RankError, RankOutcome

__all__ = ["Job", "Kind", "Runner"]

Kind = Literal["processes", "threads", "engines", "torchrun", "simulated"]


@runtime_checkable
class Job(Protocol):
    """Code running on some ranks of a Runner."""

    ranks: list[int]

    def done(self) -> bool:
        """Every rank of the job has ended (well or not)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until done); True once done."""

    def pending(self) -> list[int]:
        """The ranks whose part has not ended yet."""

    def outcomes(self) -> list[RankOutcome]:
        """What each rank's part ended as, in rank order (``"running"`` for a rank not ended yet)."""

    def error(self) -> RankError | None:
        """The RankError of a job that ended badly (from :func:`meshviz.ranks.outcomes.rank_error`), else None."""


@runtime_checkable
class Runner(Protocol):
    """``n`` ranks of one ``kind``: ``"processes"`` (:class:`~meshviz.ranks.processes.RankProcesses`),
    ``"threads"`` (:class:`~meshviz.ranks.threads.ThreadWorld`), ``"engines"`` (the cluster's ipyparallel
    engines), ``"torchrun"`` (:class:`~meshviz.launch.agent.Torchrun`) or ``"simulated"``
    (:class:`~meshviz.ranks.simulated.SimulatedWorld`: tensors without storage, collectives that move nothing).

    ``start()`` makes the ranks ready and returns the runner; ``submit(fn, ranks)`` runs ``fn(rank)`` on each of
    ``ranks`` (all by default) and returns its Job. A one-shot runner (processes, torchrun) takes one
    ``submit``, whose job is its processes' one function. ``interrupt(ranks)`` is a KeyboardInterrupt (SIGINT) on
    those ranks; ``stop()`` ends every rank and frees what the runner held."""

    kind: Kind
    n: int

    def start(self) -> Runner: ...

    def submit(self, fn: Callable[..., Any], ranks=None) -> Job: ...

    def interrupt(self, ranks=None) -> None: ...

    def stop(self) -> None: ...
