"""Settings every rank of a group must share, compared once (one small all-gather) before anything is built."""

from __future__ import annotations

import zlib

import torch

from .. import compat
from ..rank_context import current as rank_context
from ..rank_context import getenv
from ..trace.status import name_ranks
from . import rollcall

__all__ = ["same_on_every_rank", "same_or_refused", "alone"]


def _code(v) -> int:
    return int(v) if isinstance(v, int) else zlib.crc32(repr(v).encode())


def same_on_every_rank(who: str, settings: dict, pg=None, ranks=None) -> None:
    """Raise ValueError on every rank of process group ``pg`` (the world by default; ``ranks``: its global ranks)
    naming which ranks were given what, where their ``settings`` differ. An int or a bool is shown as it is; anything
    else by this rank's own value, the others' as "another" (a rank only sees a checksum of theirs)."""
    import torch.distributed as tdist

    pg = pg or tdist.group.WORLD
    n = tdist.get_world_size(pg)
    if n < 2:
        return
    ranks = list(range(n)) if ranks is None else list(ranks)
    mine = [_code(v) for v in settings.values()]
    out = torch.empty(n * len(mine), dtype=torch.int64)
    rec = rollcall.current()  # shown in the roll-call (a rank that never comes is named), not numbered
    prev = rec.enter(f"{who} (its settings check)", tuple(ranks), counted=False)
    try:
        compat.all_gather_single(out, torch.tensor(mine, dtype=torch.int64), group=pg)
    except BaseException as e:
        rec.fail(e)
        raise
    finally:
        rec.leave(prev)
    rows = [tuple(r) for r in out.view(n, len(mine)).tolist()]
    if len(set(rows)) == 1:
        return
    differ = [i for i in range(len(mine)) if len({r[i] for r in rows}) > 1]
    names = list(settings)
    kinds: dict = {}
    for rank, row in zip(ranks, rows):
        kinds.setdefault(row, []).append(rank)

    def shown(i, code):
        v = settings[names[i]]
        if isinstance(v, int):
            return f"{names[i]} {bool(code) if isinstance(v, bool) else code}"
        return f"{names[i]} {v!r}" if _code(v) == code else f"another {names[i]}"

    parts = [f"{name_ranks(rs)}: " + ", ".join(shown(i, row[i]) for i in differ) for row, rs in kinds.items()]
    raise ValueError(f"{who}: the ranks were given different settings (every rank needs the same): "
                     + "; ".join(parts))


def same_or_refused(who: str, settings: dict, refused: Exception | None, pg=None, ranks=None) -> dict:
    """:func:`same_on_every_rank`, where this rank may have refused its arguments (``refused``: its own error, None
    where it accepted them): that rank takes part too, so the others raise naming it rather than wait for it in a
    later collective, and it raises its own error. Returns the settings compared (with the "arguments accepted" one)."""
    settings = {"arguments accepted (a refusing rank raises why)": refused is None, **settings}
    try:
        same_on_every_rank(who, settings, pg, ranks)
    except ValueError:
        if refused is None:
            raise
    if refused is not None:
        raise refused
    return settings


def alone() -> bool:
    """Whether no other rank can wait for this one: no process group started, and none to join but one of this
    process alone (not a rank thread, no WORLD_SIZE above 1). A refusal there may raise before starting one."""
    import torch.distributed as tdist

    size = getenv("WORLD_SIZE") or getenv("PADDLE_TRAINERS_NUM") or "1"
    return not tdist.is_initialized() and rank_context().init is None and size.strip() == "1"
