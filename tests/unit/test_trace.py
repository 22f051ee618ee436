"""Trace sinks and the live stream: batching, order, latency, JSONL round trips, robustness."""

import json
import threading
import time

import pytest

from meshviz import trace
from meshviz.trace import Event
from meshviz.trace.stream import EventLog, StreamReceiver, StreamSink

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def link():
    got = []
    rx = StreamReceiver(on_control=got.append)
    sink = StreamSink(rx.address)
    trace.add_sink(sink)
    yield rx, sink, got
    trace.remove_sink(sink)
    rx.close()


def test_tracing_off_builds_nothing():
    trace.clear_sinks()
    assert not trace.active()
    with trace.span("collective", op="all_reduce") as ev:
        assert ev is None


def test_events_arrive_in_order_and_batched(link):
    rx, sink, _ = link
    n = 500
    for i in range(n):
        trace.emit(Event(kind="mark", rank=3, name=f"e{i}", values=[i]))
    assert sink.flush() == n
    assert rx.log.wait_for({3: n}, timeout=10)
    evs = list(rx.log)
    assert [e.name for e in evs] == [f"e{i}" for i in range(n)]
    assert [e.values for e in evs] == [[i] for i in range(n)]
    assert [e.seq for e in evs] == sorted(e.seq for e in evs)
    assert rx.batches < n / 5, f"{rx.batches} messages for {n} events: not batched"


def test_events_from_threads_keep_per_thread_order(link):
    rx, sink, _ = link

    def work(r):
        for i in range(200):
            trace.emit(Event(kind="mark", rank=r, step=i))

    ts = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    sink.flush()
    assert rx.log.wait_for({r: 200 for r in range(4)}, timeout=10)
    for _r, evs in rx.log.by_rank().items():
        assert [e.step for e in evs] == list(range(200))


def test_single_events_arrive_one_by_one(link):
    # their latency (p95 under 50 ms) is measured in bench/bench_trace.py
    rx, sink, _ = link
    for i in range(20):
        trace.emit(Event(kind="mark", rank=0, step=i))
        assert rx.log.wait_for(i + 1, timeout=5)
        assert rx.log[-1].step == i and rx.log.arrivals[-1] >= rx.log[-1].end


def test_subscribers_and_control_messages(link):
    rx, sink, got = link
    seen = []
    cb = rx.log.subscribe(seen.append)
    trace.emit(Event(kind="collective", rank=1, op="all_reduce", bytes=16))
    sink.send_control({"type": "failed", "rank": 1})
    sink.flush()
    assert rx.log.wait_for(1, timeout=5)
    deadline = time.time() + 5
    while not got and time.time() < deadline:
        time.sleep(0.01)
    assert got == [{"type": "failed", "rank": 1}]
    assert [e.op for e in seen] == ["all_reduce"]
    rx.log.unsubscribe(cb)
    trace.emit(Event(kind="mark", rank=1))
    sink.flush()
    assert rx.log.wait_for(2, timeout=5)
    assert len(seen) == 1


def test_waiting_for_control_messages_waits_until_they_are_handled():
    """A control message travelling with events counts as arrived only once its handler has returned (the cluster
    reads a failure report's verdict right after the wait)."""
    handled = []

    def slow(message):
        time.sleep(0.5)
        handled.append(message)

    rx = StreamReceiver(on_control=slow)
    sink = StreamSink(rx.address)
    try:
        sink(Event(kind="mark", rank=2))
        sink.send_control({"type": "failed", "rank": 2})
        sink.flush()
        assert (sink.sent, sink.controls_sent) == (1, 1)
        assert rx.log.wait_for({2: 1}, timeout=5, controls={2: 1})
        assert handled == [{"type": "failed", "rank": 2}] and rx.log.controls[2] == 1
        assert not rx.log.wait_for({2: 1}, timeout=0.2, controls={2: 2})
    finally:
        sink.close()
        rx.close()


def test_a_broken_subscriber_does_not_stop_the_stream(link):
    rx, sink, _ = link

    def bad(e):
        raise RuntimeError("widget bug")

    rx.log.subscribe(bad)
    for i in range(3):
        trace.emit(Event(kind="mark", rank=0, step=i))
    sink.flush()
    assert rx.log.wait_for(3, timeout=5)


def test_garbage_messages_are_dropped():
    import zmq

    rx = StreamReceiver()
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(rx.address)
    s.send(b"\x80not json")
    s.send(b'{"events": [{"kind": "mark", "rank": 2, "bogus_field": 1}]}')
    assert rx.log.wait_for(1, timeout=5)
    assert rx.log[0].kind == "mark" and rx.log[0].rank == 2
    s.close()
    ctx.term()
    rx.close()


