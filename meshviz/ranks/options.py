"""``spawn``'s options as Paddle's: the known ones, the deprecated ones, and what only several machines need."""

from __future__ import annotations

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
