"""Run a function on N local ranks with a deadline and collect what each rank returns."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import traceback
from functools import partial

from .errors import RankError

__all__ = ["run_ranks", "RankFailed"]

RankFailed = RankError  # the name tests have used for a failed run_ranks


def _entry(index, port, func, args, world, outdir, env, rank_envs=None):
    from .ranks import patches
    from .runtime import rendezvous

    os.environ.update(env)
    if rank_envs:
        os.environ.update(rank_envs[index])
    os.environ.update(rendezvous.rank_env(index, world, rendezvous.LOOPBACK, port, hosted=True))
    import torch

    torch.set_num_threads(1)
    patches.record_torch_calls_when_watched(env)  # a raw tdist collective shows in the roll-call
    path = os.path.join(outdir, f"rank{index}.pkl")
    try:
        result = ("ok", func(*args), None)
    except BaseException as e:  # report every failure, with its traceback, to the parent
        result = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    if result[0] == "ok":
        _leave_counts(os.path.join(outdir, f"rank{index}.status.json"))
    try:
        blob = pickle.dumps(result)
    except Exception as e:
        blob = pickle.dumps(("error", f"returned something unpicklable: {e}", None))
    with open(path + ".tmp", "wb") as fh:
        fh.write(blob)
    os.replace(path + ".tmp", path)
    try:
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)  # skip interpreter teardown: a peer may still hold sockets to us


def _leave_counts(path: str) -> None:
    """Leave this rank's roll-call answer as its function returned (the collectives it entered on each group) at
    ``path``: it exits at once, and the parent's roll-call must tell a rank that passed the collective the others
    wait in from one that never entered it."""
    from .runtime import rollcall

    rollcall.current().finish("its function returned")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(rollcall.snapshot().to_dict(), fh)
        os.replace(path + ".tmp", path)
    except (OSError, TypeError, ValueError):  # without it the rank is named as idle, with no counts
        pass


def run_ranks(func, nprocs: int, *args, timeout: float = 120.0, collective_timeout: float = 30.0,
              env: dict | None = None, ranks: str | None = None, devices="cpu",
              backend: str | None = "gloo") -> list:
    """Run ``func(*args)`` on ranks 0..nprocs-1; return the list of per-rank return values.

    ``devices``/``backend`` as for ``dist.spawn`` (default: gloo on the CPU, whatever GPUs the machine has;
    ``devices="cuda"`` with gloo puts the ranks on the GPUs round robin, several ranks sharing one).

    Raises :class:`~meshviz.errors.RankError` (also known here as ``RankFailed``) naming the rank that failed
    first, with its traceback, and what every other rank did: raised, died, or was still running after
    ``timeout`` seconds (those are killed). ``func`` must be importable (defined at module level).

    ``ranks="threads"`` (or ``MESHVIZ_RANKS=threads``) runs the ranks as threads of this process instead
    (:mod:`meshviz.ranks.threads`); ``env`` then holds per-rank variables.
    """
    ranks = ranks or os.environ.get("MESHVIZ_RANKS") or "processes"
    if ranks == "threads":
        from .ranks.threads import run

        if devices not in ("cpu", "auto"):
            raise ValueError(f"run_ranks: ranks='threads' run on the CPU; devices={devices!r} needs processes")

        return run(func, nprocs, *args, timeout=timeout, collective_timeout=collective_timeout, env=env)
    if ranks not in ("processes", "engines"):
        raise ValueError(f"run_ranks: ranks must be 'processes' or 'threads', got {ranks!r}")
    from .core.devices import plan_devices
    from .ranks.processes import DEFAULT_START_METHOD, RankProcesses
    from .runtime import watchdog
    from .runtime.devices import rank_env, visible_gpu_count

    plan = plan_devices(nprocs, devices, visible_gpu_count(), backend, who="run_ranks")
    rank_envs = [rank_env(plan, r) for r in range(nprocs)]
    outdir = tempfile.mkdtemp(prefix="meshviz-ranks-")
    # the ranks answer a roll-call (printed only for a wait as long as the collective timeout): at the deadline it
    # names a rank that never entered the collective the others wait in
    envd = {"MESHVIZ_TIMEOUT": str(collective_timeout), watchdog.HANG_AFTER_ENV: str(float(collective_timeout)),
            watchdog.HOST_ENV: "parent", **(env or {})}
    procs = RankProcesses(nprocs, collective_timeout, DEFAULT_START_METHOD, hang_after=collective_timeout).start()
    try:
        job = procs.submit(partial(_entry, port=procs.port, func=func, args=args, world=nprocs, outdir=outdir,
                                   env=envd, rank_envs=rank_envs),
                           read_reports=partial(_read_results, outdir, nprocs),
                           read_returned=partial(_read_returned, outdir, nprocs), stop_on_failure=False)
        job.wait(timeout)
        job.end_running()
        err = job.error()
        if err is not None:
            raise err
        values = job.results()[1]
        return [values[r] for r in range(nprocs)]
    finally:
        procs.stop()
        shutil.rmtree(outdir, ignore_errors=True)


def _read_results(outdir: str, nprocs: int) -> tuple[dict, dict]:
    """(reports, values): what each rank wrote to ``outdir``, a failure (summary, traceback, when) or its value."""
    values, reports = {}, {}
    for r in range(nprocs):
        path = os.path.join(outdir, f"rank{r}.pkl")
        if not os.path.exists(path):
            continue
        with open(path, "rb") as fh:
            status, value, tb = pickle.load(fh)
        if status == "error":
            reports[r] = (value, tb, os.path.getmtime(path))
        else:
            values[r] = value
    return reports, values


def _read_returned(outdir: str, nprocs: int) -> dict:
    """rank -> the roll-call answer (:class:`~meshviz.trace.status.RankStatus`) each rank whose function returned
    left in ``outdir``."""
    from .trace.status import RankStatus

    out = {}
    for r in range(nprocs):
        try:
            with open(os.path.join(outdir, f"rank{r}.status.json")) as fh:
                out[r] = RankStatus.from_dict({**json.load(fh), "rank": r})
        except (OSError, ValueError, TypeError):
            continue
    return out
