"""TracedStage: a torch PipelineStage that emits compute events per block and send/recv events per transfer."""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist
from torch.distributed.pipelining import PipelineStage

from ... import trace
from ...compat import pipeline_setup_calls, pipeline_stage_marks_every_recv, pipeline_stage_sends_zero_grads
from ...compat.pipeline_meta import forward_metas_of, grad_metas_of, meta_summary
from ...trace import Compute, Event, Recv, Send
from ..devices import needs_host_p2p, p2p_through_host, staged_recv, staged_send

__all__ = ["TracedStage", "MetaChain"]


def _nbytes(ops) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


_MARKS_EVERY_RECV = pipeline_stage_marks_every_recv()
_SENDS_ZEROS = pipeline_stage_sends_zero_grads()


class _Stage(PipelineStage):
    """torch 2.11's PipelineStage marks every received activation as needing a gradient (an integer one, such as
    position ids, raises), and 2.11's and 2.12's send a gradient back for each (a missing one raises). Here integer
    activations need none, and a received activation without a gradient sends back zeros, as torch 2.13 does by
    itself. torch 2.11's input-only backward (zero bubble) differentiates outputs that have no gradient (it raises)
    and returns gradients for the activations that need one only; here it skips those outputs, and the gradients
    are put back in place. The last stage detaches its outputs after its backward: where one is a
    received activation itself (a last stage that passes it on unchanged), torch 2.11 left its receive buffer
    needing no gradient from then on, and the stages before got none from the second step on; here each buffer
    that needs a gradient needs it again before its forward."""

    _chain: MetaChain | None = None

    def _prepare_forward_infra(self, *args, **kwargs):
        if self.is_first and self._chain is not None and self._chain.simulated and len(args) > 1:
            self._chain.note(args[1])
        out = self._prepare_receive_buffers(*args, **kwargs)
        self._grad_bufs = {k: [b for info in infos if isinstance(b := getattr(info, "buffer", None), torch.Tensor)
                               and b.requires_grad] for k, infos in self.args_recv_info.items()}
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        for buf in getattr(self, "_grad_bufs", {}).get(fwd_chunk_id, ()):
            if not buf.requires_grad:
                buf.requires_grad_(True)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def _prepare_receive_buffers(self, *args, **kwargs):
        if not _MARKS_EVERY_RECV:
            return super()._prepare_forward_infra(*args, **kwargs)
        backward = self.has_backward
        self.has_backward = False  # only its receive buffers read it here
        try:
            out = super()._prepare_forward_infra(*args, **kwargs)
        finally:
            self.has_backward = backward
        if backward:
            for infos in self.args_recv_info.values():
                for info in infos:
                    buf = getattr(info, "buffer", None)
                    if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                        buf.requires_grad_(True)
        return out

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        outs, grads = bwd_kwargs.get("stage_output"), bwd_kwargs.get("output_grads")
        if backward_type == "input" and isinstance(outs, (tuple, list)) and grads is not None:
            # 2.11's input-only backward takes every output, one without a gradient too (later releases skip it)
            keep = [i for i, t in enumerate(outs) if t.requires_grad or t.grad_fn is not None]
            if len(keep) < len(outs):
                bwd_kwargs = {**bwd_kwargs, "stage_output": tuple(outs[i] for i in keep),
                              "output_grads": [grads[i] for i in keep]}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def get_bwd_send_ops(self, bwd_chunk_id):
        if not _SENDS_ZEROS and self.has_backward and not self.is_first and bwd_chunk_id in self.bwd_cache:
            bufs = [getattr(info, "buffer", None) for info in self.args_recv_info[bwd_chunk_id]]
            if not _MARKS_EVERY_RECV and self.grad_send_info is None:
                # 2.12: the previous stage waits for a gradient only where the activation needs one (or got one:
                # a last stage's backward may have detached an activation it passed on)
                got = self.bwd_cache[bwd_chunk_id]
                self.grad_send_info = [
                    None if isinstance(b, torch.Tensor) and not b.requires_grad and g is None else to
                    for to, b, g in zip(self._create_grad_send_info(self.args_recv_info[0]), bufs, got)]
            sends = self.grad_send_info or [True] * len(bufs)
            grads = self.bwd_cache[bwd_chunk_id]
            if len(grads) < len(bufs):  # 2.11's input-only backward: the gradients of the inputs needing one
                it, needs = iter(grads), {id(b) for b in getattr(self, "_grad_bufs", {}).get(bwd_chunk_id, ())}
                grads = tuple(next(it, None) if id(b) in needs else None for b in bufs)
            self.bwd_cache[bwd_chunk_id] = tuple(
                torch.zeros_like(b) if g is None and isinstance(b, torch.Tensor) and to is not None else g
                for g, b, to in zip(grads, bufs, sends))
        return super().get_bwd_send_ops(bwd_chunk_id)

    # torch with _send_meta (2.12.1, 2.13 and later): a stage's shape inference receives its output gradients'
    # shapes from the next stage, which sends them back once its own backward inference ran. For plain tensors they
    # are the outputs' shapes (as torch before it takes them), so both sides take them here without sending anything
    # backwards: a stage then never waits on a later one at set-up (simulated ranks run one after another).
    def _send_meta(self, meta, dst_stage):
        if dst_stage < self.stage_index and _plain(self._stage_meta.inputs):
            return None
        if dst_stage > self.stage_index and self._simulated_before(dst_stage):
            return self._check_taken(meta, dst_stage)
        return super()._send_meta(meta, dst_stage)

    def _recv_meta(self, src_stage):
        outputs = self._stage_meta.outputs
        if src_stage > self.stage_index and _plain(outputs):
            return grad_metas_of(outputs)
        if src_stage < self.stage_index and self._simulated_after(src_stage):
            return self._take_from_chain(src_stage, self.has_backward)
        return super()._recv_meta(src_stage)

    # torch before _send_meta (2.11): one method receives the inputs' shapes, runs the stage, sends the outputs'
    def _shape_inference(self, args, kwargs=None):
        ranks, prev, nxt = self.stage_index_to_group_rank, self.stage_index - 1, self.stage_index + 1
        saved = dict(ranks)
        take = not self.is_first and self._simulated_after(prev)
        keep = not self.is_last and self._simulated_before(nxt)
        if take:
            args = self._take_from_chain(prev, False)
            ranks[prev] = self.group_rank  # torch then takes them as a same-rank neighbour's
        if keep:
            ranks[nxt] = self.group_rank
        try:
            out = super()._shape_inference(args, kwargs)
        finally:
            ranks.clear()
            ranks.update(saved)
        if keep:
            self._check_taken(out, nxt)
            return ()
        return out

    # -- simulated ranks run one after another: the first pipe rank's later chunks cannot hear from the last one
    # (which runs after it), so it computes their inputs' shapes from the model's description instead, and the
    # last one, instead of sending its outputs' shapes, checks they are the ones taken -------------------------
    def _global_of(self, stage: int) -> int:
        return tdist.get_global_rank(self.group, self.stage_index_to_group_rank[stage])

    def _simulated_after(self, stage: int) -> bool:
        return self._chain is not None and self._chain.simulated and \
            self._global_of(stage) > self._global_of(self.stage_index)

    def _simulated_before(self, stage: int) -> bool:
        return self._chain is not None and self._chain.simulated and \
            self._global_of(stage) < self._global_of(self.stage_index)

    def _take_from_chain(self, src_stage: int, grad: bool):
        assert self._chain is not None
        meta = forward_metas_of(self._chain.outputs(src_stage, grad))
        tdist.send_object_list([meta_summary(meta)], dst=self._global_of(src_stage), group=self.group)
        return meta

    def _check_taken(self, meta, dst_stage: int) -> None:
        got: list = [None]
        tdist.recv_object_list(got, src=self._global_of(dst_stage), group=self.group)
        if got[0] != meta_summary(meta):
            raise RuntimeError(
                f"what_if: stage {dst_stage} (rank {self._global_of(dst_stage)}, simulated before this one) took its "
                f"inputs to be (shape, stride, dtype, requires_grad) {got[0]}, from the model's description, but "
                f"stage {self.stage_index} outputs {meta_summary(meta)}")


