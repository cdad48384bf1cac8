"""The row epilogue: reductions and normalisation of a CTA's row tile, on chip.

Every block after the GEMM is moved under the CTA's row-tile loop (``blockIdx.x``), in
program order, so it only touches the CTA's own rows: row reductions become warp
reductions (rows over ``threadIdx.y``, the reduced axis over the 32 lanes, combined with
shuffles), per-row statistics and the row tile stay in shared memory, and only blocks that
write the function's outputs touch global memory. That is the whole point of ComFuse: the
un-normalised GEMM result never makes the round trip through HBM.
"""

from __future__ import annotations

from tvm import s_tir

from .blocks import is_reduction, writes_output


def _loops_below(sch: s_tir.Schedule, rv, bx) -> list:
    """The loops of block ``rv`` nested under the CTA loop ``bx``."""
    bx_var = sch.get(bx).loop_var
    loops = sch.get_loops(rv)
    outer = next(i for i, loop in enumerate(loops) if sch.get(loop).loop_var.same_as(bx_var))
    return loops[outer + 1 :]


def _bind_reduction(sch: s_tir.Schedule, rv, bx, warps: int) -> None:
    loops = _loops_below(sch, rv, bx)
    n_spatial = sum(1 for iv in sch.get(rv).iter_vars if iv.iter_type == 0)
    rows = sch.fuse(*loops[:n_spatial]) if n_spatial else sch.add_unit_loop(rv)
    red = sch.fuse(*loops[n_spatial:])
    rs, ty = sch.split(rows, [None, warps])
    ro, tx = sch.split(red, [None, 32])
    sch.reorder(rs, ty, tx, ro)
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def bind_spatial(sch: s_tir.Schedule, rv, bx, warps: int) -> None:
    """Spread a spatial block under ``bx`` over the CTA's ``warps x 32`` threads."""
    loops = _loops_below(sch, rv, bx)
    fused = sch.fuse(*loops) if loops else sch.add_unit_loop(rv)
    _, ty, tx = sch.split(fused, [None, warps, 32])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def schedule_row_epilogue(sch: s_tir.Schedule, bx, blocks: list, outputs: set, warps: int) -> None:
    """Move ``blocks`` (program order) under ``bx`` and bind them to the CTA's threads."""
    for rv in blocks:
        sch.reverse_compute_at(rv, bx, preserve_unit_loops=True)
        if not writes_output(sch, rv, outputs):
            sch.set_scope(rv, 0, "shared")
        (_bind_reduction if is_reduction(sch, rv) else bind_spatial)(sch, rv, bx, warps)
