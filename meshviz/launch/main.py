"""Paddle's launch flags mapped onto torch.distributed's elastic launcher (torchrun's machinery)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys

from .envs import apply_env, overrides, with_sources
from .envs import strtobool as _bool
from .logs import LogCopier, WorkerLogs

__all__ = ["main", "launch", "parse_args", "build_config"]


# Paddle's flags for what meshviz does not run: given, they are refused, saying why (None: not given)
_PS = "a parameter-server flag (Paddle's --run_mode ps)"
_REFUSED = {"servers": _PS, "trainers": _PS, "trainer_num": _PS, "server_num": _PS, "gloo_port": _PS, "with_gloo": _PS,
            "auto_parallel_config": "a flag of Paddle's auto-parallel tuner", "auto_tuner_json": "a flag of Paddle's "
            "auto-tuner"}
_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


def parse_args(argv=None, environ=None) -> argparse.Namespace:
    """The flags in ``argv``, then Paddle's launch variables in ``environ`` (default ``os.environ``) over them, as
    Paddle's launch reads them (PADDLE_NNODES, PADDLE_MASTER, ...: see :mod:`meshviz.launch.envs`); ValueError,
    naming the variable, for one whose value is of the wrong kind."""
    p = argparse.ArgumentParser(
        prog="python -m meshviz.launch",
        description="Start a distributed training script on this node, Paddle's way (on torchrun's agent).",
        epilog="Paddle's launch variables override these flags, as in Paddle: PADDLE_NNODES, PADDLE_MASTER, "
               "PADDLE_RANK (else PADDLE_TRAINER_ID), PADDLE_NPROC_PER_NODE, PADDLE_DEVICES, PADDLE_IPS, "
               "PADDLE_START_PORT, PADDLE_LOG_DIR, PADDLE_LOG_LEVEL, PADDLE_LOG_OVERWRITE, PADDLE_JOB_ID, "
               "PADDLE_RUN_MODE, PADDLE_MAX_RESTART, PADDLE_SORT_IP, PADDLE_ELASTIC_LEVEL, PADDLE_ELASTIC_TIMEOUT, "
               "PADDLE_AUTO_CLUSTER, POD_IP (--host); its parameter-server and auto-tuner ones are refused.")
    p.add_argument("--nproc_per_node", type=int, default=None, help="processes on this node (default: one per "
                   "device in --devices, else one per GPU, else 1)")
    p.add_argument("--nnodes", default=None, help="number of nodes (default 1, or len(--ips)); Paddle's elastic "
                   "range N:M is refused")
    p.add_argument("--master", default=None, help="ip:port of the rendezvous on node 0 (needed with nnodes > 1)")
    p.add_argument("--rank", type=int, default=-1, help="this node's rank, 0..nnodes-1 (ignored on one node, "
                   "as Paddle's)")
    p.add_argument("--devices", "--gpus", "--xpus", dest="devices", default=None,
                   help="comma-separated GPU ids, one process each, or 'cpu' (default: one process per GPU with "
                        "NCCL when there are enough GPUs, else on the CPU with gloo)")
    p.add_argument("--ips", default=None, help="comma-separated node ips (legacy); node 0's is the master")
    p.add_argument("--host", default=None, help="this node's ip, to find it in --ips")
    p.add_argument("--log_dir", default="log", help="where workerlog.N (local rank N) goes (default: log)")
    p.add_argument("--log_overwrite", type=_bool, default=False, help="write workerlog.N afresh (default False: "
                   "each run is appended to what earlier runs left, as Paddle's)")
    p.add_argument("--log_level", default="INFO", help="the launcher's own messages: INFO (default) prints the "
                   "configuration, WARNING and above only warnings and errors")
    p.add_argument("--max_restart", type=int, default=0, help="restarts of the local workers on failure (default "
                   "0: Paddle restarts only in its elastic mode, which meshviz does not have)")
    p.add_argument("--job_id", default="default", help="run id shared by the nodes of one job")
    p.add_argument("--run_mode", default="collective", help="only 'collective' is supported")
    p.add_argument("--start_port", type=int, default=6070, help="master port with --ips and no --master")
    p.add_argument("--sort_ip", type=_bool, default=False, help="accepted, as Paddle's (node ranks here come "
                   "from --rank or --ips)")
    p.add_argument("--enable_gpu_log", type=_bool, default=True, help="accepted, as Paddle's")
    p.add_argument("--legacy", type=_bool, default=False, help="Paddle's legacy launcher: only false")
    p.add_argument("--elastic_level", type=int, default=-1, help="only -1 (Paddle's elastic mode is not supported)")
    p.add_argument("--elastic_timeout", type=int, default=30, help="accepted, as Paddle's (no elastic mode)")
    p.add_argument("--auto_cluster_config", type=_bool, default=False, help="only false")
    for name in _REFUSED:
        p.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hang_after", type=float, default=5.0, help="seconds a rank may wait in one collective "
                   "before node 0 prints the roll-call (which rank waits where, which never arrived); 0: never")
    p.add_argument("--check_collectives", action="store_true", help="compare op, shapes and dtypes across the "
                   "ranks before each collective on gloo (gloo ends a process on a size mismatch)")
    p.add_argument("training_script", help="the script to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return apply_env(p.parse_args(argv), environ)


def _local_ips() -> set[str]:
    ips = {"127.0.0.1", "localhost"}
    try:
        host = socket.gethostname()
        ips.add(host)
        ips.update(info[4][0] for info in socket.getaddrinfo(host, None))
    except OSError:
        pass
    return ips


def _spec(args):
    from ..core.devices import parse_devices

    if not args.devices:
        return "auto"
    try:
        return parse_devices(args.devices)
    except ValueError:
        raise ValueError(f"--devices must be comma-separated GPU ids or 'cpu', got {args.devices!r}") from None


def _plan(args):
    """Every local worker's device and the one backend, decided before anything starts (ValueError otherwise)."""
    from ..core.devices import plan_devices
    from ..runtime.devices import visible_gpu_count

    spec, nproc = _spec(args), args.nproc_per_node
    if isinstance(spec, tuple) and nproc is not None:
        spec = spec[:nproc]
    return plan_devices(nproc, spec, visible_gpu_count(), os.environ.get("MESHVIZ_BACKEND") or None,
                        default_cpu=1, who="", names={"n": "--nproc_per_node", "devices": "--devices",
                                                      "backend": "MESHVIZ_BACKEND"})


