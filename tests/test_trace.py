"""Trace sinks and the live stream: batching, order, latency, JSONL round trips, robustness."""

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
    for r, evs in rx.log.by_rank().items():
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
    from meshviz.distributed.rendezvous import free_port

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
