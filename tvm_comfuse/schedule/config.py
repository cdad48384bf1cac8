"""Schedule configurations: the tunables of the ComFuse rules, their limits and defaults.

A configuration is valid for a target only if its shared memory, threads and accumulator
registers fit; the rules never sample an invalid one, which is what keeps the build-error
rate of tuning low (the stock tensor-core rules fail to build ~80% of their candidates).
Defaults per architecture live in ``schedules/<arch>.json`` at the top of the repository
(copied into the package at install time is not needed: the file is looked up next to the
package first, then in the source tree).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

#: Registers per thread we allow the fp32 accumulators to take (of 255).
MAX_ACC_REGS = 128
#: Dynamic shared memory per thread block (bytes) with the opt-in carve-out; sm_90: 227 KiB.
SMEM_DYN_BYTES = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}
#: Static ``__shared__`` arrays are capped at 48 KiB on every architecture.
SMEM_STATIC_BYTES = 48 * 1024


@dataclass(frozen=True)
class RowTileConfig:
    """One CTA owns ``bm`` whole rows: the GEMM tile is ``bm x N`` and the row reductions
    run on it in shared memory before anything is written.

    ``warps`` warps split the rows of the tile; ``bk`` is the K step staged in shared memory;
    ``vec`` the vector width of global loads/stores.
    """

    bm: int = 16
    warps: int = 4
    bk: int = 16
    vec: int = 4

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, n: int, in_bytes: int, tile_bytes: int) -> int:
        """Shared memory: A and B stages for one K step plus the bm x n row tile."""
        return (self.bm + n) * self.bk * in_bytes + self.bm * n * tile_bytes

    def acc_regs(self, n: int) -> int:
        """fp32 accumulators per thread for a bm x n tile."""
        return self.bm * n // self.threads

    def fits(self, n: int, in_bytes: int, tile_bytes: int, smem_limit: int) -> bool:
        """True if the tile fits the thread block's shared memory and register budget."""
        return (
            self.bm % self.warps == 0
            and self.smem_bytes(n, in_bytes, tile_bytes) <= smem_limit
            and self.acc_regs(n) <= MAX_ACC_REGS
        )

    def to_json(self) -> dict:
        return asdict(self)


def smem_limit(arch: str | None, dynamic: bool = False) -> int:
    """Shared memory a thread block may use on ``arch`` (``sm_90a`` counts as ``sm_90``):
    static ``shared`` scope is capped at 48 KiB, ``shared.dyn`` gets the carve-out."""
    if not dynamic or not arch:
        return SMEM_STATIC_BYTES
    return SMEM_DYN_BYTES.get(arch.rstrip("a"), SMEM_STATIC_BYTES)


def _defaults_path(arch: str) -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (here, os.path.join(here, "..", "..", "schedules")):
        path = os.path.join(root, f"{arch.rstrip('a')}.json")
        if os.path.isfile(path):
            return path
    return None


def default_config(arch: str | None, n: int, in_bytes: int, tile_bytes: int) -> RowTileConfig | None:
    """The first default for ``arch`` that fits an ``n``-wide row tile, else None (no rule)."""
    candidates = []
    path = _defaults_path(arch or "")
    if path:
        with open(path, encoding="utf-8") as f:
            candidates = [RowTileConfig(**c) for c in json.load(f).get("row_tile", [])]
    candidates += [RowTileConfig(), replace(RowTileConfig(), bm=8), replace(RowTileConfig(), bm=4, warps=2)]
    limit = smem_limit(arch)
    for cfg in candidates:
        if cfg.fits(n, in_bytes, tile_bytes, limit):
            return cfg
    return None


def default_mma_config(arch: str | None, n: int):
    """The first tensor-core default for ``arch`` that fits an ``n``-wide row tile, or None."""
    from .mma_mainloop import MmaConfig  # pylint: disable=import-outside-toplevel

    candidates = []
    path = _defaults_path(arch or "")
    if path:
        with open(path, encoding="utf-8") as f:
            candidates = [MmaConfig(**c) for c in json.load(f).get("mma_row_tile", [])]
    candidates += [
        MmaConfig(bm=bm, bk=bk, warps_m=1, warps_n=wn, stages=st)
        for bm, bk, wn, st in ((32, 32, 8, 3), (32, 32, 8, 2), (16, 32, 8, 3), (16, 32, 8, 2), (16, 32, 4, 2))
    ]
    limit = smem_limit(arch, dynamic=True)
    return next((c for c in candidates if c.valid(n, limit)), None)
