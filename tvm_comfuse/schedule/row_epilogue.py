"""The row epilogue: reductions and normalisation of a CTA's row tile, on chip.

Every block after the GEMM is moved under the CTA's row-tile loop (``blockIdx.x``), in
program order, so it only touches the CTA's own rows: row reductions become warp
reductions (rows over ``threadIdx.y``, the reduced axis over the 32 lanes, combined with
shuffles), per-row statistics and the row tile stay in shared memory, and only blocks that
write the function's outputs touch global memory. That is the whole point of ComFuse: the
un-normalised GEMM result never makes the round trip through HBM.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from .blocks import is_reduction, uses_var, writes_output


def _loops_below(sch: s_tir.Schedule, rv, bx) -> list:
    """The loops of block ``rv`` nested under the CTA loop ``bx``."""
    bx_var = sch.get(bx).loop_var
    loops = sch.get_loops(rv)
    outer = next(i for i, loop in enumerate(loops) if sch.get(loop).loop_var.same_as(bx_var))
    return loops[outer + 1 :]


def _bind_reduction(sch: s_tir.Schedule, rv, bx, warps: int) -> None:
    loops = _loops_below(sch, rv, bx)
    n_spatial = sum(1 for iv in sch.get(rv).iter_vars if iv.iter_type == 0)
    _rows_over_warps(sch, rv, loops[:n_spatial], loops[n_spatial:], warps)


def _rows_over_warps(sch: s_tir.Schedule, rv, row_loops: list, red_loops: list, warps: int) -> None:
    """A row reduction: rows over the warps, the reduced axis over the 32 lanes (shuffles)."""
    rows = sch.fuse(*row_loops) if row_loops else sch.add_unit_loop(rv)
    red = sch.fuse(*red_loops)
    rs, ty = sch.split(rows, [None, warps])
    ro, tx = sch.split(red, [None, 32])
    sch.reorder(rs, ty, tx, ro)
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def bind_spatial(sch: s_tir.Schedule, rv, bx, warps: int, vec: int = 1) -> None:
    """Spread a spatial block under ``bx`` over the CTA's ``warps x 32`` threads."""
    loops = _loops_below(sch, rv, bx)
    _spread(sch, rv, loops, warps, vec)


def _spread(sch: s_tir.Schedule, rv, loops: list, warps: int, vec: int = 1) -> None:
    """Fuse ``loops`` (rows x columns of block ``rv``) and spread them over the CTA's threads.
    With ``vec > 1``, ``vec`` consecutive columns per thread as one vector access (when the row
    width and the extent allow) and the per-thread loop unrolled.

    Why: these blocks read the residual, bias and LayerNorm weights from global memory; one
    scalar load per iteration of a rolled loop leaves one load in flight per thread. Vector
    accesses and an unrolled loop let nvcc keep several in flight (and, at 4096x768x768, cut
    the kernel from 128 to 86 registers per thread). Measured on the H200: 4 lanes make the
    whole-row kernel 1.2-1.4x faster on the suite shapes (notebooks/results/NOTES.md)."""
    if not loops:
        loops = [sch.add_unit_loop(rv)]
    width = sch.get(loops[-1]).extent
    lanes = None
    if vec > 1 and isinstance(width, tirx.IntImm) and int(width) % vec == 0:
        # the lanes split off the column axis alone, so a lane never changes the row: a row
        # statistic indexed by ``(f * vec + v) // width`` would stop TVM from vectorising
        cols, lanes = sch.split(loops[-1], [None, vec])
        loops = [*loops[:-1], cols]
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    outer, ty, tx = sch.split(fused, [None, warps, 32])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if lanes is not None:
        sch.vectorize(lanes)
        if isinstance(sch.get(outer).extent, tirx.IntImm):
            sch.unroll(outer)


def schedule_row_epilogue(sch: s_tir.Schedule, bx, blocks: list, outputs: set, warps: int, vec: int = 1,
                          tile_rows: tuple | None = None) -> None:
    """Move ``blocks`` (program order) under ``bx`` and bind them to the CTA's threads.

    All blocks are placed before any is bound: a block's region under ``bx`` is derived from
    its producers' loops there, and a producer already fused and split over the threads
    (``bm x N`` rarely divides by the thread count) gives a bounding box of more rows than
    the tile. A block writing an output then wrote rows of the next thread block (a race:
    GPU fuzz seeds 20, 86, 160 and others on the H200, 2026-12-02)."""
    for rv in blocks:
        sch.reverse_compute_at(rv, bx, preserve_unit_loops=True)
        if not writes_output(sch, rv, outputs):
            sch.set_scope(rv, 0, "shared")
    if tile_rows is not None:
        _check_tile_bounds(sch, bx, blocks, outputs, *tile_rows)
    for rv in blocks:
        if is_reduction(sch, rv):
            _bind_reduction(sch, rv, bx, warps)
        else:
            bind_spatial(sch, rv, bx, warps, vec)


def _check_tile_bounds(sch: s_tir.Schedule, bx, blocks: list, outputs: set, bm: int, rows) -> None:
    """Raise ValueError if a block writing an output iterates over more than the CTA's ``bm``
    rows of it (``rows``: the GEMM's static row count; a symbolic one is not checked): that
    block would write rows of another thread block."""
    if not isinstance(rows, (int, tirx.IntImm)):
        return
    for rv in blocks:
        if not writes_output(sch, rv, outputs):
            continue
        extents = [sch.get(loop).extent for loop in _loops_below(sch, rv, bx)]
        if not all(isinstance(e, tirx.IntImm) for e in extents):
            continue  # a thread-block dependent extent: gemm_reduce._check_row_tiles rejects it
        numel = math.prod(int(d) for d in sch.get(rv).writes[0].source.shape)
        if math.prod(int(e) for e in extents) * int(rows) > bm * numel:
            raise ValueError(f"block {sch.get(rv).name_hint} covers more than its {bm}-row tile")


