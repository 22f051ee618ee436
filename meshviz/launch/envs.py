"""Paddle's launch variables (PADDLE_NNODES, PADDLE_MASTER, ...): each one set overrides its flag, as in Paddle."""

from __future__ import annotations

import argparse
import os
import re

__all__ = ["ENV_FLAGS", "apply_env", "overrides", "with_sources", "strtobool"]


def strtobool(text: str) -> bool:
    """Paddle's ``strtobool`` for its yes/no flags."""
    v = str(text).strip().lower()
    if v in ("y", "yes", "t", "true", "on", "1"):
        return True
    if v in ("n", "no", "f", "false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a yes/no value (true, false, 1, 0, ...), got {text!r}")


# Paddle 3.3.1's env_args_mapping (paddle/distributed/launch/context/args_envs.py): variable -> (flag, kind); the
# flags meshviz refuses (parameter server, auto-parallel tuner) keep the variable's text, refused in main._flags
ENV_FLAGS: dict[str, tuple[str, type]] = {
    "POD_IP": ("host", str), "PADDLE_MASTER": ("master", str), "PADDLE_DEVICES": ("devices", str),
    "PADDLE_NNODES": ("nnodes", str), "PADDLE_RUN_MODE": ("run_mode", str), "PADDLE_LOG_LEVEL": ("log_level", str),
    "PADDLE_LOG_OVERWRITE": ("log_overwrite", bool), "PADDLE_SORT_IP": ("sort_ip", bool),
    "PADDLE_NPROC_PER_NODE": ("nproc_per_node", int), "PADDLE_JOB_ID": ("job_id", str),
    "PADDLE_RANK": ("rank", int), "PADDLE_LOG_DIR": ("log_dir", str), "PADDLE_MAX_RESTART": ("max_restart", int),
    "PADDLE_ELASTIC_LEVEL": ("elastic_level", int), "PADDLE_ELASTIC_TIMEOUT": ("elastic_timeout", int),
    "PADDLE_SERVER_NUM": ("server_num", str), "PADDLE_TRAINER_NUM": ("trainer_num", str),
    "PADDLE_SERVERS_ENDPOINTS": ("servers", str), "PADDLE_TRAINERS_ENDPOINTS": ("trainers", str),
    "PADDLE_GLOO_PORT": ("gloo_port", str), "PADDLE_WITH_GLOO": ("with_gloo", str),
    "PADDLE_START_PORT": ("start_port", int), "PADDLE_IPS": ("ips", str),
    "PADDLE_AUTO_PARALLEL_CONFIG": ("auto_parallel_config", str),
    "PADDLE_AUTO_CLUSTER": ("auto_cluster_config", bool),
}
TRAINER_ID = "PADDLE_TRAINER_ID"  # read as the node rank (0 or more) before PADDLE_RANK, as Paddle's parse_args


def _value(name: str, text: str, flag: str, kind: type):
    try:
        return strtobool(text) if kind is bool else kind(text.strip()) if kind is int else text
    except (ValueError, argparse.ArgumentTypeError):
        what = "a yes/no value (true, false, 1, 0, ...)" if kind is bool else "an integer"
        raise ValueError(f"{name}={text!r}: Paddle's launch reads it as --{flag}, which takes {what}") from None


def apply_env(args: argparse.Namespace, environ=None) -> argparse.Namespace:
    """Set ``args``' flags from Paddle's variables in ``environ`` (default ``os.environ``) as Paddle's launch does:
    a variable set overrides its flag, given or not; PADDLE_TRAINER_ID (when 0 or more) is the node rank, and
    PADDLE_RANK overrides that. An empty variable counts as unset. ``args.from_env`` keeps flag -> (variable, its
    text). ValueError, naming the variable, for a value of the wrong kind."""
    env = os.environ if environ is None else environ
    args.from_env = {}
    trainer = (env.get(TRAINER_ID) or "").strip()
    if trainer:
        rank = _value(TRAINER_ID, trainer, "rank", int)
        if rank >= 0:
            args.rank = rank
            args.from_env["rank"] = (TRAINER_ID, trainer)
    for name, (flag, kind) in ENV_FLAGS.items():
        text = env.get(name)
        if text:
            setattr(args, flag, _value(name, text, flag, kind))
            args.from_env[flag] = (name, text)
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    """The notices, one per variable that set a flag, as Paddle's launch prints them (PADDLE_TRAINER_ID silently)."""
    return [f"{name}={text} overrides --{flag} (Paddle's launch variables take precedence over its flags)"
            for flag, (name, text) in getattr(args, "from_env", {}).items() if name != TRAINER_ID]


def with_sources(message: str, args: argparse.Namespace) -> str:
    """``message`` (an error about flags) and, for each flag it names that a variable set, which variable."""
    notes = [f"--{flag} from {name}={text!r}" for flag, (name, text) in getattr(args, "from_env", {}).items()
             if re.search(rf"--{flag}(?![\w-])", message)]
    return f"{message} ({'; '.join(notes)})" if notes else message
