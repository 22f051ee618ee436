"""Pure pipeline schedules: orders written out by hand, every block once and runnable, one bubble formula."""

import itertools

import pytest

from meshviz.core.schedule import (
    bubble_formula,
    fthenb_order,
    interleaved_order,
    one_f_one_b_order,
    schedule_orders,
)


def F(s, i):
    return ("F", s, i)


def B(s, i):
    return ("B", s, i)


def test_small_orders_written_out():
    # 1F1B, 3 stages, 4 micro-batches: stage d warms up with p-d forwards, then alternates
    assert one_f_one_b_order(3, 4, 0) == [F(0, 0), F(0, 1), F(0, 2), B(0, 0), F(0, 3), B(0, 1), B(0, 2), B(0, 3)]
    assert one_f_one_b_order(3, 4, 1) == [F(1, 0), F(1, 1), B(1, 0), F(1, 2), B(1, 1), F(1, 3), B(1, 2), B(1, 3)]
    assert one_f_one_b_order(3, 4, 2) == [F(2, 0), B(2, 0), F(2, 1), B(2, 1), F(2, 2), B(2, 2), F(2, 3), B(2, 3)]
    # fewer micro-batches than stages: all forwards, then all backwards
    assert one_f_one_b_order(4, 2, 1) == [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]
    # FThenB with 2 chunks on 2 stages: position 1 holds virtual stages 1 and 3
    assert fthenb_order(2, 2, 1, v=2) == [F(1, 0), F(1, 1), F(3, 0), F(3, 1), B(3, 0), B(3, 1), B(1, 0), B(1, 1)]
    # interleaved 1F1B, 2 stages, 2 micro-batches, 2 chunks
    assert interleaved_order(2, 2, 2, 0) == [F(0, 0), F(0, 1), F(2, 0), F(2, 1), B(2, 0), B(2, 1), B(0, 0), B(0, 1)]
    assert interleaved_order(2, 2, 2, 1) == [F(1, 0), F(1, 1), F(3, 0), B(3, 0), F(3, 1), B(3, 1), B(1, 0), B(1, 1)]


def _runs(orders, p, v):
    """Execute the orders on an ideal machine, one block per position per tick; False on a deadlock."""
    done, pos = set(), [0] * p
    while any(pos[d] < len(orders[d]) for d in range(p)):
        ready = []
        for d in range(p):
            if pos[d] == len(orders[d]):
                continue
            ph, s, i = orders[d][pos[d]]
            deps = [F(s - 1, i)] if ph == "F" and s > 0 else []
            if ph == "B":
                deps = [F(s, i)] + ([B(s + 1, i)] if s < p * v - 1 else [])
            if all(x in done for x in deps):
                ready.append(d)
        if not ready:
            return False
        for d in ready:
            done.add(orders[d][pos[d]])
            pos[d] += 1
    return True


@pytest.mark.parametrize("name", ["FThenB", "1F1B", "VPP"])
def test_every_block_once_on_its_position_and_runnable(name):
    for p, m, v in itertools.product(range(1, 6), range(1, 9), range(1, 4)):
        if name == "1F1B" and v > 1 or name == "VPP" and m % p:
            continue
        orders = schedule_orders(name, p, m, v)
        assert len(orders) == p
        for d, order in enumerate(orders):
            want = {(ph, c * p + d, i) for ph in "FB" for c in range(v) for i in range(m)}
            assert len(order) == len(want) and set(order) == want, (name, p, m, v, d)
        assert _runs(orders, p, v), (name, p, m, v)


def test_names_and_bad_input():
    assert schedule_orders("gpipe", 2, 3) == schedule_orders("FThenB", 2, 3)
    assert schedule_orders("1f1b", 2, 4, 2) == schedule_orders("Interleaved-1F1B", 2, 4, 2)  # 1F1B with chunks
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_orders("2F2B", 2, 2)
    with pytest.raises(ValueError, match="divisible"):
        schedule_orders("VPP", 3, 4, 2)
    with pytest.raises(ValueError, match="out of range"):
        one_f_one_b_order(2, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        fthenb_order(2, 0, 0)


def test_one_bubble_formula_everywhere():
    import meshviz.distributed.pipeline as pipeline
    import meshviz.widgets as widgets

    assert pipeline.bubble_formula is widgets.bubble_formula is bubble_formula
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
    assert bubble_formula(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_formula(1, 5) == 0.0
    for bad in ((0, 4), (4, 0), (4, 8, 0), (-1, 2)):
        with pytest.raises(ValueError, match="must be >= 1"):
            bubble_formula(*bad)


def test_fleet_stage_1_owners_are_paddles():
    from meshviz.core.sharding import owners_by_size

    # largest first (ties in order), each to the rank with the fewest elements so far (ties: the lower rank)
    assert owners_by_size([10, 30, 20, 30, 5], 2) == [1, 0, 0, 1, 1]
    assert owners_by_size([60, 10, 30, 3], 2) == [0, 1, 1, 1]
    assert owners_by_size([4, 4, 4], 4) == [0, 1, 2]
    assert owners_by_size([], 3) == []
    with pytest.raises(ValueError, match="nranks"):
        owners_by_size([1], 0)
