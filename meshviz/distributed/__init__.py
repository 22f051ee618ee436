"""Paddle's distributed API on torch: ``import meshviz.distributed as dist``."""

from ..core import Partial, Placement, ProcessMesh, ReduceType, Replicate, Shard
from ..ranks.processes import spawn
from ..runtime import modules as _modules  # noqa: F401  (module hooks while tracing: who issued a collective)
from ..runtime.devices import device, strict_devices
from ..runtime.dtensor import DistTensor
from ..runtime.world import ParallelEnv, get_rank, get_world_size, is_initialized
from . import process_mesh as _process_mesh  # noqa: F401  (installs ProcessMesh.get_group)
from .api import (
    dtensor_from_fn,
    dtensor_from_local,
    dtensor_to_local,
    is_dist_tensor,
    local_map,
    plan_of,
    reshard,
    shard_tensor,
    unshard_dtensor,
)
from .dataloader import ShardDataloader, shard_dataloader
from .shard_api import (
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    shard_layer,
    shard_optimizer,
    shard_scaler,
)

__all__ = [
    "ProcessMesh", "Placement", "Shard", "Replicate", "Partial", "ReduceType",
    "init_parallel_env", "get_rank", "get_world_size", "is_initialized", "spawn",
    "ParallelEnv", "destroy_process_group", "device", "strict_devices",
    "DistTensor", "shard_tensor", "reshard", "dtensor_from_fn", "dtensor_from_local", "dtensor_to_local",
    "unshard_dtensor",
    "local_map", "is_dist_tensor", "plan_of",
    "shard_layer", "shard_optimizer", "shard_scaler", "shard_dataloader", "ShardDataloader",
    "ShardingStage1", "ShardingStage2", "ShardingStage3",
]

# --- training API (collectives, DataParallel, fleet, checkpoint) -----------------------------------
from . import collective, stream  # noqa: F401  (dist.collective, dist.stream, as in Paddle)
from .collective import (
    Group,
    P2POp,
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    alltoall,
    alltoall_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_backend,
    get_group,
    irecv,
    is_available,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    scatter_object_list,
    send,
    wait,
)
from .object_p2p import recv_object_list, send_object_list

__all__ += [
    "barrier", "Group", "P2POp", "ReduceOp", "all_gather", "all_gather_object", "all_reduce", "alltoall",
    "alltoall_single", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "get_backend",
    "get_group", "irecv", "isend", "new_group", "recv", "reduce", "reduce_scatter", "scatter", "send", "wait",
    "scatter_object_list", "is_available", "send_object_list", "recv_object_list",
]
from . import fleet
from .checkpoint import load_state_dict, save_state_dict
from .fleet.topology import ParallelMode
from .parallel import DataParallel, fused_allreduce_gradients, init_parallel_env

__all__ += ["fleet", "DataParallel", "fused_allreduce_gradients", "save_state_dict", "load_state_dict",
            "ParallelMode"]
# --- end training API ---------------------------------------------------------------------------------

from . import sharding
from .auto_parallel import DistModel, Strategy, to_static

__all__ += ["sharding", "to_static", "DistModel", "Strategy"]

# --- intermediate API (parallelize and its plans, the global mesh, LocalLayer) ---------------------------
from . import auto_parallel
from .auto_parallel import LocalLayer, get_mesh, set_mesh, to_distributed
from .auto_parallel.intermediate import (
    ColWiseParallel,
    ConvParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    SplitPoint,
    parallelize,
)

__all__ += ["auto_parallel", "parallelize", "ColWiseParallel", "RowWiseParallel", "SequenceParallelBegin",
            "SequenceParallelEnd", "SequenceParallelEnable", "SequenceParallelDisable", "PrepareLayerInput",
            "PrepareLayerOutput", "SplitPoint", "set_mesh", "get_mesh", "LocalLayer", "to_distributed", "ConvParallel"]
