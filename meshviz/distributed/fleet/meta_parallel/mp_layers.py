"""Megatron-style tensor-parallel layers: column/row parallel Linear, vocab-parallel Embedding, parallel CE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .mp_ops import (
    c_concat,
    c_identity,
    c_lookup_table,
    c_split,
    group_index,
    mp_allreduce,
    mp_group_of,
    parallel_cross_entropy,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelCrossEntropy"]


def _full_linear_init(in_features, out_features, weight_attr, has_bias):
    """The full [out, in] weight and [out] bias, drawn exactly as ``nn.Linear(in, out)`` draws them."""
    w = torch.empty(out_features, in_features)
    if callable(weight_attr):
        weight_attr(w)
    elif weight_attr is None:
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    else:
        raise TypeError("weight_attr must be None or an init function taking the full weight tensor")
    b = None
    if has_bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        b = torch.empty(out_features).uniform_(-bound, bound)
    return w, b


def _check_divisible(what, n_items, n):
    if n_items % n:
        raise ValueError(f"{what} ({n_items}) must be divisible by the model-parallel size {n}")


def _mark(p: nn.Parameter, axis: int, is_mp: bool):
    """Paddle's marks: ``is_distributed`` (and ``split_axis``) only when the model-parallel group has 2+ ranks."""
    p.is_distributed = is_mp
    if is_mp:
        p.split_axis = axis
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output features split over the model-parallel group.

    Weights use torch's layout: this rank holds ``weight`` [out/n, in] (rows ``r*out/n ...``) and ``bias``
    [out/n]. Paddle's weight is [in, out] split on dim 1: the same numbers, transposed. Parameters are drawn
    like ``nn.Linear(in, out)``'s full weight from the shared generator, and sliced: with the same seed on every
    rank the shards assemble into exactly that layer. ``gather_output=False`` leaves y split on its last dim.
    No bias unless ``has_bias`` is true (Paddle's default ``None`` means none; RowParallelLinear's is True).
    With a model-parallel group of one rank (``is_mp`` false) it is a plain linear layer: no collectives.
    """

    def __init__(self, in_features, out_features, weight_attr=None, has_bias=None, gather_output=True,
                 fuse_matmul_bias=False, mp_group=None, name=None):
        super().__init__()
        self.model_parallel_group = mp_group_of(mp_group)
        self.rank, self.world_size = group_index(self.model_parallel_group)
        self.is_mp = self.world_size > 1
        _check_divisible("ColumnParallelLinear out_features", out_features, self.world_size)
        self.in_features, self.out_features = in_features, out_features
        self.output_size_per_partition = out_features // self.world_size
        self.gather_output = gather_output
        self.name = name
        w, b = _full_linear_init(in_features, out_features, weight_attr, has_bias)
        rows = slice(self.rank * self.output_size_per_partition, (self.rank + 1) * self.output_size_per_partition)
        self.weight = _mark(nn.Parameter(w[rows].clone()), 0, self.is_mp)
        self.bias = _mark(nn.Parameter(b[rows].clone()), 0, self.is_mp) if b is not None else None

    def forward(self, x):
        if not self.is_mp:
            return F.linear(x, self.weight, self.bias)
        x = c_identity(x, self.model_parallel_group)
        y = F.linear(x, self.weight, self.bias)
        return c_concat(y, self.model_parallel_group) if self.gather_output else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features} (local {self.output_size_per_partition}), "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input features split over the model-parallel group; partial sums all-reduced.

    This rank holds ``weight`` [out, in/n] (columns ``r*in/n ...``, torch layout; Paddle's [in, out] split on
    dim 0 transposed) and the full ``bias`` [out], added after the all-reduce. ``input_is_parallel=True`` takes x
    already split on its last dim (a ColumnParallelLinear's output with ``gather_output=False``).
    """

    def __init__(self, in_features, out_features, weight_attr=None, has_bias=True, input_is_parallel=False,
                 fuse_matmul_bias=False, mp_group=None, name=None):
        super().__init__()
        self.model_parallel_group = mp_group_of(mp_group)
        self.rank, self.world_size = group_index(self.model_parallel_group)
        self.is_mp = self.world_size > 1
        _check_divisible("RowParallelLinear in_features", in_features, self.world_size)
        self.in_features, self.out_features = in_features, out_features
        self.input_size_per_partition = in_features // self.world_size
        self.input_is_parallel = input_is_parallel
        self.name = name
        w, b = _full_linear_init(in_features, out_features, weight_attr, has_bias)
        cols = slice(self.rank * self.input_size_per_partition, (self.rank + 1) * self.input_size_per_partition)
        self.weight = _mark(nn.Parameter(w[:, cols].clone()), 1, self.is_mp)
        self.bias = nn.Parameter(b.clone()) if has_bias else None

    def forward(self, x):
        if not self.is_mp:
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = c_split(x, self.model_parallel_group)
        y = mp_allreduce(F.linear(x, self.weight), self.model_parallel_group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in={self.in_features} (local {self.input_size_per_partition}), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over the model-parallel group.

    This rank holds rows ``r*V/n ... (r+1)*V/n`` of the [V, D] table, drawn like ``nn.Embedding(V, D)``'s.
    Ids outside this rank's range look up zeros; an all-reduce sums the shards' lookups. An id outside
    ``[0, num_embeddings)`` raises IndexError on every rank before the all-reduce (Paddle's GPU ``c_embedding``
    check; torch's ``nn.Embedding`` raises too).
    """

    def __init__(self, num_embeddings, embedding_dim, weight_attr=None, mp_group=None, name=None):
        super().__init__()
        self.model_parallel_group = mp_group_of(mp_group)
        self.rank, self.world_size = group_index(self.model_parallel_group)
        self.is_mp = self.world_size > 1
        _check_divisible("VocabParallelEmbedding num_embeddings", num_embeddings, self.world_size)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.origin_num_embeddings = num_embeddings
        self.per_part = num_embeddings // self.world_size
        self.vocab_start_index = self.rank * self.per_part
        self.vocab_end_index = self.vocab_start_index + self.per_part
        self.name = name
        w = torch.empty(num_embeddings, embedding_dim)
        if callable(weight_attr):
            weight_attr(w)
        elif weight_attr is None:
            nn.init.normal_(w)
        else:
            raise TypeError("weight_attr must be None or an init function taking the full weight tensor")
        self.weight = _mark(nn.Parameter(w[self.vocab_start_index:self.vocab_end_index].clone()), 0, self.is_mp)

    def forward(self, x):
        if not self.is_mp:
            return F.embedding(x, self.weight)
        out = c_lookup_table(self.weight, x, self.vocab_start_index, self.num_embeddings)
        return mp_allreduce(out, self.model_parallel_group)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"local rows {self.vocab_start_index}:{self.vocab_end_index}")


class ParallelCrossEntropy(nn.Module):
    """Cross-entropy of logits split along the class dim (a ColumnParallelLinear with gather_output=False).

    Returns the per-sample loss with a trailing 1 (Paddle's [N, 1]); ``ignore_index`` labels give 0.
    """

    def __init__(self, mp_group=None, name=None, ignore_index=-100):
        super().__init__()
        self.model_parallel_group = mp_group_of(mp_group)
        self.ignore_index = ignore_index
        self.name = name

    def forward(self, input, label):
        return parallel_cross_entropy(input, label, self.model_parallel_group, self.ignore_index)
