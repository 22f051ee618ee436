"""The roll-call: what a set of rank records says about a hang, records read while a rank blocks, the comm table,
module attribution, the gloo match check."""

import pickle
import threading
import time

import pytest
import torch

from meshviz import trace
from meshviz.errors import RankError, RankOutcome
from meshviz.trace import Event, RankStatus, RollCall

pytestmark = pytest.mark.timeout(120)

G = (0, 1)


def _waits(rank, op="all_reduce", seq=1, group=G, s=6.2, shape=(4,), dtype="float32", where="line 3 of the cell"):
    return RankStatus(rank, "in_collective", op=op, group=group, seq=seq, waiting_s=s, where=where,
                      shapes=(shape,), dtypes=(dtype,), entered=((group, seq),))


def test_a_skipped_collective_names_the_rank_that_never_entered():
    rc = RollCall([_waits(0), RankStatus(1, "idle", note="its cell finished", entered=((G, 0),))])
    assert rc.lines() == ["rank 0 waits in all_reduce #1 on group [0, 1] for 6.2 s; rank 1 is idle: its cell "
                          "finished without entering all_reduce #1"]
    assert rc.culprits() == [1] and rc.hung(6.0) and not rc.hung(7.0)
    assert [x.waiting for x in rc.stuck()] == [(0,)]  # where idle means done, nothing can end the wait
    assert rc.blame() == ["rank 1 never entered all_reduce #1 on group [0, 1] (idle: its cell finished)",
                          "rank 0 waited in all_reduce #1 on group [0, 1] for 6.2 s"]


def test_a_send_or_recv_waits_on_its_peer_only():
    """A point-to-point call has no number on its group: it waits on its peer, and the peer is the one to name
    (with the call it must enter), never the other ranks of the world."""
    world = (0, 1, 2, 3)
    idle = [RankStatus(r, "idle", note="its cell finished", entered=((world, 2),)) for r in (1, 2, 3)]
    rc = RollCall([_waits(0, op="recv", seq=None, group=(0, 1), s=3.0)] + idle)
    assert rc.lines() == ["rank 0 waits in recv on group [0, 1] for 3.0 s; rank 1 is idle: its cell finished "
                          "without entering send"]
    assert rc.culprits() == [1] and not rc.mismatches() and len(rc.stuck()) == 1
    assert rc.blame() == ["rank 1 never entered send on group [0, 1] (idle: its cell finished)",
                          "rank 0 waited in recv on group [0, 1] for 3.0 s"]
    both = RollCall([_waits(0, op="send", seq=None, group=(0, 1)), _waits(1, op="recv", seq=None, group=(0, 1))])
    assert both.culprits() == [] and not both.mismatches() and not both.stuck()
    assert both.lines() == ["ranks 0, 1 wait in send on group [0, 1] for 6.2 s; every member entered it"]


def test_running_elsewhere_dead_and_silent_ranks():
    group = (0, 1, 2, 3, 4)
    rc = RollCall([
        _waits(0, group=group, seq=2, s=3.0),
        _waits(1, group=group, seq=2, s=2.5),
        RankStatus(2, "running", where="train.py:12 in step()", entered=((group, 1),)),
        _waits(3, op="all_gather", group=(3, 4), seq=1, s=1.0, where="train.py:20"),
        RankStatus(4, "dead", note="engine process 9 exited"),
    ])
    (x, y) = rc.situations()
    assert x.waiting == (0, 1) and sorted(x.culprits) == [2, 3, 4] and not x.mismatch
    assert x.line() == ("ranks 0, 1 wait in all_reduce #2 on group [0, 1, 2, 3, 4] for 3.0 s; rank 2 is running at "
                        "train.py:12 in step(): it never entered all_reduce #2; rank 3 is elsewhere: in all_gather #1 "
                        "on group [3, 4] at train.py:20; rank 4 is dead (engine process 9 exited)")
    assert y.waiting == (3,) and list(y.culprits) == [4]
    assert rc.blame()[:4] == [
        "rank 2 never entered all_reduce #2 on group [0, 1, 2, 3, 4]; it is running at train.py:12 in step()",
        "rank 3 never entered all_reduce #2 on group [0, 1, 2, 3, 4]: it is elsewhere, in all_gather #1 on group "
        "[3, 4] at train.py:20",
        "rank 4 never entered all_reduce #2 on group [0, 1, 2, 3, 4]: it is dead (engine process 9 exited)",
        "ranks 0, 1 waited in all_reduce #2 on group [0, 1, 2, 3, 4] for 3.0 s"]
    assert rc.culprits() == [2, 3, 4]
    assert [x.waiting for x in rc.stuck()] == [(3,)]  # rank 2 may still come to #2, rank 4 never to rank 3's
    silent = RollCall([_waits(0), RankStatus(1, "unknown")])
    assert not silent.stuck()
    assert silent.blame()[0] == "rank 1 never entered all_reduce #1 on group [0, 1] (it did not answer the roll-call)"
    alone = RollCall([RankStatus(0, "idle"), RankStatus(1, "dead", note="killed by SIGKILL")])
    assert alone.lines() == ["rank 1 is dead (killed by SIGKILL)"]
    quiet = RollCall([RankStatus(0, "idle"), RankStatus(1, "running")])
    assert quiet.lines() == [] and quiet.culprits() == [] and not quiet.hung(0)


