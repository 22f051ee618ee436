"""PipelineView over stages, not ranks; the schedule clock of simulated ranks; one pipeline's rows at 1,024 ranks."""

from __future__ import annotations

import json

import pytest

from meshviz.core.schedule import bubble_formula, ideal_replay, schedule_orders
from meshviz.trace import Event, Mark, from_json, to_json
from meshviz.widgets import PipelineView, synthetic_schedule
from meshviz.widgets.base import png_size

MARK = Event(kind="mark", op="what_if", rank=0, seq=-1, start=0.0, payload=Mark(fields={"nranks": 4}))


def _pipes(p, m, dp, schedule="1F1B", v=1):
    """``dp`` pipelines of ``p`` stages, rank ``d + dp * s`` at stage s of pipeline d (pp outer, as fleet's)."""
    return [e for d in range(dp) for e in synthetic_schedule(p, m, schedule, v, ranks=[d + dp * s for s in range(p)])]


def _simulated(events):
    """The events as ``what_if`` leaves them: each rank's numbered from 0 in its order and run after the rank
    before it (0.01 s an event), so rank 1's first forward starts after rank 0's last backward."""
    out, clock = [], 100.0
    for r in sorted({e.rank for e in events}):
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.seq)
        for i, e in enumerate(mine):
            out.append(Event(**{**e.__dict__, "seq": i, "start": clock, "end": clock + 0.01}))
            clock += 0.01
    return out


def _times(blocks):
    """(rank, phase, stage, micro-batch) -> (start, end), rounded; a repeat (a later step) under its own key."""
    out: dict = {}
    for b in sorted(blocks, key=lambda b: b["start"]):
        key = (b["rank"], b["phase"], b["stage"], b["micro_batch"])
        while key in out:
            key += ("again",)
        out[key] = (round(b["start"], 9), round(b["end"], 9))
    return out


def test_the_formula_counts_stages_not_ranks():
    """dp 2 x pp 2, m 4: p is 2 stages, (p-1)/(m+p-1) = 20% (was 42.9%, p = 4 ranks)."""
    view = PipelineView(_pipes(2, 4, 2), schedule="1F1B")
    assert view.formula == pytest.approx(0.2) and view.stage_count == 2
    assert view.bubble == pytest.approx(0.2)
    assert view._headline().startswith("1F1B · 2 stages × 2 pipelines (4 ranks), 4 micro-batches")
    vpp = PipelineView(_pipes(4, 8, 2, "VPP", 2))  # 8 virtual stages, 2 a rank: 4 stages
    assert vpp.formula == pytest.approx(3 / 19) == pytest.approx(bubble_formula(4, 8, 2)) and vpp.stage_count == 4
    assert PipelineView(synthetic_schedule(2, 4))._headline().startswith("2 stage ranks, 4 micro-batches")
    plain = [Event(kind="compute", rank=r, start=0.0, end=1.0) for r in range(3)]  # no stages: the ranks
    assert PipelineView(plain).stage_count == 3


def test_simulated_events_are_laid_out_on_the_schedule_clock():
    """Events of ranks simulated one after another, with what_if's marker: the blocks start where the ideal 1F1B
    schedule starts them (not 'bubble measured 93.7%', arrows running backwards); 'measured' keeps the times."""
    ideal = synthetic_schedule(2, 4, "1F1B")
    sim = [MARK] + _simulated(ideal)
    view = PipelineView(sim)
    assert view.bubble == pytest.approx(0.2) == pytest.approx(view.formula)
    assert view.clock == "schedule" and view.simulated
    blocks, transfers, comms = view.laid_out()
    assert _times(blocks) == (_times(PipelineView(ideal).blocks))
    assert "bubble of the schedule 20.0%" in view._headline()
    assert view._headline().endswith("· 2 of 4 ranks simulated")  # MARK's what-if had 4 ranks, 2 simulated
    at = _times(blocks)  # a transfer runs from its sending block's end to its receiving block's start
    want = sorted((e.rank, at[(e.rank, e.payload.phase, e.rank, e.payload.micro_batch)][1],
                   at[(e.peer, e.payload.phase, e.peer, e.payload.micro_batch)][0]) for e in ideal if e.kind == "send")
    assert sorted((t["src"], t["start"], t["end"]) for t in transfers) == want
    assert want[:2] == [(0, 1.0, 1.0), (0, 2.0, 4.0)]  # F1 is sent at 2 and used at 4, after rank 1's B0
    assert all(t["end"] >= t["start"] for t in transfers) and len(transfers) == 8
    fig = view.figure()
    assert fig.axes[0].get_xlabel() == "schedule time (forward = 1; simulated ranks have no clock)"
    measured = PipelineView(sim, clock="measured")
    assert measured.clock == "measured" and measured.bubble > 0.5
    asked = PipelineView(_simulated(ideal), clock="schedule")  # no marker, asked for
    assert asked.bubble == pytest.approx(0.2) and asked.figure().axes[0].get_xlabel() == "schedule time (forward = 1)"
    assert PipelineView(_simulated(ideal)).clock == "measured"
    with pytest.raises(ValueError, match="clock"):
        PipelineView(ideal, clock="wall")


