"""Schedule configurations of the gemm_reduce rule: tunables, their limits, defaults, spaces.

Two mainloops, two configuration types: :class:`MmaConfig` (tensor cores, fp16) and
:class:`RowTileConfig` (CUDA cores: fp32, bf16, N or K not 8-aligned). Each knows whether it
fits a target (shared memory, accumulator registers, divisibility), so the search space the
rule offers MetaSchedule holds only configurations that build — the stock tensor-core rules
fail to build ~80% of their candidates. Defaults per architecture come first, from
``schedules/<arch>.json`` at the top of the source tree (measured on the GPU), then the space
in a fixed order.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

#: fp32 accumulator registers per thread we allow (of 255), leaving room for addresses.
MAX_ACC_REGS = 128
#: Dynamic shared memory per thread block with the opt-in carve-out; sm_90: 227 KiB.
SMEM_DYN_BYTES = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}
#: Shared memory of one SM, which the CTAs resident on it share (``min_ctas`` > 1).
SMEM_PER_SM_BYTES = {"sm_80": 164 * 1024, "sm_86": 100 * 1024, "sm_89": 100 * 1024, "sm_90": 228 * 1024}
#: Shared memory the driver reserves per resident CTA (1 KiB since sm_80).
SMEM_DRIVER_RESERVE = 1024
#: 32-bit registers of one SM; ptxas keeps what a thread uses beyond its accumulators (operand
#: fragments, addresses) around this many registers.
REGS_PER_SM, NON_ACC_REGS = 65536, 32
#: Static ``__shared__`` arrays are capped at 48 KiB on every architecture.
SMEM_STATIC_BYTES = 48 * 1024
#: What the mma kernels' static ``__shared__`` arrays (the epilogue's cross-warp reduction
#: buffers) may take out of the dynamic budget, which the driver counts together with them:
#: measured up to 4.3 KiB; a 224 KiB dynamic ring plus 4 KiB of them failed to launch on the
#: H200 (``test_every_configuration_the_tuner_may_pick_is_correct[1000-768-1024]``).
SMEM_STATIC_RESERVE = 8 * 1024


#: Shared memory a cluster-split kernel takes beyond its operand ring and tiles (bytes).
CLUSTER_SMEM_MARGIN = 40 * 1024
#: Portable thread-block cluster sizes (CTAs sharing a row when it is split).
CLUSTER_SIZES = (2, 4, 8)


def has_clusters(arch: str | None) -> bool:
    """Thread-block clusters and distributed shared memory: sm_90 and later."""
    return bool(arch) and arch.startswith("sm_") and int("".join(c for c in arch[3:] if c.isdigit()) or 0) >= 90


def smem_per_sm(arch: str | None) -> int:
    """Shared memory of one SM on ``arch`` (0 when unknown: then only one CTA per SM is planned)."""
    return SMEM_PER_SM_BYTES.get((arch or "").rstrip("a"), 0)


def smem_limit(arch: str | None, dynamic: bool) -> int:
    """Shared memory per thread block on ``arch`` (``sm_90a`` counts as ``sm_90``)."""
    if not dynamic or not arch:
        return SMEM_STATIC_BYTES
    return SMEM_DYN_BYTES.get(arch.rstrip("a"), SMEM_STATIC_BYTES)


@dataclass(frozen=True)
class MmaConfig:
    """Tensor-core mainloop: a ``bm x bn`` tile per block (``bn`` = the whole padded row), a
    ``warps_m x warps_n`` warp grid, ``bk`` staged per step through a ``stages``-deep ring."""

    bm: int = 32
    bk: int = 32
    warps_m: int = 1
    warps_n: int = 8
    stages: int = 3
    vec: int = 8  # fp16 elements per cp.async (16 bytes)
    splits: int = 1  # CTAs (one cluster) sharing each row, each a ``n // splits`` column slice
    #: columns per thread and vector access in the epilogue's spatial blocks: at most 4, the
    #: widest float32 vector TVM's CUDA codegen prints (8 lanes of the fp32 math give
    #: ``make_ulonglong4`` with 8 arguments, which nvcc rejects)
    epilogue_vec: int = 1
    #: the pre-norm row tile (the residual sum the reductions read) staged in shared memory
    #: (True), or recomputed from the C tile by each of its readers (False: 48 KiB less at
    #: bm 32, N 768, which leaves room for two CTAs per SM; not in the search space: no faster
    #: with one CTA per SM, notebooks/results/NOTES.md, session 5)
    stage_rows: bool = True
    #: CTAs per SM the kernel is built for (``__launch_bounds__(threads, min_ctas)``: ptxas caps
    #: the registers per thread to fit them); not in the search space until the GPU measures it
    min_ctas: int = 1

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_n

    def bn(self, n: int) -> int:
        """The padded row width (a multiple of 16 per warp column), or with ``splits`` the
        exact width of one CTA's column slice."""
        if self.splits > 1:
            return n // self.splits
        step = 16 * self.warps_n
        return (n + step - 1) // step * step

    def smem_bytes(self, n: int, tile_bytes: int = 2) -> int:
        """Dynamic shared memory: the fp32 C tile reuses the operand ring once the mainloop is
        done (TVM merges the allocations), the row tile lives beside both. Measured on the
        lowered kernels: 172 KiB for bm=16 and 192 KiB for bm=32 at N=768 (this gives 175/203).
        """
        bn = self.bn(n)
        ring = self.stages * (self.bm + bn) * self.bk * 2
        # a split CTA holds its slice of the row tile, plus the static exchange buffers and
        # allocation padding: measured 224 KiB of dynamic smem (over the limit with the static
        # buffers) where the other terms give 212 KiB (bm=128, bk=64, N/4=256) and 197 KiB
        # (bm=64, bk=32, N/8=512) on the H200
        split = self.splits > 1
        staged = self.bm * (bn if split else n) * tile_bytes if self.stage_rows else 0
        return max(ring, self.bm * bn * 4) + staged + split * CLUSTER_SMEM_MARGIN

    def acc_regs(self, n: int) -> int:
        """fp32 accumulator registers per thread."""
        return self.bm * self.bn(n) // (32 * self.warps)

    def fits(self, n: int, arch: str | None, in_bytes: int = 2) -> bool:  # pylint: disable=unused-argument
        """True if the tiling divides evenly and fits shared memory and registers (and, for a
        row split over a cluster, the architecture has clusters and the slices divide the row)."""
        split_ok = self.splits == 1 or (
            self.splits in CLUSTER_SIZES
            and has_clusters(arch)
            and n % self.splits == 0
            and (n // self.splits) % (16 * self.warps_n) == 0
        )
        return (
            split_ok
            and self.epilogue_vec in (1, 2, 4)
            and self.bm % (16 * self.warps_m) == 0
            and self.bk % 32 == 0  # the XOR swizzle needs rows of >= 32 fp16
            and self.warps <= 32
            and self.smem_bytes(n) + SMEM_STATIC_RESERVE <= smem_limit(arch, dynamic=True)
            and self.acc_regs(n) <= MAX_ACC_REGS
            and self._resident(n, arch)
        )

    def _resident(self, n: int, arch: str | None) -> bool:
        """``min_ctas`` CTAs fit one SM together: their shared memory, and registers enough for
        the accumulators once ptxas caps each thread at the SM's share."""
        if self.min_ctas == 1:
            return True
        per_cta = self.smem_bytes(n) + SMEM_STATIC_RESERVE + SMEM_DRIVER_RESERVE
        regs = REGS_PER_SM // (32 * self.warps * self.min_ctas)
        return self.min_ctas * per_cta <= smem_per_sm(arch) and self.acc_regs(n) <= regs - NON_ACC_REGS


@dataclass(frozen=True)
class RowTileConfig:
    """CUDA-core mainloop: ``bm`` rows per block over ``warps`` warps, ``bk`` per K step."""

    bm: int = 16
    warps: int = 4
    bk: int = 16

    def smem_bytes(self, n: int, in_bytes: int, tile_bytes: int = 4) -> int:
        """A and B for one K step plus the ``bm x n`` row tile (static shared memory)."""
        return (self.bm + n) * self.bk * in_bytes + self.bm * n * tile_bytes

    def fits(self, n: int, arch: str | None, in_bytes: int = 4) -> bool:
        """True if the tile fits static shared memory and the accumulator budget."""
        return (
            self.bm % self.warps == 0
            and self.smem_bytes(n, in_bytes) <= smem_limit(arch, dynamic=False)
            and self.bm * n // (32 * self.warps) <= MAX_ACC_REGS
        )


#: The search space of each configuration type (filtered by ``fits`` per target and row).
#: Tensor cores: whole rows with the vectorised epilogue (1.2-1.4x faster than the scalar one
#: on every H200 suite shape; scalar epilogues stay among the defaults, as fallbacks), staged
#: or recomputed rows (48 KiB less at bm 32, N 768: room for a 64-deep K step, 64-row tiles or
#: two CTAs per SM, one CTA's epilogue beside the other's mainloop), then rows split over a
#: cluster (what fits when a whole row does not; slower where both fit: NOTES.md, session 4).
SPACES = {
    MmaConfig: [
        MmaConfig(bm=bm, bk=32, warps_m=wm, warps_n=wn, stages=st, epilogue_vec=4)
        for bm, wm, wn, st in itertools.product((32, 16), (1, 2), (8, 4), (2, 3))
    ]
    + [
        MmaConfig(bm=bm, bk=bk, warps_m=wm, warps_n=8, stages=st, epilogue_vec=4, stage_rows=False, min_ctas=ctas)
        for ctas, bm, bk, wm, st in itertools.product((2, 1), (32, 16, 64), (32, 64), (1, 2), (2, 3))
    ]
    + [
        MmaConfig(bm=bm, bk=32, warps_m=2, warps_n=wn, stages=3, splits=sp, epilogue_vec=4)
        for sp, bm, wn in itertools.product((2, 4, 8), (64, 128), (8, 4))
    ],
    RowTileConfig: [
        RowTileConfig(bm=bm, warps=w, bk=bk)
        for bm, w, bk in itertools.product((32, 16, 8, 4), (4, 2, 8), (32, 16, 8))
    ],
}
_DEFAULTS_KEY = {MmaConfig: "mma_row_tile", RowTileConfig: "row_tile"}


def _defaults_file(arch: str) -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "schedules", f"{arch.rstrip('a')}.json")
    return path if arch and os.path.isfile(path) else None


def candidates(kind, arch: str | None, n: int, in_bytes: int = 2) -> list:
    """Every configuration of type ``kind`` that fits an ``n``-wide row on ``arch``: the
    architecture's measured defaults first, then the rest of the space."""
    path = _defaults_file(arch or "")
    listed = []
    if path:
        with open(path, encoding="utf-8") as f:
            listed = [kind(**c) for c in json.load(f).get(_DEFAULTS_KEY[kind], [])]
    ordered = list(dict.fromkeys(listed + SPACES[kind]))
    return [c for c in ordered if c.fits(n, arch, in_bytes)]


def default(kind, arch: str | None, n: int, in_bytes: int = 2):
    """The configuration an untuned compile uses, or None if nothing fits."""
    found = candidates(kind, arch, n, in_bytes)
    return found[0] if found else None