def _rank_envs(plan, listed: bool) -> list[dict]:
    """Each local worker's device variables: GPUs named in --devices are the only one a worker sees (as Paddle's
    FLAGS_selected_gpus); otherwise worker i sees every GPU and computes on its own; CPU workers see none."""
    from ..runtime.devices import rank_env, visible_gpu_labels

    labels = visible_gpu_labels()
    out = []
    for r in range(plan.n):
        env = rank_env(plan, r, labels, renumber=listed)
        if plan.on_gpu and plan.gpus is not None:
            g = plan.gpus[r]
            env["FLAGS_selected_gpus"] = labels[g] if listed and labels and g < len(labels) else str(g)
        out.append(env)
    return out


def _paddle_envs(args, plan, nnodes: int, node_rank: int, master: str) -> list[dict]:
    """Each local worker's Paddle variables, as Paddle's launch sets them: ranks, sizes, the master, the endpoints
    (with --ips Paddle's ``ip:start_port+i``; else the master's host and the ports after its port, names only), the
    log folder and, on the CPU, PADDLE_DISTRI_BACKEND=gloo. Without --ips each worker names its rank and the
    endpoints again once torch's rendezvous has counted the ranks (nodes may run different --nproc_per_node)."""
    from ..runtime.rendezvous import paddle_endpoints, paddle_env

    n = plan.n
    ips = _ips(args)
    if ips:
        endpoints = [e for ip in ips for e in paddle_endpoints(ip, args.start_port, n)]
    else:
        host, _, port = master.rpartition(":")
        endpoints = paddle_endpoints(host, int(port), nnodes * n)
    out = []
    for i in range(n):
        g = node_rank * n + i
        env = paddle_env(g, endpoints)
        env.update(PADDLE_GLOBAL_RANK=str(g), PADDLE_GLOBAL_SIZE=str(nnodes * n), PADDLE_LOCAL_RANK=str(i),
                   PADDLE_RANK_IN_NODE=str(i), PADDLE_LOCAL_SIZE=str(n), PADDLE_NNODES=str(nnodes),
                   PADDLE_MASTER=master, PADDLE_LOG_DIR=os.path.abspath(args.log_dir))
        if not plan.on_gpu:
            env["PADDLE_DISTRI_BACKEND"] = "gloo"
        elif plan.gpus is None:  # the worker sees every GPU: its own is its local rank's (listed: _rank_envs)
            env["FLAGS_selected_gpus"] = str(i)
        out.append(env)
    return out


