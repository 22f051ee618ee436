"""Events the runtime emits and the widgets draw, and where they go."""

from .commtable import CommRow, CommTable, comm_table
from .events import KINDS, MAX_VALUES, Event, EventTemplate, from_json, leading_rows, small_values, to_json
from .ownership import Ownership
from .payloads import (
    Collective,
    Compute,
    Issued,
    Mark,
    OpRule,
    Payload,
    Placed,
    Recv,
    ReshardPlan,
    ReshardStep,
    Send,
    Share,
)
from .recorder import (
    FLUSH_AFTER,
    JSONLSink,
    MemorySink,
    active,
    add_sink,
    clear_sinks,
    defer,
    defer_entry,
    defer_record,
    emit,
    flush,
    lazy_reader,
    load_events,
    my_rank,
    on_active,
    record,
    remove_sink,
    replay,
    set_cell,
    set_rank,
    sinks,
    span,
)
from .status import RankStatus, RollCall, Situation

__all__ = [
    "Event", "EventTemplate", "KINDS", "MAX_VALUES", "leading_rows", "small_values", "to_json", "from_json",
    "Ownership", "Payload", "Placed", "ReshardPlan", "ReshardStep", "Issued", "Collective", "Send", "Recv", "Compute",
    "Mark", "Share", "OpRule", "RankStatus", "RollCall", "Situation", "CommRow", "CommTable", "comm_table",
    "active", "on_active", "emit", "defer", "defer_entry", "defer_record", "lazy_reader", "flush", "FLUSH_AFTER",
    "span", "add_sink", "remove_sink", "clear_sinks", "sinks", "set_rank", "set_cell", "my_rank", "MemorySink",
    "JSONLSink", "record", "replay", "load_events",
]
