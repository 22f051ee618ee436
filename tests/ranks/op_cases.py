"""The op sweep: ops real models use, on dist tensors in many placements, checked against the dense run."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["In", "OpCase", "CASES", "MESHES", "combos", "case_keys", "sweep_rank", "run_sweep", "tally", "figure"]

MESHES = {"1d": [2], "2d": [2, 2]}
RTOL, ATOL = 1e-6, 1e-9  # the sweep runs in float64


@dataclass(frozen=True)
class In:
    """One input: its shape and kind. f: float (gets a gradient), p: a probability in (0.05, 0.95) with a
    gradient, pos: positive with a gradient, t: a probability without one, i: ints in [0, hi), ig: labels in
    [0, hi) with every third one from the second -100 (ignored), b: a bool mask."""

    shape: tuple
    kind: str = "f"
    hi: int = 0

    @property
    def is_float(self) -> bool:
        return self.kind in ("f", "p", "pos", "t")

    @property
    def grad(self) -> bool:
        return self.kind in ("f", "p", "pos")


@dataclass(frozen=True)
class OpCase:
    op: str  # the name the figure counts it under
    variant: str
    fn: object  # (*inputs) -> a tensor or a tuple of them
    shapes: tuple  # tuples of In: even and uneven
    check: object = field(default=None)  # (dense inputs, full outputs, full grads, weights) -> error or None


def _f(*shape):
    return In(tuple(shape))


def _same(*shapes_of_inputs):
    return tuple(tuple(In(s) if isinstance(s, tuple) else s for s in ins) for ins in shapes_of_inputs)


def _rms_norm_by_hand(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _dropout_check(p):
    def check(dense, outs, grads, weights):
        x, out, g, w = dense[0], outs[0], grads[0], weights[0]
        if out.shape != x.shape:
            return f"shape {list(out.shape)} != {list(x.shape)}"
        kept = out != 0
        if not torch.allclose(out[kept], x[kept] / (1 - p), rtol=RTOL, atol=ATOL):
            return "kept values are not x / (1 - p)"
        if not 0 < kept.double().mean() < 1:
            return f"dropped a fraction {1 - kept.double().mean():.2f} for p={p}"
        if g is None or not torch.allclose(g, kept * w / (1 - p), rtol=RTOL, atol=ATOL):
            return "grad is not mask * w / (1 - p)"
        return None

    return check


def _losses() -> list:
    out = []
    ev, un = (4, 8), (5, 3)
    pair = _same((ev, ev), (un, un))
    for red in ("mean", "sum"):
        out += [
            OpCase("mse_loss", red, lambda x, t, r=red: F.mse_loss(x, t, reduction=r), pair),
            OpCase("l1_loss", red, lambda x, t, r=red: F.l1_loss(x, t, reduction=r), pair),
            OpCase("smooth_l1_loss", red, lambda x, t, r=red: F.smooth_l1_loss(x, t, reduction=r, beta=0.5), pair),
            OpCase("huber_loss", red, lambda x, t, r=red: F.huber_loss(x, t, reduction=r, delta=0.5), pair),
            OpCase("binary_cross_entropy", red, lambda x, t, r=red: F.binary_cross_entropy(x, t, reduction=r),
                   ((In(ev, "p"), In(ev, "p")), (In(un, "p"), In(un, "p")))),
            OpCase("binary_cross_entropy_with_logits", red,
                   lambda x, t, r=red: F.binary_cross_entropy_with_logits(x, t, reduction=r),
                   ((In(ev), In(ev, "p")), (In(un), In(un, "p")))),
            OpCase("kl_div", red, lambda x, t, r=red: F.kl_div(x, t, reduction=r),
                   ((In(ev), In(ev, "p")), (In(un), In(un, "p")))),
        ]
        lab = ((In(ev), In((4,), "i", 8)), (In(un), In((5,), "i", 3)))
        ign = ((In(ev), In((4,), "ig", 8)), (In(un), In((5,), "ig", 3)))
        out += [
            OpCase("cross_entropy", red, lambda x, y, r=red: F.cross_entropy(x, y, reduction=r), lab),
            OpCase("cross_entropy", red + ",ignore_index",
                   lambda x, y, r=red: F.cross_entropy(x, y, reduction=r, ignore_index=-100), ign),
            OpCase("cross_entropy", red + ",label_smoothing",
                   lambda x, y, r=red: F.cross_entropy(x, y, reduction=r, label_smoothing=0.1), lab),
            OpCase("cross_entropy", red + ",both",
                   lambda x, y, r=red: F.cross_entropy(x, y, reduction=r, ignore_index=-100, label_smoothing=0.1),
                   ign),
            OpCase("nll_loss", red, lambda x, y, r=red: F.nll_loss(x, y, reduction=r), lab),
            OpCase("nll_loss", red + ",ignore_index",
                   lambda x, y, r=red: F.nll_loss(x, y, reduction=r, ignore_index=-100), ign),
        ]
    out += [
        OpCase("kl_div", "batchmean", lambda x, t: F.kl_div(x, t, reduction="batchmean"),
               ((In(ev), In(ev, "p")), (In(un), In(un, "p")))),
        OpCase("kl_div", "sum,log_target", lambda x, t: F.kl_div(x, t, reduction="sum", log_target=True), pair),
        OpCase("cross_entropy", "mean,3d", lambda x, y: F.cross_entropy(x.flatten(0, 1), y.flatten()),
               ((In((2, 4, 6)), In((2, 4), "ig", 6)), (In((3, 2, 5)), In((3, 2), "ig", 5)))),
    ]
    return out


def _reductions() -> list:
    one = _same(((4, 8),), ((5, 3),))
    three = _same(((2, 4, 6),), ((3, 5, 2),))
    return [
        OpCase("sum", "all", lambda x: x.sum(), one + three),
        OpCase("sum", "dim0", lambda x: x.sum(0), one),
        OpCase("sum", "dim-1,keepdim", lambda x: x.sum(-1, keepdim=True), one + three),
        OpCase("mean", "all", lambda x: x.mean(), one + three),
        OpCase("mean", "dim-1", lambda x: x.mean(-1), one + three),
        OpCase("mean", "dims(0,1)", lambda x: x.mean((0, 1)), three),
        OpCase("var", "dim-1", lambda x: x.var(-1), one),
        OpCase("var", "all,correction0", lambda x: x.var(correction=0), one),
        OpCase("std", "dim0", lambda x: x.std(0), one),
        OpCase("std", "all", lambda x: x.std(), one),
        OpCase("norm", "all", lambda x: x.norm(), one),
        OpCase("norm", "dim-1", lambda x: torch.linalg.vector_norm(x, 2, dim=-1), one),
        OpCase("norm", "p1,dim0", lambda x: x.norm(p=1, dim=0), one),
        OpCase("max", "dim-1", lambda x: x.max(-1), one),
        OpCase("max", "all", lambda x: x.max(), one),
        OpCase("min", "dim0", lambda x: x.min(0), one),
        OpCase("min", "all", lambda x: x.min(), one),
        OpCase("amax", "dim-1", lambda x: x.amax(-1), one),
        OpCase("argmax", "dim-1", lambda x: x.argmax(-1), one),
        OpCase("argmax", "all", lambda x: x.argmax(), one),
        OpCase("argmin", "dim0", lambda x: x.argmin(0), one),
        OpCase("logsumexp", "dim-1", lambda x: torch.logsumexp(x, -1), one + three),
        OpCase("logsumexp", "dim0", lambda x: torch.logsumexp(x, 0), one),
    ]


def _matmuls() -> list:
    return [
        OpCase("matmul", "2d", lambda x, w: x @ w, _same(((4, 6), (6, 8)), ((5, 3), (3, 5)))),
        OpCase("matmul", "3d@2d", lambda x, w: x @ w, _same(((2, 4, 6), (6, 4)), ((3, 5, 2), (2, 3)))),
        OpCase("linear", "bias", lambda x, w, b: F.linear(x, w, b),
               _same(((2, 4, 6), (8, 6), (8,)), ((3, 5, 2), (3, 2), (3,)))),
        OpCase("linear", "nobias", lambda x, w: F.linear(x, w), _same(((4, 6), (8, 6)), ((5, 3), (5, 3)))),
        OpCase("bmm", "", torch.bmm, _same(((2, 4, 6), (2, 6, 4)), ((3, 5, 2), (3, 2, 3)))),
        OpCase("einsum", "bij,bjk", lambda a, b: torch.einsum("bij,bjk->bik", a, b),
               _same(((2, 4, 6), (2, 6, 4)), ((3, 5, 2), (3, 2, 3)))),
        OpCase("einsum", "bsh,hd", lambda a, b: torch.einsum("bsh,hd->bsd", a, b),
               _same(((2, 4, 6), (6, 4)), ((3, 5, 2), (2, 3)))),
        OpCase("einsum", "ij,ij->i", lambda a, b: torch.einsum("ij,ij->i", a, b),
               _same(((4, 6), (4, 6)), ((5, 3), (5, 3)))),
    ]


def _elementwise() -> list:
    row = _same(((4, 8), (8,)), ((5, 3), (3,)))
    col = _same(((4, 8), (4, 1)), ((5, 3), (5, 1)))
    one = _same(((4, 8),), ((5, 3),))
    out = [
        OpCase("add", "row", torch.add, row),
        OpCase("add", "same", torch.add, _same(((4, 8), (4, 8)), ((5, 3), (5, 3)))),
        OpCase("sub", "col", torch.sub, col),
        OpCase("mul", "col", torch.mul, col),
        OpCase("mul", "row", torch.mul, row),
        OpCase("div", "row", torch.div, ((In((4, 8)), In((8,), "pos")), (In((5, 3)), In((3,), "pos")))),
        OpCase("pow", "row", torch.pow, ((In((4, 8), "pos"), In((8,))), (In((5, 3), "pos"), In((3,))))),
        OpCase("pow", "scalar", lambda x: x.pow(2), one),
        OpCase("add", "scalar", lambda x: x + 1.5, one),
    ]
    for name, variant, fn in (("exp", "", torch.exp), ("tanh", "", torch.tanh), ("relu", "", F.relu),
                              ("gelu", "", F.gelu), ("gelu", "tanh", lambda x: F.gelu(x, approximate="tanh")),
                              ("silu", "", F.silu), ("rsqrt", "", lambda x: torch.rsqrt(x.abs() + 0.5))):
        out.append(OpCase(name, variant, fn, one))
    out += [
        OpCase("exp", "+row", lambda x, b: torch.exp(x) + b, row),
        OpCase("silu", "*col", lambda x, b: F.silu(x) * b, col),
    ]
    return out


def _norms() -> list:
    ln = _same(((2, 4, 8), (8,), (8,)), ((3, 5, 3), (3,), (3,)))
    rms = _same(((2, 4, 8), (8,)), ((3, 5, 3), (3,)))
    out = [
        OpCase("softmax", "dim-1", lambda x: F.softmax(x, -1), _same(((4, 8),), ((5, 3),), ((2, 4, 6),))),
        OpCase("softmax", "dim0", lambda x: F.softmax(x, 0), _same(((4, 8),), ((5, 3),))),
        OpCase("log_softmax", "dim-1", lambda x: F.log_softmax(x, -1), _same(((4, 8),), ((5, 3),), ((2, 4, 6),))),
        OpCase("log_softmax", "dim0", lambda x: F.log_softmax(x, 0), _same(((4, 8),), ((5, 3),))),
        OpCase("layer_norm", "", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), ln),
        OpCase("layer_norm", "noaffine", lambda x: F.layer_norm(x, x.shape[-1:]), _same(((4, 8),), ((5, 3),))),
        OpCase("rms_norm", "by hand", _rms_norm_by_hand, rms),
    ]
    if hasattr(torch.ops.aten, "_fused_rms_norm"):
        out.append(OpCase("rms_norm", "aten._fused_rms_norm",
                          lambda x, w: torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, 1e-6)[0], rms))
    if hasattr(F, "rms_norm"):
        out.append(OpCase("rms_norm", "F.rms_norm", lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6), rms))
    return out


def _embedding_dropout() -> list:
    emb = ((In((2, 4), "i", 6), In((6, 8))), (In((3, 5), "i", 5), In((5, 3))))
    one = _same(((4, 8),), ((5, 3),))
    return [
        OpCase("embedding", "", lambda i, w: F.embedding(i, w), emb),
        OpCase("embedding", "padding_idx", lambda i, w: F.embedding(i, w, padding_idx=0), emb),
        OpCase("dropout", "p=0", lambda x: F.dropout(x, 0.0, training=True), one),
        OpCase("dropout", "eval", lambda x: F.dropout(x, 0.5, training=False), one),
        OpCase("dropout", "p=0.5", lambda x: F.dropout(x, 0.5, training=True), _same(((8, 8),), ((7, 5),)),
               check=_dropout_check(0.5)),
    ]


def _views() -> list:
    three = _same(((2, 4, 6),), ((3, 5, 2),))
    return [
        OpCase("reshape", "merge(0,1)", lambda x: x.reshape(-1, x.shape[-1]), three),
        OpCase("reshape", "merge(1,2)", lambda x: x.reshape(x.shape[0], -1), three),
        OpCase("reshape", "split-1", lambda x: x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2), three),
        OpCase("view", "split-1", lambda x: x.view(*x.shape[:-1], 2, x.shape[-1] // 2), three),
        OpCase("view", "merge(0,1)", lambda x: x.view(-1, x.shape[-1]), three),
        OpCase("transpose", "(0,1)", lambda x: x.transpose(0, 1), three),
        OpCase("transpose", ".T", lambda x: x.t(), _same(((4, 6),), ((5, 3),))),
        OpCase("permute", "(2,0,1)", lambda x: x.permute(2, 0, 1), three),
        OpCase("flatten", "(1)", lambda x: x.flatten(1), three),
        OpCase("flatten", "all", lambda x: x.flatten(), three),
        OpCase("squeeze", "dim1", lambda x: x.squeeze(1), _same(((4, 1, 6),), ((5, 1, 3),))),
        OpCase("unsqueeze", "dim1", lambda x: x.unsqueeze(1), _same(((4, 6),), ((5, 3),))),
        OpCase("contiguous", "of transpose", lambda x: x.transpose(0, 1).contiguous().view(-1), three),
    ]


def _joins() -> list:
    two = _same(((4, 6), (4, 6)), ((5, 3), (5, 3)))
    return [
        OpCase("cat", "dim0", lambda a, b: torch.cat([a, b], 0), two),
        OpCase("cat", "dim1", lambda a, b: torch.cat([a, b], 1), _same(((4, 6), (4, 2)), ((5, 3), (5, 2)))),
        OpCase("stack", "dim0", lambda a, b: torch.stack([a, b], 0), two),
        OpCase("stack", "dim-1", lambda a, b: torch.stack([a, b], -1), two),
        OpCase("split", "dim-1", lambda x: torch.split(x, [2, x.shape[-1] - 2], -1), _same(((4, 6),), ((5, 3),))),
        OpCase("split", "dim0,size", lambda x: torch.split(x, 2, 0), _same(((4, 6),), ((5, 3),))),
        OpCase("chunk", "dim-1", lambda x: torch.chunk(x, 2, -1), _same(((4, 6),), ((5, 3),))),
        OpCase("chunk", "dim0", lambda x: torch.chunk(x, 2, 0), _same(((4, 6),), ((5, 3),))),
    ]


def _indexing() -> list:
    one = _same(((4, 8),), ((5, 3),))
    mask = ((In((4, 8)), In((4, 8), "b")), (In((5, 3)), In((5, 3), "b")))
    return [
        OpCase("gather", "dim1", lambda x, i: torch.gather(x, 1, i),
               ((In((4, 8)), In((4, 3), "i", 8)), (In((5, 3)), In((5, 2), "i", 3)))),
        OpCase("gather", "dim0", lambda x, i: torch.gather(x, 0, i),
               ((In((4, 8)), In((2, 8), "i", 4)), (In((5, 3)), In((3, 3), "i", 5)))),
        OpCase("index_select", "dim0", lambda x, i: torch.index_select(x, 0, i),
               ((In((4, 8)), In((6,), "i", 4)), (In((5, 3)), In((3,), "i", 5)))),
        OpCase("index_select", "dim1", lambda x, i: torch.index_select(x, 1, i),
               ((In((4, 8)), In((4,), "i", 8)), (In((5, 3)), In((5,), "i", 3)))),
        OpCase("masked_select", "", torch.masked_select, mask),
        OpCase("masked_fill", "", lambda x, m: x.masked_fill(m, -2.5), mask),
        OpCase("where", "", lambda x, m, y: torch.where(m, x, y),
               ((In((4, 8)), In((4, 8), "b"), In((8,))), (In((5, 3)), In((5, 3), "b"), In((3,))))),
        OpCase("topk", "dim-1", lambda x: torch.topk(x, 2, -1), one),
        OpCase("topk", "dim0", lambda x: torch.topk(x, 2, 0), one),
        OpCase("sort", "dim-1", lambda x: torch.sort(x, -1), one),
        OpCase("sort", "dim0,desc", lambda x: torch.sort(x, 0, descending=True), one),
        OpCase("cumsum", "dim-1", lambda x: torch.cumsum(x, -1), one),
        OpCase("cumsum", "dim0", lambda x: torch.cumsum(x, 0), one),
    ]


CASES: list[OpCase] = (_losses() + _reductions() + _matmuls() + _elementwise() + _norms() + _embedding_dropout()
                       + _views() + _joins() + _indexing())


# -- placements ------------------------------------------------------------------------------------------------

def _axis_options(spec: In) -> list[str]:
    """One mesh axis: S<d> for each dim, R, P (sum); an integer or bool input only R or Shard(0) (its batch dim)."""
    if not spec.is_float:
        return ["R", "S0"]
    return [f"S{d}" for d in range(len(spec.shape))] + ["R", "P"]


def combos(case: OpCase, shape_idx: int, mesh_ndim: int) -> list[tuple]:
    """Every placement of every input on a mesh of ``mesh_ndim`` axes: a tuple (per input) of tuples (per axis)."""
    per_input = [list(itertools.product(_axis_options(s), repeat=mesh_ndim)) for s in case.shapes[shape_idx]]
    return list(itertools.product(*per_input))


def case_keys(mesh_ndim: int, sample: int | None = None, seed: int = 0, ops=None) -> list[tuple]:
    """(case index, shape index, placements) for every case, or ``sample`` seeded picks per case and shape."""
    rng = random.Random(seed)
    keys = []
    for ci, case in enumerate(CASES):
        if ops and case.op not in ops:
            continue
        for si in range(len(case.shapes)):
            cs = combos(case, si, mesh_ndim)
            if sample is not None and len(cs) > sample:
                cs = rng.sample(cs, sample)
            keys += [(ci, si, c) for c in cs]
    return keys


def _placements(code):
    import meshviz.distributed as dist

    return [dist.Replicate() if c == "R" else dist.Partial() if c == "P" else dist.Shard(int(c[1:])) for c in code]


# -- one rank's run ---------------------------------------------------------------------------------------------

def _dense_inputs(case: OpCase, si: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in case.shapes[si]:
        if s.kind == "f":
            t = torch.randn(s.shape, generator=g, dtype=torch.float64)
        elif s.kind in ("p", "t"):
            t = torch.rand(s.shape, generator=g, dtype=torch.float64) * 0.9 + 0.05
        elif s.kind == "pos":
            t = torch.rand(s.shape, generator=g, dtype=torch.float64) + 0.5
        elif s.kind in ("i", "ig"):
            t = torch.randint(0, s.hi, s.shape, generator=g)
            if s.kind == "ig":
                t.view(-1)[1::3] = -100
        else:
            t = torch.rand(s.shape, generator=g) < 0.5
        out.append(t)
    return out


def _dist_input(dense: torch.Tensor, spec: In, code, mesh, seed: int):
    """``dense`` placed as ``code``; a Partial one as random per-rank summands adding up to it."""
    import meshviz.distributed as dist
    from meshviz.core.layout import local_block

    pl = _placements(code)
    if "P" not in code:
        t = dist.shard_tensor(dense, mesh, pl)
    else:
        paxes = [a for a, c in enumerate(code) if c == "P"]
        n = 1
        for a in paxes:
            n *= mesh.shape[a]
        g = torch.Generator().manual_seed(seed)
        noise = [torch.randn(dense.shape, generator=g, dtype=dense.dtype) for _ in range(n - 1)]
        noise.append(-sum(noise))
        coord = mesh.coordinate(dist.get_rank())
        k = 0
        for a in paxes:
            k = k * mesh.shape[a] + coord[a]
        summand = dense / n + noise[k]
        block = [dist.Replicate() if c == "P" else p for c, p in zip(code, pl)]
        sl = tuple(slice(a, b) for a, b in local_block(tuple(dense.shape), mesh, block, coord))
        t = dist.dtensor_from_local(summand[sl].contiguous(), mesh, pl, shape=list(dense.shape))
    t = t.detach()
    if spec.grad:
        t.requires_grad_(True)
    return t


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]


def _weights(outs, seed: int) -> list:
    g = torch.Generator().manual_seed(seed + 7)
    return [torch.randn(tuple(o.shape), generator=g, dtype=torch.float64) if o.is_floating_point() else None
            for o in outs]


def _loss(fulls, weights):
    terms = [(f * w).sum() for f, w in zip(fulls, weights) if w is not None]
    return sum(terms) if terms else None


def _close(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    return torch.equal(a, b)


def _gather_blocks(ts) -> list | None:
    """Every rank's block of each of ``ts`` (on rank 0; None elsewhere), to read the values without meshviz's
    planner: one gather for them all."""
    import torch.distributed as tdist

    ts = [t._resolved() for t in ts]
    got = [None] * tdist.get_world_size()
    tdist.all_gather_object(got, (tdist.get_rank(), [t._local_value().detach().numpy() for t in ts]))
    if tdist.get_rank() != 0:
        return None
    return [(tuple(t.shape), t.placements, {r: blocks[k] for r, blocks in got}) for k, t in enumerate(ts)]


def _value_of_blocks(gathered, mesh, dtype):
    """The value blocks stand for, by ``tests.partials.dense_of`` (replicas must agree); NaN where they do not."""
    import numpy as np

    from tests.partials import dense_of

    shape, placements, locals_ = gathered
    if not shape:  # dense_of writes into blocks: give a 0-d tensor one dim
        shape, locals_ = (1,), {r: v.reshape(1) for r, v in locals_.items()}
    try:
        full = dense_of(locals_, shape, mesh, placements)
    except AssertionError:
        return torch.full(gathered[0], float("nan"), dtype=dtype)
    return torch.from_numpy(np.asarray(full)).to(dtype).reshape(gathered[0])


def _names_op(msg: str, case: OpCase) -> bool:
    m = msg.lower()
    return "aten." in m or case.op.lower() in m


def _one_case(case: OpCase, si: int, code, mesh, seed: int, comms: list, compare: bool) -> tuple:
    """(status, detail) for one case on this rank; every rank makes the same calls (collectives)."""
    import meshviz.distributed as dist

    dense = _dense_inputs(case, si, seed)
    # dropout draws from each rank's generator: start every case from one state (an uneven block before would
    # leave the ranks' generators apart, and Replicate masks with them: see the README)
    torch.manual_seed(seed)
    xs = [_dist_input(d, s, c, mesh, seed + 101 + i) for i, (d, s, c) in enumerate(zip(dense, case.shapes[si], code))]
    before = comms[0]
    try:
        outs = _flat(case.fn(*xs))
    except (ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if _names_op(msg, case) and comms[0] == before:
            return "refused", msg
        return "crashed", f"forward {type(e).__name__}: {msg} (after {comms[0] - before} collectives)"
    except Exception as e:
        return "crashed", f"forward {type(e).__name__}: {e}"
    stage = "unshard"
    try:
        fulls = [dist.unshard_dtensor(o) for o in outs]
        weights = _weights(fulls, seed)
        loss = _loss(fulls, weights)
        stage = "backward"
        if loss is not None and loss.requires_grad:
            loss.backward()
        stage = "grad unshard"
        grads = [dist.unshard_dtensor(x.grad) if x.grad is not None else None for x in xs]
        stage = "blocks"
        blocks = _gather_blocks(outs + [x.grad for x in xs if x.grad is not None])
    except Exception as e:
        return "crashed", f"{stage} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not compare:
        return "ok", ""
    try:
        return _compare(case, si, mesh, dense, outs, fulls, grads, blocks, weights)
    except Exception as e:  # on rank 0 only, after every collective of the case: the run goes on
        return "crashed", f"compare {type(e).__name__}: {e}"


def _compare(case, si, mesh, dense, outs, fulls, grads, blocks, weights) -> tuple:
    fulls = [f.detach() for f in fulls]
    grads = [g.detach() if g is not None else None for g in grads]
    bad = [f"blocks of {'out' if k < len(outs) else 'grad'}{k if k < len(outs) else k - len(outs)}"
           for k, (b, f) in enumerate(zip(blocks, fulls + [g for g in grads if g is not None]))
           if not _close(_value_of_blocks(b, mesh, f.dtype), f)]
    if case.check is not None:
        err = case.check(dense, fulls, grads, weights)
        bad += [err] if err else []
        return ("WRONG", ", ".join(bad)) if bad else ("ok", "")
    leaves = [d.clone().requires_grad_(s.grad) for d, s in zip(dense, case.shapes[si])]
    want = _flat(case.fn(*leaves))
    bad += [f"out{k}" for k, (a, b) in enumerate(zip(fulls, want)) if not _close(a, b.detach())]
    if len(want) != len(fulls):
        bad.append(f"{len(fulls)} outputs, not {len(want)}")
    wl = _loss(want, weights)
    if wl is not None and wl.requires_grad:
        wl.backward()
    for k, (x, g) in enumerate(zip(leaves, grads)):
        if not case.shapes[si][k].grad:
            continue
        if x.grad is None and g is None:
            continue
        if x.grad is None or g is None or not _close(g, x.grad):
            bad.append(f"grad{k}" + (" missing" if g is None else ""))
    if bad:
        return "WRONG", ", ".join(bad)
    return "ok", ""


_PROGRESS: dict = {}  # rank -> its (key, status, detail) so far (ranks are threads of this process)


class CaseCrashed(RuntimeError):
    """A case crashed on this rank: the run ends here (the ranks' collectives may be out of step) and the sweep
    goes on from the next case in a fresh world."""


def sweep_rank(mesh_shape, keys, seed: int = 0) -> list:
    """Run ``keys`` on one mesh; rank 0 returns (key, status, detail) per case (the others check their status
    agrees). A crash ends the run (:class:`CaseCrashed`); what every rank did so far is in ``_PROGRESS``."""
    import meshviz.distributed as dist
    from meshviz.ranks import threads as thread_world

    dist.init_parallel_env()
    n = 1
    for s in mesh_shape:
        n *= s
    mesh = dist.ProcessMesh(torch.arange(n).reshape(mesh_shape).tolist(), [f"d{i}" for i in range(len(mesh_shape))])
    comms = [0]

    def count(op, tensors):
        comms[0] += 1

    thread_world.observers().append(count)
    rank = dist.get_rank()
    results = _PROGRESS.setdefault(rank, [])
    for ci, si, code in keys:
        case = CASES[ci]
        st, detail = _one_case(case, si, code, mesh, seed * 100003 + ci * 101 + si, comms, compare=rank == 0)
        results.append(((ci, si, code), st, detail))
        if st == "crashed" and not detail.startswith("compare"):
            raise CaseCrashed(detail)
    return results


def run_sweep(mesh_name: str, keys, seed: int = 0, timeout: float = 600.0) -> list:
    """Every case of ``keys`` on mesh ``mesh_name`` on ranks as threads; (mesh, key, status, detail) each. After a
    crash the rest runs in a fresh world, so one crash is one case."""
    from meshviz.errors import RankError
    from meshviz.testing import run_ranks

    shape = MESHES[mesh_name]
    n = 1
    for s in shape:
        n *= s
    out, start = [], 0
    while start < len(keys):
        _PROGRESS.clear()
        try:
            run_ranks(sweep_rank, n, shape, keys[start:], seed, ranks="threads", timeout=timeout)
        except RankError as e:
            crash = str(e).splitlines()[0]
        else:
            crash = None
        per_rank = [list(_PROGRESS.get(r, [])) for r in range(n)]
        done = min(len(r) for r in per_rank)
        for k in range(done):
            key, st, detail = per_rank[0][k]
            # a rank that raised where rank 0 did not (or the other way) is a defect of its own
            others = {r[k][1] for r in per_rank[1:]}
            if st != "crashed" and any(o in ("crashed", "refused") and o != st for o in others):
                st, detail = "crashed", f"ranks disagree: {sorted(others)}"
            out.append((mesh_name, key, st, detail))
        if crash is None:
            break
        if done and out[-1][2] == "crashed" and not out[-1][3].startswith("compare"):
            start += done  # every rank recorded the crash: the case after it has not run
            continue
        key = keys[start + done]
        details = [r[done][2] for r in per_rank if len(r) > done]
        out.append((mesh_name, key, "crashed", details[0] if details else crash))
        start += done + 1
    return out


def label(mesh_name: str, key) -> str:
    ci, si, code = key
    c = CASES[ci]
    shapes = ",".join("x".join(map(str, s.shape)) for s in c.shapes[si])
    pls = " ".join("[" + ",".join(p) + "]" for p in code)
    return f"{mesh_name} {c.op}({c.variant}) shapes {shapes} placements {pls}"


def tally(results) -> dict:
    """op -> Counter of statuses (and 'tried')."""
    per: dict = {}
    for _mesh, (ci, _si, _code), st, _d in results:
        c = per.setdefault(CASES[ci].op, Counter())
        c["tried"] += 1
        c[st] += 1
    return per


def figure(results) -> str:
    per = tally(results)
    total = Counter()
    for c in per.values():
        total.update(c)
    ops = len(per)
    meshes = len({r[0] for r in results})
    lines = [f"ops x placements x meshes: {ops} ops, {meshes} meshes, {total['tried']} cases tried, "
             f"{total['WRONG']} wrong, {total['refused']} refused, {total['crashed']} crashed"]
    lines.append(f"{'op':36} {'tried':>6} {'wrong':>6} {'refused':>8} {'crashed':>8}")
    for op, c in per.items():
        lines.append(f"{op:36} {c['tried']:6} {c['WRONG']:6} {c['refused']:8} {c['crashed']:8}")
    return "\n".join(lines)
