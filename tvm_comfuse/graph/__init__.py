"""Graph -> group: which Relax operators ComFuse groups around a GEMM, and the group record."""

from .analysis import B2B_MAX_INTERMEDIATE, find_groups
from .group import B2B_GEMM, GEMM_ELEMENTWISE, GEMM_REDUCE, KINDS, FusionGroup, format_groups
