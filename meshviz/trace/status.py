"""Roll-call records: what each rank is doing (plain data), and what a set of them says about a hang."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["STATES", "RankStatus", "RollCall", "Situation", "describe", "name_ranks", "SHAPED_OPS",
           "called_differently", "call_name", "odd_ones"]

STATES = ("idle", "running", "in_collective", "dead", "unknown")

# collectives whose tensors must have the same shapes and dtypes on every member (others may differ per rank)
SHAPED_OPS = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter"})
P2P_OPS = frozenset({"send", "recv", "send_recv", "batch_isend_irecv"})  # on their peers, without a number
_MATCHING: dict[str | None, str | None] = {"send": "recv", "recv": "send"}  # what a waiting rank's peer must enter


@dataclass(frozen=True)
class RankStatus:
    """One rank's roll-call answer.

    ``state``: ``"idle"`` (nothing running), ``"running"`` (a cell or function runs, outside any collective),
    ``"in_collective"`` (inside ``op``, the ``seq``-th collective this rank entered on ``group``, for
    ``waiting_s`` seconds), ``"dead"`` (its process is gone) or ``"unknown"`` (it did not answer).
    ``where``: the user's code the rank is at (``"line 3 of the cell"``, ``"train.py:12 in step"``).
    ``entered``: (group, how many collectives this rank entered on it) for every group it used.
    ``note``: why it is idle or dead, or what kind of wait it is ("DataParallel gradients").
    ``stack``: the rank's Python stack, when asked for. ``refused``: the last call the rank refused and went on
    (``"broadcast (ValueError: ...) at line 4 of the cell"``), ``refused_entered``: its ``entered`` then.
    ``turn``: ranks as threads take turns; a ``"running"`` rank whose cell waits for its turn (to start, or to go on
    after a wait) names the rank that holds it, ``waiting_s`` how long it waited.
    """

    rank: int
    state: str
    op: str | None = None
    group: tuple | None = None
    seq: int | None = None
    waiting_s: float | None = None
    where: str | None = None
    bytes: int | None = None
    shapes: tuple | None = None
    dtypes: tuple | None = None
    cell: int | None = None
    entered: tuple = ()
    note: str | None = None
    stack: str | None = None
    refused: str | None = None
    refused_entered: tuple = ()
    turn: int | None = None

    def __post_init__(self):
        if self.state not in STATES:
            raise ValueError(f"RankStatus: state must be one of {STATES}, got {self.state!r}")

    def entered_on(self, group) -> int:
        """How many collectives this rank entered on ``group``."""
        return _count(self.entered, group)

    def refused_before(self, group, seq) -> str | None:
        """What the rank refused (and went on) as collective #``seq`` on ``group`` was its next there, else None."""
        if self.refused is None or group is None:
            return None
        then = _count(self.refused_entered, group)
        return self.refused if then == (self.entered_on(group) if seq is None else seq - 1) else None

    @property
    def collective(self) -> str | None:
        """``"all_reduce #1 on group [0, 1]"`` while in a collective."""
        return describe(self.op, self.group, self.seq) if self.state == "in_collective" else None

    def signature(self) -> str:
        """``"float32[4]"``: the dtypes and shapes of the tensors it passed."""
        if not self.shapes:
            return ""
        dts = self.dtypes or ("?",) * len(self.shapes)
        parts = [f"{d}{list(s)}" for d, s in zip(dts, self.shapes)]
        return ", ".join(parts[:3]) + (f", ... ({len(parts)} tensors)" if len(parts) > 3 else "")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("group", "shapes", "dtypes"):
            if d[k] is not None:
                d[k] = [list(x) if isinstance(x, tuple) else x for x in d[k]]
        d["entered"] = [[list(g), n] for g, n in self.entered]
        d["refused_entered"] = [[list(g), n] for g, n in self.refused_entered]
        return {k: v for k, v in d.items() if v is not None and v != []}

    @classmethod
    def from_dict(cls, d: dict) -> "RankStatus":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("group", "dtypes"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        if kw.get("shapes") is not None:
            kw["shapes"] = tuple(tuple(s) for s in kw["shapes"])
        for k in ("entered", "refused_entered"):
            kw[k] = tuple((tuple(g), int(n)) for g, n in kw.get(k, ()))
        return cls(**kw)

    def line(self) -> str:
        """One line: ``rank 0: in all_reduce #1 on group [0, 1] for 6.2 s at line 3 of the cell``."""
        if self.state == "in_collective":
            text = f"in {self.collective}"
            if self.waiting_s is not None:
                text += f" for {self.waiting_s:.1f} s"
            if self.note:
                text += f" ({self.note})"
        elif self.state == "dead":
            text = "dead" + (f" ({self.note})" if self.note else "")
        elif self.state == "running" and self.turn is not None:
            text = f"waiting for its turn for {self.waiting_s or 0.0:.1f} s (rank {self.turn} keeps it)"
        elif self.state == "running":
            text = "running"
        elif self.state == "idle":
            text = "idle" + (f" ({self.note})" if self.note else "")
        else:
            text = "did not answer"
        if self.where and self.state in ("in_collective", "running"):
            text += f" at {self.where}"
        return f"rank {self.rank}: {text}"


def _count(entered, group) -> int:
    g = tuple(group)
    for k, n in entered:
        if tuple(k) == g:
            return n
    return 0


def describe(op, group, seq) -> str:
    """``"all_reduce #1 on group [0, 1]"`` (no ``#`` when the sequence number is not known)."""
    text = str(op) if seq is None else f"{op} #{seq}"
    return text if group is None else f"{text} on group {list(group)}"


def name_ranks(rs) -> str:
    """``"rank 2"`` or ``"ranks 0, 3"``."""
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


@dataclass(frozen=True)
class Situation:
    """One hang: the collective ``op`` #``seq`` on ``group`` that ``waiting`` ranks are inside, the members that
    are not (``culprits``: rank -> (what it does instead: "idle", "running", "elsewhere", "dead", "passed" (it
    left the collective and is done) or "unknown", the detail)), or the members inside it with another op, shape or
    dtype (``mismatch``: rank -> what it entered). A situation without waiting ranks is a dead rank nobody waits
    for."""

    op: str | None
    group: tuple | None
    seq: int | None
    waiting: tuple
    waited_s: float
    culprits: dict = field(default_factory=dict)
    mismatch: dict = field(default_factory=dict)
    left: tuple = ()  # members whose count says they already passed this collective
    refused: dict = field(default_factory=dict)  # rank -> the call it refused and went on, instead of this one

    @property
    def collective(self) -> str:
        return describe(self.op, self.group, self.seq)

    @property
    def awaited(self) -> str | None:
        """What the members not inside must enter: the op itself, or a send's recv (and a recv's send)."""
        return _MATCHING.get(self.op, self.op)

    def line(self) -> str:
        """One line for the roll-call: who waits where and for how long, and what each missing member does."""
        if self.mismatch:
            return self._mismatch_line()
        if not self.waiting:
            return "; ".join(_now(r, how, what, None) for r, (how, what) in sorted(self.culprits.items()))
        head = f"{name_ranks(self.waiting)} wait{'s' if len(self.waiting) == 1 else ''} in {self.collective} for " \
               f"{self.waited_s:.1f} s"
        name = describe(self.awaited, None, self.seq)
        parts = [head] + [_now(r, how, what, name) + (f"; {self._went_on(r)}" if r in self.refused else "")
                          for r, (how, what) in sorted(self.culprits.items())]
        if not self.culprits:
            parts.append("every member entered it")
        return "; ".join(parts)

    def _mismatch_line(self) -> str:
        group = list(self.group or ())
        at = f"#{self.seq} on group {group}" if self.seq is not None else f"group {group}"
        entered = "; ".join(f"rank {r} entered {what}" + (f" ({self._went_on(r)})" if r in self.refused else "")
                            for r, what in sorted(self.mismatch.items()))
        return f"mismatch at {at}: {entered}"

    def _went_on(self, rank: int) -> str:
        return f"it refused {self.refused[rank]} and went on"

    def blame(self) -> list[str]:
        """The error's lines: each culprit ("rank 1 never entered all_reduce #1 on group [0, 1]", and where it is),
        or the mismatch, then the ranks that waited."""
        if self.mismatch:
            return [self._mismatch_line()]
        coll = describe(self.awaited, self.group, self.seq)
        out = []
        for r, (how, what) in sorted(self.culprits.items()):
            never = f"rank {r} never entered {coll}"
            went = f": {self._went_on(r)}" if r in self.refused else ""
            then = ";" if went else ":"
            if not self.waiting:
                out.append(_now(r, how, what, None))
            elif how == "elsewhere":
                out.append(f"{never}{went}{then} it is elsewhere, in {what}")
            elif how == "running":
                out.append(f"{never}{went}; it is running at {what or 'an unknown place'}")
            elif how == "idle":
                out.append(f"{never}{went} (idle: {what or 'it runs nothing'})")
            elif how == "dead":
                out.append(f"{never}{went}{then} it is dead" + (f" ({what})" if what else ""))
            elif how == "passed":
                out.append(f"rank {r} passed {coll} without the ranks still in it and is done"
                           + (f" ({what})" if what else "") + ": its call was paired with another (a different "
                           "size?); check_collectives names the difference")
            else:
                out.append(f"{never}{went} (it did not answer the roll-call)")
        if self.waiting:
            out.append(f"{name_ranks(self.waiting)} waited in {self.collective} for {self.waited_s:.1f} s")
        return out


def _now(rank: int, how: str, what, name) -> str:
    """What member ``rank`` does, for a roll-call line (``name``: the collective it is missing from)."""
    if how == "dead":
        return f"rank {rank} is dead" + (f" ({what})" if what else "")
    if how == "elsewhere":
        return f"rank {rank} is elsewhere: in {what}"
    if how == "passed":
        return f"rank {rank} passed {name or 'it'} and is done" + (f" ({what})" if what else "")
    if how == "idle":
        return f"rank {rank} is idle: {what or 'it runs nothing'}" + (f" without entering {name}" if name else "")
    if how == "running":
        return f"rank {rank} is running at {what or 'an unknown place'}" + (
            f": it never entered {name}" if name else "")
    return f"rank {rank} did not answer the roll-call"


def call_name(op: str, reduce_op: str | None = None, root=None) -> str:
    """``op`` with its reduce op and root where they are what differs: ``"all_reduce(max)"``, ``"reduce(dst=1)"``."""
    name = op + (f"({reduce_op})" if reduce_op is not None else "")
    if root is not None:
        name += f"({'dst' if op.startswith(('reduce', 'gather')) else 'src'}={root})"
    return name


def odd_ones(ranks, keys) -> list[int]:
    """The ranks whose key differs from the most common one (all of them when no one key is the most common)."""
    keys = list(keys)
    most = max(keys.count(k) for k in keys)
    tops = [k for i, k in enumerate(keys) if keys.count(k) == most and keys.index(k) == i]
    return [r for r, k in zip(ranks, keys) if len(tops) > 1 or k != tops[0]]


def called_differently(group, seq, op: str, calls: dict) -> tuple[str, list[int]]:
    """The members of collective ``op`` #``seq`` (None: not known) on ``group`` called it with arguments that differ
    where every member's must agree: the line naming each one's, as the gloo match check words it, and the ranks
    whose call differs from the most common one (all when none is). ``calls``: rank -> (reduce op or None, root or
    None, shapes, dtypes, key), the reduce op and root named where they differ, ``key`` what must agree."""
    rows = list(calls.values())
    reduces, roots = (len({row[i] for row in rows}) > 1 for i in (0, 1))
    entered = []
    for r, (rop, root, shapes, dtypes, _) in sorted(calls.items()):
        sig = RankStatus(r, "idle", shapes=tuple(shapes), dtypes=tuple(dtypes)).signature()
        name = call_name(op, rop if reduces else None, root if roots else None)
        entered.append(f"rank {r} entered {name} {sig}".rstrip() if reduces or roots else
                       f"rank {r} entered {name} with {sig}")
    odd = odd_ones(sorted(calls), [calls[r][4] for r in sorted(calls)])
    return f"mismatch at {f'#{seq} on ' if seq is not None else ''}group {list(group)}: " + "; ".join(entered), odd


class RollCall(Sequence):
    """Every rank's :class:`RankStatus` (indexed by position, rank order), taken at ``taken`` (``time.time()``),
    and what they say: :meth:`situations` (hangs and mismatches), :meth:`lines`, :meth:`culprits`."""

    def __init__(self, statuses, taken: float | None = None, title: str | None = None):
        self.statuses = tuple(sorted(statuses, key=lambda s: s.rank))
        self.taken = time.time() if taken is None else taken
        self.title = title

    # -- a sequence of RankStatus ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.statuses)

    def __getitem__(self, i):
        return self.statuses[i]

    def __iter__(self) -> Iterator[RankStatus]:
        return iter(self.statuses)

    def by_rank(self) -> dict[int, RankStatus]:
        return {s.rank: s for s in self.statuses}

    @property
    def states(self) -> dict[int, str]:
        return {s.rank: s.state for s in self.statuses}

    def to_dicts(self) -> list[dict]:
        return [s.to_dict() for s in self.statuses]

    @classmethod
    def from_dicts(cls, ds, taken: float | None = None) -> "RollCall":
        return cls([RankStatus.from_dict(d) for d in ds], taken)

    def merged(self, others) -> "RollCall":
        """This roll-call with ``others`` (RankStatus) replacing the ranks they name."""
        by = self.by_rank()
        for s in others:
            by[s.rank] = s
        return RollCall(by.values(), self.taken, self.title)

    # -- what it says ---------------------------------------------------------------------------------------
    def waiting(self, after: float = 0.0) -> list[RankStatus]:
        """Ranks inside a collective for at least ``after`` seconds."""
        return [s for s in self.statuses if s.state == "in_collective" and (s.waiting_s or 0.0) >= after]

    def held_back(self, after: float = 0.0) -> list[RankStatus]:
        """Ranks as threads waiting for their turn for at least ``after`` seconds (another rank keeps it)."""
        return [s for s in self.statuses if s.turn is not None and (s.waiting_s or 0.0) >= after]

    def hung(self, after: float) -> bool:
        return bool(self.waiting(after) or self.held_back(after))

    def situations(self) -> list[Situation]:
        """One Situation per collective some rank is inside (with a known group), in order of its lowest rank."""
        by = self.by_rank()
        inst: dict = {}
        for s in self.statuses:
            if s.state != "in_collective" or s.group is None:
                continue
            op = "p2p" if s.op in P2P_OPS else s.op  # a send and the recv it waits for are one situation
            key = (tuple(s.group), s.seq) if s.seq is not None else (tuple(s.group), None, op)
            inst.setdefault(key, []).append(s)
        out = []
        for key, inside in sorted(inst.items(), key=lambda kv: min(s.rank for s in kv[1])):
            group, seq = key[0], key[1]
            first = inside[0]
            mismatch = {}
            ops = {s.op for s in inside}
            if len(ops) > 1 and not ops <= P2P_OPS:
                mismatch = {s.rank: f"{s.op} {s.signature()}".rstrip() for s in inside}
            elif first.op in SHAPED_OPS and len({(s.shapes, s.dtypes) for s in inside if s.shapes}) > 1:
                mismatch = {s.rank: f"{s.op} with {s.signature()}" for s in inside}
            members = [r for r in group if r not in {s.rank for s in inside}]
            culprits, left = {}, []
            for m in members:
                why = _absent(by.get(m), group, seq)
                if why is None and by[m].state in ("idle", "dead"):
                    # it passed this collective and is done: the call it was paired with was not this one (gloo
                    # pairs calls of one op whatever their sizes), so nothing can end the wait
                    culprits[m] = ("passed", by[m].note)
                elif why is None:
                    left.append(m)
                else:
                    culprits[m] = why
            waited = max((s.waiting_s or 0.0) for s in inside)
            refused = {r: by[r].refused_before(group, seq) for r in [*mismatch, *culprits]
                       if r in by and culprits.get(r, ("",))[0] != "passed"}
            also = {s.refused for s in inside if s.rank not in mismatch}  # the waiting ranks refused it too
            out.append(Situation(first.op, group, seq, tuple(sorted(s.rank for s in inside)), waited, culprits,
                                 mismatch, tuple(left), {r: t for r, t in refused.items() if t and t not in also}))
        for s in self.statuses:  # a dead rank nobody waits for is still news
            if s.state == "dead" and not any(s.rank in x.culprits for x in out):
                out.append(Situation(None, None, None, (), 0.0, {s.rank: ("dead", s.note)}))
        return out

    def mismatches(self) -> list[Situation]:
        return [x for x in self.situations() if x.mismatch]

    def stuck(self) -> list[Situation]:
        """The waits nothing can end where idle means done (a rank process whose function or script returned):
        every member missing from the collective is idle or dead, or passed it and is done."""
        return [x for x in self.situations() if x.waiting and x.culprits and not x.mismatch
                and all(how in ("idle", "dead", "passed") for how, _ in x.culprits.values())]

    def culprits(self) -> list[int]:
        """The ranks to blame: members missing from a collective others wait in, and the ranks of a mismatch."""
        out = set()
        for x in self.situations():
            out |= set(x.mismatch) | set(x.culprits)
        return sorted(out)

    def lines(self) -> list[str]:
        """One line per situation (a hang, a mismatch, a dead rank, ranks as threads waiting for the turn another
        keeps); ``[]`` when nothing is wrong."""
        by = self.by_rank()
        turns: dict[int | None, list[RankStatus]] = {}  # holder -> the ranks waiting for their turn
        for s in self.held_back():
            turns.setdefault(s.turn, []).append(s)
        held = [f"{name_ranks([s.rank for s in ss])} wait{'s' if len(ss) == 1 else ''} for the turn for "
                f"{max(s.waiting_s or 0.0 for s in ss):.1f} s; rank {h} keeps it" + (
                    f", running at {by[h].where}" if h in by and by[h].where else "")
                + " (ranks as threads take turns)" for h, ss in sorted(turns.items())]
        return [x.line() for x in self.situations()] + held

    def blame(self) -> list[str]:
        """The lines an error shows: who never entered (and where it is), who waited."""
        return [ln for x in self.situations() for ln in x.blame()]

    def gist(self) -> tuple:
        """What this roll-call says, without the seconds that change every time (equal gists: nothing new)."""
        return tuple((s.rank, s.state, s.op, s.seq, s.where) for s in self.statuses) + tuple(
            (x.op, x.seq, tuple(sorted(x.culprits)), bool(x.mismatch)) for x in self.situations())

    def text(self) -> str:
        head = self.title or f"roll-call of {len(self)} ranks"
        return "\n".join([head] + [f"  {s.line()}" for s in self.statuses] + [f"  - {ln}" for ln in self.lines()])

    def __repr__(self) -> str:
        return self.text()


def _absent(s: RankStatus | None, group, seq):
    """(how, detail) for a member that is not inside collective #``seq`` on ``group`` (None: it already passed)."""
    if s is None or s.state == "unknown":
        return ("unknown", None)
    if s.state == "dead":
        return ("dead", s.note)
    if s.state == "in_collective":
        return ("elsewhere", describe(s.op, s.group, s.seq) + (f" at {s.where}" if s.where else ""))
    if seq is not None and s.entered_on(group) >= seq:
        return None
    if s.state == "idle":
        return ("idle", s.note)
    if s.turn is not None:
        return ("running", f"{s.where or 'the start of its cell'}, waiting for its turn (rank {s.turn} keeps it)")
    return ("running", s.where)
