"""The pipeline engine: one rank's stage chunks run under a torch schedule (FThenB, 1F1B, VPP, ZBH1), with events."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as tdist

from ... import compat, trace
from ...compat.pipeline_meta import drop_receive_buffers, forget_losses
from ...core.schedule import fthenb_order, one_f_one_b_order
from ...trace import Event, Mark
from ..comm import Call, CollectiveOp, Task, run
from . import failure
from .meter import ActivationMeter, MicroLoss

__all__ = ["PipelineEngine", "SCHEDULE_MODES", "resolve_schedule", "check_pipeline_config"]

SCHEDULE_MODES = ("FThenB", "1F1B", "VPP", "ZBH1")

# (mode, interleaved?) -> torch.distributed.pipelining schedule class (imported on first use: it is slow)
_CLASSES = {
    ("FThenB", False): "ScheduleGPipe",
    ("FThenB", True): "ScheduleLoopedBFS",
    ("1F1B", False): "Schedule1F1B",
    ("1F1B", True): "ScheduleInterleaved1F1B",
    ("VPP", True): "ScheduleInterleaved1F1B",
    ("ZBH1", False): "ScheduleInterleavedZeroBubble",
    ("ZBH1", True): "ScheduleInterleavedZeroBubble",
}
_SINGLE = ("ScheduleGPipe", "Schedule1F1B")
_PHASE = {"F": "F", "B": "B", "I": "B", "W": "W"}  # torch action letter -> event phase
_LOSS_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # the broadcast loss's dtype code


def _schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, name)


def resolve_schedule(mode: str, v: int):
    """(canonical mode name, torch schedule class name) for ``pipeline_configs['schedule_mode']`` and v chunks."""
    names = {m.lower(): m for m in SCHEDULE_MODES}
    if not isinstance(mode, str) or mode.lower() not in names:
        raise ValueError(f"pipeline_configs['schedule_mode'] = {mode!r}: use one of {list(SCHEDULE_MODES)}")
    mode = names[mode.lower()]
    if mode == "VPP" and v < 2:
        raise ValueError("schedule_mode 'VPP' needs PipelineLayer(num_virtual_pipeline_stages=v) with v > 1")
    if mode == "1F1B" and v > 1:
        mode = "VPP"
    return mode, _CLASSES[(mode, v > 1)]


def check_pipeline_config(p: int, m: int, v: int, mode: str) -> None:
    """ValueError for micro-batch counts the schedule cannot run (raised before any communication)."""
    if mode in ("VPP", "ZBH1") or (v > 1 and mode != "FThenB"):
        if v > 1 and m < p:
            raise ValueError(f"interleaved schedule {mode!r}: accumulate_steps ({m}) must be >= pp_degree ({p})")
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"schedule {mode!r}: accumulate_steps ({m}) must be a multiple of "
                             f"max(1, accumulate_steps // pp_degree) = {rounds} (torch's round structure); "
                             f"use a multiple of pp_degree ({p})")


def _joined(x, m: int, mbs: int, what: str):
    """Paddle's list form, one micro-batch per accumulate step (a tuple's items may be such lists), joined into one
    batch; each micro-batch must hold micro_batch_size rows (the schedule splits the batch evenly again)."""
    if isinstance(x, tuple):
        return tuple(_joined(t, m, mbs, f"{what}[{i}]") if isinstance(t, list) else t for i, t in enumerate(x))
    if not isinstance(x, list):
        return x
    if len(x) != m:
        raise ValueError(f"{what} is a list of {len(x)} micro-batches; accumulate_steps is {m}")
    for k, t in enumerate(x):
        n = _batch_of(t, f"{what}[{k}]")
        if n != mbs:
            raise ValueError(f"{what}[{k}]: a micro-batch of {n} rows; micro_batch_size is {mbs}")
    if all(isinstance(t, torch.Tensor) for t in x):
        return torch.cat(x)
    if len({len(t) for t in x}) > 1 or not all(isinstance(t, tuple) for t in x):
        raise ValueError(f"{what}: micro-batches of different kinds (each a tensor, or each a tuple of as many)")
    return tuple(torch.cat(parts) for parts in zip(*x))


def _batch_of(x, what: str):
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError(f"{what} is a scalar; it needs a batch dimension to split into micro-batches")
        return x.shape[0]
    if isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) for t in x):
        sizes = {t.shape[0] if t.dim() else None for t in x}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"{what}: tensors with different batch sizes {sorted(map(str, sizes))}")
        return sizes.pop()
    raise ValueError(f"{what} must be a tensor or a tuple of tensors, got {type(x).__name__}")


def _to_device(x, dev: torch.device):
    """A batch (a tensor, or a tuple of them) on ``dev``; None stays None."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x if x.device == dev else x.to(dev)
    return type(x)(t if t.device == dev else t.to(dev) for t in x)


