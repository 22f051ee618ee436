"""A simulated rank's cached fake ops make what torch's FakeTensorMode makes, call after call."""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshviz import compat
from meshviz.ranks.fake import SimulatedTensors
from meshviz.ranks.ledger import Ledger

CALLS = {
    "view": lambda x, y: x.view(-1),
    "t": lambda x, y: x.t(),
    "detach": lambda x, y: x.detach(),
    "narrow": lambda x, y: x.narrow(1, 2, 3),
    "slice": lambda x, y: x[1:3],
    "transpose": lambda x, y: x.transpose(0, 1),
    "expand": lambda x, y: x[:1].expand(4, 6),
    "add": lambda x, y: x + y,
    "mul_scalar": lambda x, y: x * 2,
    "mul_bool": lambda x, y: x * True,
    "to_bf16": lambda x, y: x.to(torch.bfloat16),
    "float_of_int": lambda x, y: (x > 0).to(torch.int32) + 1,
    "mm": lambda x, y: x @ y.t(),
    "clone": lambda x, y: x.clone(),
    "contiguous_t": lambda x, y: x.t().contiguous(),
    "empty_like": lambda x, y: torch.empty_like(x),
    "zeros": lambda x, y: torch.zeros(3, 5, dtype=torch.float16),
    "new_empty": lambda x, y: x.new_empty(7),
    "sum": lambda x, y: x.sum(0),
    "mul_": lambda x, y: x.clone().mul_(3),
    "t_": lambda x, y: x.clone().t_(),
    "resize_": lambda x, y: x.clone().resize_(30),
    "unsqueeze_": lambda x, y: x.clone().unsqueeze_(0),
    "as_strided": lambda x, y: x.as_strided((2, 2), (1, 2), 3),
}


def _meta(t):
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes())


def _alias(out, x) -> bool:
    return out.untyped_storage()._cdata == x.untyped_storage()._cdata


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_cached_op_makes_what_the_mode_makes(name):
    call = CALLS[name]
    with FakeTensorMode():  # the truth: torch's own fake tensors
        x, y = torch.empty(4, 6), torch.empty(4, 6)
        want = call(x, y)
        want_alias = _alias(want, x)
    mode = SimulatedTensors()
    with mode:
        x, y = torch.empty(4, 6), torch.empty(4, 6)
        for _ in range(3):  # the first call asks the mode, the next ones may be made from the cache
            got = call(x, y)
            assert type(got) is compat.fake_tensor_type() and got.fake_mode is mode
            assert _meta(got) == _meta(want)
            assert _alias(got, x) == want_alias


def test_metadata_written_in_place_is_never_skipped():
    with SimulatedTensors():
        x = torch.empty(4, 6)
        shapes = [tuple(x.t_().shape) for _ in range(3)]
        assert shapes == [(6, 4), (4, 6), (6, 4)]
        y = torch.empty(2, 3)
        assert y.unsqueeze_(0).shape == (1, 2, 3) and y.unsqueeze_(0).shape == (1, 1, 2, 3)


def test_the_cache_is_used_and_the_ledger_sees_each_new_tensor_once():
    ledger = Ledger()
    mode = SimulatedTensors(ledger)
    ops = compat.FakeOps()
    with mode:
        x = torch.empty(256, 256)
        key = ops.key(mode, torch.ops.aten.mul.Tensor, (x, 2.0), {})
        first = x * 2.0
        ops.learn(key, torch.ops.aten.mul.Tensor, (x, 2.0), first)
        made = ops.get(mode, key, (x, 2.0))
        assert made is not None and made is not first and not _alias(made, first) and _meta(made) == _meta(first)
        before = ledger.peak
        outs = [x * 2.0 for _ in range(4)]  # four new 256 kB tensors alive at once
        views = [o.view(-1) for o in outs]  # views hold no new memory
        assert ledger.peak - before == 4 * 256 * 256 * 4
        assert all(_alias(v, o) for v, o in zip(views, outs))


