"""``spawn``'s options as Paddle's: the known ones, the deprecated ones, and what only several machines need."""

from __future__ import annotations

import numbers

from ..runtime import rendezvous

__all__ = ["check_spawn_options", "SPAWN_OPTIONS"]

SPAWN_OPTIONS = frozenset({"backend", "devices", "gpus", "timeout", "trace", "threads", "start_method", "hang_after",
                            "check_collectives", "print_config", "ips", "xpus", "mlus"})
_DEPRECATED = frozenset({"selected_devices", "started_port", "cluster_node_ips", "node_ip", "use_paddlecloud"})


def check_spawn_options(options: dict) -> None:
    """Paddle's spawn options: ``ips`` naming this machine only (launch spans machines), no XPUs or MLUs here, the
    deprecated ones warned about and ignored, as Paddle does; any other unknown name raises."""
    import warnings

    for name in sorted(_DEPRECATED & set(options)):
        warnings.warn(f"spawn: the option {name!r} is deprecated and ignored (as in Paddle)", DeprecationWarning, 3)
    unknown = sorted(set(options) - SPAWN_OPTIONS - _DEPRECATED)
    if unknown:  # as Paddle's spawn: a misspelt option is an error, not silently ignored
        raise ValueError(f"spawn: unknown options {unknown}; the options are {sorted(SPAWN_OPTIONS)}")
    ips = [ip.strip() for ip in str(options.get("ips") or "127.0.0.1").split(",")]
    if len(ips) != 1 or not rendezvous.is_loopback(ips[0]):
        raise ValueError(f"spawn: ips={options['ips']!r}: spawn starts its ranks on this machine; for several "
                         "machines run python -m meshviz.launch on each")
    for kind in ("xpus", "mlus"):
        if options.get(kind):
            raise ValueError(f"spawn: {kind}={options[kind]!r}: meshviz runs on CPUs and CUDA GPUs (devices=, gpus=)")
    _check_values(options)


_START_METHODS = ("spawn", "fork", "forkserver")


def _positive(v, integer: bool = False) -> bool:
    """``v`` is a positive finite number (an int with ``integer``), or a string of one; a bool is not."""
    if isinstance(v, str):
        try:
            v = int(v) if integer else float(v)
        except ValueError:
            return False
    kind = numbers.Integral if integer else numbers.Real
    return isinstance(v, kind) and not isinstance(v, bool) and 0 < v < float("inf")


def _check_values(options: dict) -> None:
    """The values of meshviz's own options, checked here: a bad one would otherwise fail on every rank once the
    processes have started (``threads``) or deep inside torch's store (``timeout``)."""
    if "threads" in options and not _positive(options["threads"], integer=True):
        raise ValueError(f"spawn: threads (torch threads per rank) must be a positive int, got {options['threads']!r}")
    for name in ("timeout", "hang_after"):
        v = options.get(name)
        if v is not None and not _positive(v):
            raise ValueError(f"spawn: {name} must be a positive number of seconds or None, got {v!r}")
    method = options.get("start_method")
    if method is not None and method not in _START_METHODS:
        raise ValueError(f"spawn: start_method must be one of {list(_START_METHODS)}, got {method!r}")
