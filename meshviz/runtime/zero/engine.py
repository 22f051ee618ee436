"""The ZeRO step every layout shares: reduce gradients to their owners, clip, step the owned part, gather."""

from __future__ import annotations

__all__ = ["Zero"]


class Zero:
    """A torch optimizer (``inner``) whose ``param_groups`` hold only what this rank owns at ``level``.

    ``level``: ``"os"`` (optimizer states sharded), ``"os_g"`` (and gradients), ``"p_g_os"`` (and parameters),
    or None (nothing sharded). A layout says who owns what and how the shards move: ``_prepare`` (before the
    gradients are read), ``_sync_grads`` (every gradient reduced to the rank that steps it), ``_clip``,
    ``_inner_step`` and ``_gather`` (the stepped shards back into the parameters the model uses).
    """

    def __init__(self, inner, level):
        self._inner_opt = inner
        self.level = level

    @property
    def param_groups(self):
        return self._inner_opt.param_groups

    def step(self, closure=None):
        self._prepare()
        loss = self._before_sync(closure)
        self._sync_grads()
        self._clip()
        out = self._inner_step(closure)
        self._gather()
        return loss if out is None else out

    # the layout's parts; the defaults shard nothing
    def _prepare(self) -> None:
        pass

    def _before_sync(self, closure):
        return None

    def _sync_grads(self) -> None:
        pass

    def _clip(self):
        return None

    def _inner_step(self, closure):
        return self._inner_opt.step(closure) if closure is not None else self._inner_opt.step()

    def _gather(self) -> None:
        pass