def build_config(args: argparse.Namespace):
    """(LaunchConfig, environment for the workers) from the parsed flags; ValueError on inconsistent flags.

    A port picked here for a one-node run is only a number once this returns; :func:`launch` keeps it held.
    """
    config, env, _, _ = _build(args)
    return config, env


def _ips(args) -> list[str] | None:
    return [i.strip() for i in args.ips.split(",") if i.strip()] if args.ips else None


def _nnodes(text) -> int:
    """``--nnodes N``; Paddle's elastic ``N:M`` only when N == M (one number of nodes)."""
    lo, sep, hi = str(text).partition(":")
    try:
        n, m = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"--nnodes must be a number of nodes, got {text!r}") from None
    if n != m:
        raise ValueError(f"--nnodes {text}: an elastic range of nodes (Paddle's elastic mode) is not supported; "
                         "give one number")
    return n


def _flags(args: argparse.Namespace):
    """(nnodes, node rank, master or None) from the flags that need no torch; ValueError on inconsistent ones."""
    if args.run_mode != "collective":
        raise ValueError(f"--run_mode {args.run_mode!r}: only 'collective' is supported")
    for name, what in _REFUSED.items():
        if getattr(args, name, None) is not None:
            raise ValueError(f"--{name} is {what}, which meshviz does not have (it runs collective jobs)")
    if args.legacy:
        raise ValueError("--legacy: Paddle's legacy launcher is not supported; leave the flag out")
    if args.elastic_level != -1:
        raise ValueError(f"--elastic_level {args.elastic_level}: Paddle's elastic mode is not supported (only -1)")
    if args.auto_cluster_config:
        raise ValueError("--auto_cluster_config: Paddle's auto-parallel cluster search is not supported")
    if str(args.log_level).upper() not in _LEVELS:
        raise ValueError(f"--log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got {args.log_level!r}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node must be >= 1, got {args.nproc_per_node}")
    spec = _spec(args)
    if isinstance(spec, tuple) and args.nproc_per_node is not None and args.nproc_per_node > len(spec):
        raise ValueError(f"--nproc_per_node {args.nproc_per_node} asks for more processes than the {len(spec)} "
                         f"devices listed in --devices {args.devices}")
    ips = _ips(args)
    nnodes = _nnodes(args.nnodes) if args.nnodes is not None else (len(ips) if ips else 1)
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if ips and len(ips) != nnodes:
        raise ValueError(f"--ips lists {len(ips)} nodes but --nnodes is {nnodes}")
    node_rank = args.rank
    if nnodes == 1:
        node_rank = 0  # one node is node 0 whatever --rank, PADDLE_RANK or PADDLE_TRAINER_ID say: Paddle ignores them
    if node_rank < 0:
        if ips:
            here = {args.host} if args.host else _local_ips()
            mine = [i for i, ip in enumerate(ips) if ip in here]
            if len(mine) != 1:
                raise ValueError(f"cannot tell which of --ips {ips} is this node; pass --rank (or --host)")
            node_rank = mine[0]
        else:
            raise ValueError("--nnodes > 1 needs --rank (this node's rank)")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--rank {node_rank} outside 0..{nnodes - 1}")
    master = args.master
    if master is None and nnodes > 1:
        if not ips:
            raise ValueError("--nnodes > 1 needs --master ip:port (or --ips)")
        master = f"{ips[0]}:{args.start_port}"
    if master is not None and master.startswith("etcd://"):
        raise ValueError(f"--master {master}: Paddle's elastic mode (an etcd master) is not supported; give ip:port")
    if master is not None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--master must be ip:port, got {master!r}")
    if args.max_restart < 0:
        raise ValueError(f"--max_restart must be >= 0, got {args.max_restart}")
    if args.hang_after < 0:
        raise ValueError(f"--hang_after must be >= 0, got {args.hang_after}")
    return nnodes, node_rank, master


