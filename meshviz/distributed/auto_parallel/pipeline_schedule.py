"""Paddle's ``strategy.pipeline`` in DistModel: each batch as micro-batches through the stages, in a schedule."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as tdist

from ... import trace
from ...core.placements import Shard
from ...core.schedule import fthenb_order, one_f_one_b_order
from ...runtime.dtensor import DistTensor, make_dist
from ...runtime.pipeline import failure
from ...trace import Compute, Event, Mark

__all__ = ["SCHEDULES", "check_pipeline", "split_micro", "Pipeline"]

SCHEDULES = ("FThenB", "1F1B")


def _count(section, key) -> int:
    v = getattr(section, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"to_static: strategy.pipeline.{key} must be a positive int, got {v!r}")
    return v


def check_pipeline(strategy, world: int) -> tuple[str, int, int]:
    """``(schedule, accumulate_steps, pp_degree)`` of an enabled ``strategy.pipeline``; ValueError (the same on every
    rank: it reads only the strategy) where DistModel cannot run it as Paddle's static pipeline does."""
    pp = strategy.pipeline
    mode = pp.schedule_mode
    if mode == "VPP" or _count(pp, "vpp_degree") > 1:
        raise ValueError("to_static: strategy.pipeline with schedule_mode 'VPP' (vpp_degree > 1) is not supported: "
                         "use 'FThenB' or '1F1B', or fleet's PipelineLayer(num_virtual_pipeline_stages=v)")
    if mode not in SCHEDULES:
        raise ValueError(f"to_static: strategy.pipeline.schedule_mode must be one of {list(SCHEDULES)} "
                         f"(Paddle's static pipeline also has 'VPP'), got {mode!r}")
    m, p = _count(pp, "accumulate_steps"), _count(pp, "pp_degree")
    _count(pp, "micro_batch_size")
    if world % p:
        raise ValueError(f"to_static: strategy.pipeline.pp_degree ({p}) must divide the number of ranks ({world})")
    if mode == "1F1B" and p > m:
        raise ValueError(f"to_static: schedule_mode '1F1B' needs accumulate_steps ({m}) >= pp_degree ({p}) "
                         f"(Paddle: Num of micro batches should larger than or equal to pp degree)")
    gm = strategy.gradient_merge
    if gm.enable and (gm.k_steps != m or not gm.avg):
        raise ValueError(f"to_static: strategy.pipeline replaces gradient_merge with accumulate_steps ({m}) "
                         f"micro-batches, averaged (as Paddle's); got gradient_merge k_steps={gm.k_steps}, "
                         f"avg={gm.avg}: disable gradient_merge or set k_steps={m}, avg=True")
    if strategy.sharding.enable:
        raise ValueError("to_static: strategy.pipeline with strategy.sharding is not supported; shard the optimizer "
                         "with dist.shard_optimizer instead")
    if m > 1 and not strategy.return_numpy:
        raise ValueError(f"to_static: with strategy.pipeline.accumulate_steps {m} > 1 the micro-batches' values come "
                         f"back merged as numpy arrays (Paddle: merge_tensor does not support return_numpy False); "
                         f"set strategy.return_numpy = True")
    return mode, m, p


def _rows_split(t, m: int, what: str) -> int:
    """The rows of each of ``m`` micro-batches of ``t``; ValueError where they are not even (the same on every rank
    for a dist tensor: it reads the global layout)."""
    if t.dim() == 0:
        raise ValueError(f"DistModel pipeline: {what} is a 0-dim tensor; every feed is split along its rows into "
                         f"accumulate_steps ({m}) micro-batches")
    rows, parts = int(t.shape[0]), 1
    if isinstance(t, DistTensor):
        for axis, pl in enumerate(t.placements):
            if pl == Shard(0):
                parts *= t.process_mesh.shape[axis]
    if rows % (m * parts):
        held = f" in {parts} row blocks" if parts > 1 else ""
        raise ValueError(f"DistModel pipeline: {what} has {rows} rows{held}: each block's rows must split evenly into "
                         f"accumulate_steps ({m}) micro-batches (Paddle: Split expects feed data's dim[0] is "
                         f"divisible by micro_batch_num)")
    return rows // m


def split_micro(feeds: list, m: int, what: str) -> list[list]:
    """``m`` lists of micro-batches of ``feeds``: each rank's rows (a dist feed's local block) cut into ``m`` even
    parts, as Paddle's executor splits every feed; every feed is checked before any is cut."""
    rows = [_rows_split(t, m, f"{what}[{j}]") for j, t in enumerate(feeds)]
    out: list[list] = [[] for _ in range(m)]
    for t, r in zip(feeds, rows):
        for i in range(m):
            out[i].append(_piece(t, i, m, r))
    return out


def _piece(t, i: int, m: int, rows: int):
    if not isinstance(t, DistTensor):
        return t.narrow(0, i * rows, rows)
    local = t._local_value().detach()
    if _held(t) and local.numel():
        k = local.shape[0] // m
        local = local.narrow(0, i * k, k)
    return make_dist(local, t.process_mesh, t.placements, [rows] + list(t.shape[1:]))


def _held(t) -> bool:
    """Whether this rank holds ``t``'s value (a dist tensor's: a rank of its mesh)."""
    if not isinstance(t, DistTensor) or not tdist.is_initialized():
        return True
    return tdist.get_rank() in t.process_mesh.process_ids


def _outputs(got) -> list:
    outs = list(got) if isinstance(got, (tuple, list)) else [got]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"predict: the model must return a tensor or a list/tuple of tensors, got {type(got).__name__}")
    return outs