def test_two_pipelines_two_steps_and_collectives_on_the_schedule_clock():
    """dp 2 x pp 2 run twice: each pipeline replays alone, step 2 after step 1; a collective after a block sits
    at its end; the bubble is the formula's."""
    one = synthetic_schedule(2, 4, "1F1B")
    step2 = [Event(**{**e.__dict__, "seq": e.seq + 1000}) for e in one]
    events = []
    for d in range(2):
        for e in one + step2:
            events.append(Event(**{**e.__dict__, "rank": e.rank * 2 + d,
                                   "peer": None if e.peer is None else e.peer * 2 + d}))
    events.append(Event(kind="collective", rank=0, op="all_reduce", seq=999, start=0.0, end=1.0))
    view = PipelineView([MARK] + _simulated(events))
    assert view.bubble == pytest.approx(0.2) == pytest.approx(view.formula)
    assert view.pipelines() == [[0, 2], [1, 3]]
    blocks, _, comms = view.laid_out()
    ends = sorted(b["end"] for b in blocks if b["rank"] == 0)
    assert ends[-1] == pytest.approx(30.0) and ends[7] == pytest.approx(15.0)  # step 1 ends at 15, step 2 at 30
    assert [(c["start"], c["end"]) for c in comms] == [(15.0, 15.0)]


def test_ideal_replay_splits_the_backward_with_w_and_never_hangs():
    rows = {0: [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)],
            1: [("F", 1, 0), ("B", 1, 0), ("W", 1, 0), ("F", 1, 1), ("B", 1, 1), ("W", 1, 1)]}
    got = ideal_replay(rows)
    assert got[1] == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert got[0] == [(0, 1), (1, 2), (3, 4), (4, 5), (6, 7), (7, 8)]
    orders = schedule_orders("VPP", 2, 4, 2)
    vpp = ideal_replay(dict(enumerate(orders)), chunks=2)
    ideal = _times(PipelineView(synthetic_schedule(2, 4, "VPP", 2)).blocks)
    assert {(r, *b): t for r in vpp for b, t in zip(orders[r], vpp[r])} == ideal
    stuck = ideal_replay({0: [("B", 0, 0), ("F", 0, 0)]})  # a backward before its forward: placed in order
    assert stuck == {0: [(0, 2), (2, 3)]}
    missing = ideal_replay({1: [("F", 1, 0), ("B", 1, 0)]})  # stage 0 not among the blocks: done at 0
    assert missing == {1: [(0, 1), (1, 3)]}
    apart = ideal_replay({0: [("F", 0, 0)], 1: [("F", 1, 0)]}, pipe={0: 0, 1: 1})  # two pipelines: no dependency
    assert apart == {0: [(0, 1)], 1: [(0, 1)]}


def test_a_thousand_ranks_draw_the_first_pipelines_that_fit():
    """pp 8 x dp 128 on the schedule clock was 828 x 33,525 px: now 4 whole pipelines of 8 in 32 rows; the
    bubble is still over every block."""
    events = [MARK] + _simulated(_pipes(8, 4, 128))
    view = PipelineView(events)
    w, h = png_size(view.png())
    assert h < 1400, (w, h)
    ranks, taken, total = view.drawn()
    assert total == 128 and taken == [[d + 128 * s for s in range(8)] for d in range(4)]
    assert ranks == sorted(r for g in taken for r in g) and len(ranks) == 32
    assert view.bubble == pytest.approx(bubble_formula(8, 4)) == pytest.approx(view.formula)
    assert "8 stages × 128 pipelines (1024 ranks)" in view._headline()
    assert "4 of 128 pipelines drawn: ranks [0, 1, 2, 3, 128, 129, …, 899] (32 ranks)" in view._headline()
    fig = view.figure()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[:2] == ["rank 0 · stage 0", "rank 1 · stage 0"] and len(labels) == 32
    few = PipelineView(_pipes(2, 4, 2))
    assert few.drawn() == ([0, 1, 2, 3], [[0, 2], [1, 3]], 2)


def test_what_if_marks_its_events_and_a_saved_report_replays_the_same_picture(tmp_path):
    """meshviz.what_if's events begin with one plain-data mark; through JSONL the view still knows them."""
    pytest.importorskip("torch")
    import meshviz
    from meshviz.trace import JSONLSink, load_events

    report = meshviz.what_if(_pipeline_dp2_pp2, 4)
    first = report.events[0]
    assert (first.kind, first.op, first.rank) == ("mark", "what_if", 0)
    assert first.payload.fields == {"nranks": 4, "simulated": report.simulated}
    assert json.loads(to_json(first))["payload"]["fields"]["nranks"] == 4
    assert from_json(to_json(first)).payload == first.payload
    view = PipelineView(report.events)
    assert view.clock == "schedule" and view.pipelines() == [[0, 1], [2, 3]]  # pp the inner axis, as fleet has it
    assert view.formula == pytest.approx(0.2) and view.bubble == pytest.approx(0.2)
    ideal = _times(PipelineView(synthetic_schedule(2, 4, "1F1B")).blocks)
    blocks = view.laid_out()[0]
    for pipe in ([0, 1], [2, 3]):
        mine = [{**b, "rank": pipe.index(b["rank"])} for b in blocks if b["rank"] in pipe]
        assert {k: v for k, v in _times(mine).items() if "again" not in k} == ideal
    sink = JSONLSink(str(tmp_path / "what_if.jsonl"))
    for e in report.events:
        sink(e)
    sink.close()
    again = PipelineView(load_events(str(tmp_path / "what_if.jsonl")))
    assert again.clock == "schedule" and _times(again.laid_out()[0]) == (_times(blocks))
    assert again._headline() == view._headline()


def _pipeline_dp2_pp2():
    """One train_batch of a 2-stage fleet pipeline, 4 micro-batches, data parallel 2."""
    import torch
    from torch import nn

    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 4, "schedule_mode": "1F1B"}
    fleet.init(is_collective=True, strategy=s)
    torch.manual_seed(0)
    layer = PipelineLayer([LayerDesc(nn.Linear, 4, 4) for _ in range(4)], loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(torch.optim.SGD(layer.parameters(), lr=0.01))
    model.train_batch((torch.randn(8, 4), torch.randn(8, 4)), opt)