def _split(x, m: int):
    if isinstance(x, torch.Tensor):
        return list(x.tensor_split(m))
    return [tuple(p) for p in zip(*(t.tensor_split(m) for t in x))]


def _shapes(inputs):
    if inputs is None:
        return None
    ts = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple((tuple(t.shape), str(t.dtype)) for t in ts)


class PipelineEngine:
    """This rank's pipeline stage under a torch schedule; every argument explicit, nothing read from elsewhere.

    ``chunks``: this rank's modules, one per virtual stage, at global virtual stage indices ``virtual_stages``;
    ``group``: the pipe group (a runtime Group); ``ranks``: the global rank of every pipe position, in stage order;
    ``stage_id`` of ``num_stages``, each holding ``num_virtual_stages`` chunks; a batch holds ``accumulate_steps``
    micro-batches of ``micro_batch_size`` rows; ``schedule_mode`` one of :data:`SCHEDULE_MODES`; ``device`` where
    the stage computes; ``loss_fn(output, label)`` of one micro-batch (or a list of them, :class:`MicroLoss`);
    ``stage_meta(virtual_stage, inputs)``: that stage's outputs for meta-tensor inputs, on any rank (simulated ranks
    need it with virtual stages). Each micro loss is divided by accumulate_steps before its backward, so the
    gradients accumulated over the micro-batches are those of the mean loss. Emits ``compute`` / ``send`` /
    ``recv`` events per block and transfer (:class:`TracedStage`) and a ``mark`` (op ``pipeline_step``) per step;
    ``step`` counts the steps run.
    """

    def __init__(self, chunks, virtual_stages, *, group, ranks, stage_id: int, num_stages: int,
                 num_virtual_stages: int, micro_batch_size: int, accumulate_steps: int, schedule_mode: str,
                 device: torch.device, loss_fn=None, stage_meta=None):
        self.schedule_mode, self.schedule_class = resolve_schedule(schedule_mode, num_virtual_stages)
        check_pipeline_config(num_stages, accumulate_steps, num_virtual_stages, self.schedule_mode)
        if self.schedule_class == "Schedule1F1B" and accumulate_steps < num_stages:
            # Paddle runs 1F1B with fewer micro-batches than stages; torch's Schedule1F1B refuses. GPipe's order
            # gives the same gradients and the same bubble (every micro-batch is in flight at once either way).
            self.schedule_class = "ScheduleGPipe"
        self.chunks = list(chunks)
        self.virtual_stages = list(virtual_stages)
        self.group = group
        self.ranks = list(ranks)
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.num_virtual_stages = num_virtual_stages
        self.micro_batch_size = micro_batch_size
        self.accumulate_steps = accumulate_steps
        self.device = device
        self.loss_fn = loss_fn
        self.stage_meta = stage_meta
        self.is_first_stage = stage_id == 0
        self.is_last_stage = stage_id == num_stages - 1
        self.step = 0
        self.meter = ActivationMeter()
        self._cache: dict = {}

    # -- schedules -----------------------------------------------------------------------------------
    def _build(self, kind: str, compute_loss: bool, shapes):
        key = (kind, compute_loss, shapes)
        if key in self._cache:
            return self._cache[key]
        from .stage import MetaChain, TracedStage

        p, v, m = self.num_stages, self.num_virtual_stages, self.accumulate_steps
        chain = MetaChain(self.stage_meta, tdist.get_backend(self.group.process_group) == "simulated")
        stages = [TracedStage(chunk, vs, p * v, self.device, self.group.process_group, self.ranks,
                              lambda: self.step, self.meter, chain)
                  for chunk, vs in zip(self.chunks, self.virtual_stages)]
        loss = MicroLoss(self.loss_fn, m) if compute_loss else None
        name = self.schedule_class if kind == "train" else ("ScheduleGPipe" if v == 1 else "ScheduleLoopedBFS")
        multi = name not in _SINGLE
        sched = _schedule_class(name)(stages if multi else stages[0], m, loss_fn=loss, scale_grads=False)
        self._cache[key] = (sched, stages, loss)
        return self._cache[key]

    def schedule_order(self, pipe_rank: int | None = None) -> list[tuple[str, int, int]]:
        """The compute blocks ``(phase, virtual stage, micro-batch)`` the train schedule runs on a pipe position.

        Phases F, B (full or input-grad backward), W. For the multi-chunk and zero-bubble schedules this is
        torch's schedule IR, which its runtime executes (no communication); torch's single-stage GPipe and 1F1B
        loop over micro-batches directly (their IR is only a drawing), so those orders come from
        ``meshviz.core.schedule``, which the views draw too.
        """
        d = self.stage_id if pipe_rank is None else pipe_rank
        p, m = self.num_stages, self.accumulate_steps
        if self.schedule_class == "ScheduleGPipe":
            return fthenb_order(p, m, d)
        if self.schedule_class == "Schedule1F1B":
            return one_f_one_b_order(p, m, d)
        sched, _, _ = self._build("train", True, None)
        out = []
        for a in compat.pipeline_order(sched)[d]:
            if a is None:
                continue
            ct, stage, mb = compat.action_fields(a)
            if ct in _PHASE:
                out.append((_PHASE[ct], stage, mb))
        return out

    # -- data ----------------------------------------------------------------------------------------
    def check_data(self, data, need_labels: bool):
        """``(inputs, labels)`` of a batch of exactly micro_batch_size * accumulate_steps rows (ValueError else).
        Each may be a tensor, a tuple of tensors, or, as in Paddle, a list holding each micro-batch."""
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise ValueError("train_batch/eval_batch: data must be (inputs, labels)")
        m, mbs = self.accumulate_steps, self.micro_batch_size
        inputs, labels = (_joined(x, m, mbs, what) for x, what in zip(data, ("inputs", "labels")))
        want = self.micro_batch_size * self.accumulate_steps
        for x, what, needed in ((inputs, "inputs", self.is_first_stage), (labels, "labels",
                                                                          need_labels and self.is_last_stage)):
            if x is None:
                if needed:
                    raise ValueError(f"pipeline stage {self.stage_id}: {what} is None but this stage needs it")
                continue
            n = _batch_of(x, what)
            if n != want:
                raise ValueError(f"{what} batch size {n} != micro_batch_size ({self.micro_batch_size}) * "
                                 f"accumulate_steps ({self.accumulate_steps}) = {want}")
        return inputs, labels

    # -- running -------------------------------------------------------------------------------------
    def _run(self, sched, stages, loss, inputs, labels, eval_mode: bool):
        m = self.accumulate_steps
        inputs, labels = _to_device(inputs, self.device), _to_device(labels, self.device)
        if loss is not None:
            loss.values = {}
            loss.labels = _split(labels, m) if self.is_last_stage else None
        args = () if not self.is_first_stage else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        target = torch.arange(m) if (loss is not None and self.is_last_stage) else None
        if trace.active():
            trace.emit(Event(kind="mark", op="pipeline_step", name=f"{self.schedule_mode} step {self.step}",
                             group=list(self.ranks),
                             payload=Mark(schedule="FThenB" if eval_mode else self.schedule_mode,
                                          p=self.num_stages, m=m, v=self.num_virtual_stages, step=self.step,
                                          stage=self.stage_id, eval=eval_mode)))
        self.meter.reset()
        go = sched.eval if (eval_mode and loss is not None) else sched.step
        try:
            return go(*args, target=target)
        except Exception as e:
            forget_losses(sched)
            if tdist.get_backend(self.group.process_group) == "threads":
                for stage in stages:
                    drop_receive_buffers(stage)
            err = self._failed(failure.unwrapped(e))
            if err is e:
                raise
            raise err from None

    def _failed(self, err: BaseException) -> BaseException:
        """The error to raise for ``err`` out of this rank's stage; the stages waiting for this one's transfers
        stop now, naming it (on gloo rank processes: this rank's connections to them are closed)."""
        return failure.announce(err, self.stage_id, self.ranks)

    def _shape_key(self, inputs) -> int:
        """The first stage's input shapes as a number every stage of the pipe agrees on (one small broadcast): a
        later stage may be handed None for its inputs, as in Paddle, and must still build its schedule again when
        they change."""
        key = zlib.crc32(repr(_shapes(inputs)).encode()) if self.is_first_stage else 0
        buf = torch.tensor([key], dtype=torch.int64, device=self.device)
        src = self.ranks[0]
        run(Call(CollectiveOp.BROADCAST, self.group, lambda g: tdist.broadcast(buf, src, group=g.process_group),
                 tensors=(buf,), peers={"src": src}, src=src, traced=False))
        return int(buf.item())

    def forward_backward(self, inputs, labels, scaler=None, loss_fn_idx: int = 0) -> MicroLoss:
        """Run the train schedule over the micro-batches of one batch; the gradients accumulate in the chunks'
        parameters (of loss function ``loss_fn_idx``'s loss). ``scaler.scale`` is applied to each micro loss when
        given. Returns the micro losses."""
        sched, stages, loss = self._build("train", True, self._shape_key(inputs))
        loss.scaler, loss.index = scaler, loss_fn_idx
        try:
            self._run(sched, stages, loss, inputs, labels, eval_mode=False)
        except Exception:
            for chunk in self.chunks:  # no micro-batch's gradient of the failed step is carried into the next one
                for q in chunk.parameters():
                    q.grad = None
            raise
        return loss

    def reduce_loss(self, loss: MicroLoss, per_micro: bool = False) -> tuple[torch.Tensor, Task]:
        """Start broadcasting the summed micro losses (``per_micro``: each micro-batch's) of every loss function
        from the last stage; returns (the buffer, the task to wait), :meth:`loss_value` reads the buffer. The
        buffer is float64 whatever the loss's dtype, which its last element names, so every stage sends and
        receives as many bytes (a last stage's float64 or bfloat16 loss made the stages' broadcasts differ)."""
        cols = self.accumulate_steps if per_micro else 1
        buf = torch.zeros(len(loss.loss_fns) * cols + 1, dtype=torch.float64)
        if self.is_last_stage and loss.values:
            per_fn = [torch.stack([loss.values[k][i] for k in sorted(loss.values)]) for i in range(len(loss.loss_fns))]
            vals = torch.stack([v if per_micro else v.sum() for v in per_fn])
            buf[:-1] = vals.detach().reshape(-1).to(torch.float64)
            buf[-1] = _LOSS_DTYPES.index(vals.dtype) if vals.dtype in _LOSS_DTYPES else 0
        buf = buf.to(self.device)  # broadcast from this rank's device
        src = self.ranks[-1]
        task = run(Call(CollectiveOp.BROADCAST, self.group,
                        lambda g: tdist.broadcast(buf, src, group=g.process_group, async_op=True),
                        tensors=(buf,), peers={"src": src}, sync_op=False, src=src))
        return buf, task

    def loss_value(self, buf: torch.Tensor, per_micro: bool = False):
        """The loss :meth:`reduce_loss` broadcast (after its task): a 0-d tensor (``per_micro``: one value per
        micro-batch) in the last stage's loss dtype, or a list of them, one per loss function, as Paddle's."""
        code = 0 if tdist.get_backend(self.group.process_group) == "simulated" else int(buf[-1].item())
        vals = buf[:-1].to(_LOSS_DTYPES[code]).reshape(-1, self.accumulate_steps if per_micro else 1)
        out = [v if per_micro else v.reshape(()) for v in vals]
        return out[0] if len(out) == 1 else out

    def end_step(self) -> None:
        self.step += 1

    def forward_only(self, inputs, labels, compute_loss: bool, loss_fn_idx: int = 0, per_micro: bool = False):
        """Forward every micro-batch (FThenB order, no backward), then end the step. With ``compute_loss`` the
        mean micro loss on every stage (:meth:`loss_value`); without, the last stage's list of micro-batch outputs
        (else [])."""
        sched, stages, loss = self._build("eval", bool(compute_loss), self._shape_key(inputs))
        if loss is not None:
            loss.index = loss_fn_idx
        with torch.no_grad():
            self._run(sched, stages, loss, inputs, labels, eval_mode=True)
        self.end_step()
        if compute_loss:
            buf, task = self.reduce_loss(loss, per_micro)
            try:
                task.wait()
            except Exception as e:
                err = self._failed(e) if tdist.get_backend(self.group.process_group) == "gloo" else e
                if err is e:
                    raise
                raise err from None
            return self.loss_value(buf, per_micro)
        last = [s for s in stages if s.is_last]
        if not last:
            return []
        # a last stage that passes on what it received returns its receive buffer, which the next step refills
        bufs = [b for infos in last[0].args_recv_info.values() for info in infos
                if isinstance(b := getattr(info, "buffer", None), torch.Tensor)]

        def own(t):
            held = isinstance(t, torch.Tensor) and any(t is b or t._base is b for b in bufs)
            return t.clone() if held else t

        return [tuple(own(t) for t in o) if isinstance(o, tuple) else own(o) for o in last[0].output_chunks]

    def __repr__(self) -> str:
        return (f"PipelineEngine({self.schedule_mode}, stage {self.stage_id}/{self.num_stages}, "
                f"v={self.num_virtual_stages}, micro_batch_size={self.micro_batch_size}, "
                f"accumulate_steps={self.accumulate_steps}, ranks={self.ranks})")
