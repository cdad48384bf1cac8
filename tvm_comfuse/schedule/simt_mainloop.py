"""The CUDA-core mainloop: a ``bm x N`` row tile computed with fp32 FMAs.

Used for GEMMs the tensor cores do not take (fp32 inputs) and as the reference layout the
tensor-core mainloop follows: ``blockIdx.x`` walks row tiles, ``threadIdx.y`` is the warp,
``threadIdx.x`` the lane, A and B are staged through shared memory one K step at a time, and
the accumulators are written back by a block that the epilogue is inlined into.
"""

from __future__ import annotations

from tvm import s_tir

from .config import RowTileConfig


def _operand_reads(sch: s_tir.Schedule, mm) -> list:
    """Indices of the mainloop's reads that are its operands (not its own accumulator)."""
    block = sch.get(mm)
    out = {w.source for w in block.writes}
    return [i for i, r in enumerate(block.reads) if r.source not in out]


def _cooperative_fetch(sch: s_tir.Schedule, cache, cfg: RowTileConfig, dims: int) -> None:
    loop = sch.fuse(*sch.get_loops(cache)[-dims:])
    _, ty, tx = sch.split(loop, [None, cfg.warps, 32])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def schedule_simt_mainloop(sch: s_tir.Schedule, mm, cfg: RowTileConfig):
    """Tile the GEMM block ``mm`` into ``bm``-row CTAs; return ``(bx loop, writeback block)``.

    ``mm``'s loops are ``[*batch, i, j, k]``; batch loops fold into ``blockIdx.x``.
    """
    *batch, i, j, k = sch.get_loops(mm)
    io, ii = sch.split(i, [None, cfg.bm])
    bx = sch.fuse(*batch, io) if batch else io
    ty, mi = sch.split(ii, [cfg.warps, None])
    tx, jn = sch.split(j, [32, None])  # contiguous columns per lane: the writeback's region
    ko, ki = sch.split(k, [None, cfg.bk])
    sch.reorder(bx, ty, tx, ko, ki, mi, jn)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    writeback = sch.cache_write(mm, 0, "local")
    sch.reverse_compute_at(writeback, tx, preserve_unit_loops=True)
    for index in _operand_reads(sch, mm):
        cache = sch.cache_read(mm, index, "shared")
        sch.compute_at(cache, ko, preserve_unit_loops=True)
        _cooperative_fetch(sch, cache, cfg, dims=2)
    sch.decompose_reduction(mm, ko)
    return bx, writeback
