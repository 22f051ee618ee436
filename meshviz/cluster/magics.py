"""``%px`` / ``%%px`` for a Cluster: ipyparallel's magics, with failures reported by rank and output in rank order."""

from __future__ import annotations

import sys

from ipyparallel.client.magics import ParallelMagics

from .config import OUTPUT_WAIT
from .rank_output import RankOrderedOutput

__all__ = ["RankMagics"]


class RankMagics(ParallelMagics):
    """ParallelMagics whose blocking execution waits on the Cluster: a failure names the rank that caused it,
    a dead engine is reported instead of waited on, Ctrl-C reaches the engines, and the cell's events have
    arrived when the cell returns."""

    def __init__(self, shell, view, suffix="", cluster=None):
        self.cluster = cluster
        super().__init__(shell, view, suffix)

    def parallel_execute(self, cell, block=None, groupby="type", save_name=None, stream_output=None,
                         progress_after=None, signal_on_interrupt=None):
        block = self.view.block if block is None else block
        cluster = self.cluster
        if cluster is None or not block:
            if cluster is not None:
                cluster._prepare()
            return super().parallel_execute(cell, block=block, groupby=groupby, save_name=save_name,
                                            stream_output=stream_output, progress_after=progress_after,
                                            signal_on_interrupt=signal_on_interrupt)
        stream_output = self.stream_output if stream_output is None else stream_output
        mark = cluster._prepare()
        result = self.view.execute(cell, silent=False, block=False)
        result._fname = "%px"
        self.last_result = result
        if save_name:
            self.shell.user_ns[save_name] = result
        error = None
        # ranks print in any order (and engines' output arrives in any order): show it rank by rank, live in a
        # notebook when streaming, at the end otherwise
        ordered = RankOrderedOutput(result, cluster) if stream_output else None
        try:
            try:
                cluster._finish(result, None, tick=ordered.update if ordered is not None else None, mark=mark)
            except Exception as e:  # RankError, shown after the outputs
                error = e
            if result.done():
                result.wait_for_output(OUTPUT_WAIT if error is None else 1)
        finally:
            if ordered is not None:
                ordered.finish(groupby)
            else:
                result.display_outputs(groupby)
            sys.stdout.flush()
        if error is not None:
            raise error from None
