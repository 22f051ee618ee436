"""A pipeline stage that raises tells the stages waiting on it at once, naming itself, without any collective."""

from __future__ import annotations

import re

from ... import rank_context
from ...backends import threads as thread_backend

__all__ = ["announce", "summary", "unwrapped"]

_RELAYED = re.compile(r"rank \d+ failed \((pipeline stage \d+ \(rank \d+\) raised .*)\); ", re.S)  # a peer's failure
_WRAPPED = ("failed to run forward", "Failed to run stage backward")  # torch 2.11 to 2.15
_LIMIT = 300  # characters of the error's message kept in the record


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


def announce(err: BaseException, stage: int) -> None:
    """Stage ``stage`` of this rank raised ``err`` out of its schedule. On ranks as threads, every receive and
    collective waiting for this rank fails now, and every later one until the next round (the next cell, the next
    job), naming this stage and ``err``, as when a rank's function raises: the caller may catch ``err`` and go on,
    and the stages waiting for a transfer it will never send would otherwise wait until the deadlock detector or
    the collective timeout. A stage that raises because a peer stage failed passes that failure on, so a stage
    two transfers away hears it too. Called only on the failure path: nothing is added where no stage fails."""
    comms = thread_backend.THREADS.get().comms
    if comms is None or isinstance(err, KeyboardInterrupt):
        return
    me = rank_context.current().rank
    if me is None:
        return
    with comms.sched.lock:
        if me in comms.failed:
            return
        relayed = _RELAYED.match(str(err)) if isinstance(err, thread_backend.RankStopped) else None
        comms.rank_failed(me, relayed.group(1) if relayed else summary(err, stage, me))
        # a receive posted after this (it fails at once) and transfers never taken stay behind: the next round
        # starts from fresh mailboxes
        comms.dirty = True
