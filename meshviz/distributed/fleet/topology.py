"""Paddle's hybrid-parallel topology: ranks laid out over (dp, pp, sharding, mp) in the strategy's order."""

from __future__ import annotations

import collections
import itertools
import math

from ... import trace
from ...core.mesh import ProcessMesh
from ...runtime.world import get_rank, get_world_size
from ..collective import new_group
from .state import current as _fleet

__all__ = ["ParallelMode", "CommunicateTopology", "HybridCommunicateGroup", "hybrid_group"]


def hybrid_group() -> "HybridCommunicateGroup | None":
    """The hybrid group this rank built last (None before ``fleet.init``)."""
    return _fleet()._built

# hybrid_configs short name -> topology axis name
AXIS_NAMES = {"dp": "data", "pp": "pipe", "sharding": "sharding", "sep": "sep", "cp": "context", "mp": "model"}


class ParallelMode:
    DATA_PARALLEL = 0
    TENSOR_PARALLEL = 1
    PIPELINE_PARALLEL = 2
    SHARDING_PARALLEL = 3
    SEGMENT_PARALLEL = 4
    MODEL_PARALLEL = TENSOR_PARALLEL


class CommunicateTopology:
    """Rank = row-major index of the coordinate over ``dims`` (the first name is the outermost axis).

    The ranks form a ``ProcessMesh`` of shape ``dims`` whose axes are the parallel names; ``mesh`` is it.
    """

    def __init__(self, hybrid_group_names=("data", "pipe", "sharding", "model"), dims=(1, 1, 1, 1)):
        self._parallel_names = list(hybrid_group_names)
        self._dims = [int(d) for d in dims]
        self.coordinate = collections.namedtuple("Coordinate", self._parallel_names)
        self._world_size = math.prod(self._dims)
        self.mesh = ProcessMesh(shape=self._dims, process_ids=range(self._world_size), dim_names=self._parallel_names)

    def get_hybrid_group_names(self):
        return self._parallel_names

    def get_dim(self, axis_name):
        return self._dims[self._parallel_names.index(axis_name)] if axis_name in self._parallel_names else 1

    get_dim_size = get_dim

    def world_size(self):
        return self._world_size

    def get_rank(self, **args):
        coord = self.coordinate(**args)
        if not all(0 <= c < d for c, d in zip(coord, self._dims)):
            raise KeyError(coord)
        return self.mesh.rank_at(coord)

    def get_coord(self, rank):
        coord = self.mesh.coordinate(rank)
        if coord is None:
            raise KeyError(rank)
        return self.coordinate(*coord)

    def get_axis_list(self, axis_name, index):
        """The ranks whose coordinate along ``axis_name`` is ``index``, sorted."""
        if not 0 <= index < self.mesh.get_dim_size(axis_name):
            return []
        return sorted(self.mesh.get_mesh_with_dim(axis_name, index).process_ids)

    def get_comm_list(self, axis_name):
        """Every group along ``axis_name``: the ranks that differ only in that coordinate."""
        return [list(line) for line in self.mesh.axis_groups(axis_name)]

    def get_fused_ranks(self, fused_axis):
        """The groups of ranks that differ only along the ``fused_axis`` names, each ordered by those axes'
        coordinates (the first name outermost), the groups sorted (Paddle's ``create_fuse_group`` order)."""
        others = [n for n in self._parallel_names if n not in fused_axis]
        out = []
        for fixed in itertools.product(*(range(self.get_dim(n)) for n in others)):
            base = dict(zip(others, fixed))
            out.append([self.get_rank(**base, **dict(zip(fused_axis, c)))
                        for c in itertools.product(*(range(self.get_dim(n)) for n in fused_axis))])
        return sorted(out)

    def get_rank_from_stage(self, global_rank, **kwargs):
        return self.get_rank(**self.get_coord(global_rank)._replace(**kwargs)._asdict())

    def __repr__(self) -> str:
        return "CommunicateTopology(" + ", ".join(f"{n}={d}" for n, d in zip(self._parallel_names, self._dims)) + ")"


