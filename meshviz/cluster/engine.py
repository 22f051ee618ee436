"""Engine side of a Cluster: bind a device, join the process group, stream events, and stop peers when a rank fails."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

from ..errors import summary as _summary
from ..ranks import patches
from .messages import TO_RANKS, Abort, Failure, PeerFailed, StatusReply, StatusRequest, Stuck, decode
from .peers import broke_process_group, close_peer_sockets

__all__ = ["probe", "setup", "reinit", "stream_count", "set_tracing", "guarded_call", "call_on_rank", "shutdown",
           "state"]

GRACE = 0.25  # seconds a rank may still be running after a peer failed before it counts as stuck
REPEAT_CLOSE = 2.0  # seconds after an abort when a rank still in the same cell closes its peers' sockets again

_state: "_EngineState | None" = None


def state() -> "_EngineState | None":
    return _state


def _debug(*args) -> None:
    path = os.environ.get("MESHVIZ_CLUSTER_DEBUG")
    if path:
        with open(path.replace("{rank}", os.environ.get("RANK", "?")), "a") as fh:
            print(f"{time.time():.3f}", *args, file=fh)


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _in_users_code(frame) -> bool:
    """Is ``frame`` (the main thread's, where a signal landed) inside the code a kernel request runs for the user:
    a cell's code under IPython's ``run_code``, or an apply's call under ipyparallel's ``do_apply``?"""
    dirs = tuple(os.path.dirname(m.__file__) + os.sep for name in ("IPython", "ipykernel", "ipyparallel")
                 if (m := sys.modules.get(name)) is not None and getattr(m, "__file__", None))
    while frame is not None and frame.f_back is not None:
        parent = frame.f_back
        if parent.f_code.co_name in ("run_code", "do_apply") and parent.f_code.co_filename.startswith(dirs) \
                and not frame.f_code.co_filename.startswith(dirs):
            return True
        frame = parent
    return False


def failure_report(rank: int, value: BaseException, cell: int, rec=None, aborted: bool = False) -> dict:
    """The ``failed`` message a rank sends the cluster (engines and thread ranks alike): the error and its
    traceback, the collective it came out of (``rec``, the rank's roll-call record, when that failure is of this
    ``cell``), a collective mismatch, and whether the rank's process group was torn down because of it."""
    collective = mismatch = None
    if rec is not None:
        failed, rec.failed = rec.failed, None
        if failed is not None and failed.get("cell") == cell:
            collective = failed
    if type(value).__name__ == "CollectiveMismatch":
        mismatch = {"line": str(value), "ranks": list(getattr(value, "ranks", []))}
    return Failure(rank, cell, time.time(), _summary(value), "".join(traceback.format_exception(value))[-8000:],
                   bool(aborted), collective, mismatch).to_dict()


class _EngineState:
    """Per-engine glue: the stream sink, the cell hooks and a thread listening for the client's commands."""

    def __init__(self, cfg: dict):
        import zmq

        from .. import trace
        from ..trace.stream import StreamSink

        self.rank = cfg["rank"]
        self.backend = cfg["backend"]
        self.sink = StreamSink(cfg["stream"])
        self.tracing = False
        self.set_tracing(cfg.get("trace", True))
        self.running = False
        self.cell = 0
        self.abort_pending = False
        self.aborted = False
        self.last_failure: dict | None = None
        self.failed_cell = -1
        self.store = None
        self.peer_pids = set(cfg.get("peer_pids", ()))
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(cfg["control"])
        self._stop = False
        from ..runtime import rollcall

        self._rollcall = rollcall
        rec = rollcall.current()
        rec.rank = self.rank
        rec.thread = threading.get_ident()  # cells run on the engine's main thread, which sets us up
        self._thread = threading.Thread(target=self._listen, name="meshviz-guard", daemon=True)
        self._thread.start()
        self._trace = trace
        self._install_hooks()
        patches.record_torch_calls()  # a raw tdist collective shows in the roll-call and names where it failed

    # -- tracing ------------------------------------------------------------------------------------------------
    def set_tracing(self, on: bool) -> None:
        from .. import trace

        if on and not self.tracing:
            trace.add_sink(self.sink)
        elif not on and self.tracing:
            trace.remove_sink(self.sink, close=False)
        self.tracing = on

    # -- IPython hooks ------------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self._custom_tb = None
        ip = _ipython()
        if ip is None:
            return
        for name, cb in self._events():
            ip.events.register(name, cb)
        ip.set_custom_exc((Exception, KeyboardInterrupt), self._on_exception)
        self._custom_tb = ip.CustomTB
        kernel = getattr(ip, "kernel", None)
        if kernel is not None:  # the kernel makes SIGINT raise during every request, its reply included
            kernel.pre_handler_hook = lambda: setattr(kernel, "saved_sigint_handler",
                                                      signal.signal(signal.SIGINT, self._on_sigint))

    def _events(self) -> tuple:
        """IPython's events this rank follows: a cell's start and end."""
        return (("pre_run_cell", self._pre), ("post_run_cell", self._post))

    def _on_sigint(self, signum, frame):
        # an interrupt escaping the request it lands in (the kernel's reply on its way, IPython's own steps around
        # a cell) loses the reply and leaves the client waiting for this rank forever: only the user's code is
        # interrupted, where the request turns the KeyboardInterrupt into its error
        if _in_users_code(frame):
            raise KeyboardInterrupt
        _debug("SIGINT outside the user's code: ignored")

    def _uninstall_hooks(self) -> None:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is None:
            return
        if "pre_handler_hook" in vars(getattr(ip, "kernel", None) or object()):
            del ip.kernel.pre_handler_hook
        for name, cb in self._events():
            try:
                ip.events.unregister(name, cb)
            except ValueError:
                pass
        ip.set_custom_exc((), None)

    def _pre(self, *_):
        ip = _ipython()
        if ip is not None and ip.CustomTB != self._custom_tb:  # unregistered (see _on_exception): back again
            ip.set_custom_exc((Exception, KeyboardInterrupt), self._on_exception)
            self._custom_tb = ip.CustomTB
        self.cell += 1
        self.running = True
        self._rollcall.current().start(self.cell)
        self._trace.set_cell(self.cell)  # events say which cell emitted them (the comm table groups by it)

    def _post(self, *args, note: str = "its cell finished"):
        err = getattr(args[0], "error_in_exec", None) if args else None
        if isinstance(err, BaseException) and self.failed_cell != self.cell:
            # IPython takes a SystemExit before any custom handler sees it: reported here, or the peers would wait
            # for this rank until the collective timeout
            try:
                self.report_failure(err)
            except BaseException as e:
                _debug("failure report", _summary(e))
        self.running = False
        self._rollcall.current().finish(note)
        if self.abort_pending:
            self._abort()
        self._trace.flush()  # the cell's deferred events (a traced reshard's) go out with it
        self.sink.flush(1.0)

    def _on_exception(self, shell, etype, value, tb, tb_offset=None):
        # IPython unregisters a handler that raises, and the cluster's interrupt (SIGINT) may land in this one:
        # it must never raise, or this rank's later failures would go unreported and its peers wait forever
        try:
            aborts = self.abort_pending or broke_process_group(value)
        except BaseException:
            aborts = self.abort_pending
        reported = aborted = False
        for _ in range(3):  # a SIGINT landing here interrupts a step: it is taken again
            try:
                if not reported:
                    self.report_failure(value, aborts)
                    reported = True
                if aborts and not aborted:
                    # cascade: peers blocked on this rank fail now instead of at the timeout. Gloo closes its
                    # sockets only when the group is freed, and the traceback's frames hold the pending work.
                    try:
                        traceback.clear_frames(tb)
                    except RuntimeError:  # a frame still executing
                        pass
                    self._abort()
                    aborted = True
                break
            except KeyboardInterrupt:
                _debug("failure handler interrupted")
            except BaseException as e:
                _debug("failure handler", _summary(e))
                break
        try:
            return shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        except BaseException:
            return None

    def report_failure(self, value: BaseException, aborts: bool = False) -> None:
        """Tell the client this rank failed: the error, its traceback, the collective it came out of (the
        roll-call's record of it), and whether this rank tears its process group down because of it."""
        _debug("failure", _summary(value))
        self.failed_cell = self.cell  # a rank busy reporting its own error is not stuck
        self.last_failure = failure_report(self.rank, value, self.cell, self._rollcall.current(), aborts)
        self.sink.send_control(self.last_failure)

    def answer_status(self, msg: StatusRequest) -> None:
        """The roll-call: this rank's record as it is now, taken on the listening thread (the rank may be blocked)."""
        try:
            status = self._rollcall.snapshot(stacks=bool(msg.stacks)).to_dict()
        except Exception as e:  # never leave the client waiting for a broken snapshot
            status = {"rank": self.rank, "state": "unknown", "note": f"roll-call failed: {_summary(e)}"}
        self.sink.send_control(StatusReply(msg.id, self.rank, status).to_dict())

    # -- commands from the client -------------------------------------------------------------------------------
    def _listen(self) -> None:
        import json

        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop:
            try:
                if not poller.poll(100):
                    continue
                msg = decode(TO_RANKS, json.loads(self._sub.recv(zmq.NOBLOCK)))
            except Exception:
                continue
            _debug("got", msg, "running", self.running, "cell", self.cell)
            if isinstance(msg, StatusRequest):
                self.answer_status(msg)
            elif isinstance(msg, PeerFailed) and msg.rank != self.rank and self.running:
                cell, failed = self.cell, msg.rank
                self._if_still_in(cell, GRACE, lambda: self.sink.send_control(Stuck(self.rank, cell, failed).to_dict()))
            elif isinstance(msg, Abort):
                self.abort_pending = True
                if not self.running:
                    self._abort()
                elif self.backend == "nccl":  # NCCL's abort unblocks a pending collective; gloo's does not
                    threading.Thread(target=self._abort, daemon=True).start()
                else:
                    self._close_peers()  # a pending gloo collective fails at once
                    # still in that cell later (a look-up that failed on a busy machine, a connection made since)?
                    self._if_still_in(self.cell, REPEAT_CLOSE, self._close_peers)

    def _close_peers(self) -> None:
        _debug("closed peer sockets", close_peer_sockets(self.peer_pids))

    def _if_still_in(self, cell: int, delay: float, then) -> None:
        """``then()`` in ``delay`` seconds if this rank is still running ``cell`` and not reporting a failure of its
        own in it (a daemon timer: it never holds the engine's exit)."""
        def check():
            _debug("still in", cell, "?", self.running, self.cell, self.failed_cell)
            if self.running and self.cell == cell and self.failed_cell != cell:
                then()

        timer = threading.Timer(delay, check)
        timer.daemon = True
        timer.start()

    def _abort(self) -> None:
        """Tear down every process group of this rank: peers blocked on it in a collective fail at once."""
        self.abort_pending = False
        _debug("abort")
        try:
            import torch.distributed as tdist

            from .. import compat

            if tdist.is_initialized():
                compat.abort_process_group()
            _clear_groups()
            self._close_peers()
            import gc

            gc.collect()  # a cycle may still hold the group, and gloo closes its sockets only when it is freed
            os.environ.pop("MASTER_PORT", None)  # a later init_parallel_env fails at once; reinit sets a new one
        except Exception:
            pass
        self.aborted = True

    def close(self) -> None:
        self._stop = True
        self._uninstall_hooks()
        patches.unrecord_torch_calls()
        self.set_tracing(False)
        self.sink.close()
        self._thread.join(1.0)
        self._sub.close()
        self._ctx.term()


_held: dict = {}  # port -> PortReservation: a bound socket kept until the store takes it over


def _release_held() -> None:
    for res in _held.values():
        res.close()
    _held.clear()


def probe(loopback: bool = True) -> dict:
    """Where this engine runs, and a port bound here and held open (rank 0's becomes the store's)."""
    from ..runtime.rendezvous import LOOPBACK, PortReservation

    _release_held()
    res = PortReservation(LOOPBACK if loopback else "")
    _held[res.port] = res
    return {"host": socket.gethostname(), "pid": os.getpid(), "port": res.port}


def _clear_groups() -> None:
    from ..runtime import groups

    groups.reset()


def _init_process_group(rank: int, world: int, backend: str, timeout: float, port: int, loopback: bool):
    """The default process group on a TCPStore that rank 0 serves on the port its :func:`probe` held; on
    loopback only when ``loopback`` (torch's own rendezvous makes the store listen on every interface)."""
    import datetime

    import torch
    import torch.distributed as tdist

    from ..runtime.rendezvous import connect_store, serve_store

    master = os.environ["MASTER_ADDR"]
    to = datetime.timedelta(seconds=timeout)
    held = _held.pop(port, None)
    _release_held()
    if rank == 0:
        if held is None:
            raise RuntimeError(f"rank 0 lost the store port {port}")
        store = serve_store(held, world, to)  # the store owns the socket from here on
    else:
        if held is not None:
            held.close()
        store = connect_store(master, port, world, to)
    kwargs = {}
    if os.environ.get("MESHVIZ_DEVICE", "cpu").startswith("cuda") or backend == "nccl":
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES shows this rank its one GPU
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", 0)
    tdist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=to, **kwargs)
    os.environ["MASTER_PORT"] = str(port)
    from .. import trace
    from ..core.mesh import set_rank_getter

    trace.set_rank(rank)
    set_rank_getter(lambda: rank)  # an engine's rank never changes
    if _state is not None:
        _state.store = store
        _state.backend = tdist.get_backend()