class MetaChain:
    """The first stage's inputs (one micro-batch) and ``stage_meta(stage, inputs) -> outputs``, a virtual stage run
    on meta tensors: the shapes any stage's outputs have, computed on any rank. ``simulated``: whether the ranks
    are simulated ones (only they take shapes from here)."""

    def __init__(self, stage_meta, simulated: bool):
        self.stage_meta = stage_meta
        self.simulated = simulated
        self.inputs: tuple | None = None
        self._outs: dict = {}

    def note(self, args) -> None:
        ts = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        self.inputs = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                            .requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in ts)
        self._outs.clear()

    def outputs(self, stage: int, grad: bool) -> tuple:
        """Stage ``stage``'s outputs (meta tensors) for the noted inputs; ``grad``: as a stage that runs a backward
        computes them (needing gradients), else as without one."""
        if self.stage_meta is None:
            raise RuntimeError("what_if: this pipeline's interleaved stages need each stage's output shapes on the "
                               "first pipe rank; give PipelineEngine a stage_meta (PipelineLayer.meta_forward)")
        if self.inputs is None:
            raise RuntimeError("what_if: the first stage's inputs were not seen before a later stage's shapes")
        x, done = self.inputs, 0
        while (done, grad) in self._outs and done <= stage:
            x, done = self._outs[(done, grad)], done + 1
        with torch.enable_grad() if grad else torch.no_grad():
            for s in range(done, stage + 1):
                out = self.stage_meta(s, x)
                x = self._outs[(s, grad)] = out if isinstance(out, tuple) else (out,)
        return x