def _build(args: argparse.Namespace, flags=None):
    """build_config, the port reservation for the agent's store when this process picked the port, and the plan
    (``flags``: what :func:`_flags` gave for ``args``, when the caller checked them already)."""
    nnodes, node_rank, master = flags or _flags(args)

    from torch.distributed.launcher.api import LaunchConfig

    from ..runtime import rendezvous

    plan = _plan(args)
    nproc = plan.n
    reservation = None
    if master is None:
        reservation = rendezvous.reserve_port()  # held until the agent's store serves on it
        master = f"{rendezvous.LOOPBACK}:{reservation.port}"

    from ..runtime import watchdog
    from . import nodes

    env = {"MESHVIZ_LAUNCH_MERGE_STDERR": "1", "MESHVIZ_BACKEND": plan.backend,
           "MESHVIZ_LAUNCH_ENDPOINTS": "" if args.ips else master,
           nodes.IPS_ENV: json.dumps({"ips": _ips(args), "start_port": args.start_port}) if args.ips else "",
           "MESHVIZ_LAUNCH_RANK_ENV": json.dumps(_rank_envs(plan, listed=isinstance(_spec(args), tuple))),
           "MESHVIZ_LAUNCH_PADDLE_ENV": json.dumps(_paddle_envs(args, plan, nnodes, node_rank, master))}
    if args.hang_after > 0:
        env[watchdog.HANG_AFTER_ENV] = str(args.hang_after)
        env[watchdog.HOST_ENV] = "parent"  # node 0's launcher prints the roll-call
    if args.check_collectives:
        env["MESHVIZ_CHECK_COLLECTIVES"] = "1"
    logs = WorkerLogs(args.log_dir, tee_ranks={0} if node_rank == 0 else set())
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=args.job_id,
        role="worker",
        rdzv_backend="static",
        rdzv_endpoint=master,
        rdzv_configs={"rank": node_rank, "timeout": int(os.environ.get("MESHVIZ_RDZV_TIMEOUT", "900"))},
        max_restarts=args.max_restart,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs,
    )
    return config, env, reservation, plan


def _agent_store(config, reservation):
    """On node 0 of a run on this machine (a loopback master), the TCPStore that torchrun's agent is about to
    create, served here first on loopback only: the agent's ``TCPStore(..., multi_tenant=True)`` on the same port
    then uses it instead of listening on every interface. None elsewhere (the agent serves, or node 0 does)."""
    from ..runtime import rendezvous

    host, _, port = config.rdzv_endpoint.rpartition(":")
    if config.rdzv_configs["rank"] != 0 or not rendezvous.is_loopback(host):
        if reservation is not None:
            reservation.close()
        return None
    if reservation is None:
        reservation = rendezvous.PortReservation(rendezvous.LOOPBACK, int(port))
    timeout = config.rdzv_configs.get("timeout", 900)
    return rendezvous.serve_store(reservation, None, timeout, multi_tenant=True)


def _banner(args, config, plan=None) -> str:
    placed = None if plan is None else f"{', '.join(plan.devices)} ({plan.backend})"
    rows = [("nnodes", config.min_nodes), ("nproc_per_node", config.nproc_per_node), ("node rank",
            config.rdzv_configs["rank"]), ("master", config.rdzv_endpoint), ("devices", args.devices),
            ("workers on", placed), ("log_dir", args.log_dir), ("log_overwrite", args.log_overwrite),
            ("max_restart", config.max_restarts), ("job_id", config.run_id),
            ("training_script", args.training_script), ("training_script_args", args.training_script_args)]
    lines = ["-----------  Configuration Arguments -----------"]
    lines += [f"{k}: {v}" for k, v in rows]
    lines.append("------------------------------------------------")
    return "\n".join(lines)


