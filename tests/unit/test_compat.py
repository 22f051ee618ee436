"""Every private torch / ipyparallel symbol meshviz uses resolves on the installed versions, through meshviz.compat."""

import pytest
import torch

from meshviz import compat


def test_every_compat_symbol_resolves():
    assert compat.TORCH_VERSION in compat.SUPPORTED_TORCH, torch.__version__
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name
    assert compat.missing() == []


def test_wrapper_subclass_and_dense_flattening():
    class Box(torch.Tensor):
        __torch_function__ = compat.disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return NotImplemented

    b = compat.make_wrapper_subclass(Box, (2, 3), dtype=torch.float32, device="cpu", requires_grad=False)
    assert isinstance(b, Box) and tuple(b.shape) == (2, 3)
    ts = [torch.arange(3.0), torch.ones(2, 2)]
    flat = compat.flatten_dense_tensors(ts)
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    back = compat.unflatten_dense_tensors(flat * 2, ts)
    assert [t.tolist() for t in back] == [[0.0, 2.0, 4.0], [[2.0, 2.0], [2.0, 2.0]]]


def test_pipeline_actions_read():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    assert compat.action_fields(_Action(2, _ComputationType.FORWARD, 5)) == ("F", 2, 5)


def test_thread_worlds_give_each_thread_its_own_c10d_world():
    import threading

    import torch.distributed as tdist

    c10d = tdist.distributed_c10d
    before = c10d._world
    compat.install_thread_worlds()
    try:
        seen = {}

        def look(name):  # the world object itself is kept: an id alone can be reused once a thread's world is freed
            seen[name] = (tdist.is_initialized(), c10d._world._get_world())

        ts = [threading.Thread(target=look, args=(f"t{i}",)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert seen["t0"][0] is False and seen["t0"][1] is not seen["t1"][1]  # one world per thread
        assert "THREADS" in compat.backend_plugins() or "THREADED" in compat.backend_plugins()
    finally:
        compat.uninstall_thread_worlds()
    assert c10d._world is before


class _Spy(compat.TorchDispatchMode):
    """Notes the name of every op that reaches it (``seen``), and runs it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_dispatch_modes_hides_ops_from_the_active_mode():
    with _Spy() as spy:
        torch.ones(2).add(1)
        with compat.no_dispatch_modes():
            torch.ones(2).mul(3)
    assert any("add" in s for s in spy.seen) and not any("mul" in s for s in spy.seen)


A = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
FAST = [  # op, args, kwargs: torch's binding of the op's name runs this very op
    (torch.ops.aten.add.Tensor, (A, A.t()), {}),
    (torch.ops.aten.add.Tensor, (A, A), {"alpha": 3}),
    (torch.ops.aten.mul.Tensor, (A, 2.5), {}),
    (torch.ops.aten.sum.dim_IntList, (A, [0]), {}),
    (torch.ops.aten.sum.dim_IntList, (A, [1], True), {"dtype": torch.float64}),
    (torch.ops.aten.mm.default, (A, A), {}),
    (torch.ops.aten.relu.default, (A - 0.5,), {}),
    (torch.ops.aten.view.default, (A, [2, 8]), {}),
    (torch.ops.aten.cat.default, ([A, A], 1), {}),
    (torch.ops.aten.native_layer_norm.default, (A, [4], None, None, 1e-5), {}),
]
SLOW = [  # op, args, kwargs: the binding runs another op, returns another type, or cannot be checked
    (torch.ops.aten.add.Scalar, (A, 2), {}),  # A + 2 is add.Tensor with a wrapped number
    (torch.ops.aten.max.dim, (A, 0), {}),  # the binding's named tuple is not the op's tuple
    (torch.ops.aten.split.Tensor, (A, 2), {}),  # the binding's tuple is not the op's list
    (torch.ops.aten.masked_select.default, (A, A > 0), {}),  # no meta kernel: not checked
    (torch.ops.aten.add.Tensor, (torch.nn.Parameter(A.clone()), A), {}),  # a subclass has its own torch function
]


@pytest.mark.parametrize("op, args, kwargs", FAST, ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_fast_call_runs_the_op_itself_through_its_binding(op, args, kwargs):
    call = compat.fast_call(op, args, kwargs)
    assert call is not op
    got, want = call(*args, **kwargs), op(*args, **kwargs)
    assert type(got) is type(want)
    for g, w in zip(got if isinstance(got, (tuple, list)) else [got], want if isinstance(want, (tuple, list))
                    else [want]):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("op, args, kwargs", SLOW, ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_fast_call_keeps_the_op_where_the_binding_is_not_it(op, args, kwargs):
    assert compat.fast_call(op, args, kwargs) is op


def test_fast_call_is_checked_out_of_sight_of_the_threads_modes():
    with _Spy() as spy:
        call = compat.fast_call(torch.ops.aten.sum.dim_IntList, (A, [0]), {})
    assert call is not torch.ops.aten.sum.dim_IntList and spy.seen == []


def test_a_process_that_only_runs_collectives_never_imports_dynamo():
    import subprocess
    import sys

    code = ("import sys, torch\nimport meshviz.distributed as dist\nseen = ['torch._dynamo' in sys.modules]\n"
            "dist.init_parallel_env(); t = torch.ones(2); dist.all_reduce(t); dist.barrier()\n"
            "print(seen[0], 'torch._dynamo' in sys.modules, t.tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "[1.0,", "1.0]"]  # Dynamo costs about 1 s of CPU to import


def test_eager_runs_eagerly_under_compile_and_as_itself_outside():
    from meshviz.compat.dynamo import eager

    seen = []

    def note(x):
        seen.append(torch.compiler.is_compiling())  # True where Dynamo traced this call into its graph
        return x * 2

    eager_note = eager(note)
    assert eager_note(torch.ones(1)).item() == 2.0 and seen == [False]
    seen.clear()

    @torch.compile(backend="eager", fullgraph=False)
    def f(x):
        return eager_note(x + 1) + 1

    assert f(torch.ones(1)).item() == 5.0
    assert seen == [False]  # called at run time, eagerly: were it traced, is_compiling would be True
    torch._dynamo.reset()
