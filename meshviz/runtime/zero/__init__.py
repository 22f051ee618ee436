"""The ZeRO engine: optimizer state, gradients and parameters sharded over an explicit group at a level."""

from .blocks import step_on_blocks
from .engine import Zero, check_elementwise, create_states, is_fresh_state
from .flat import FlatZero
from .fsdp import apply_fsdp, unmix_foreach
from .group import ShardingGroup, broadcast_module, gather_object
from .layout import layout_settings
from .owners import OwnerZero
from .placed import (
    PlacedZero,
    StateView,
    dist_params_for_dist_grads,
    grads_as_params,
    laid_out_states,
    sharded_placements,
)
from .slot import Slot, local_tensor
from .state import full_optimizer_state
from .units import Unit, gather_per_unit

__all__ = [
    "Zero", "FlatZero", "OwnerZero", "PlacedZero", "StateView", "sharded_placements", "dist_params_for_dist_grads",
    "grads_as_params", "laid_out_states", "ShardingGroup", "check_elementwise", "create_states", "is_fresh_state",
    "broadcast_module", "gather_object", "Slot", "local_tensor", "full_optimizer_state", "apply_fsdp", "unmix_foreach",
    "Unit", "gather_per_unit", "step_on_blocks", "layout_settings",
]