def test_mismatches_at_one_sequence_number():
    op = RollCall([_waits(0), _waits(1, op="all_gather")])
    assert op.lines() == ["mismatch at #1 on group [0, 1]: rank 0 entered all_reduce float32[4]; rank 1 entered "
                          "all_gather float32[4]"]
    assert op.culprits() == [0, 1] and op.blame() == op.lines()
    shape = RollCall([_waits(0), _waits(1, shape=(8,))])
    assert shape.lines() == ["mismatch at #1 on group [0, 1]: rank 0 entered all_reduce with float32[4]; rank 1 "
                             "entered all_reduce with float32[8]"]
    dtype = RollCall([_waits(0), _waits(1, dtype="float64")])
    assert "rank 1 entered all_reduce with float64[4]" in dtype.lines()[0]
    # all-to-all pieces may differ per rank; everyone inside one collective is no mismatch
    a2a = RollCall([_waits(0, op="all_to_all"), _waits(1, op="all_to_all", shape=(2,))])
    assert a2a.mismatches() == [] and a2a.lines()[0].endswith("every member entered it")
    # a member whose count says it already passed this collective is not blamed while it runs on
    passed = RollCall([_waits(0), RankStatus(1, "running", where="a.py:3", entered=((G, 1),))])
    assert passed.culprits() == [] and passed.situations()[0].left == (1,) and not passed.stuck()
    # but once it is done, nothing can end the wait: gloo paired its call with another (a different size)
    done = RollCall([_waits(0), RankStatus(1, "idle", note="its script finished", entered=((G, 1),))])
    assert done.culprits() == [1] and len(done.stuck()) == 1 and done.situations()[0].left == ()
    assert done.lines() == ["rank 0 waits in all_reduce #1 on group [0, 1] for 6.2 s; rank 1 passed all_reduce #1 "
                            "and is done (its script finished)"]
    assert done.blame()[0] == ("rank 1 passed all_reduce #1 on group [0, 1] without the ranks still in it and is "
                               "done (its script finished): its call was paired with another (a different size?); "
                               "check_collectives names the difference")


def test_status_records_round_trip_and_check_their_state():
    s = _waits(0)
    assert RankStatus.from_dict(s.to_dict()) == s
    assert s.entered_on([0, 1]) == 1 and s.entered_on((2, 3)) == 0
    assert s.line() == "rank 0: in all_reduce #1 on group [0, 1] for 6.2 s at line 3 of the cell"
    with pytest.raises(ValueError, match="state must be one of"):
        RankStatus(0, "sleeping")
    rc = RollCall([s, RankStatus(1, "idle")])
    assert RollCall.from_dicts(rc.to_dicts()).statuses == rc.statuses
    assert len(rc) == 2 and rc[1].state == "idle" and [x.rank for x in rc] == [0, 1]
    assert rc.gist() == RollCall([_waits(0, s=9.0), RankStatus(1, "idle")]).gist()  # seconds are not news


# -- a rank's record, read from another thread ------------------------------------------------------------------

