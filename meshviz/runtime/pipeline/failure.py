"""A pipeline stage that raises tells the stages waiting on it at once, naming itself, without any collective."""

from __future__ import annotations

import os
import re

from ... import rank_context
from ...backends import threads as thread_backend

__all__ = ["announce", "summary", "unwrapped", "heard", "close_connections"]

_RELAYED = re.compile(r"rank \d+ failed \((pipeline stage \d+ \(rank \d+\) raised .*)\); ", re.S)  # a peer's failure
_WRAPPED = ("failed to run forward", "Failed to run stage backward")  # torch 2.11 to 2.15
_LIMIT = 300  # characters of the error's message kept in the record
_ORIGIN = re.compile(r"pipeline stage \d+ \(rank (\d+)\) raised ")  # a record's failing rank
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's, a peer's socket shut


def unwrapped(err: BaseException) -> BaseException:
    """The error a stage's layers raised, out of the RuntimeError torch's PipelineStage wraps it in ("[Stage 0]
    failed to run forward: args: ...", "Failed to run stage backward: ...", which do not say what failed)."""
    cause = err.__cause__
    if type(err) is RuntimeError and cause is not None and any(w in str(err) for w in _WRAPPED):
        return cause
    return err


def summary(err: BaseException, stage: int, rank: int) -> str:
    """How the other stages name the failure: ``"pipeline stage 1 (rank 1) raised IndexError: ..."``."""
    msg = str(err)
    if len(msg) > _LIMIT:
        msg = msg[:_LIMIT - 3] + "..."
    return f"pipeline stage {stage} (rank {rank}) raised {type(err).__name__}: {msg}"


def announce(err: BaseException, stage: int, ranks=None) -> BaseException:
    """Stage ``stage`` of this rank raised ``err`` out of its schedule. On ranks as threads, every receive and
    collective waiting for this rank fails now, and every later one until the next round (the next cell, the next
    job), naming this stage and ``err``, as when a rank's function raises: the caller may catch ``err`` and go on,
    and the stages waiting for a transfer it will never send would otherwise wait until the deadlock detector or
    the collective timeout. A stage that raises because a peer stage failed passes that failure on, so a stage
    two transfers away hears it too. On gloo rank processes, the same through :func:`heard` and
    :func:`close_connections` with the pipe's global ``ranks`` (default: the world's). Returns the error to raise:
    ``err``, or the RankStopped naming the stage that failed first where ``err`` is its closed connection. Called
    only on the failure path: nothing is added where no stage fails."""
    comms = thread_backend.THREADS.get().comms
    if comms is None:
        return _on_processes(err, stage, ranks)
    me = rank_context.current().rank
    if me is None or isinstance(err, KeyboardInterrupt):
        return err
    with comms.sched.lock:
        if me in comms.failed:
            return err
        comms.rank_failed(me, _relayed_or_own(err, stage, me))
        # a receive posted after this (it fails at once) and transfers never taken stay behind: the next round
        # starts from fresh mailboxes
        comms.dirty = True
    return err


def _on_processes(err: BaseException, stage: int, ranks) -> BaseException:
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_backend() != "gloo":
        return err
    ranks = range(tdist.get_world_size()) if ranks is None else ranks
    err = heard(err, ranks)
    close_connections(err, stage, ranks)
    return err


def _relayed_or_own(err: BaseException, stage: int, rank: int) -> str:
    relayed = _RELAYED.match(str(err)) if isinstance(err, thread_backend.RankStopped) else None
    return relayed.group(1) if relayed else summary(err, stage, rank)


def _lost(err: BaseException) -> bool:
    try:
        return any(k in str(err) for k in _LOST)
    except Exception:
        return False


def heard(err: BaseException, ranks) -> BaseException:
    """On rank processes: ``err``, a transfer or collective of the pipe (global ``ranks``) that failed because a
    peer stage closed its connections after it failed (:func:`close_connections`), as a RankStopped naming that
    stage (as on ranks as threads); any other error as it is."""
    if isinstance(err, thread_backend.RankStopped) or not _lost(err):
        return err
    from ..watchdog import stage_failures

    said = stage_failures(ranks)
    if not said:
        return err
    own = [r for r, text in sorted(said.items()) if (m := _ORIGIN.match(text)) and int(m.group(1)) == r]
    r = own[0] if own else min(said)  # the stage that failed, else one that passed its failure on
    return thread_backend.RankStopped(f"rank {r} failed ({said[r]}); it closed its connections to this rank")


def close_connections(err: BaseException, stage: int, ranks) -> None:
    """On rank processes, ``err`` came out of this rank's pipeline stage ``stage``: record it where the pipe's other
    ranks (global ``ranks``) read it, then shut this process's sockets to theirs (on this machine), so that their
    pending gloo transfers fail at once and name it (:func:`heard`) instead of waiting for the collective timeout;
    a later collective of this rank with them raises saying so. Not for a bare lost connection (nothing to name).
    Called only on the failure path: nothing is added where no stage fails."""
    import torch.distributed as tdist

    from .. import closed, watchdog

    if isinstance(err, KeyboardInterrupt) or (_lost(err) and not isinstance(err, thread_backend.RankStopped)):
        return
    me = tdist.get_rank()
    peers = [r for r in ranks if r != me]
    text = _relayed_or_own(err, stage, me)
    if not peers or not watchdog.note_stage_failure(text):
        return
    pids = watchdog.local_pids(peers)
    port = os.environ.get("MASTER_PORT", "")
    closed.shut_sockets(pids.values(), (int(port),) if port.isdigit() else ())
    closed.close(pids, text)