def launch(argv=None) -> int:
    """Parse ``argv``, start the local workers, wait; returns the exit code (0 when every worker succeeded)."""
    from .agent import Torchrun
    from .leavers import Leavers
    from .nodes import rendezvous_failure

    args = None
    try:
        args = parse_args(argv)
        _print_overrides(args)
        flags = _flags(args)  # before torch is imported: a bad flag or a missing script is refused at once
        _check_script(args.training_script)
        config, env, reservation, plan = _build(args, flags)
    except ValueError as e:
        print(f"meshviz.launch: error: {with_sources(str(e), args) if args is not None else e}", file=sys.stderr)
        return 2
    try:
        store = _agent_store(config, reservation)  # served until the agent is done
    except OSError as e:
        print(f"meshviz.launch: error: cannot serve the rendezvous on {config.rdzv_endpoint}: {e}", file=sys.stderr)
        shutil.rmtree(config.logs_specs.raw_dir, ignore_errors=True)
        return 2
    level = logging.getLevelName(args.log_level.upper())
    if level <= logging.INFO:
        print(_banner(args, config, plan), flush=True)
    if plan.notice and level <= logging.WARNING:
        print(f"meshviz.launch: {plan.notice}", file=sys.stderr, flush=True)
    os.environ.update(env)
    logs = LogCopier(config.logs_specs.raw_dir, args.log_dir, plan.n, args.log_overwrite).start()
    runner = Torchrun(config, entrypoint=sys.executable, leave=True)
    host = _rollcall_host(args, config, runner)
    line = _node_line(config, runner)
    hung, over = _stop_when_hung(host, runner, line) if host is not None else ([], None)
    leavers = Leavers(config.rdzv_endpoint, config.min_nodes * plan.n, config.min_nodes).watch(runner)
    from torch.distributed import DistNetworkError, DistStoreError

    try:
        try:
            job = runner.start().submit(
                ["-u", "-m", "meshviz.launch._worker", args.training_script, *args.training_script_args])
        except (DistStoreError, DistNetworkError) as e:  # the agent's rendezvous timed out: no worker started
            print(f"meshviz.launch: error: {rendezvous_failure(e, config)}", file=sys.stderr, flush=True)
            return 1
        finally:
            logs.stop()
            leavers.stop()
        if leavers.left:
            return leavers.report(args)
        if hung:
            return _report_hang(args, hung[0])
        if line is not None and line.heard is not None and (job.interrupted is not None or job.exception is None):
            print("meshviz.launch: " + "\nmeshviz.launch: ".join(line.text(line.heard, job)), file=sys.stderr)
            return 1
        if job.interrupted is not None:
            print(f"meshviz.launch: {job.interrupted}: the workers were stopped{job.killed_text()}", file=sys.stderr)
            return signal.Signals[job.interrupted].value  # the signal's number, as Paddle's launch exits (2, 15)
        if job.exception is not None:
            return _report_failure(args, job, host, logs, line)
    finally:
        if over is not None:
            over.set()
        if line is not None:  # node 0 of a failed job serves the store until the other nodes have read it
            line.finish(failed=bool(hung or leavers.left) or line.heard is not None or (
                runner.job is not None and runner.job.exception is not None))
        if host is not None:
            host.stop()
        logs.remove_raw()
        del store
    return 0


def _check_script(script: str) -> None:
    """ValueError unless ``script`` is a Python script (or folder, or zip) here, or a program to run as it is."""
    from ._worker import is_program

    if is_program(script):
        if shutil.which(script) is None:
            raise ValueError(f"no such program {script!r} (a script not ending in .py is run as a program, as in "
                             "Paddle's launch)")
    elif not os.path.exists(script):
        raise ValueError(f"no such script {script!r}")


def _print_overrides(args) -> None:
    """Which of Paddle's variables set a flag (unless --log_level hides warnings), as Paddle's launch says."""
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int) or level <= logging.WARNING:
        for line in overrides(args):
            print(f"meshviz.launch: {line}", file=sys.stderr, flush=True)


