"""RankState: one typed slot per concern, one value per rank context."""

import threading
from dataclasses import dataclass, field

import pytest

from meshviz import rank_context
from meshviz.rank_context import RankContext, RankState, bound


@dataclass
class _Probe:
    items: list = field(default_factory=list)


PROBE = rank_context.slot("test_probe", _Probe)


def test_each_rank_context_has_its_own_value():
    a, b = RankContext(0), RankContext(1)
    with bound(a):
        PROBE.get().items.append("a")
    seen = []

    def rank1():
        with bound(b):
            PROBE.get().items.append("b")
            seen.append(list(PROBE.get().items))

    t = threading.Thread(target=rank1)
    t.start()
    t.join()
    assert seen == [["b"]] and PROBE.get(a).items == ["a"] and a.state.test_probe is PROBE.get(a)
    with bound(a):
        fresh = PROBE.reset()
        assert PROBE.get() is fresh and fresh.items == []
    assert PROBE.get(b).items == ["b"]


def test_slots_are_listed_and_unique():
    import meshviz.distributed  # noqa: F401  (registers the runtime's slots)

    names = RankState.slots()
    assert {"groups", "trace", "rollcall", "fleet", "rng", "mesh", "world", "match", "test_probe"} <= set(names)
    ctx = RankContext(3)
    ctx.state.get(PROBE)
    assert repr(ctx.state).startswith("RankState(test_probe; not made yet: ")
    with pytest.raises(ValueError, match="already registered"):
        rank_context.slot("groups", _Probe)
    with pytest.raises(AttributeError, match="no rank state slot 'nope'"):
        ctx.state.nope  # noqa: B018


def test_checking_and_fail_hooks_stay_with_their_rank():
    from meshviz.runtime import match, rollcall

    process_on = match.checking()
    a, b = RankContext(0), RankContext(1)
    with bound(a):
        assert match.checking() == process_on  # a rank that never chose follows the process
        match.set_checking(not process_on)
        rollcall._state().fail_hooks.append(print)
    with bound(b):
        assert match.checking() == process_on and rollcall._state().fail_hooks == []
    assert match.checking() == process_on and print not in rollcall._state().fail_hooks
    with bound(a):
        assert match.checking() == (not process_on) and rollcall._state().fail_hooks == [print]
