"""PrimFunc -> schedule: the ComFuse rules (DLight-style: ``apply`` returns a Schedule or None)."""

from .config import RowTileConfig, default_config
from .gemm_reduce import GemmRowTile, row_tile_fits