def setup(cfg: dict) -> dict:
    """Run once on each engine: environment, device binding, process group, stream and hooks."""
    global _state
    os.environ.update(cfg["env"])  # before torch is imported: CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS
    import torch

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    if _state is not None:
        _state.close()
    from ..runtime import match

    match.set_checking(bool(cfg.get("check", False)))
    _state = _EngineState(cfg)
    _init_process_group(cfg["rank"], cfg["world"], cfg["backend"], cfg["timeout"], cfg["port"], cfg["loopback"])
    import torch.distributed as tdist

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    on_gpu = os.environ.get("MESHVIZ_DEVICE", "cpu").startswith("cuda") or _state.backend == "nccl"
    dev = f"cuda:{gpu}" if on_gpu and gpu else "cpu"  # the GPU's id on this machine (it sees it as cuda:0)
    return {
        "rank": tdist.get_rank(), "world": tdist.get_world_size(), "pid": os.getpid(), "host": socket.gethostname(),
        "backend": _state.backend, "device": dev, "threads": torch.get_num_threads(),
    }


def reinit(port: int, timeout: float, loopback: bool = True) -> bool:
    """Make a fresh default process group (after an abort), on a new store port from :func:`probe`."""
    import torch.distributed as tdist

    from .. import compat

    if tdist.is_initialized():
        try:
            compat.abort_process_group()
        except Exception:
            pass
    _clear_groups()
    # group names (and so store keys) come from this counter; every rank must start the new world from 0
    compat.reset_group_count()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = _state.backend if _state is not None else "gloo"
    from ..runtime import rollcall

    rollcall.reset()  # a new world: every rank counts its collectives from 1 again
    _init_process_group(rank, world, backend, timeout, port, loopback)
    if _state is not None:
        _state.aborted = False
        _state.abort_pending = False
    return True