def _report_failure(args, job, host, logs, line=None) -> int:
    """Say which workers failed (the agent stopped the others), the roll-call's diagnosis and their logs' tails (on
    several nodes, another node's worker that failed first where this node's lost their connection); the exit code."""
    from .nodes import tell_nodes

    failed = job.failed()
    news = tell_nodes(line, job, failed[0]) if line is not None else None
    if host is not None:
        # a worker that raised before a collective its peers wait in is named with its error; the stopped never answer
        host.dead, host.ended = job.gone, lambda: job.ranks
    rc = host.blame() if host is not None and news is None else None
    if rc is not None and rc.blame():
        print("meshviz.launch: " + "\nmeshviz.launch: ".join(rc.blame()), file=sys.stderr)
    then = ", ".join(map(str, failed[1:]))
    after = f" first, then global rank{'s' if len(failed) > 2 else ''} {then}" if len(failed) > 1 else ""
    logs_at = f"Logs: {os.path.join(args.log_dir, 'workerlog.N')}"
    if news is not None:
        print("meshviz.launch: " + "\nmeshviz.launch: ".join(line.text(news)) + f". {logs_at}", file=sys.stderr)
    else:
        print(f"meshviz.launch: the worker with global rank {failed[0]} failed{after}; the others were stopped"
              f"{job.killed_text()}. {logs_at}", file=sys.stderr)
    for rank in failed:
        f = job.failures[rank]
        path = os.path.join(args.log_dir, f"workerlog.{f.local_rank}")
        if os.path.exists(path):
            tail = logs.this_run(f.local_rank).splitlines()[-15:]  # this run's: the log keeps earlier runs' too
            print(f"---- tail of {path} (rank {rank}, exit code {f.exitcode}) ----", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)
    return job.exit_code() or 1


def _stop_when_hung(host, runner, line=None):
    """Watch ``host`` until the returned event is set: at a roll-call that found a wait nothing can end (ranks in
    different collectives, or ranks missing from one that are done), keep it in the returned list, tell the other
    nodes (``line``) and stop the workers."""
    import threading

    hung: list = []
    over = threading.Event()

    def watch():
        while not over.wait(0.2):
            rc = host.unending()
            if rc is not None and runner.job is not None and not runner.job.done():
                hung.append(rc)
                if line is not None:
                    line.say_stopped(rc)
                os.kill(os.getpid(), signal.SIGTERM)  # the agent ends its workers with it (a SIGINT waits 30 s)
                return

    threading.Thread(target=watch, name="meshviz-launch-hang", daemon=True).start()
    return hung, over


def _report_hang(args, rc) -> int:
    """Say why the workers were stopped at a roll-call: who never entered (or the mismatch), who waited."""
    print("meshviz.launch: " + "\nmeshviz.launch: ".join(rc.blame()), file=sys.stderr)
    print(f"meshviz.launch: the workers were stopped at the roll-call: nothing could end that wait. Logs: "
          f"{os.path.join(args.log_dir, 'workerlog.N')}", file=sys.stderr)
    return 1


def _node_line(config, runner):
    """On several nodes, this node's line to the others (:class:`~meshviz.launch.nodes.NodeLine`), watching."""
    if config.min_nodes < 2:
        return None
    from .nodes import NodeLine

    line = NodeLine(config.rdzv_endpoint, config.min_nodes, config.rdzv_configs["rank"])
    line.watch(runner)
    return line


def _rollcall_host(args, config, runner):
    """On node 0, the thread that prints the roll-call when a worker has waited ``--hang_after`` seconds in a
    collective (it reads the agent's store, which may come up a moment later). None elsewhere or when off."""
    if args.hang_after <= 0 or config.rdzv_configs["rank"] != 0:
        return None
    from .nodes import rollcall_host

    host, _, port = config.rdzv_endpoint.rpartition(":")
    return rollcall_host(host, int(port), config.min_nodes, config.nproc_per_node, args.hang_after, runner)


def main(argv=None) -> None:
    """Console script ``fleetrun`` and ``python -m meshviz.launch``."""
    sys.exit(launch(argv))