def test_sink_never_blocks_without_a_receiver():
    from meshviz.runtime.rendezvous import free_port

    sink = StreamSink(f"tcp://127.0.0.1:{free_port()}", hwm=100)
    for i in range(20000):  # a blocking send would hang here until the module's timeout; the cost is in bench/
        sink(Event(kind="mark", rank=0, step=i))
    sink.flush(2.0)
    sink.close()
    assert sink.sent + sink.dropped <= 20000


def test_jsonl_round_trip_and_replay(tmp_path):
    log = EventLog()
    evs = [Event(kind="reshard_step", rank=r, op="all_gather", axis=0, group=[0, 1], bytes=24,
                 placements_before=["S(0)"], placements_after=["R"], values=[1.5, 2], mesh={"shape": [2]})
           for r in range(2)]
    log._extend(evs, time.time())
    path = str(tmp_path / "t.jsonl")
    assert log.save(path) == 2
    back = trace.load_events(path)
    assert [e.to_dict() for e in back] == [e.to_dict() for e in evs]
    out = []
    assert trace.replay(path, out.append) == 2
    assert [e.to_dict() for e in out] == [e.to_dict() for e in evs]


def test_eventlog_limit_keeps_newest():
    log = EventLog(limit=10)
    log._extend([Event(kind="mark", rank=0, step=i) for i in range(25)], time.time())
    assert len(log) == 10 and [e.step for e in log] == list(range(15, 25))
    assert len(log.arrivals) == 10
    assert "EventLog(10 events" in repr(log)


PAYLOADS = [
    ("placed", None, trace.Placed(dtype="float32")),
    ("reshard", None, trace.ReshardPlan(target_mesh={"shape": [2], "process_ids": [0, 1], "dim_names": ["x"]},
                                        ops=("all_reduce", "all_gather"))),
    ("reshard_step", "all_to_all", trace.ReshardStep(dim=0, dst_dim=1, seq=3, where="cell.py:4", module="fc1")),
    ("collective", "all_reduce", trace.Collective(reduce_op="avg", bucket=2, seq=7, module="net.fc2", backward=True)),
    ("send", "send", trace.Send(batched=True)),
    ("recv", "recv", trace.Recv(micro_batch=1, phase="B", stage=2, src_stage=3, dst_stage=2, step=0,
                                transfer="0:B1:s3->s2")),
    ("compute", "F", trace.Compute(stage=1, micro_batch=0, phase="F", chunk=0, step=4, live_activation_bytes=96)),
    ("mark", "pipeline_step", trace.Mark(schedule="1F1B", p=2, m=4, v=1, step=0, stage=1, eval=True)),
    ("ownership", "os_g", trace.Share(sharded=("grad", "state"), numel=12, mode="slice", ranges=((0, 6), (6, 12)),
                                      holds={"param": [0, 12], "grad": [6, 12], "state": [6, 12]})),
    ("mark", None, trace.Mark({"anything": [1, 2], "said": "hi"})),
]


@pytest.mark.parametrize("kind,op,payload", PAYLOADS, ids=[f"{k}-{type(p).__name__}" for k, _, p in PAYLOADS])
def test_typed_payloads_round_trip_through_json_and_the_stream(kind, op, payload, link, tmp_path):
    e = Event(kind=kind, rank=1, op=op, payload=payload)
    back = trace.from_json(trace.to_json(e))
    assert type(back.payload) is type(payload) and back.payload == payload
    assert back.to_dict() == e.to_dict() and back.to_dict()["payload"]["type"] == payload.TYPE
    path = str(tmp_path / "p.jsonl")
    with trace.record(path):
        trace.emit(Event(kind=kind, rank=1, op=op, payload=payload))
    (loaded,) = trace.load_events(path)
    assert loaded.payload == payload
    rx, sink, _ = link
    trace.emit(Event(kind=kind, rank=5, op=op, payload=payload))
    assert rx.log.wait_for({5: 1}, timeout=10)
    assert rx.log[-1].payload == payload  # the live stream carries the same record
    assert type(payload).__name__ in repr(payload) and "None" not in repr(payload)


