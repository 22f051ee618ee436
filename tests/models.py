"""Small models the seeds use, shared by the tests (the examples keep their own copies, to stand alone)."""

import torch
from torch import nn


class LinearNet(nn.Module):
    """Seeds 000 and 004: two Linear layers, 10 -> 10 -> 1."""

    def __init__(self):
        super().__init__()
        self._linear1 = nn.Linear(10, 10)
        self._linear2 = nn.Linear(10, 1)

    def forward(self, x):
        return self._linear2(self._linear1(x))


class CusTanh(torch.autograd.Function):
    """Seed 000's PyLayer, as a torch autograd Function."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy * (1 - torch.square(y))


class SimpleNet(nn.Module):
    """Seed 000's PyLayer example network."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, inputs):
        return self.linear(CusTanh.apply(inputs))


class LlamaConfig:
    """A tiny Llama: sizes divisible by 2 and 4 so every mesh in the tests splits them evenly."""

    vocab_size = 16
    hidden_size = 8
    num_heads = 4
    intermediate_size = 16
    num_layers = 2
    eps = 1e-6


class LlamaRMSNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.eps = config.eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, h // config.num_heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (p(x).reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        # products summed by hand rather than `@`: torch 2.11's DTensor cannot fold a 4-D matmul with its heads split
        scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) / self.head_dim**0.5
        causal = torch.full((s, s), float("-inf")).triu(1)
        out = (torch.softmax(scores + causal, dim=-1).unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config)
        self.mlp = LlamaMLP(config)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, num_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(num_layers))
        self.norm = LlamaRMSNorm(config)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Paddle's test model's layout (``llama.embed_tokens``, ``llama.layers.N.self_attn.q_proj``, ``lm_head``);
    ``tie=True`` shares the embedding with the LM head."""

    def __init__(self, config=LlamaConfig, seed=0, num_layers=None, tie=False):
        super().__init__()
        torch.manual_seed(seed)
        self.llama = LlamaModel(config, num_layers or config.num_layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if tie:
            self.lm_head.weight = self.llama.embed_tokens.weight

    def forward(self, input_ids):
        return self.lm_head(self.llama(input_ids))


def llama_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def llama_batches(steps=3, batch=4, seq=4, vocab=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


IGNORE_INDEX = -100


class LlamaPretrainingCriterion(nn.Module):
    """Paddle's Llama loss (test/auto_parallel's semi-auto Llama, PaddleNLP's criterion): per-token cross entropy,
    then ``masked_select`` of the positive losses (an ignored label's loss is 0) and their float32 mean."""

    def __init__(self, ignore_index=IGNORE_INDEX):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, prediction_scores, masked_lm_labels):
        # Paddle's cross entropy runs over the last axis, torch's over dim 1: one row per token, the loss [b, s]
        masked_lm_loss = torch.nn.functional.cross_entropy(
            prediction_scores.float().flatten(0, 1), masked_lm_labels.flatten(), reduction="none",
            ignore_index=self.ignore_index).reshape(masked_lm_labels.shape)
        masked_lm_loss = torch.masked_select(masked_lm_loss, masked_lm_loss > 0).float()
        return masked_lm_loss.mean()


def llama_batches_with_ignored(steps=3, batch=4, seq=4, vocab=16, seed=5, ignored=0.25):
    """``llama_batches`` with about ``ignored`` of the labels set to ``IGNORE_INDEX`` (padding)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [(ids, labels.masked_fill(torch.rand(labels.shape, generator=g) < ignored, IGNORE_INDEX))
            for ids, labels in llama_batches(steps, batch, seq, vocab, seed)]
