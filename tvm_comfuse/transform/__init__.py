"""Relax/TIR passes: outline fusion groups (FuseComputeMemory), annotate the fused PrimFuncs."""

from .cast_before_transpose import CastBeforeTranspose
from .annotate_blocks import ROLE_ATTR, ROLES, AnnotateFusedBlocks, block_roles
from .fold_rms_norm import FoldRMSNorm
from .fuse_compute_memory import GROUPS_ATTR, KIND_ATTR, FuseComputeMemory, analyze
from .hoist_row_reshape import HoistRowReshape
from .offload_hopper import OffloadHopperPostNorm
from .offload_hopper_attention import OffloadHopperAttention
from .offload_hopper_b2b import OffloadHopperB2B
from .offload_hopper_elementwise import OffloadHopperElementwise
from .widen_bf16_layer_norm import WidenBF16LayerNorm
