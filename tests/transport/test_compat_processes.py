"""meshviz.compat on real gloo processes (split from tests/unit/test_compat.py): groups in the order given, and
point-to-point through the host patching torch's send/recv and restoring them."""

import pytest
import torch

from meshviz import compat
from meshviz.testing import run_ranks


def _ordered_groups():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz.runtime import groups

    dist.init_parallel_env()
    r = dist.get_rank()
    pg = compat.new_group_in_order([2, 0])
    out = {"member": pg is not tdist.GroupMember.NON_GROUP_MEMBER}
    if out["member"]:
        out["ranks"] = tdist.get_process_group_ranks(pg)
        got = [torch.zeros(1) for _ in range(2)]
        tdist.all_gather(got, torch.tensor([10.0 * r + 1]), group=pg)
        out["gathered"] = [g.item() for g in got]  # group order: rank 2's first
        dm = groups.device_mesh(dist.ProcessMesh([2, 0], ["x"]), "cpu")
        out["coordinate"] = list(dm.get_coordinate())
    return out


@pytest.mark.timeout(60)
def test_groups_keep_the_order_they_are_given():
    res = run_ranks(_ordered_groups, 3, ranks="processes")
    assert res[1] == {"member": False}
    for r in (0, 2):
        assert res[r]["ranks"] == [2, 0]
        assert res[r]["gathered"] == [21.0, 1.0]
        assert res[r]["coordinate"] == [{2: 0, 0: 1}[r]]


def _through_host():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz.runtime import devices

    dist.init_parallel_env()
    r = dist.get_rank()
    before = (tdist.send, tdist.recv, tdist.send_object_list, tdist.recv_object_list)
    with devices.p2p_through_host():
        patched = tdist.send is not before[0]
        t = torch.full((3,), float(r + 1))
        objs = [{"shape": (2, 5), "rank": r}] if r == 0 else [None]
        if r == 0:
            tdist.send(t, dst=1)
            tdist.send_object_list(objs, dst=1, device=torch.device("cpu"))
        else:
            tdist.recv(t, src=0)
            tdist.recv_object_list(objs, src=0, device=torch.device("cpu"))
    restored = (tdist.send, tdist.recv, tdist.send_object_list, tdist.recv_object_list) == before
    return {"patched": patched, "restored": restored, "t": t.tolist(), "objs": objs}


def test_p2p_through_host_carries_tensors_and_objects_and_restores_torch():
    """The stage set-up path for gloo between CUDA tensors (tests/transport/test_gpu.py runs it on a GPU); here on
    the CPU."""
    res = run_ranks(_through_host, 2, ranks="processes")
    assert all(o["patched"] and o["restored"] for o in res)
    assert res[1]["t"] == [1.0, 1.0, 1.0] and res[0]["t"] == [1.0, 1.0, 1.0]
    assert res[1]["objs"] == [{"shape": (2, 5), "rank": 0}]
