"""One training step of a Llama block: ``dist.parallelize`` against torch's ``parallelize_module`` + FSDP2 by hand."""

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.testing import run_ranks


class Config:
    vocab, hidden, heads, ffn, layers = 512, 128, 8, 512, 2


class RMSNorm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c.hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Heads counted with -1 (torchtitan's way), so torch's local tensors and meshviz's global ones both fit.
    (meshviz runs `@` on the split heads as DTensor ops, which needs torch 2.13: see README.)"""

    def __init__(self, c):
        super().__init__()
        self.head_dim = c.hidden // c.heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(c.hidden, c.hidden) for _ in range(3))
        self.o_proj = nn.Linear(c.hidden, c.hidden, bias=False)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        d = self.head_dim
        q, k, v = (p(x).reshape(b, s, -1, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / d**0.5
        scores = scores + torch.full_like(scores, float("-inf")).triu(1)
        return self.o_proj((torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(c.hidden, c.ffn, bias=False), nn.Linear(c.hidden, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(c), Attention(c)
        self.post_attention_layernorm, self.mlp = RMSNorm(c), MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        torch.manual_seed(0)
        self.llama = LlamaModel(c)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.llama(ids))


def paddle_plan(sp):
    import meshviz.distributed as dist

    plan = {
        "llama.layers.*.self_attn.q_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.k_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.v_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.o_proj": dist.RowWiseParallel(),
        "llama.layers.*.mlp.gate_proj": dist.ColWiseParallel(),
        "llama.layers.*.mlp.up_proj": dist.ColWiseParallel(),
        "llama.layers.*.mlp.down_proj": dist.RowWiseParallel(),
    }
    if sp:
        plan["llama.embed_tokens"] = [dist.ColWiseParallel(), dist.SequenceParallelBegin(need_transpose=False)]
        plan["llama.layers.*.self_attn"] = dist.SequenceParallelDisable(need_transpose=False)
        plan["llama.layers.*.mlp"] = dist.SequenceParallelDisable(need_transpose=False)
        plan["lm_head"] = [dist.ColWiseParallel(gather_output=True), dist.SequenceParallelEnd(need_transpose=False)]
    else:
        plan["llama.embed_tokens"] = dist.ColWiseParallel(gather_output=True)
        plan["lm_head"] = dist.ColWiseParallel(gather_output=True)
    return plan


def torch_plan(sp):
    """The same split with torch's styles, the way torchtitan writes it (sequence parallel along dim 1 of [b, s, h])."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()
    plan = {"llama.embed_tokens": ColwiseParallel(output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    for i in range(Config.layers):
        p = f"llama.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{p}.{name}"] = RowwiseParallel(output_layouts=seq)
        if sp:
            for name in ("input_layernorm", "post_attention_layernorm"):
                plan[f"{p}.{name}"] = SequenceParallel()
            for name in ("self_attn", "mlp"):
                plan[f"{p}.{name}"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                         desired_input_layouts=(Replicate(),))
    if sp:
        plan["llama.norm"] = SequenceParallel()
    return plan


def _batch(batch, seq, rank_slice=None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, Config.vocab, (batch, seq), generator=g)
    labels = torch.randint(0, Config.vocab, (batch, seq), generator=g)
    return ids, labels


def _rank(dp, mp, batch, seq, sp, level, rounds, steps, size=None, traced=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import meshviz.distributed as dist
    from meshviz import trace

    if size is not None:  # the model's size, set in each rank (ranks may be fresh processes)
        Config.layers, Config.hidden, Config.ffn = size
    dist.init_parallel_env()
    rank = dist.get_rank()
    ids, labels = _batch(batch, seq)

    # meshviz: Paddle's config on a [dp, mp] mesh
    mesh = dist.ProcessMesh(torch.arange(dp * mp).reshape(dp, mp).tolist(), dim_names=["dp", "mp"])
    mv = LlamaForCausalLM(Config)
    mv_opt = torch.optim.AdamW(mv.parameters(), lr=1e-3)
    mv, mv_opt = dist.parallelize(mv, mv_opt, mesh, {"mp_config": {"parallelize_plan": paddle_plan(sp)},
                                                     "dp_config": {"sharding_level": level}})
    pl = [dist.Shard(0), dist.Replicate()]
    mv_ids, mv_labels = dist.shard_tensor(ids, mesh, pl), dist.shard_tensor(labels, mesh, pl)

    def mv_step():
        loss = F.cross_entropy(mv(mv_ids).flatten(0, 1), mv_labels.flatten())
        loss.backward()
        mv_opt.step()
        mv_opt.zero_grad()
        return loss

    # torch by hand: parallelize_module on the mp sub-mesh, FSDP2 (fully_shard) over dp, each rank its own batch rows
    mesh2d = init_device_mesh("cpu", (dp, mp), mesh_dim_names=("dp", "mp"))
    th = LlamaForCausalLM(Config)
    parallelize_module(th, mesh2d["mp"], torch_plan(sp))
    if dp > 1:
        for layer in th.llama.layers:
            fully_shard(layer, mesh=mesh2d["dp"])
        fully_shard(th, mesh=mesh2d["dp"])
    th_opt = torch.optim.AdamW(th.parameters(), lr=1e-3)
    rows = slice(rank // mp * (batch // dp), (rank // mp + 1) * (batch // dp))
    th_ids, th_labels = ids[rows], labels[rows]

    def th_step():
        loss = F.cross_entropy(th(th_ids).flatten(0, 1), th_labels.flatten())
        loss.backward()
        th_opt.step()
        th_opt.zero_grad()
        return loss

    # both train the same model on the same data: check the first step's loss agrees
    first_mv = dist.unshard_dtensor(mv_step()).item()
    first_th = th_step().detach()
    torch.distributed.all_reduce(first_th)
    first_th = first_th.item() / (dp * mp)
    variants = [("meshviz", mv_step, False), ("torch", th_step, False)]
    if traced:  # under a recorder, as a live view runs it; each round's events are made (flushed) inside its time
        variants.append(("meshviz traced", mv_step, True))
    times = {name: [] for name, _, _ in variants}
    cpu = {name: [] for name, _, _ in variants}  # this process's CPU time: what other jobs' load does not inflate
    events = []  # events a traced step made on this rank
    for _ in range(rounds):
        for name, fn, on in variants:  # interleaved: drifting load hits each
            with trace.record() if on else contextlib.nullcontext() as mem:
                torch.distributed.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    fn()
                if on:
                    trace.flush()
                c1 = time.process_time()
                torch.distributed.barrier()
                times[name].append((time.perf_counter() - t0) / steps)
                cpu[name].append((c1 - c0) / steps)
                if on:
                    events.append(len(mem.events) / steps)
    return {"times": times, "cpu": cpu, "first": (first_mv, first_th), "events": events}


def _measure(a, dp, mp, sp, level, size):
    res = run_ranks(_rank, dp * mp, dp, mp, a.batch, a.seq, sp, level, a.rounds, a.steps, size, a.traced,
                    timeout=1800, collective_timeout=300)
    per_round = {k: [max(r["times"][k][i] for r in res) for i in range(a.rounds)] for k in res[0]["times"]}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratios = [m / t for m, t in zip(per_round["meshviz"], per_round["torch"])]
    # CPU time per step summed over the ranks, median over the rounds
    cpu = {k: statistics.median(sum(r["cpu"][k][i] for r in res) for i in range(a.rounds)) for k in per_round}
    if a.traced:
        print(f"events a traced step made, per rank: {[statistics.median(r['events']) for r in res]}")
    return res[0]["first"], per_round, med, ratios, cpu


def _grow(a):
    """How the ratio grows: 3 model sizes at 2 ranks (mp=2) and 4 ranks (dp=2 x mp=2), sequence parallel on."""
    sizes = [(2, 64, 256), (2, 128, 512), (4, 256, 1024)]
    print(f"how cost grows: batch {a.batch} x seq {a.seq}, sequence parallel, level {a.level} where dp > 1; "
          f"{a.rounds} rounds of {a.steps} steps; median ms/step of the slowest rank, per-round ratio range")
    print(f"{'layers x hidden (ffn)':>22} {'ranks':>12} {'meshviz':>9} {'torch':>9} {'ratio':>6} {'range':>10}"
          f" {'CPU ms meshviz':>15} {'torch':>7} {'ratio':>6}")
    for size in sizes:
        for dp, mp in ((1, 2), (2, 2)):
            _, _, med, ratios, cpu = _measure(a, dp, mp, True, a.level if dp > 1 else 0, size)
            print(f"{f'{size[0]} x {size[1]} ({size[2]})':>22} {f'dp={dp} x mp={mp}':>12} "
                  f"{med['meshviz'] * 1e3:9.1f} {med['torch'] * 1e3:9.1f} {med['meshviz'] / med['torch']:6.2f} "
                  f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>10} {cpu['meshviz'] * 1e3:15.1f} "
                  f"{cpu['torch'] * 1e3:7.1f} {cpu['meshviz'] / cpu['torch']:6.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--mp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--hidden", type=int, default=Config.hidden)
    ap.add_argument("--ffn", type=int, default=None, help="default: 4 x hidden")
    ap.add_argument("--level", type=int, default=3, help="meshviz sharding_level (3 is what FSDP2 does)")
    ap.add_argument("--no-sp", action="store_true", help="without sequence parallel")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--grow", action="store_true", help="the ratio at 3 model sizes, at 2 and 4 ranks")
    ap.add_argument("--traced", action="store_true", help="also meshviz under trace.record(), as a live view runs it")
    a = ap.parse_args()
    if a.grow:
        return _grow(a)
    sp = not a.no_sp
    size = (a.layers, a.hidden, a.ffn or 4 * a.hidden)
    print(f"Llama: {size[0]} layers, hidden {size[1]}, ffn {size[2]}, {Config.heads} heads, vocab "
          f"{Config.vocab}; batch {a.batch} x seq {a.seq}; mesh dp={a.dp} x mp={a.mp}, sequence parallel {sp}; "
          f"meshviz sharding_level {a.level}; {a.rounds} rounds of {a.steps} steps, median")
    (mv_first, th_first), per_round, med, ratios, cpu = _measure(a, a.dp, a.mp, sp, a.level, size)
    print(f"first-step loss: meshviz {mv_first:.6f}, torch {th_first:.6f}")
    for k, v in per_round.items():
        print(f"{k:>8}: median {med[k] * 1e3:8.1f} ms/step  (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})")
    print(f"ratio meshviz / torch: {med['meshviz'] / med['torch']:.2f} (per-round ratios {min(ratios):.2f}.."
          f"{max(ratios):.2f})")
    print(f"CPU time per step, all ranks: meshviz {cpu['meshviz'] * 1e3:.1f} ms, torch {cpu['torch'] * 1e3:.1f} ms, "
          f"ratio {cpu['meshviz'] / cpu['torch']:.2f}")
    if a.traced:
        traced = [t / m for t, m in zip(per_round["meshviz traced"], per_round["meshviz"])]
        print(f"traced / untraced meshviz: {med['meshviz traced'] / med['meshviz']:.2f} (per-round ratios "
              f"{min(traced):.2f}..{max(traced):.2f}); CPU {cpu['meshviz traced'] / cpu['meshviz']:.2f}; "
              f"traced / torch {med['meshviz traced'] / med['torch']:.2f}")


if __name__ == "__main__":
    main()