def test_the_record_is_read_while_the_rank_blocks_in_a_collective():
    from meshviz.runtime import rollcall

    rec = rollcall.Record(rank=3)
    inside, release = threading.Event(), threading.Event()
    t = torch.ones(2, 3, dtype=torch.float64)

    def rank_code():  # what comm.run does around a collective that blocks
        rec.thread = threading.get_ident()
        rec.start(7)
        prev = rec.enter("all_gather", (3, 5), (t,), None)
        inside.set()
        release.wait(10)
        rec.leave(prev)
        prev = rec.enter("all_gather", (3, 5), (t,), None)
        rec.leave(prev)
        rec.finish("its cell finished")

    th = threading.Thread(target=rank_code)
    th.start()
    assert inside.wait(10)
    time.sleep(0.05)
    s = rollcall.snapshot(rec, stacks=True)
    assert (s.rank, s.state, s.op, s.group, s.seq, s.cell) == (3, "in_collective", "all_gather", (3, 5), 1, 7)
    assert s.shapes == ((2, 3),) and s.dtypes == ("float64",) and s.bytes == 48 and s.waiting_s >= 0.04
    assert s.where.startswith("test_rollcall.py:") and s.where.endswith("in rank_code()")
    assert "release.wait(10)" in s.stack
    release.set()
    th.join(10)
    s = rollcall.snapshot(rec)
    assert (s.state, s.note, s.op) == ("idle", "its cell finished", None)
    assert s.entered == (((3, 5), 2),)  # the second all_gather on that group was #2
    rec.reset()
    assert rollcall.snapshot(rec).entered == ()


def test_async_waits_show_the_collective_again():
    from meshviz.runtime import rollcall
    from meshviz.runtime.comm import Task

    rec = rollcall.current()
    seen = []

    class Work:
        def wait(self):
            seen.append((rec.op, rec.group, rec.seq))

        def is_completed(self):
            return True

    Task([Work()], call=("broadcast", (0, 1), 4, ())).wait()
    assert seen == [("broadcast", (0, 1), 4)] and rec.op is None


def test_a_backward_under_dataparallel_counts_as_its_all_reduce():
    from meshviz.runtime import rollcall

    rec = rollcall.Record(rank=0)
    inside, release = threading.Event(), threading.Event()

    def rank_code():
        rec.thread = threading.get_ident()
        rec.start()
        w = torch.ones(3, requires_grad=True)
        rec.begin_region("all_reduce", (0, 1), "DataParallel gradients")
        y = (w * 2).sum()
        w.register_hook(lambda g: (inside.set(), release.wait(10)) and None)
        y.backward()

    th = threading.Thread(target=rank_code)
    th.start()
    assert inside.wait(10)
    s = rollcall.snapshot(rec)
    release.set()
    th.join(10)
    assert (s.state, s.op, s.group, s.note) == ("in_collective", "all_reduce", (0, 1), "DataParallel gradients")
    assert rollcall.snapshot(rec).state == "running"  # the backward is over


def test_where_is_the_users_code():
    from meshviz.runtime import rollcall

    def inner():
        return rollcall.where()

    assert inner().startswith("test_rollcall.py:") and inner().endswith("in inner()")



def test_a_backward_is_named_after_the_module_whose_forward_made_the_running_node():
    from torch import nn

    from meshviz.runtime import modules, rollcall  # noqa: F401  (the module hooks come with tracing)

    seen = []

    class Spy(torch.autograd.Function):  # its backward asks who issues, as a reshard's backward does
        @staticmethod
        def forward(ctx, x, tag):
            ctx.tag = tag
            seen.append((tag, "forward", rollcall.issuer()))
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            seen.append((ctx.tag, "backward", rollcall.issuer()))
            return g, None

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return Spy.apply(self.fc(x), "inner")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(Inner())  # a wrapper whose only child makes all its nodes: the child is named
            self.b = nn.Linear(3, 3)

        def forward(self, x):
            h = Spy.apply(torch.relu(self.a(x)), "net")  # made between the children: the net's own
            return self.b(h)

    net = Net()
    net.b.weight.register_post_accumulate_grad_hook(lambda p: seen.append(("b.weight", "grad", rollcall.issuer())))

    def ends():
        seen.append(("callback", "end", rollcall.issuer()))

    with trace.record():
        first, second = net(torch.ones(2, 3)), net(torch.ones(2, 3))
        out = first.sum() * Spy.apply(torch.ones((), requires_grad=True), "top")  # made outside any module
        first.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(ends))
        seen.append(("outside", "-", rollcall.issuer()))
        out.backward()  # the first forward's nodes, after a second forward
        del second
    assert seen[:6] == [
        ("inner", "forward", ("Net.a.0", False)), ("net", "forward", ("Net", False)),
        ("inner", "forward", ("Net.a.0", False)), ("net", "forward", ("Net", False)),
        ("top", "forward", (None, False)), ("outside", "-", (None, False)),
    ]
    assert sorted(seen[6:-1]) == [  # in the order the engine runs them
        ("b.weight", "grad", ("Net.b", True)), ("inner", "backward", ("Net.a.0", True)),
        ("net", "backward", ("Net", True)), ("top", "backward", (None, True)),
    ]
    assert seen[-1] == ("callback", "end", (None, True))


