"""What ``%px`` sees of thread ranks, in ipyparallel's shapes: the view, the results, each rank's captured output."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

from .. import rank_context
from ..errors import RankError, RankOutcome, alike
from ..rank_context import bound
from ..ranks.outcomes import error_of
from ..ranks.patches import capture

if TYPE_CHECKING:
    from .threads import Threads

__all__ = ["ThreadView", "RankResult"]

# how a rank stopped because of another's failure begins (meshviz.backends.threads)
_STOPPED = ("RankStopped: rank ", "RankStopped: the process group was torn down",
            "RankStopped: the ranks' collectives stopped")


# -- each rank's output ----------------------------------------------------------------------------------------

class _Output:
    """What one rank printed and displayed during one execution."""

    __slots__ = ("stdout", "stderr", "outputs", "execute_result", "count", "key")

    def __init__(self, key: tuple[int, int] | None = None):
        self.key = key  # (id of the Threads, rank): where threads the execution starts write (cluster.threads)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.outputs: list[dict] = []  # display_data contents, as ipyparallel keeps them
        self.execute_result: dict | None = None
        self.count: int | None = None


# -- threads a rank's cell starts -----------------------------------------------------------------------------

_live: dict[tuple[int, int], _Output] = {}  # (id of the Threads, rank) -> the output of the cell the rank runs now


class _Kernel:
    """A late thread's stream once no cell of its rank runs: the kernel's, each line labelled with the rank and
    written whole (threads of several ranks print at once; ``print`` writes a line in pieces)."""

    def __init__(self, name: str, rank: int):
        self.name, self.rank, self.part = name, rank, ""

    def append(self, text: str) -> None:
        text = self.part + text
        whole, _, self.part = text.rpartition("\n")
        if whole or text.endswith("\n"):
            self._write(whole + "\n")

    def flush(self) -> None:
        if self.part:
            part, self.part = self.part, ""
            self._write(part + "\n")

    def _write(self, text: str) -> None:
        label = f"[{self.name}:{self.rank}] "
        text = "".join(label + ln for ln in text.splitlines(True))
        with bound(rank_context.process()):  # the process's capture is none: the write goes where the kernel's go
            getattr(sys, self.name).write(text)


class _Follow:
    """Where a thread started by a rank's cell writes (its capture's ``out``): that cell's output while it runs,
    then the output of the cell its rank runs (as an engine sends a thread's output with the current request),
    else the kernel's streams, labelled with the rank."""

    def __init__(self, key: tuple[int, int], out):
        self.key = self._key = key  # a thread this one starts writes where it does
        self._out = out
        self._kernel = {name: _Kernel(name, key[1]) for name in ("stdout", "stderr")}

    def _now(self) -> _Output | None:
        return _live.get(self._key)

    @property
    def stdout(self):
        now = self._now()
        return now.stdout if now is not None else self._kernel["stdout"]

    @property
    def stderr(self):
        now = self._now()
        return now.stderr if now is not None else self._kernel["stderr"]

    @property
    def outputs(self):
        now = self._now()
        return now.outputs if now is not None else self._out.outputs

    def flush(self) -> None:
        """The thread ended: a part line it left for the kernel's streams goes out."""
        for stream in self._kernel.values():
            stream.flush()


def _follow(out) -> _Follow | None:
    """Where a thread a rank's cell starts writes (``ranks.patches.follow_threads``' hook): that rank's output, as on
    an engine; None for a capture that is no cell's."""
    key = getattr(out, "key", None)
    return None if key is None else _Follow(key, out)


class _RankDisplay:
    """Stands in for the shell's display publisher: a rank thread's displays are kept with its output (shown as
    ``[output:r]``, as with engines), everyone else's are published."""

    def __init__(self, pub):
        self._pub = pub

    def publish(self, data, metadata=None, *args, **kwargs):
        out = capture().out
        if out is None:
            return self._pub.publish(data, metadata, *args, **kwargs)
        out.outputs.append({"data": data, "metadata": metadata or {}})

    def clear_output(self, *args, **kwargs):
        if capture().out is None:
            return self._pub.clear_output(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._pub, name)


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _pull(ns: dict, names):
    if isinstance(names, str):
        return eval(names, ns)
    return [eval(n, ns) for n in names]


def _push(ns: dict, values: dict) -> None:
    ns.update(values)


# -- results ---------------------------------------------------------------------------------------------------

class _RankOut:
    """A rank's cell result, shown as ``Out[rank:count]: ...`` (ipyparallel's form)."""

    def __init__(self, rank: int, result: dict):
        self.rank = rank
        self.count = result.get("count")
        self.data = result["data"]
        self.metadata = result.get("metadata") or {}

    def _plaintext(self) -> str:
        text = self.data.get("text/plain", "")
        if "\n" in text and not text.startswith("\n"):
            text = "\n" + text
        return f"Out[{self.rank}:{self.count}]: {text}"

    def _repr_mimebundle_(self, *args, **kwargs):
        data = dict(self.data)
        data["text/plain"] = self._plaintext()
        return data, self.metadata

    def _repr_pretty_(self, p, cycle):
        p.text(self._plaintext())

    def __repr__(self) -> str:
        return self._plaintext()


class RankResult:
    """What a thread cluster's ``execute`` / ``apply`` returns, with ipyparallel AsyncResult's surface: ``get``,
    ``wait``, ``ready``, ``done``, ``stdout``/``stderr`` (in rank order), ``display_outputs``, ``stream_output``."""

    def __init__(self, job, ranks: list[int], outputs: dict, single: bool, kind: str):
        self._job = job
        self.ranks = ranks
        self._outs = outputs
        self._single = single
        self.kind = kind
        self._fname = kind
        self._streaming = False
        self._shown: dict = {}
        self._last_prefix = ""
        self._trailing_newline = True

    # -- waiting ---------------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        done = self._job.wait(timeout)
        if self._streaming:
            self._stream()
        return done

    def ready(self) -> bool:
        return self._job.done()

    done = ready

    def wait_for_output(self, timeout=None) -> bool:
        return True

    def wait_interactive(self, *args, **kwargs) -> None:
        self.wait()

    def pending(self) -> list[int]:
        return self._job.pending()

    def outcomes(self) -> list[RankOutcome]:
        return self._job.outcomes()

    def error(self) -> RankError | None:
        """The RankError naming the first rank (in rank order) that failed on its own, not stopped because a peer
        failed; None while running or when every rank ended well (the cluster's own error, ``Control.rank_error``,
        names the cause from the ranks' reports)."""
        if not self._job.done():
            return None
        outcomes = self._job.outcomes()
        own = [o.rank for o in outcomes if o.status != "ok" and not (o.error or "").startswith(_STOPPED)]
        err = error_of(outcomes, own[:1])
        same = alike(outcomes, own[0]) if own and err is not None and not err.lead else []
        return RankError(err.outcomes, same, err.note, err.diagnosis, False, err.rollcall, same=True) \
            if len(same) > 1 and err is not None else err

    @property
    def result(self) -> "RankResult":
        """What ``Cluster.execute`` returns for this job: the RankResult itself."""
        return self

    def successful(self) -> bool:
        return self.ready() and all(o.status == "ok" for o in self._job.outcomes())

    def get(self, timeout: float | None = None):
        if not self._job.wait(timeout):
            from ipyparallel import error

            raise error.TimeoutError("Result not ready.")
        err = self.error()
        if err is not None:
            raise err
        values = [o.value for o in self._job.outcomes()]
        return values[0] if self._single else values

    # -- output ----------------------------------------------------------------------------------------------
    def _per_rank(self, field: str):
        vals = ["".join(getattr(self._outs[r], field)) for r in self.ranks]
        return vals[0] if self._single else vals

    @property
    def stdout(self):
        return self._per_rank("stdout")

    @property
    def stderr(self):
        return self._per_rank("stderr")

    @property
    def outputs(self):
        vals = [list(self._outs[r].outputs) for r in self.ranks]
        return vals[0] if self._single else vals

    @property
    def execute_result(self):
        vals = [self._outs[r].execute_result for r in self.ranks]
        return vals[0] if self._single else vals

    def _display_stream(self, text: str, prefix: str = "", file=None) -> None:
        """Print a stream as ipyparallel does: a prefix line each time the rank changes."""
        if not text:
            return
        file = file or sys.stdout
        if prefix:
            if prefix == self._last_prefix:
                prefix = ""
            else:
                self._last_prefix = prefix
        pre = "\n" if prefix and not self._trailing_newline else ""
        sep = "\n" if prefix else ""
        self._trailing_newline = text.endswith("\n")
        print(f"{pre}{prefix}{sep}{text}", file=file, end="")

    def display_outputs(self, groupby: str = "type", result_only: bool = False) -> None:
        """Show what the ranks printed and displayed, and their results, as ipyparallel does for engines."""
        from IPython.display import display, display_pretty

        shell = _shell()
        if self._single:
            r = self.ranks[0]
            if not result_only:
                self._display_stream("".join(self._outs[r].stdout))
                self._display_stream("".join(self._outs[r].stderr), file=sys.stderr)
                if shell is not None:
                    for o in self._outs[r].outputs:
                        shell.display_pub.publish(data=o["data"], metadata=o["metadata"])
            if shell is not None and self._outs[r].execute_result is not None:
                display(_RankOut(r, self._outs[r].execute_result))
            return
        if groupby not in ("type", "order", "engine"):
            raise ValueError(f"groupby must be one of 'type', 'engine', 'order', not {groupby!r}")
        if groupby == "engine":
            for r in self.ranks:
                out = self._outs[r]
                if not result_only:
                    self._display_stream("".join(out.stdout), f"[stdout:{r}] ")
                    self._display_stream("".join(out.stderr), f"[stderr:{r}] ", file=sys.stderr)
                if shell is None:
                    continue
                if (out.outputs and not result_only) or out.execute_result is not None:
                    display_pretty(f"[output:{r}]", raw=True)
                if not result_only:
                    for o in out.outputs:
                        shell.display_pub.publish(data=o["data"], metadata=o["metadata"])
                if out.execute_result is not None:
                    display(_RankOut(r, out.execute_result))
            return
        if not result_only:
            for r in self.ranks:
                self._display_stream("".join(self._outs[r].stdout), f"[stdout:{r}] ")
            for r in self.ranks:
                self._display_stream("".join(self._outs[r].stderr), f"[stderr:{r}] ", file=sys.stderr)
        if shell is None:
            return
        if not result_only:
            for r in self.ranks:
                outs = self._outs[r].outputs
                if outs:
                    display_pretty(f"[output:{r}]", raw=True)
                for o in outs:
                    shell.display_pub.publish(data=o["data"], metadata=o["metadata"])
        for r in self.ranks:
            if self._outs[r].execute_result is not None:
                display(_RankOut(r, self._outs[r].execute_result))

    @contextlib.contextmanager
    def stream_output(self):
        """Show each rank's output while the cell runs (on the waiting thread), as ipyparallel streams it."""
        self._streaming = True
        try:
            yield
        finally:
            self._stream()
            self._streaming = False

    def _stream(self) -> None:
        shell = _shell()
        in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
        for r in self.ranks:
            out = self._outs[r]
            for name in ("stdout", "stderr"):
                chunks = getattr(out, name)
                seen = self._shown.get((r, name), 0)
                if len(chunks) == seen:
                    continue
                self._shown[(r, name)] = len(chunks)
                if in_kernel:
                    from IPython.display import publish_display_data

                    publish_display_data({"text/plain": f"[{name}:{r}] " + "".join(chunks)},
                                         transient={"display_id": f"{id(self)}-{name}-{r}"}, update=seen > 0)
                else:
                    self._display_stream("".join(chunks[seen:]), f"[{name}:{r}] ",
                                         file=sys.stderr if name == "stderr" else None)

    def __repr__(self) -> str:
        state = "pending" if not self.ready() else ("finished" if self.successful() else "failed")
        return f"<RankResult({self._fname}): {state}>"


# -- the view --------------------------------------------------------------------------------------------------

class _Client:
    """The little of ipyparallel's Client that ``%px`` reaches for."""

    def __init__(self, backend: "Threads"):
        self._backend = backend

    @property
    def ids(self) -> list[int]:
        return list(self._backend.ranks)

    def send_signal(self, sig=None, targets=None, block=None) -> None:
        self._backend.interrupt()

    @property
    def outstanding(self) -> set:
        return {0} if self._backend.busy() else set()


class ThreadView:
    """The ranks as ipyparallel's DirectView shows engines: ``execute``, ``apply_sync``/``apply_async``, ``pull``,
    ``push``, ``targets``, ``block`` (what ``%px`` and notebooks use)."""

    def __init__(self, backend: "Threads", targets=None):
        self._backend = backend
        self.targets = list(backend.ranks) if targets is None else targets
        self.block = True
        self.client = _Client(backend)

    def _ranks(self, targets=None) -> tuple[list[int], bool]:
        t = self.targets if targets is None else targets
        if t == "all" or t is None:
            return list(self._backend.ranks), False
        if isinstance(t, int):
            return [t], True
        return [int(r) for r in t], False

    def execute(self, code: str, silent: bool = False, targets=None, block=None):
        ranks, single = self._ranks(targets)
        ar = self._backend.run_code(code, ranks, single)
        if self.block if block is None else block:
            ar.get()
        return ar

    def apply_async(self, f, *args, **kwargs):
        ranks, single = self._ranks()
        return self._backend.run_call(f, *args, _ranks=ranks, _single=single, **kwargs)

    def apply_sync(self, f, *args, **kwargs):
        return self.apply_async(f, *args, **kwargs).get()

    def apply(self, f, *args, **kwargs):
        ar = self.apply_async(f, *args, **kwargs)
        return ar.get() if self.block else ar

    def pull(self, names, targets=None, block=None):
        """Each rank's value of ``names`` (a name or expression, or a sequence of them), evaluated on the rank as
        ipyparallel evaluates them on an engine (an expression may communicate: every rank evaluates it)."""
        ranks, single = self._ranks(targets)
        ar = self._backend.run_eval(names, ranks, single)
        return ar.get() if (self.block if block is None else block) else ar

    def push(self, ns: dict, targets=None, block=None):
        ranks, single = self._ranks(targets)
        ar = self._backend.run_call(_push, dict(ns), _ranks=ranks, _single=single, _namespace=True)
        return ar.get() if (self.block if block is None else block) else ar

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.pull(key)
        return ThreadView(self._backend, targets=key)

    def __setitem__(self, key: str, value) -> None:
        self.push({key: value})

    def __len__(self) -> int:
        return len(self._ranks()[0])

    def __repr__(self) -> str:
        return f"<ThreadView {self.targets}>"