# -- rows split over a thread-block cluster -------------------------------------------------


def split_reductions(sch: s_tir.Schedule, blocks: list, splits: int) -> tuple:
    """Split every row reduction of ``blocks`` over ``splits`` column slices (``rfactor``):
    ``R[r] = reduce_k f(r, k)`` becomes ``R_rf[s, r] = reduce over slice s`` and ``R[r] = reduce_s
    R_rf[s, r]``. Returns the new block list (program order) and the names of the combining
    blocks. Raises ValueError for a reduction that is not ``rows x one reduced axis``."""
    out, combines = [], set()
    for rv in blocks:
        if not is_reduction(sch, rv):
            out.append(rv)
            continue
        kinds = [iv.iter_type for iv in sch.get(rv).iter_vars]
        if kinds.count(2) != 1 or kinds[-1] != 2 or len(sch.get(rv).writes) != 1:
            raise ValueError("a cluster split needs reductions over one trailing axis")
        ko, _ = sch.split(sch.get_loops(rv)[-1], [splits, None])
        out += [sch.rfactor(ko, 0), rv]
        combines.add(sch.get(rv).name_hint)
    return out, combines


def schedule_cluster_row_epilogue(sch: s_tir.Schedule, bx, blocks: list, combines: set, outputs: set, cfg) -> None:
    """The row epilogue when the ``cfg.splits`` CTAs of a cluster (``blockIdx.x``) share each
    row, each holding one ``n // splits`` column slice of the row tile in shared memory.

    Under the row-tile loop ``bx``: blocks that touch columns (partial reductions, the
    normalisation, output copies) run on the CTA's own slice; each combining block first
    gathers the partials of all CTAs through distributed shared memory (:mod:`.cluster`),
    then every CTA combines them for its rows. ``blocks`` come from :func:`split_reductions`.
    """
    from . import cluster  # pylint: disable=import-outside-toplevel

    gathers = {}
    for rv in blocks:  # placement first: each block's region is taken from its producers' loops
        sch.reverse_compute_at(rv, bx, preserve_unit_loops=True)
        if not writes_output(sch, rv, outputs):
            sch.set_scope(rv, 0, "shared")
        if sch.get(rv).name_hint in combines:
            gathers[sch.get(rv).name_hint] = sch.cache_read(rv, 0, "shared")
    for rv in blocks:
        name = sch.get(rv).name_hint
        loops = _loops_below(sch, rv, bx)
        ivs = sch.get(rv).iter_vars
        if len(loops) != len(ivs):
            raise ValueError(f"block {name} has a loop nest the cluster epilogue cannot bind")
        if name in combines:
            gather = gathers[name]
            dtype = str(sch.get(gather).reads[0].source.dtype)
            if not cluster.supported(dtype):
                raise ValueError(f"no cluster exchange for {dtype} partials")
            _drop_unit_axes(sch, gather)
            rank, rows = _loops_below(sch, gather, bx)
            sch.tensorize(rows, cluster.allgather(dtype, cfg.bm, cfg.splits))
            sch.bind(rank, "blockIdx.x")
            _bind_rows(sch, rv, loops, ivs, cfg.warps)
        elif is_reduction(sch, rv):  # a partial reduction over the CTA's slice
            slice_ = next(i for i, iv in enumerate(ivs) if uses_var(sch.get(rv).writes[0].region[0].min, iv.var))
            rest = [loop for i, loop in enumerate(loops) if i != slice_]
            sch.reorder(loops[slice_], *rest)
            sch.bind(loops[slice_], "blockIdx.x")
            _rows_over_warps(sch, rv, rest[:-1], rest[-1:], cfg.warps)
        elif len(loops) >= 2 and int(ivs[-1].dom.extent) % cfg.splits == 0:  # rows x columns
            cols_o, cols_i = sch.split(loops[-1], [cfg.splits, None])
            sch.reorder(cols_o, *loops[:-1], cols_i)
            sch.bind(cols_o, "blockIdx.x")
            _spread(sch, rv, [*loops[:-1], cols_i], cfg.warps, cfg.epilogue_vec)
        else:  # per-row values: every CTA of the cluster computes them for its rows
            bind_spatial(sch, rv, bx, cfg.warps)


def _drop_unit_axes(sch: s_tir.Schedule, gather) -> None:
    """Lay the partials out as ``[ranks, rows]`` (a ``keepdims`` reduction writes ``[rows, 1]``):
    the ``allgather`` intrinsic moves one contiguous row vector per rank."""
    shape = sch.get(gather).writes[0].source.shape
    if len(shape) == 2:
        return
    if any(int(d) != 1 for d in shape[2:]):
        raise ValueError("a cluster split needs row reductions (one value per row)")
    drop = tirx.IndexMap.from_func(lambda s, r, *_: (s, r), ndim=len(shape))
    producer = sch.get_producers(gather)[0]
    sch.transform_layout(producer, ("write", 0), drop, assume_injective_transform=True)
    sch.transform_layout(gather, ("write", 0), drop, assume_injective_transform=True)
    sch.fuse(*sch.get_loops(gather)[-(len(shape) - 1):])


def _bind_rows(sch: s_tir.Schedule, rv, loops, ivs, warps: int) -> None:
    """A combining reduction: its rows over the CTA's threads, the partials in a serial loop."""
    rows = [loop for loop, iv in zip(loops, ivs) if iv.iter_type == 0]
    red = [loop for loop, iv in zip(loops, ivs) if iv.iter_type != 0]
    sch.reorder(*rows, *red)
    _spread(sch, rv, rows, warps)
    sch.decompose_reduction(rv, red[0])