def test_a_backward_names_its_module_after_many_forwards_in_flight(monkeypatch):
    from torch import nn

    from meshviz.runtime import modules, rollcall

    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, tag):
            ctx.tag = tag
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            seen.append((ctx.tag, rollcall.issuer()))
            return g, None

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, mb):
            return Spy.apply(self.fc(x), mb)

    stage, loss_fn, m = Stage(), nn.MSELoss(), 200  # FThenB: every forward, then every backward
    with trace.record():
        losses = [loss_fn(stage(torch.ones(2, 3), mb), torch.zeros(2, 3)) for mb in range(m)]
        for loss in losses:  # the oldest forward first: 2 * m outermost module calls ago
            loss.backward()
        kept = len(rollcall.current().spans)
        losses.clear()
        # a node made outside any module, after hundreds of forwards kept: it names none
        out = Spy.apply(torch.ones((), requires_grad=True), "outside")
        out.backward()
    assert seen[:-1] == [(mb, ("Stage", True)) for mb in range(m)]
    assert seen[-1] == ("outside", (None, True))
    assert 2 * m <= kept <= modules.SPANS  # the stage's and the loss's, each with its spans

    monkeypatch.setattr(modules, "SPANS", 30)  # what a rank keeps is bounded: the oldest half goes
    seen.clear()
    with trace.record():
        losses = [loss_fn(stage(torch.ones(2, 3), mb), torch.zeros(2, 3)) for mb in range(m)]
        spans = sum(len(fw.spans) for fw in rollcall.current().spans)
        for loss in losses:
            loss.backward()
    assert spans <= 2 * modules.SPANS
    named = [mb for mb, (name, backward) in seen if name == "Stage" and backward]
    assert named == list(range(m - len(named), m)) and len(named) >= modules.SPANS // 6  # the latest forwards


# -- errors -------------------------------------------------------------------------------------------------------

def test_rank_error_leads_with_the_rank_that_never_entered():
    rc = RollCall([_waits(0, s=8.0), RankStatus(1, "idle", note="its cell finished")])
    outcomes = [RankOutcome(0, 0, "error", "RuntimeError: \x1b[31mTimed out\x1b[0m waiting 8000ms"),
                RankOutcome(1, 1, "ok")]
    err = RankError(outcomes, rc.culprits(), "re-created before the next cell", rc.blame(), True, rc)
    text = str(err)
    assert err.ranks == [1] and "\x1b" not in text
    assert text.splitlines()[0] == ("rank 1 never entered all_reduce #1 on group [0, 1] (idle: its cell finished); "
                                    "rank 0 waited in all_reduce #1 on group [0, 1] for 8.0 s")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == text and back.diagnosis == err.diagnosis
    raised = RankError([RankOutcome(1, 1, "error", "ValueError: broke"), RankOutcome(0, 0, "error", "peer")], [1],
                       diagnosis=["rank 1 never entered all_reduce #1 on group [0, 1] (idle: its cell finished)"])
    assert str(raised).splitlines()[:2] == [
        "rank 1 raised ValueError: broke (rank 0 stopped because of it)",
        "  rank 1 never entered all_reduce #1 on group [0, 1] (idle: its cell finished)"]


# -- the comm table -----------------------------------------------------------------------------------------------

def _comm_events():
    mesh = {"shape": [2, 2], "process_ids": [0, 1, 2, 3], "dim_names": ["dp", "mp"]}
    out = []
    for r in range(2):
        out += [
            Event(kind="collective", rank=r, op="all_reduce", group=[0, 1], bytes=64, start=1.0, end=1.5, cell=3,
                  payload=trace.Collective(module="Net.row", seq=1)),
            Event(kind="collective", rank=r, op="all_reduce", group=[0, 1], bytes=32, start=2.0, end=2.25, cell=3,
                  payload=trace.Collective(module="Net.col", backward=True, seq=2)),
            Event(kind="reshard_step", rank=r, op="all_gather", mesh=mesh, axis=1, group=[0, 1], bytes=16,
                  start=3.0, end=3.1, cell=4, payload=trace.ReshardStep(dim=0)),
            Event(kind="reshard_step", rank=r, op="slice", mesh=mesh, axis=0, start=3.2, end=3.2, cell=4),
            Event(kind="mark", rank=r, op="x", cell=4),
        ]
    out.append(Event(kind="collective", rank=0, op="all_reduce", group=[0, 1], bytes=64, start=4.0, end=5.0,
                     cell=3, payload=trace.Collective(module="Net.row")))
    return out


