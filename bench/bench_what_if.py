"""meshviz.what_if on a Llama-70B-shaped model: one training step on 1,024 simulated ranks, timed, with the memory
this process used.

    python bench/bench_what_if.py                          # dp 128 x mp 8, sharding stage 1, 80 layers
    python bench/bench_what_if.py --mesh 16x8x8 --names dp,pp,mp
    python bench/bench_what_if.py --layers 4 --mesh 2x2    # a quick look
"""

import argparse
import resource
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import meshviz
import meshviz.distributed as dist

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 128256, 8192, 64, 8, 28672, 80
HEAD = HIDDEN // HEADS


def set_dims(vocab: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
    """Models built after this call have these sizes (a smaller Llama; each process that builds one calls it)."""
    global VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, HEAD
    VOCAB, HIDDEN, HEADS, KV_HEADS, FFN = vocab, hidden, heads, kv_heads, ffn
    HEAD = HIDDEN // HEADS


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def attend(q, k, v):
    """Causal attention on this rank's heads (its blocks of q, k, v: [batch, seq, heads x head dim])."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, HEAD).transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention: no [s, s] scores
    return out.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD, HIDDEN, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        mesh = q.process_mesh
        split = [dist.Shard(0) if n == "dp" else dist.Shard(2) for n in mesh.dim_names]  # batch on dp, heads on mp
        out = dist.local_map(attend, [split], [split] * 3, mesh, reshard_inputs=True)(q, k, v)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), Attention()
        self.post_attention_layernorm, self.mlp = RMSNorm(), MLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = RMSNorm()

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.llama = Model(layers)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.llama(ids))


class AdamW(torch.optim.Optimizer):
    """AdamW keeping an fp32 master copy of each parameter and fp32 moments (mixed precision, as Paddle's
    multi_precision=True): 12 bytes of state per parameter."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["master"] = p.detach().float()
                    st["exp_avg"] = torch.zeros_like(st["master"])
                    st["exp_avg_sq"] = torch.zeros_like(st["master"])
                st["step"] += 1
                g = p.grad.float()
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt_().add_(group["eps"])
                st["master"].mul_(1 - group["lr"] * group["weight_decay"])
                st["master"].addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** st["step"]))
                p.copy_(st["master"])


PLAN = {
    "llama.embed_tokens": dist.ColWiseParallel(gather_output=True),
    "llama.layers.*.self_attn.q_proj": dist.ColWiseParallel(),
    "llama.layers.*.self_attn.k_proj": dist.ColWiseParallel(),
    "llama.layers.*.self_attn.v_proj": dist.ColWiseParallel(),
    "llama.layers.*.self_attn.o_proj": dist.RowWiseParallel(),
    "llama.layers.*.mlp.gate_proj": dist.ColWiseParallel(),
    "llama.layers.*.mlp.up_proj": dist.ColWiseParallel(),
    "llama.layers.*.mlp.down_proj": dist.RowWiseParallel(),
    "lm_head": dist.ColWiseParallel(gather_output=True),
}


def train(shape, names, level=1, layers=LAYERS, seq=4096, micro=1):
    """One step of the Llama under dist.parallelize on a mesh of ``shape`` named ``names`` (dp, mp, pp)."""
    mesh = dist.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), dim_names=names)
    dist.auto_parallel.set_mesh(mesh)
    config = {"dp_config": {"sharding_level": level}, "mp_config": {"parallelize_plan": PLAN}}
    if "pp" in names:
        config["pp_config"] = {"split_spec": "llama.layers"}
    with torch.device("meta"):  # nothing is allocated until each rank holds only its blocks
        model = LlamaForCausalLM(layers).to(torch.bfloat16)
    from meshviz.distributed.auto_parallel.intermediate import parallelize_model, parallelize_optimizer

    model = parallelize_model(model, config=config)
    model.to_empty(device=dist.device())
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    opt = parallelize_optimizer(AdamW(model.parameters()), config=config)
    dp = shape[names.index("dp")]
    first = last = mesh
    if "pp" in names:
        pp = shape[names.index("pp")]
        first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", pp - 1)
    ids = torch.randint(0, VOCAB, (dp * micro, seq))
    x = dist.shard_tensor(ids, first, [dist.Shard(0) if n == "dp" else dist.Replicate() for n in first.dim_names])
    labels = dist.shard_tensor(ids, last, [dist.Shard(0) if n == "dp" else dist.Replicate() for n in last.dim_names])
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="128x8", help="mesh shape, e.g. 128x8 or 16x8x8")
    ap.add_argument("--names", default="dp,mp", help="mesh axis names (dp, mp, pp)")
    ap.add_argument("--level", type=int, default=1, help="sharding stage of the optimizer (0-3)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.mesh.split("x"))
    names = args.names.split(",")
    n = int(np.prod(shape))
    t0 = time.perf_counter()
    report = meshviz.what_if(train, n, shape, names, args.level, args.layers, args.seq, timeout=3600)
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(report)
    print(report.table())
    print(f"{n} ranks, {args.layers} layers, mesh {args.mesh} ({args.names}), sharding stage {args.level}: "
          f"{seconds:.1f} s ({report.deciding:.1f} s deciding which ranks are alike), {len(report.simulated)} "
          f"simulated, peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
