"""Which nn.Module is running: global module hooks that keep each rank's module stack and the autograd nodes each
module call made, so that a traced collective names the module whose forward or backward issued it (installed only
while tracing is on)."""

from __future__ import annotations

import weakref
from bisect import bisect_right
from operator import attrgetter

from torch.nn.modules import module as _nn

from .. import compat, trace
from ..compat.dynamo import eager
from . import rollcall

__all__ = ["module_name", "installed", "backward_issuer"]

_WRAPPERS = {"DataParallel", "DistributedDataParallel", "OptimizedModule", "FullyShardedDataParallel"}
_SKIP = {"module", "_layers", "_orig_mod", "_fsdp_wrapped_module", "_ddp"}  # wrappers' own attribute names
_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_handles: list = []


def module_name(module, parent: str | None = None, parent_module=None) -> str:
    """A module's name: its class at the top (``"MLP"``), else its parent's name and its path below it
    (``"MLP.fc1"``), wrappers' own attributes left out (``DataParallel(net).fc1`` is ``"DataParallel.fc1"``)."""
    name = _names.get(module)
    if name is not None:
        return name
    if parent is None:
        name = type(module).__name__
    else:
        path = None
        if parent_module is not None:
            for p, m in parent_module.named_modules():
                if m is module:
                    path = p
                    break
        if path is None:  # not below the running module (a wrapper's inner copy): it stands for the parent
            name = parent
        else:
            parts = [x for x in path.split(".") if x not in _SKIP or type(parent_module).__name__ not in _WRAPPERS]
            name = ".".join([parent] + parts) if parts else parent
    try:
        _names[module] = name
    except TypeError:
        pass
    return name


_seq = compat.autograd_sequence_nr
# module calls a rank keeps the spans of (about 130 bytes each), those of its latest outermost calls; the oldest half
# goes when it is over, and a backward of an older one names no module
SPANS = 1 << 15
_FIRST = attrgetter("first")
RECENT = 64  # outermost calls looked through one by one where bisecting misses (module calls on several threads)


class _Forward:
    """One outermost module call: ``first``, the number of the first node it could make; ``spans``, (first node
    number, -number after its last, name) of each module call in it that made autograd nodes, in the order they
    ended (the outermost call last, holding all the others); ``upto``: the rank's spans so far, these included;
    ``index``: made at need."""

    __slots__ = ("first", "spans", "upto", "index")

    def __init__(self, first: int):
        self.first, self.spans, self.upto, self.index = first, [], 0, None

    def holds(self, seq: int) -> bool:
        spans = self.spans
        return bool(spans) and spans[-1][0] <= seq < -spans[-1][1]

    def issuer(self, seq: int) -> str | None:
        """The innermost module call in it that made node ``seq``."""
        if self.index is None:
            # module calls nest; sorted by first node (the outer first where two start alike: the inner one was
            # added first), a span's parent is the nearest span before it that has not ended where it starts
            order = [sp for _, sp in sorted(((sp[0], sp[1], -i), sp) for i, sp in enumerate(self.spans))]
            parents: list[int] = []
            open_: list[int] = []
            for i, (first, _, _) in enumerate(order):
                while open_ and -order[open_[-1]][1] <= first:
                    open_.pop()
                parents.append(open_[-1] if open_ else -1)
                open_.append(i)
            self.index = ([sp[0] for sp in order], order, parents)
        firsts, order, parents = self.index
        i = bisect_right(firsts, seq) - 1
        while i >= 0 and -order[i][1] <= seq:  # it ended before the node was made: the node is an outer call's
            i = parents[i]
        return order[i][2] if i >= 0 else None


def _pre(module, args):
    rec = rollcall.current()
    stack = rec.modules
    first = _seq()
    if stack:
        top = stack[-1]
        name = _names.get(module) or module_name(module, top[0], top[1]())
    else:
        name = _names.get(module) or module_name(module)
        rec.spans.append(_Forward(first))
    stack.append((name, weakref.ref(module), first))


def _post(module, args, output):
    rec = rollcall.current()
    stack = rec.modules
    if not stack:
        return
    name, _, first = stack.pop()
    end = _seq()
    forwards = rec.spans
    if end > first and forwards:  # it made autograd nodes: their backward is this module's (no hook per output)
        forwards[-1].spans.append((first, -end, name))
    if not stack and forwards:
        fw = forwards[-1]
        if not fw.spans:
            forwards.pop()  # it made no nodes (no grad): nothing to name
            return
        fw.upto = len(fw.spans) + (forwards[-2].upto if len(forwards) > 1 else 0)
        if fw.upto - forwards[0].upto > SPANS:
            del forwards[: len(forwards) // 2]


_owners: dict = {}  # id of a parameter -> (weakref to it, the name of the module that holds it)


def _owner(param) -> str | None:
    """The module, among those seen running, that holds ``param`` itself."""
    known = _owners.get(id(param))
    if known is not None and known[0]() is param:
        return known[1]
    name = None
    for ref in _names.keyrefs():  # a copy made at once: another rank thread may name a module meanwhile
        m = ref()
        if m is not None and any(p is param for p in m._parameters.values()):
            name = _names.get(m)
            break
    if len(_owners) >= 1 << 16:
        _owners.clear()
    _owners[id(param)] = (weakref.ref(param), name)
    return name


def backward_issuer(rec) -> tuple[str | None, bool]:
    """(the module whose forward made the autograd node running now, True) in a backward, else (None, False): a
    gradient's own hook (its node accumulates a parameter) names the module that holds the parameter."""
    if not compat.in_backward():
        return None, False
    node = compat.running_node()
    if node is None:
        return None, True
    try:  # a name is a nicety: never let it break the collective that asks
        if type(node).__name__ == "AccumulateGrad":
            return _owner(node.variable), True
        seq = node._sequence_nr()
        forwards = rec.spans
        # a rank's outermost calls are in node order where one thread made them all: bisect, then look through the
        # latest ones
        i = bisect_right(forwards, seq, key=_FIRST) - 1
        if i >= 0 and forwards[i].holds(seq):
            return forwards[i].issuer(seq), True
        for fw in forwards[: -RECENT - 1: -1]:
            if fw.holds(seq):
                return fw.issuer(seq), True
    except Exception:
        pass
    return None, True


rollcall.backward_issuer = backward_issuer


_EAGER_PRE, _EAGER_POST = eager(_pre), eager(_post)


def installed() -> bool:
    return bool(_handles)


def _switch(on: bool) -> None:
    if on and not _handles:
        # run eagerly under torch.compile: bookkeeping, and a weak dict that garbage collection may shrink while
        # dynamo iterates it ("dictionary changed size during iteration")
        _handles.append(_nn.register_module_forward_pre_hook(_EAGER_PRE))
        _handles.append(_nn.register_module_forward_hook(_EAGER_POST, always_call=True))
    elif not on and _handles:
        for h in _handles:
            h.remove()
        _handles.clear()


trace.on_active(_switch)