def _global(t):
    return t.full_tensor() if isinstance(t, DistTensor) else t


def _merged(values: list):
    """Paddle's merge of a fetch over micro-batches: one micro-batch's value itself; else along the rows, a
    scalar per micro-batch becoming a row of its own."""
    if len(values) == 1:
        return values[0]
    return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values])


def _merged_rows(values: list):
    """The micro-batches' dist values split along their rows, merged as one dist tensor whose blocks are each
    rank's blocks in order: the whole batch's rows in their order (micro-batch i holds the i-th part of every
    block, as Paddle's executor splits each rank's feed); None where they do not lie so."""
    first = values[0]
    alike = all(isinstance(v, DistTensor) and v.dim() and v.process_mesh == first.process_mesh
                and list(v.placements) == list(first.placements) and v.shape[1:] == first.shape[1:] for v in values)
    if len(values) < 2 or not alike:
        return None
    parts = 1
    for axis, pl in enumerate(first.placements):
        parts *= first.process_mesh.shape[axis] if pl == Shard(0) else 1
    if parts == 1 or any(v.shape[0] % parts for v in values):
        return None
    local = torch.cat([v._local_value().detach() for v in values])
    return make_dist(local, first.process_mesh, first.placements,
                     [sum(int(v.shape[0]) for v in values)] + list(first.shape[1:]))


def _fetch(values: list, each):
    """Paddle's merged fetch of ``values`` as one tensor: dist values split along the rows merged rank by rank
    (the batch's row order), else ``each`` value merged along the rows."""
    rows = _merged_rows(values)
    return rows.full_tensor() if rows is not None else _merged([each(v) for v in values])


class Pipeline:
    """The micro-batch loop of one DistModel: every rank runs each micro-batch's forward (and backward) through
    the whole model in the schedule's order (its own stage's ops; the stages' transfers are the model's reshards),
    gradients are averaged over the micro-batches and the optimizer steps once per call."""

    def __init__(self, strategy, world: int, layer):
        self.schedule, self.m, self.p = check_pipeline(strategy, world)
        if self.p > 1 and not any(isinstance(q, DistTensor) for q in layer.parameters()):
            raise ValueError(f"to_static: strategy.pipeline.pp_degree {self.p} needs each stage's layers on its own "
                             f"mesh (dist parameters, e.g. shard_tensor on mesh.get_mesh_with_dim('pp', i))")
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        self.stage = rank // (world // self.p)
        self.step = 0

    @staticmethod
    def quiet():
        return contextlib.nullcontext()

    def order(self, train: bool) -> list[tuple[str, int]]:
        """The blocks every rank runs, in order: the first stage's order of the schedule (all ranks walk it
        together, as each micro-batch's forward and backward cross every stage)."""
        if not train:
            return [("F", i) for i in range(self.m)]
        blocks = fthenb_order(self.p, self.m, 0) if self.schedule == "FThenB" else one_f_one_b_order(self.p, self.m, 0)
        return [(ph, i) for ph, _, i in blocks]

    def _emit(self, phase: str, i: int, t0: float) -> None:
        if trace.active():
            block = Compute(stage=self.stage, micro_batch=i, phase=phase, chunk=0, step=self.step)
            trace.emit(Event(kind="compute", start=t0, end=time.time(), op=phase, name=f"{phase}{i}", payload=block))

    def _blocks(self, dm, train: bool, micro_in: list, micro_lb: list, losses: dict, outs: list) -> None:
        for phase, i in self.order(train):
            t0 = time.time()
            if phase == "B":
                dm._backward(losses[i], self.m, True)
            elif train:
                losses[i] = dm._train_loss(micro_in[i], micro_lb[i])
            else:
                with torch.no_grad(), dm._autocast():
                    got = dm._run(micro_in[i])
                    if dm._mode == "eval":
                        losses[i] = dm._loss_of(got, micro_lb[i])
                    else:
                        outs.append(_outputs(got))
            self._emit(phase, i, t0)

    def run(self, dm, inputs: list, labels: list):
        """One call of ``dm`` in its mode: Paddle's fetch, merged over the micro-batches; None on a rank that
        does not hold it (not the last stage)."""
        mode = dm._mode
        micro_in = split_micro(inputs, self.m, "inputs")
        micro_lb = split_micro(labels, self.m, "labels") if mode != "predict" else [[] for _ in range(self.m)]
        train = mode == "train"
        if trace.active():
            schedule = self.schedule if train else "FThenB"
            trace.emit(Event(kind="mark", op="pipeline_step", name=f"{schedule} step {self.step}",
                             payload=Mark(schedule=schedule, p=self.p, m=self.m, v=1, step=self.step,
                                          stage=self.stage, eval=not train)))
        losses: dict = {}
        outs: list = []
        try:
            self._blocks(dm, train, micro_in, micro_lb, losses, outs)
        except Exception as e:
            if train:  # no micro-batch's gradient of the failed call is carried into the next one
                dm._optimizer.zero_grad()
            err = failure.announce(e, self.stage)  # the stages waiting for this one's transfers stop now, naming it
            if err is not e:  # a closed connection of a gloo rank process, as the failing stage it names
                raise err from None
            raise
        if train:
            dm._update()
        self.step += 1
        if mode == "predict":
            if not all(_held(o) for o in outs[0]):
                return None
            return {f"out{j}": dm._out(_fetch([mb[j].detach() for mb in outs], _global)) for j in range(len(outs[0]))}
        if not _held(losses[0]):
            return None
        return dm._out(_fetch([losses[i].detach() for i in range(self.m)], dm._global_loss))