def test_files_of_this_version_load_with_the_payload_of_their_kind(tmp_path):
    lines = [  # as 0.1 wrote them: a null payload, and the types send/recv/mark payloads had before they split
        {"kind": "collective", "rank": 0, "seq": 1, "start": 1.0, "op": "all_reduce", "payload": None},
        {"kind": "send", "rank": 0, "seq": 2, "start": 2.0, "payload": {
            "type": "transfer", "micro_batch": 0, "phase": "F", "stage": 0, "step": 0, "transfer": "0:F0:s0->s1"}},
        {"kind": "recv", "rank": 0, "seq": 3, "start": 3.0, "payload": {"type": "collective", "batched": True}},
        {"kind": "mark", "rank": 0, "seq": 4, "start": 4.0, "op": "pipeline_step", "payload": {
            "type": "pipeline_step", "schedule": "FThenB", "p": 2, "m": 2, "v": 1, "step": 0, "stage": 0}},
        {"kind": "mark", "rank": 0, "seq": 5, "start": 5.0, "payload": {"type": "note", "fields": {"mine": 1}}},
        {"kind": "ownership", "rank": 0, "seq": 6, "start": 6.0, "op": "os", "payload": {
            "type": "ownership", "sharded": ["state"], "numel": 4, "ranges": [[0, 2], [2, 4]],
            "holds": {"param": [0, 4], "state": [0, 2]}}},
    ]
    path = tmp_path / "v01.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    got = [e.payload for e in trace.load_events(str(path))]
    assert got == [
        trace.Collective(),
        trace.Send(micro_batch=0, phase="F", stage=0, step=0, transfer="0:F0:s0->s1"),
        trace.Recv(batched=True),
        trace.Mark(schedule="FThenB", p=2, m=2, v=1, step=0, stage=0),
        trace.Mark({"mine": 1}),
        trace.Share(sharded=("state",), numel=4, ranges=((0, 2), (2, 4)), holds={"param": [0, 4], "state": [0, 2]}),
    ]
    own = trace.Ownership.from_event(trace.load_events(str(path))[5])
    assert own.held == (0, 2) and own.ranges == ((0, 2), (2, 4))
    # an unknown payload type from a newer writer is kept as a mark's free-form fields, never executed
    e = Event.from_dict({"kind": "mark", "payload": {"type": "from_the_future", "x": 1}})
    assert e.payload == trace.Mark({"x": 1})


def test_a_record_from_before_0_1_is_refused_clearly():
    old = {"kind": "placed", "rank": 0, "seq": 1, "start": 1.0, "op": "shard_tensor", "extra": {"dtype": "int64"}}
    with pytest.raises(ValueError, match="untyped 'extra' dict comes from before meshviz 0.1"):
        Event.from_dict(old)
    with pytest.raises(ValueError, match="carries a Collective payload, not one of type 'placed'"):
        Event.from_dict({"kind": "collective", "payload": {"type": "placed", "dtype": "int64"}})


def test_an_events_kind_is_its_payloads():
    assert Event(payload=trace.Placed(dtype="float32")).kind == "placed"
    assert Event(kind="op", payload=trace.OpRule(rule="default")).kind == "op"
    assert Event(kind="collective").payload == trace.Collective()  # kind alone: the kind's payload, all defaults
    assert Event(kind="send", payload=trace.Send()).kind == "send" and Event(payload=trace.Recv()).kind == "recv"
    with pytest.raises(ValueError, match="kind 'send' does not match its payload Collective"):
        Event(kind="send", payload=trace.Collective())
    with pytest.raises(ValueError, match="unknown kind 'nonsense'"):
        Event(kind="nonsense")
    with pytest.raises(ValueError, match="needs a kind or a payload|unknown kind ''"):
        Event()
    e = Event(kind="compute", payload=trace.Compute(phase="F"))
    assert e.payload_as(trace.Compute).phase == "F"
    with pytest.raises(TypeError, match="a 'compute' event carries a Compute, not a Share"):
        e.payload_as(trace.Share)


def _made(seq, name, start):
    return Event(kind="mark", seq=seq, rank=0, name=name, start=start, end=start)


def test_deferred_events_reach_the_sinks_in_order_with_the_events_after_them():
    from meshviz.trace.state import trace_state

    trace.clear_sinks()
    st = trace_state()
    early = trace.MemorySink()
    trace.add_sink(early)
    now = time.time()
    for name in ("a", "b"):
        trace.defer(st, _made, (next(st.seq), name, now), now)
    assert early._events == []  # not made yet: nothing read it, nothing came after it
    late = trace.MemorySink()
    trace.add_sink(late)  # a sink added now never sees what was deferred before it
    assert [e.name for e in early._events] == ["a", "b"] and not st.pending
    made = []
    trace.defer(st, lambda *a: made.append(1) or _made(*a), (next(st.seq), "b2", now), now)
    trace.emit(Event(kind="mark", rank=0, name="c"))  # waits behind the deferred event, which is not made for it
    assert made == [] and [e.name for e in early._events] == ["a", "b"] and late._events == []
    assert trace.flush() == 2 and made == [1]
    assert [e.name for e in early._events] == ["a", "b", "b2", "c"]
    assert [e.name for e in late._events] == ["b2", "c"]
    trace.emit(Event(kind="mark", rank=0, name="c2"))  # nothing deferred: straight to the sinks
    assert [e.name for e in late._events] == ["b2", "c", "c2"]
    seqs = [e.seq for e in early._events]
    assert seqs == sorted(seqs)
    trace.defer(st, _made, (next(st.seq), "d", now), now)
    assert [e.name for e in early.events] == ["a", "b", "b2", "c", "c2", "d"]  # reading the sink makes them
    trace.defer(st, lambda: 1 / 0, (), now)  # a maker that fails loses its event, nothing else
    trace.defer(st, _made, (next(st.seq), "e", now), now)
    trace.remove_sink(late)  # removing a sink hands it what was deferred while it listened
    assert [e.name for e in late._events] == ["b2", "c", "c2", "d", "e"]
    trace.remove_sink(early)
    assert [e.name for e in early._events] == ["a", "b", "b2", "c", "c2", "d", "e"]
    assert not st.pending


