"""Embedding lookups into a vocab-split weight on 2x2 and 2-rank meshes, against one process."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshviz.testing import run_ranks

from .test_op_probe import _check, _place, _setup


def lookups(mesh_shape, cases, padding_idx=None, shape=(2, 4), vocab=6):
    """Each (indices' layout or None for a dense index tensor, weight's layout): the output (its value and every
    rank's block) and the weight's gradient equal one process's, on the deciding call and on a later one."""
    dist, mesh = _setup(mesh_shape)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(vocab, 8, generator=g)
    ids = torch.randint(0, vocab, shape, generator=g)
    wt = torch.linspace(-1, 1, math.prod(shape) * 8).reshape(*shape, 8)
    ref = w.clone().requires_grad_()
    want = F.embedding(ids, ref, padding_idx=padding_idx)
    (want * wt).sum().backward()
    for icode, wcode in cases:
        try:
            dw = _place(dist, mesh, w, wcode).detach().requires_grad_()
            loss = 0
            for _ in range(2):
                di = ids if icode is None else _place(dist, mesh, ids, icode)
                out = F.embedding(di, dw, padding_idx=padding_idx)
                _check(dist, mesh, out, want.detach())
                loss = loss + (out * wt).sum()
            loss.backward()
            torch.testing.assert_close(dist.unshard_dtensor(dw.grad), 2 * ref.grad)  # two lookups, one backward
        except AssertionError as e:
            raise AssertionError(f"indices {icode}, weight {wcode}: {e}") from e
    return True


def test_a_vocab_split_weight_with_indices_split_on_the_other_axis():
    """Indices [S(0), R] and a weight [S(1), S(0)] on a 2x2 mesh: torch's rule wants the indices [R, _MaskPartial]
    and its redistribute made the mask from the [1, 4] block before gathering it to [2, 4]; every rank raised
    "The shape of the mask [1, 4] ... does not match ... [2, 4, 4]". The gather now comes first, then the mask."""
    assert run_ranks(lookups, 4, [2, 2], [("S(0),R", "S(1),S(0)")]) == [True] * 4


def test_three_dim_indices_split_on_both_axes_with_an_uneven_vocab_split():
    """[2, 2, 4] indices into 9 rows split 5/4 on the second axis: the same mask made from the block before the
    gather (a [1, 2, 4] or [2, 1, 4] mask for [2, 2, 4, 4] rows)."""
    cases = [("S(0),S(0)", "S(1),S(0)"), ("S(1),S(1)", "S(1),S(0)"), ("S(0),R", "S(1),S(0)")]
    assert run_ranks(lookups, 4, [2, 2], cases, None, (2, 2, 4), 9) == [True] * 4


_NEIGHBOURS_2X2 = [(i, w) for w in ["S(1),S(0)", "S(0),S(1)", "S(0),R", "R,S(0)", "S(0),S(0)"]
                   for i in ["S(0),R", "R,S(1)", "S(0),S(1)", "S(1),S(0)", "R,R", None]]
_NEIGHBOURS_2 = [(i, w) for w in ["S(0)", "S(1)", "R"] for i in ["S(0)", "S(1)", "R", None]]


@pytest.mark.parametrize("mesh_shape,cases,padding_idx", [
    ([2, 2], _NEIGHBOURS_2X2, None),
    ([2, 2], [("S(0),R", "S(1),S(0)"), ("R,S(1)", "S(0),S(1)"), ("S(0),S(1)", "R,S(0)")], 3),
    ([2], _NEIGHBOURS_2, None),
    ([2], [("S(0)", "S(0)"), ("R", "S(0)"), ("S(1)", "S(0)")], 5),
])
def test_embedding_layouts_around_a_vocab_split_give_the_dense_lookup_and_gradient(mesh_shape, cases, padding_idx):
    assert run_ranks(lookups, math.prod(mesh_shape), mesh_shape, cases, padding_idx) == [True] * math.prod(mesh_shape)
