"""Errors raised on one rank only: every rank raises, naming it, rather than wait for it; a reentrant checkpoint
first run after the first synced step of a DataParallel with find_unused_parameters=True."""

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

from .test_data_parallel_probe import _batch, _grads, _Net

HEAD = "the ranks were given different settings (every rank needs the same): "
REFUSED = "rank 1: arguments accepted (a refusing rank raises why) False"


def _rank():
    from meshviz.rank_context import getenv

    return int(getenv("RANK"))


# -- group_sharded_parallel: an unknown level on one rank ---------------------------------------------------------

def _bogus_level():
    from meshviz.distributed.sharding import group_sharded_parallel

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    try:
        group_sharded_parallel(net, opt, "bogus" if _rank() == 1 else "os_g")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(40)
def test_an_unknown_level_on_one_rank_raises_on_every_rank():
    """Rank 1 passes level='bogus', rank 0 'os_g'. Before the process group started, rank 1 raised at once and rank
    0 waited for it in the settings check (threads: a deadlock; processes: 'rank 1 never joined the process group';
    a rank that goes on waited the collective timeout). Now rank 1 takes part in the check: it raises its own error,
    rank 0 one that names it."""
    theirs, mine = run_ranks(_bogus_level, 2, timeout=20, collective_timeout=10)
    assert mine == "group_sharded_parallel: level must be one of 'os', 'os_g', 'p_g_os', got 'bogus'", mine
    assert theirs is not None and theirs.startswith("group_sharded_parallel: " + HEAD), theirs
    assert REFUSED in theirs, theirs


_ALONE = """
import torch, torch.distributed as tdist
from meshviz.distributed.sharding import group_sharded_parallel
net = torch.nn.Linear(2, 2)
for level, kw in (("bogus", {}), ("os", {"segment_size": -1})):
    try:
        group_sharded_parallel(net, torch.optim.SGD(net.parameters(), lr=0.1), level, **kw)
    except ValueError as e:
        print(str(e).split(": ")[1], tdist.is_initialized())
from meshviz.distributed import fleet
try:
    fleet.init(is_collective=False)
except ValueError as e:
    print(str(e).split(": ")[1], tdist.is_initialized())
"""


@pytest.mark.timeout(60)
def test_a_refused_argument_in_a_process_alone_starts_no_process_group():
    """One process without a process group or a world to join (no WORLD_SIZE): a refused argument raises before
    starting one, as an unknown level and fleet.init's is_collective=False did; a bad segment_size used to start a
    1-rank process group first."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "PADDLE_TRAINERS_NUM",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", _ALONE], env=env, capture_output=True, text=True, timeout=50)
    said = ["level must be one of 'os', 'os_g', 'p_g_os', got 'bogus' False",
            "segment_size must be an int >= 0, got -1 False",
            "only collective mode (is_collective=True) is supported False"]
    assert out.stdout.splitlines() == said, out.stdout + out.stderr


# -- fleet.init: hybrid degrees one rank cannot resolve ------------------------------------------------------------

def _fleet_degrees(case):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    strategy = fleet.DistributedStrategy()
    configs = {"dp_degree": 2, "mp_degree": 1}
    if _rank() == 1:
        configs = {"too many": {"dp_degree": 2, "mp_degree": 2},
                   "indivisible": {"dp_degree": -1, "mp_degree": 3}}[case]
    strategy.hybrid_configs = configs
    try:
        fleet.init(is_collective=True, strategy=strategy)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(40)
@pytest.mark.parametrize("case,said", [
    ("too many", "fleet.init: dp_degree*pp_degree*sharding_degree*mp_degree*sep_degree = 2*1*1*2*1 = 4, but the "
                 "world has 2 ranks"),
    ("indivisible", "fleet.init: world size 2 is not divisible by pp*sharding*mp*sep = 3"),
])
def test_hybrid_degrees_refused_on_one_rank_raise_on_every_rank(case, said):
    """Rank 1's degrees do not fit the world: it raised alone while rank 0 waited for it in the hybrid_configs
    check (threads: a deadlock; a rank that goes on: the collective timeout). Now both raise, rank 0 naming rank 1."""
    theirs, mine = run_ranks(_fleet_degrees, 2, case, timeout=20, collective_timeout=10)
    assert mine == said, mine
    assert theirs is not None and theirs.startswith("fleet.init: hybrid_configs: " + HEAD), theirs
    assert REFUSED in theirs, theirs


# -- DataParallel: a reentrant checkpoint first run after the first synced step -----------------------------------

class _Late(_Net):
    """b runs inside a reentrant checkpoint where ``ckpt`` is True, plainly where False, not at all where "skip"."""

    def forward(self, x, ckpt=False):
        from meshviz.distributed.fleet.utils import recompute

        h = torch.tanh(self.a(x))
        if ckpt != "skip":
            h = h + (recompute(self.b, h, use_reentrant=True) if ckpt else self.b(h))
        return self.c(h)


def _ckpt(case, r, step):
    if case == "one step":
        return step == 1
    if case == "after an unused one" and step == 0:
        return "skip" if r == 1 else False
    return step >= 1 and (case != "rank 1" or r == 1)


def _late_ranks(case):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    torch.manual_seed(r)
    model = _Late()
    dp = dist.DataParallel(model, find_unused_parameters=case != "after an unused one")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(3):
        x, y = _batch(r, step)
        nn.functional.mse_loss(dp(x, ckpt=_ckpt(case, r, step)), y).backward()
        out.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["every rank", "rank 1", "one step", "after an unused one"])
def test_a_reentrant_checkpoint_first_run_after_the_first_step_trains_as_one_process(case):
    """DataParallel(find_unused_parameters=True) whose reentrant checkpoint first runs at step 1 (on every rank, on
    rank 1 alone, or at that step only) raised torch DDP's "Expected to mark a variable ready only once" in that
    backward: only the first synced forward looked for a custom autograd Function. So did one without
    find_unused_parameters whose first step left b out on rank 1 (DDP then searches at every step). Now the
    gradients are those of one process at every step."""
    res = run_ranks(_late_ranks, 2, case, timeout=50, collective_timeout=15)
    torch.manual_seed(0)
    model = _Late()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        loss = 0
        for r in range(2):
            x, y = _batch(r, step)
            loss = loss + nn.functional.mse_loss(model(x, ckpt=_ckpt(case, r, step) == "skip" and "skip"), y) / 2
        loss.backward()
        grads = _grads(model)
        for r in range(2):
            for k, v in grads.items():
                torch.testing.assert_close(res[r][step][k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{r} {step} {k}: {m}")
        opt.step()
        opt.zero_grad(set_to_none=True)
