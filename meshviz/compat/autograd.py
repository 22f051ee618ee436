"""The autograd engine's private corners meshviz asks about (torch 2.11-2.15)."""

from __future__ import annotations

import torch

__all__ = ["autograd_sequence_nr", "running_node", "in_backward", "will_run", "graph_task_id", "is_ddp_sink"]

# the number the next autograd node made on this thread gets: the nodes a stretch of forward made are numbered from
# its value before to its value after (torch numbers nodes so to order the backward)
autograd_sequence_nr = torch._C._autograd._get_sequence_nr


def running_node():
    """The autograd node whose backward runs now on this thread (None outside one: a backward's final callbacks)."""
    return torch._C._current_autograd_node()


def graph_task_id() -> int:
    """The backward pass (graph task) running now on this thread: one number per backward; -1 outside one."""
    return torch._C._current_graph_task_id()


def is_ddp_sink(node) -> bool:
    """Whether ``node`` is the backward of torch DDP's own autograd Function on its outputs (``_DDPSink``)."""
    from torch.nn.parallel.distributed import _DDPSink

    return getattr(node, "_forward_cls", None) is _DDPSink


def in_backward() -> bool:
    """Whether a backward pass runs now on this thread (its nodes, their hooks, its final callbacks)."""
    return torch._C._current_graph_task_id() != -1


def will_run(node) -> bool:
    """Whether the backward under way runs ``node`` (as DDP's find_unused_parameters asks; True where torch cannot
    say: outside a backward, or a torch without the query)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, AssertionError, RuntimeError):
        return True