def _plain(metas) -> bool:
    """Whether these tensor metadata describe plain tensors only (a DTensor's gradient may be placed otherwise)."""
    return metas is not None and not any(hasattr(m, "placements") for m in metas)


class TracedStage(_Stage):
    """A torch PipelineStage that emits ``compute`` events per F/B/W block and ``send``/``recv`` per transfer.

    Recv events run from when the receive was posted to when the block that needed it started (the schedule
    waits on it just before); send events mark when the send was posted (gloo/NCCL isend is asynchronous).
    """

    def __init__(self, submodule, stage_index, num_stages, device, group, ranks, step_ref, meter=None, chain=None):
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self._chain = chain
        self._ranks = list(ranks)  # global rank of every pipe position
        self._p = len(self._ranks)
        self._step_ref = step_ref  # callable -> current step number
        self._pending: dict = {}
        self._copy_back: dict = {}  # (phase, micro-batch) -> copies of CPU-staged receives into their buffers
        self._meter = meter
        if meter is not None:
            meter.watch(submodule)
        self._via_host = needs_host_p2p(torch.empty(0, device=device), group)  # gloo between CUDA tensors

    # -- set-up: torch's stage sends a dummy tensor to each neighbour (compat.pipeline_neighbor_init_ops) and
    # exchanges shapes on its device -------------------------------------------------------------------------
    def _get_init_p2p_neighbors_ops(self):
        return self._host_staged(super()._get_init_p2p_neighbors_ops())  # the dummy received is not kept

    # -- transfers -----------------------------------------------------------------------------------
    def _peer(self, stage_index: int) -> int:
        return self._ranks[stage_index % self._p]

    def _transfer(self, cls: type[Send] | type[Recv], phase, mb, src, dst) -> Send | Recv:
        step = self._step_ref()
        return cls(micro_batch=mb, phase=phase, stage=self.stage_index, src_stage=src, dst_stage=dst, step=step,
                        transfer=f"{step}:{phase}{mb}:s{src}->s{dst}")

    def _posted_recv(self, phase, mb, ops):
        if ops and trace.active():
            self._pending[(phase, mb)] = (time.time(), _nbytes(ops))
        return ops

    def _emit_recv(self, phase, mb):
        got = self._pending.pop((phase, mb), None)
        if got is None:
            return
        t0, nbytes = got
        src = self.stage_index - 1 if phase == "F" else self.stage_index + 1
        trace.emit(Event(kind="recv", start=t0, end=time.time(), op="recv", peer=self._peer(src), bytes=nbytes,
                         group=[self._peer(src), self._peer(self.stage_index)],
                         name=f"{'act' if phase == 'F' else 'grad'} mb{mb} s{src}->s{self.stage_index}",
                         payload=self._transfer(Recv, phase, mb, src, self.stage_index)))

    def _emit_send(self, phase, mb, ops):
        if ops and trace.active():
            dst = self.stage_index + 1 if phase == "F" else self.stage_index - 1
            t = time.time()
            trace.emit(Event(kind="send", start=t, end=t, op="send", peer=self._peer(dst), bytes=0,  # receives none
                             group=[self._peer(self.stage_index), self._peer(dst)],
                             name=f"{'act' if phase == 'F' else 'grad'} mb{mb} s{self.stage_index}->s{dst}",
                             payload=self._transfer(Send, phase, mb, self.stage_index, dst)))
        return ops

    def _host_staged(self, ops, key=None):
        """gloo's send/recv read host memory: CUDA activations and gradients go through CPU copies; a received
        one is copied into its CUDA buffer just before the block that needs it (the schedule has waited by then).
        Without a ``key`` nothing received is copied back (the set-up's dummy tensor)."""
        if not ops or not self._via_host:
            return ops
        out = []
        for op in ops:
            if getattr(op.op, "__name__", "") == "irecv":
                buf, fin = staged_recv(op.tensor, self.group)
                if key is not None:
                    self._copy_back.setdefault(key, []).append(fin)
            else:
                buf = staged_send(op.tensor, self.group)
            out.append(tdist.P2POp(op.op, buf, op.peer, op.group, op.tag))
        return out

    def _received(self, key) -> None:
        for fin in self._copy_back.pop(key, ()):
            fin()

    def get_fwd_recv_ops(self, fwd_chunk_id):
        ops = self._host_staged(super().get_fwd_recv_ops(fwd_chunk_id), ("F", fwd_chunk_id))
        return self._posted_recv("F", fwd_chunk_id, ops)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        ops = self._host_staged(super().get_bwd_recv_ops(bwd_chunk_id), ("B", bwd_chunk_id))
        return self._posted_recv("B", bwd_chunk_id, ops)

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._emit_send("F", fwd_chunk_id, self._host_staged(super().get_fwd_send_ops(fwd_chunk_id)))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._emit_send("B", bwd_chunk_id, self._host_staged(super().get_bwd_send_ops(bwd_chunk_id)))

    # -- compute -------------------------------------------------------------------------------------
    def _emit_compute(self, phase, mb, t0):
        block = Compute(stage=self.stage_index, micro_batch=mb, phase=phase, chunk=self.stage_index // self._p,
                        step=self._step_ref(), live_activation_bytes=None if self._meter is None else self._meter.live)
        trace.emit(Event(kind="compute", start=t0, end=time.time(), op=phase, name=f"{phase}{mb}", payload=block))

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        if self._copy_back:
            self._received(("F", fwd_chunk_id))
        if not trace.active():
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._emit_recv("F", fwd_chunk_id)
        t0 = time.time()
        if self._meter is not None and self.has_backward:
            ctx, done = self._meter.hooks((self.stage_index, fwd_chunk_id))
            with ctx:
                out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            done()
        else:
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._emit_compute("F", fwd_chunk_id, t0)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if self._copy_back:
            self._received(("B", bwd_chunk_id))
        if not (self.has_backward and trace.active()):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self._emit_recv("B", bwd_chunk_id)
        t0 = time.time()
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward and self._meter is not None:
            self._meter.release((self.stage_index, bwd_chunk_id))
        self._emit_compute("B", bwd_chunk_id, t0)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if not (self.has_backward and trace.active()):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        t0 = time.time()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        if self._meter is not None:
            self._meter.release((self.stage_index, bwd_chunk_id))
        self._emit_compute("W", bwd_chunk_id, t0)


def _set_up_through_host(name):
    def method(self, *args, **kwargs):
        run = getattr(super(TracedStage, self), name)
        if not self._via_host:
            return run(*args, **kwargs)
        with p2p_through_host():
            return run(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in pipeline_setup_calls():
    setattr(TracedStage, _name, _set_up_through_host(_name))
