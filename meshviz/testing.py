"""Run a function on N local ranks with a deadline and collect what each rank returns."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback

__all__ = ["run_ranks", "RankFailed"]


class RankFailed(RuntimeError):
    """One or more ranks raised, died or ran past the deadline; the message names them."""


def _entry(index, func, args, world, port, outdir, env):
    os.environ.update(env)
    os.environ.update(
        RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{index}.pkl")
    try:
        result = ("ok", func(*args))
    except BaseException as e:  # report every failure, with its traceback, to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        blob = pickle.dumps(result)
    except Exception as e:
        blob = pickle.dumps(("error", f"rank {index} returned something unpicklable: {e}"))
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


def run_ranks(func, nprocs: int, *args, timeout: float = 120.0, collective_timeout: float = 30.0,
              env: dict | None = None) -> list:
    """Run ``func(*args)`` on ranks 0..nprocs-1 (gloo on CPU); return the list of per-rank return values.

    Raises RankFailed naming every rank that raised (with its traceback), died, or was still running after
    ``timeout`` seconds (those are killed). ``func`` must be importable (defined at module level).
    """
    import torch.multiprocessing as mp

    from .distributed.env import free_port

    outdir = tempfile.mkdtemp(prefix="meshviz-ranks-")
    envd = {"MESHVIZ_TIMEOUT": str(collective_timeout), "MESHVIZ_BACKEND": "gloo", **(env or {})}
    ctx = mp.start_processes(
        _entry, args=(func, args, nprocs, free_port(), outdir, envd), nprocs=nprocs, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            if all(not p.is_alive() for p in ctx.processes):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        results, errors = [], []
        for r, p in enumerate(ctx.processes):
            path = os.path.join(outdir, f"rank{r}.pkl")
            if p.is_alive() and not os.path.exists(path):
                errors.append(f"rank {r}: still running after {timeout:.0f} s (killed)")
                results.append(None)
                continue
            p.join(5)
            if not os.path.exists(path):
                errors.append(f"rank {r}: died with exit code {p.exitcode} before returning")
                results.append(None)
                continue
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)
            if status == "error":
                errors.append(f"rank {r} raised {value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            raise RankFailed("\n".join(errors))
        return results
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)
        shutil.rmtree(outdir, ignore_errors=True)