def test_deferred_events_wait_at_most_flush_after():
    from meshviz.trace.state import trace_state

    trace.clear_sinks()
    st = trace_state()
    with trace.record() as rec:
        old = time.time() - 2 * trace.FLUSH_AFTER
        trace.defer(st, _made, (next(st.seq), "old", old), old)
        assert rec._events == []
        now = time.time()
        trace.defer(st, _made, (next(st.seq), "new", now), now)  # the oldest is past its wait: both go
        assert [e.name for e in rec._events] == ["old", "new"]


def test_a_traced_reshard_defers_its_events_with_the_values_of_their_time():
    import torch

    import meshviz.distributed as dist
    from meshviz.runtime.autograd import run_reshard
    from meshviz.testing import run_ranks

    def fn():
        dist.init_parallel_env()
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])  # a mesh of one rank would reshard with no step
        d = dist.shard_tensor(torch.arange(6.0).reshape(2, 3), mesh, [dist.Shard(0)])
        with trace.record() as rec:
            out = run_reshard(d, mesh, [dist.Replicate()])
            held = len(rec._events)
            out._local.mul_(10)  # changed before anything reads the events
            d._local.add_(1)
            evs = rec.events
        return held, [(e.kind, e.values, e.local_shape) for e in evs]

    [(held, evs), _] = run_ranks(fn, 2, ranks="threads")
    assert held == 0
    assert evs == [("reshard", [0.0, 1.0, 2.0], [1, 3]), ("reshard_step", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [2, 3])]


def test_a_collective_after_a_traced_reshard_waits_behind_its_events():
    import torch

    import meshviz.distributed as dist
    from meshviz.runtime.autograd import run_reshard
    from meshviz.testing import run_ranks

    def fn():
        dist.init_parallel_env()
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        d = dist.shard_tensor(torch.arange(8.0).reshape(4, 2), mesh, [dist.Shard(0)])
        g = torch.ones(2)
        with trace.record() as rec:
            out = run_reshard(d, mesh, [dist.Replicate()])
            dist.all_reduce(g)
            held = len(rec._events)  # the all-reduce's event did not make the reshard's (a GPU read would wait)
            out._local.mul_(10)
            evs = rec.events
        return held, [(e.kind, e.seq, e.values) for e in evs], g.tolist()

    for held, evs, g in run_ranks(fn, 2, ranks="threads"):
        assert held == 0 and g == [2.0, 2.0]
        assert [k for k, _, _ in evs] == ["reshard", "reshard_step", "collective"]
        assert [q for _, q, _ in evs] == sorted(q for _, q, _ in evs)
        assert evs[1][2] == [float(i) for i in range(8)]  # the gathered block as it was, not as it is now


def test_a_traced_reshard_names_the_users_line_it_ran_from():
    import sys

    import torch

    import meshviz.distributed as dist
    from meshviz.runtime.autograd import run_reshard
    from meshviz.testing import run_ranks

    def fn():
        dist.init_parallel_env()
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])  # a mesh of one rank would reshard with no step
        d = dist.shard_tensor(torch.arange(6.0).reshape(2, 3), mesh, [dist.Shard(0)])
        w = dist.shard_tensor(torch.ones(2, 3, requires_grad=True), mesh, [dist.Shard(0)])
        lines = []
        with trace.record() as rec:
            lines.append(sys._getframe().f_lineno + 1)
            dist.reshard(d, mesh, [dist.Replicate()])
            lines.append(sys._getframe().f_lineno + 1)
            dist.reshard(w, mesh, [dist.Replicate()])  # through the autograd function
            lines.append(sys._getframe().f_lineno + 1)
            run_reshard(d, mesh, [dist.Replicate()])
        return lines, [e.payload.where for e in rec.of_kind("reshard_step")]

    for lines, wheres in run_ranks(fn, 2, ranks="threads"):
        assert wheres == [f"test_trace.py:{n} in fn()" for n in lines]