class HybridCommunicateGroup:
    """This rank's groups and coordinates along each parallel axis (every rank builds every group)."""

    def __init__(self, topology: CommunicateTopology):
        self.nranks = get_world_size()
        self.global_rank = get_rank()
        self._topo = topology
        self._dp_degree = topology.get_dim("data")
        self._mp_degree = topology.get_dim("model")
        self._pp_degree = topology.get_dim("pipe")
        self._sharding_degree = topology.get_dim("sharding")
        self._sep_degree = topology.get_dim("sep")
        if topology.world_size() != self.nranks:
            raise ValueError(f"hybrid degrees {topology} multiply to {topology.world_size()}, but the world has "
                             f"{self.nranks} ranks")
        coord = topology.get_coord(self.global_rank)
        self._data_parallel_id = getattr(coord, "data", 0)
        self._model_parallel_id = getattr(coord, "model", 0)
        self._sharding_parallel_id = getattr(coord, "sharding", 0)
        self._sep_parallel_id = getattr(coord, "sep", 0)
        self.stage_id = getattr(coord, "pipe", 0)
        # same creation order as Paddle: pipe, data, model, sharding, then the check group
        self._pp_group, self._pp_comm_group = self._set_comm_group("pipe")
        self._dp_group, self._dp_comm_group = self._set_comm_group("data")
        self._mp_group, self._mp_comm_group = self._set_comm_group("model")
        self._sharding_group, self._sharding_comm_group = self._set_comm_group("sharding")
        self._sep_group = self._sep_comm_group = None
        if self._sep_degree > 1:
            self._sep_group, self._sep_comm_group = self._set_comm_group("sep")
        self._check_group, self._check_comm_group = self._set_check_group("data")
        if self._sharding_degree > 1:
            self.sharding_check_group, self.sharding_check_comm_group = self._set_check_group("sharding")
        if self._sep_degree > 1:
            self._dp_sep_group, self._dp_sep_comm_group = self._set_fused_group(["data", "sep"])
            self._pp_mp_group, self._pp_mp_comm_group = self._set_fused_group(["pipe", "model"])
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self._pp_degree - 1
        if self._pp_degree > 1:
            for line in topology.get_comm_list("pipe"):
                if self.global_rank in line:
                    i = line.index(self.global_rank)
                    self.next_rank = line[(i + 1) % self._pp_degree]
                    self.prev_rank = line[(i - 1) % self._pp_degree]
        if trace.active():  # the mesh every hybrid group is a line of, for the views and the what-if's sharing
            trace.emit(trace.Event(kind="mark", op="hybrid_topology", name="fleet hybrid topology",
                                   mesh=topology.mesh.to_dict()))
        _fleet()._built = self

    def _set_comm_group(self, axis_name):
        mine = comm = None
        if axis_name not in self._topo.get_hybrid_group_names():
            return None, None
        for line in self._topo.get_comm_list(axis_name):
            g = new_group(line)
            if self.global_rank in line:
                mine, comm = line, g
        return mine, comm

    def _set_fused_group(self, axis_names):
        mine = comm = None
        for line in self._topo.get_fused_ranks(axis_names):
            g = new_group(line)
            if self.global_rank in line:
                mine, comm = line, g
        return mine, comm

    def _set_check_group(self, axis_name):
        mine = comm = None
        for idx in range(self._topo.get_dim(axis_name)):
            line = self._topo.get_axis_list(axis_name, idx)
            g = new_group(line)
            if self.global_rank in line:
                mine, comm = line, g
        return mine, comm

    def get_parallel_mode(self):
        if self._pp_degree == 1 and self._mp_degree == 1 and self._sep_degree == 1 and self._sharding_degree == 1:
            return ParallelMode.DATA_PARALLEL
        if self._pp_degree == 1 and self._mp_degree == 1 and self._sep_degree == 1:
            return ParallelMode.SHARDING_PARALLEL
        if self._pp_degree == 1 and self._mp_degree == 1:
            return ParallelMode.SEGMENT_PARALLEL
        if self._pp_degree == 1:
            return ParallelMode.TENSOR_PARALLEL
        return ParallelMode.PIPELINE_PARALLEL

    def topology(self):
        return self._topo

    def get_global_rank(self):
        return self.global_rank

    # data parallel
    def get_data_parallel_rank(self):
        return self._data_parallel_id

    def get_data_parallel_world_size(self):
        return self._dp_degree

    def get_data_parallel_group(self):
        return self._dp_comm_group

    def get_data_parallel_group_src_rank(self):
        return self._dp_comm_group.ranks[0]

    # model (tensor) parallel
    def get_model_parallel_rank(self):
        return self._model_parallel_id

    def get_model_parallel_world_size(self):
        return self._mp_degree

    def get_model_parallel_group(self):
        return self._mp_comm_group

    def get_model_parallel_group_src_rank(self):
        return self._mp_comm_group.ranks[0]

    # pipeline parallel
    def get_stage_id(self):
        return self.stage_id

    def get_pipe_parallel_rank(self):
        return self.stage_id

    def get_pipe_parallel_world_size(self):
        return self._pp_degree

    def get_pipe_parallel_group(self):
        return self._pp_comm_group

    def get_rank_from_stage(self, stage_id, **kwargs):
        return self._topo.get_rank_from_stage(self.global_rank, pipe=stage_id, **kwargs)

    def _get_p2p_next_rank(self):
        if not hasattr(self, "next_rank"):
            raise AssertionError("next_rank has not been inited (pp_degree is 1: no pipeline neighbours)")
        return self.next_rank

    def _get_p2p_prev_rank(self):
        if not hasattr(self, "prev_rank"):
            raise AssertionError("prev_rank has not been inited (pp_degree is 1: no pipeline neighbours)")
        return self.prev_rank

    # sharding parallel
    def get_sharding_parallel_rank(self):
        return self._sharding_parallel_id

    def get_sharding_parallel_world_size(self):
        return self._sharding_degree

    def get_sharding_parallel_group(self):
        return self._sharding_comm_group

    def get_sharding_parallel_group_src_rank(self):
        return self._sharding_comm_group.ranks[0]

    # sep
    def get_sep_parallel_rank(self):
        return self._sep_parallel_id

    def get_sep_parallel_world_size(self):
        return self._sep_degree

    def _check_sep_exist(self):
        if self._sep_degree <= 1:
            raise AssertionError("sep not exist (sep_degree is 1)")

    def get_sep_parallel_group(self):
        self._check_sep_exist()
        return self._sep_comm_group

    def get_sep_parallel_group_src_rank(self):
        self._check_sep_exist()
        return self._sep_comm_group.ranks[0]

    def get_dp_sep_parallel_group(self):
        self._check_sep_exist()
        return self._dp_sep_comm_group

    def get_pp_mp_parallel_group(self):
        self._check_sep_exist()
        return self._pp_mp_comm_group

    def get_check_parallel_group(self, sharding=False):
        """The ranks with this rank's data-parallel index (``sharding=True``: its sharding index; sharding > 1)."""
        if sharding:
            if self._sharding_degree <= 1:
                raise AttributeError("no sharding check group: sharding_degree is 1")
            return self.sharding_check_comm_group
        return self._check_comm_group

    def __repr__(self) -> str:
        return (f"HybridCommunicateGroup(rank={self.global_rank}, dp={self._dp_degree}, pp={self._pp_degree}, "
                f"sharding={self._sharding_degree}, mp={self._mp_degree}; dp_group={self._dp_group}, "
                f"pp_group={self._pp_group}, sharding_group={self._sharding_group}, mp_group={self._mp_group})")