def stream_count(flush: bool = True) -> tuple[int, int, int]:
    """(rank, events handed to the stream so far, control messages so far), after flushing the queue."""
    if _state is None:
        return (-1, 0, 0)
    if flush:
        _state._trace.flush()
    sent = _state.sink.flush(2.0) if flush else _state.sink.sent
    return (_state.rank, sent, _state.sink.controls_sent)


def set_tracing(on: bool) -> bool:
    if _state is not None:
        _state.set_tracing(on)
    return on


def guarded_call(func, *args, **kwargs):
    """Call ``func`` like a %%px cell: a failure is reported to the client so that the other ranks stop."""
    st = _state
    if st is None:
        return func(*args, **kwargs)
    st._pre()
    try:
        return func(*args, **kwargs)
    except BaseException as e:
        aborts = st.abort_pending or broke_process_group(e)
        st.report_failure(e, aborts)
        if aborts:
            traceback.clear_frames(e.__traceback__)
            st._abort()
        raise
    finally:
        st._post(note="its call returned")


def call_on_rank(func):
    """``func(rank)`` like a %%px cell (a Runner's ``submit`` on engines)."""
    rank = _state.rank if _state is not None else int(os.environ.get("RANK", "0"))
    return guarded_call(func, rank)


def shutdown(exit_after: float | None = 0.2) -> None:
    """Flush and close the stream, then leave: the process exits ``exit_after`` s later (Cluster.stop calls this).

    Exiting at once skips the interpreter teardown of torch and gloo threads (seconds on a busy machine), and
    the process group is not destroyed: peers may still hold sockets to this rank.
    """
    global _state
    if _state is not None:
        _state.close()
        _state = None
    if exit_after is not None:
        def _exit():
            time.sleep(exit_after)
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except Exception:
                    pass
            os._exit(0)

        threading.Thread(target=_exit, daemon=True).start()