def test_comm_table_counts_per_cell_module_op_and_axis(tmp_path):
    from meshviz.trace import comm_table

    evs = _comm_events()
    table = comm_table(evs)
    got = [(r.cell, r.module, r.phase, r.op, r.axis, r.count, r.bytes, round(r.seconds, 3), r.ranks) for r in table]
    assert got == [
        (3, "Net.col", "backward", "all_reduce", "group [0, 1]", 1, 32, 0.25, (0, 1)),
        (3, "Net.row", "forward", "all_reduce", "group [0, 1]", 2, 128, 1.5, (0, 1)),  # rank 0 issued it twice
        (4, "(top level)", "forward", "all_gather", "axis mp", 1, 16, 0.1, (0, 1)),
    ]
    assert [r.cell for r in comm_table(evs, cell=-1)] == [4]
    assert len(comm_table(evs, cell=3)) == 2 and table.total_bytes == 176
    assert table.where(backward=True)[0].module == "Net.col"
    text = table.text(times=False)
    assert text.splitlines()[0].split() == ["cell", "module", "pass", "op", "axis", "count", "bytes/rank"]
    assert "Net.col" in text and "<td>axis mp</td>" in table._repr_html_()
    path = str(tmp_path / "run.jsonl")
    with trace.record(path):
        for e in evs:
            trace.emit(Event(**{k: v for k, v in e.__dict__.items() if k != "seq"}))
    assert [tuple(r.__dict__.values()) for r in comm_table(trace.load_events(path))] == [
        tuple(r.__dict__.values()) for r in table]  # a reading of the trace: a recorded file gives the same


def test_views_draw_a_roll_call_and_a_comm_table():
    import meshviz
    from meshviz.trace import comm_table
    from meshviz.widgets import CommView, RollCallView

    rc = RollCall([_waits(0), RankStatus(1, "idle", note="its cell finished")], title="roll-call after 6.3 s")
    v = meshviz.show(rc)
    assert isinstance(v, RollCallView) and v.png().startswith(b"\x89PNG")
    assert v.labels() == {0: "all_reduce #1\n6.2 s", 1: "idle"}
    rgb = v.cell_rgb()
    assert not (rgb[0] == rgb[1]).all()
    assert repr(v).splitlines()[0] == "<RollCallView 2 ranks: 1 in collective, 1 idle>"
    assert isinstance(meshviz.show(list(rc)), RollCallView)
    mism = meshviz.show(RollCall([_waits(0), _waits(1, shape=(8,))]))
    assert (mism.cell_rgb()[0] == mism.cell_rgb()[1]).all()  # both red
    cv = meshviz.show(comm_table(_comm_events()))
    assert isinstance(cv, CommView) and cv.png().startswith(b"\x89PNG")
    assert repr(cv) == "<CommView 3 rows, 176 B per rank>"
    assert len(CommView(_comm_events(), cell=4).table) == 1


def test_an_engine_reports_its_failure_when_an_interrupt_lands_in_the_report():
    """IPython drops an exception handler that raises: the cluster's SIGINT landing while a rank reports its own
    failure must neither escape the handler (its later failures would go unreported and its peers wait forever)
    nor lose the report."""
    from types import SimpleNamespace

    from meshviz.cluster.engine import _EngineState

    sent, calls = [], {"report": 0, "abort": 0}

    def report(value, aborts):
        calls["report"] += 1
        if calls["report"] == 1:
            raise KeyboardInterrupt  # the interrupt arrives during the first try
        sent.append((str(value), aborts))

    def abort():
        calls["abort"] += 1
        if calls["abort"] == 1:
            raise KeyboardInterrupt

    shown = []
    me = SimpleNamespace(abort_pending=True, report_failure=report, _abort=abort)
    shell = SimpleNamespace(showtraceback=lambda exc, tb_offset=None: shown.append(exc[1]))
    err = RuntimeError("Timed out waiting 2000ms")
    assert _EngineState._on_exception(me, shell, RuntimeError, err, None) is None
    assert sent == [("Timed out waiting 2000ms", True)] and calls == {"report": 2, "abort": 2} and shown == [err]
