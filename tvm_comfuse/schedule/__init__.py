"""PrimFunc -> schedule: the ComFuse rules (DLight-style: ``apply`` returns a Schedule or None)."""

from .config import MmaConfig, RowTileConfig, candidates, default
from .gemm_reduce import GemmRowTile, row_tile_fits
