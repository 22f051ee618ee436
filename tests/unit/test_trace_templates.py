"""Event templates and the block values a traced reshard reads: the same events as built field by field."""

import pytest
import torch

from meshviz import trace
from meshviz.runtime.reshard_events import values_of
from meshviz.trace import Event, EventTemplate
from meshviz.trace.state import trace_state

pytestmark = pytest.mark.timeout(60)

FIELDS = dict(kind="reshard_step", op="all_gather", mesh={"shape": [2], "process_ids": [0, 1], "dim_names": ["x"]},
              axis=0, group=[0, 1], bytes=64, placements_before=["S(0)"], placements_after=["R"],
              shape_before=[4, 4], shape_after=[4, 4], step=0, payload=trace.ReshardStep(dim=0))


def test_a_stamp_is_the_event_its_fields_make():
    tpl = EventTemplate(**FIELDS)
    ev = tpl.stamp(7, rank=1, name="w", tensor_id=3, plan_id=2, start=1.5, local_shape=[4, 4], values=[1.0, 2.0],
                   payload=trace.ReshardStep(dim=0, where="x.py:1"))
    want = Event(**{**FIELDS, "payload": trace.ReshardStep(dim=0, where="x.py:1")}, seq=7, rank=1, name="w",
                 tensor_id=3, plan_id=2, start=1.5, local_shape=[4, 4], values=[1.0, 2.0])
    assert type(ev) is Event and ev == want
    assert ev.to_dict() == want.to_dict() and list(ev.to_dict()) == list(want.to_dict())  # same fields, same order
    assert trace.to_json(ev) == trace.to_json(want)


def test_a_runs_stamp_is_the_event_its_fields_make_and_owns_its_fields():
    tpl = EventTemplate(**FIELDS)
    payload = trace.ReshardStep(dim=0, where="x.py:2", module="mlp")
    ev = tpl.stamp_run(5, 1.0, 2.5, 1, 3, "w", 4, 9, [2, 4], [0.5, 1.5], payload)
    want = Event(**{**FIELDS, "payload": payload}, seq=5, start=1.0, end=2.5, rank=1, cell=3, name="w", tensor_id=4,
                 plan_id=9, local_shape=[2, 4], values=[0.5, 1.5])
    assert type(ev) is Event and ev == want and list(ev.to_dict()) == list(want.to_dict())
    assert trace.to_json(ev) == trace.to_json(want) and trace.from_json(trace.to_json(ev)) == want
    other = tpl.stamp_run(6, 3.0, 4.0, 1, 3, "w", 4, 10, [2, 4], [7.0, 8.0])
    assert (other.seq, other.plan_id, other.values, other.payload) == (6, 10, [7.0, 8.0], trace.ReshardStep(dim=0))
    assert (ev.seq, ev.plan_id, ev.values, ev.payload) == (5, 9, [0.5, 1.5], payload)  # untouched by the next run
    with pytest.raises(ValueError, match="reshard_step"):
        tpl.stamp_run(7, 0.0, 0.0, 0, None, None, None, None, None, None, trace.Mark())
    with pytest.raises(TypeError, match="colour"):
        tpl.stamp(8, colour="red")


def test_a_template_takes_no_number_and_checks_its_kind_once():
    before = next(trace_state().seq)
    EventTemplate(**FIELDS).stamp(0)
    assert next(trace_state().seq) == before + 1
    with pytest.raises(ValueError, match="does not match"):
        EventTemplate(**{**FIELDS, "kind": "reshard"})
    ev = EventTemplate(kind="mark").stamp(0, name="m")
    assert ev.payload == trace.Mark() and ev.start > 0 and ev.name == "m"


@pytest.mark.parametrize("t", [
    torch.randn(8, 8), torch.randn(3), torch.randn(()), torch.randn(4, 4, 4), torch.randn(100), torch.randn(9, 9),
    torch.arange(12).reshape(3, 4), torch.ones(2, 3, dtype=torch.bool), torch.randn(3, 3, dtype=torch.complex64),
    torch.randn(8, 8).t(), torch.randn(0, 3), torch.empty(0), torch.randn(4, 4, device="meta"),
    torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4, requires_grad=True),
    torch.nn.Parameter(torch.randn(2, 2)), torch.randn(8, 8)[::2, 1:], torch.randn(2, 3, 4, 5),
    # over MAX_VALUES and strided: only the leading rows are read, the values are still the tensor's leading ones
    torch.randn(96, 80).t(), torch.randn(3, 5, 7, 11).permute(2, 0, 3, 1), torch.randn(64, 1).expand(64, 100),
    torch.randn(2, 3, 200)[:, :, ::3], torch.randn(40, 40, requires_grad=True).t(), torch.randn(1, 300).t(),
], ids=lambda t: f"{type(t).__name__}{list(t.shape)}{t.dtype}{t.device.type}")
def test_a_blocks_values_read_quickly_are_small_values(t):
    got, want = values_of(t), trace.small_values(t)
    assert got == want and type(got) is type(want)
    assert got is None or [type(v) for v in got] == [type(v) for v in want]
    if t.device.type == "meta" or t.is_complex():
        assert got is None
    else:  # the tensor itself: its leading values, flat
        assert got == t.detach().reshape(-1)[: trace.MAX_VALUES].tolist()