def test_calls_it_cannot_key_go_to_the_mode():
    mode = SimulatedTensors()
    ops = compat.FakeOps()
    with mode:
        x = torch.empty(3)
        small = torch.tensor([1.0, 2.0])  # keeps its values: never from the cache
        assert small.constant is not None
        assert ops.key(mode, torch.ops.aten.add.Tensor, (small, small), {}) is None
        assert ops.key(mode, torch.ops.aten.cat.default, ([x, x],), {}) is None
        assert ops.key(mode, torch.ops.aten.add.out, (x, x), {"out": x}) is None
        assert ops.key(mode, torch.ops.aten.add.Tensor, (x, x), {}) is not None
    with FakeTensorMode() as other:
        z = torch.empty(3)
    assert ops.key(mode, torch.ops.aten.add.Tensor, (z, z), {}) is None and other is not mode


def _pointer(t) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.data_ptr()
    except RuntimeError:
        return "refused"
    return "given"


@pytest.mark.parametrize("unsafe_pointers", [True, False])
def test_a_fake_tensor_is_made_as_its_constructor_makes_it(unsafe_pointers):
    FakeTensor = compat.fake_tensor_type()
    mode = SimulatedTensors()
    mode._allow_unsafe_data_ptr_access = unsafe_pointers
    device = torch.device("cpu")

    def meta():
        return torch.empty_strided((3, 4), (1, 3), dtype=torch.bfloat16, device="meta")

    want = FakeTensor(mode, meta(), device)
    for _ in range(2):  # the first call copies a fresh one's attributes, the next ones reuse them
        got = compat.wrap_meta(mode, meta(), device)
        assert type(got) is FakeTensor and got is not want
        assert got.__dict__ == want.__dict__ and got.fake_mode is mode and got.fake_device == device
        assert torch._C._dispatch_keys(got) == torch._C._dispatch_keys(want)
        assert (got.shape, got.stride(), got.dtype, got.device, got.requires_grad) == \
            (want.shape, want.stride(), want.dtype, want.device, want.requires_grad)
        assert _pointer(got) == _pointer(want) == ("given" if unsafe_pointers else "refused")
        with mode:
            out = got.float().t() @ torch.empty(3, 5)
        assert type(out) is FakeTensor and out.fake_mode is mode and out.shape == (4, 5)


def test_an_in_place_op_on_a_tensor_that_requires_grad_is_remembered():
    mode = SimulatedTensors()
    ops = compat.FakeOps()
    uniform, mul = torch.ops.aten.uniform_.default, torch.ops.aten.mul.Tensor
    with mode, torch.no_grad():
        p = torch.empty(4, 6).requires_grad_()  # a parameter's block, initialized in place
        args = (p, -1.0, 1.0)
        key = ops.key(mode, uniform, args, {})
        ops.learn(key, uniform, args, p.uniform_(-1.0, 1.0))
        assert ops.get(mode, key, args) is p and p.requires_grad
    with mode:
        q = torch.empty(4, 6).requires_grad_()
        key = ops.key(mode, mul, (q, q), {})
        out = q * q
        assert out.requires_grad
        ops.learn(key, mul, (q, q), out)  # a new tensor that requires grad: made by the mode each time
        assert ops.get(mode, key, (q, q)) is None


def test_a_device_the_constructor_completes_is_left_to_it():
    FakeTensor = compat.fake_tensor_type()
    mode = SimulatedTensors()
    for device in (torch.device("cuda"), torch.device("cuda:0")):  # a fake CUDA tensor needs no GPU
        got = compat.wrap_meta(mode, torch.empty(2, device="meta"), device)
        want = FakeTensor(mode, torch.empty(2, device="meta"), device)
        assert got.fake_device == want.fake_device == torch.device("cuda:0") and got.__dict__ == want.__dict__
    # "cuda" is completed with the current device, which may change: never copied; "cuda:0" is
    assert mode._mv_fresh[torch.device("cuda")] is None and mode._mv_fresh[torch.device("cuda:0")] is not None
