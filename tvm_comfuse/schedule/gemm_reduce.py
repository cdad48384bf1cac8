"""The ``gemm_reduce`` rule: GEMM mainloop + row epilogue (reductions, normalisation) in one kernel.

A CTA owns ``bm`` whole rows of the GEMM result. The epilogue chain up to the *row tile* (the
last elementwise result the reductions read: the residual sum before LayerNorm) is applied
to the accumulators as they are written back, into shared memory; the reductions and the
normalisation then run on that tile (see :mod:`.row_epilogue`). Only the group's outputs
reach global memory.

``gemm_elementwise`` groups need no whole rows; DLight's matmul rule tiles them in 2-D.
Applies to PrimFuncs that :class:`~tvm_comfuse.transform.AnnotateFusedBlocks` marked with a
ComFuse kind, on GPU targets, when the ``bm x N`` tile fits the target's shared memory
(otherwise it returns None and the next rule, DLight's, schedules the function).
"""

from __future__ import annotations

import functools
import logging

import tvm
import tvm.sym

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule

from ..graph.group import GEMM_REDUCE
from ..target import is_gpu
from ..transform.fuse_compute_memory import KIND_ATTR
from .blocks import (
    copied_buffer, flatten_batch_rows, flatten_row_buffers, inline_all, is_reduction, output_buffers, read_blocks,
    tile_symbolic_rows, writes_output, written_buffers,
)
from .config import MmaConfig, RowTileConfig, candidates, default
from .lowering import MIN_CTAS_ATTR
from .mma_mainloop import gemm_maps, schedule_mma_mainloop
from .row_epilogue import bind_spatial, schedule_cluster_row_epilogue, schedule_row_epilogue, split_reductions
from .simt_mainloop import schedule_simt_mainloop

LOG = logging.getLogger("tvm_comfuse")
#: How many configurations (defaults first) an untuned compile tries before leaving the
#: group to DLight: a group the first cannot schedule (a cluster split of an unusual
#: epilogue) still gets the next.
_FALLBACKS = 4


def _row_tile(sch: s_tir.Schedule, g):
    """The epilogue block whose result the normalisation reads (the residual sum before a
    LayerNorm), stepping back over pure casts; the last epilogue block if nothing reads one.
    Everything before it is inlined into it, everything after it reads it from shared memory.
    """
    epilogue = [rv for rv in g.after if g.roles[sch.get(rv).name_hint] == "epilogue"]
    if not epilogue:
        return None
    writer = {sch.get(rv).writes[0].source: rv for rv in epilogue}
    read_late = [
        r.source
        for rv in g.after
        if g.roles[sch.get(rv).name_hint] == "normalize"
        for r in sch.get(rv).reads
        if r.source in writer
    ]
    tile = writer[read_late[-1]] if read_late else epilogue[-1]
    while copied_buffer(sch, tile) in writer:
        tile = writer[copied_buffer(sch, tile)]
    return tile


def _row_layout_kept(sch: s_tir.Schedule, g) -> bool:
    """False if a block re-lays out the GEMM tile (a reshape left inside the group): its
    flattened indices cannot be tiled by rows, so the rule leaves such a group to DLight."""
    tile = sch.get(g.mainloop).writes[0].source.shape
    eq = tvm.sym.Analyzer().can_prove_equal
    numel = lambda shape: functools.reduce(lambda a, b: a * b, shape, 1)  # noqa: E731
    for rv in g.after:
        shape = sch.get(rv).writes[0].source.shape
        same = len(shape) == len(tile) and all(eq(a, b) for a, b in zip(shape, tile))
        if not same and eq(numel(shape), numel(tile)) and not eq(shape[-1], 1):
            return False
    return True


def _static_width(sch: s_tir.Schedule, mm) -> int | None:
    extent = sch.get(sch.get_loops(mm)[-2]).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _rows_supported(sch: s_tir.Schedule, mm) -> bool:
    """Static GEMM results, or 2-D ones whose row count alone is symbolic (``[n, N]``, as
    serving graphs and HoistRowReshape's flattened batch x sequence produce)."""
    shape = sch.get(mm).writes[0].source.shape
    static = [isinstance(d, tirx.IntImm) for d in shape]
    return all(static) or (len(shape) == 2 and static[1])


class GemmRowTile(ScheduleRule):
    """Schedule a fused GEMM + row epilogue group as one kernel."""

    def __init__(self, kinds=(GEMM_REDUCE,)):
        self.kinds = tuple(kinds)

    def apply(self, func: tirx.PrimFunc, target, tunable: bool):  # pylint: disable=unused-argument
        """The schedule with this target's default configuration, or None."""
        if not is_gpu(target) or str((func.attrs or {}).get(KIND_ATTR, "")) not in self.kinds:
            return None
        sch = s_tir.Schedule(func)
        for cfg in self.configs(sch, target)[:_FALLBACKS]:
            done = self._try(sch.copy(), cfg)
            if done is not None:
                return done
        return None

    def configs(self, sch: s_tir.Schedule, target) -> list:
        """Every configuration that fits this group on ``target`` (default first); empty if
        the rule does not apply (unannotated, re-laid-out tile, symbolic or too-wide rows).
        A symbolic M is fine: the configurations are those of any static M."""
        sch = sch.copy()
        g = read_blocks(sch)
        if g is None or not _row_layout_kept(sch, g):
            return []
        flatten_batch_rows(sch, g)
        n = _static_width(sch, g.mainloop)
        if n is None or n < 2 or not _rows_supported(sch, g.mainloop):
            # n = 1: nothing to reduce on chip, and with M = 1 the row reductions' barriers
            # end up inside a predicate, which TVM's ThreadSync rejects (fuzz seed 423)
            return []
        arch = str(target.attrs.get("arch", ""))
        if _tensor_core_eligible(sch, g, n, arch):
            return mma_candidates(arch, n, sch.get(g.mainloop).iter_vars[0].dom.extent)
        return candidates(RowTileConfig, arch, n, _operand_bytes(sch, g.mainloop))

    def scheduled(self, sch: s_tir.Schedule, target, limit: int | None = None, configs: list | None = None,
                  quiet: bool = False) -> list:
        """``[(configuration, schedule)]`` for the first ``limit`` configurations that fit,
        each schedule a copy of ``sch`` (so its trace replays on the task); configurations the
        rule cannot apply are left out. With ``configs``, those (offered by the space or not),
        each paired with None where the rule cannot apply it (``quiet``: without a warning)."""
        if configs is not None:
            return [(cfg, self._try(sch.copy(), cfg, quiet)) for cfg in configs]
        pairs = ((cfg, self._try(sch.copy(), cfg)) for cfg in self.configs(sch, target)[:limit])
        return [(cfg, done) for cfg, done in pairs if done is not None]

    def space(self, sch: s_tir.Schedule, target) -> list:
        """The design space for MetaSchedule: one schedule per valid configuration, none that
        cannot build."""
        return [done for _, done in self.scheduled(sch, target)]

    @staticmethod
    def _try(sch: s_tir.Schedule, cfg, quiet: bool = False):
        try:
            return _schedule(sch, cfg)
        except (RuntimeError, ValueError) as err:  # ScheduleError, InternalError, failed checks
            # a block layout the rule cannot tile: the next rule (DLight) schedules the
            # function; it stays correct, only slower
            first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
            (LOG.debug if quiet else LOG.warning)("ComFuse rule did not apply to a %s group (%s), DLight schedules it: %s",
                        sch.mod["main"].attrs[KIND_ATTR], cfg, first)
            return None


def _schedule(sch: s_tir.Schedule, cfg) -> s_tir.Schedule:
    """Schedule a fused group with one configuration (MmaConfig or RowTileConfig)."""
    g = read_blocks(sch)
    rows = flatten_batch_rows(sch, g)
    n = _static_width(sch, g.mainloop)
    m_rows = sch.get(g.mainloop).iter_vars[0].dom.extent
    outputs = output_buffers(sch.mod["main"])
    for rv in g.prologue:
        sch.compute_inline(rv)
    tile = _row_tile(sch, g)
    copies = []  # blocks made here that iterate a parameter's shape
    rest = inline_all(sch, g.after, keep=[tile] if tile is not None else [])
    if tile is not None:
        # a residual the caller also reads: the tile stays in shared memory for the
        # reductions and a copy block writes the output
        rest = [rv for rv in rest if not sch.get(rv).same_as(sch.get(tile))]
        rest = _keep_outputs_on_chip(sch, [tile, *rest], outputs, copies)[1:]
    else:
        rest = _keep_outputs_on_chip(sch, rest, outputs, copies)
    if rows is not None:
        flatten_row_buffers(sch, rows, copies)
    splits = getattr(cfg, "splits", 1)
    if splits > 1:
        rest, combines = split_reductions(sch, rest, splits)
    if isinstance(cfg, MmaConfig):
        bx, cta, c_tile = schedule_mma_mainloop(sch, g.mainloop, n, cfg)
        writeback = _inline_epilogue(sch, c_tile, tile)
        if not cfg.stage_rows and not writes_output(sch, writeback, outputs):
            if not isinstance(m_rows, tirx.IntImm) or int(m_rows) % cfg.bm:
                # a partial last tile: TVM cannot bound the C tile the vectorised readers touch
                # and allocates it for all rows (4 MiB at M = 1000)
                raise ValueError("recomputed rows need M to be a static multiple of the row tile")
            sch.compute_inline(writeback)
            writeback = None
        else:
            bind_spatial(sch, writeback, cta, cfg.warps, cfg.epilogue_vec)
        scope = "shared.dyn"
    else:
        bx, writeback = schedule_simt_mainloop(sch, g.mainloop, cfg)
        if tile is not None:
            sch.reverse_compute_inline(tile)
        scope = "shared"
    if rows is not None:
        flatten_row_buffers(sch, rows)  # and the mainloop's caches
    if writeback is not None and not writes_output(sch, writeback, outputs):
        sch.set_scope(writeback, 0, scope)
    if splits > 1:
        schedule_cluster_row_epilogue(sch, bx, rest, combines, outputs, cfg)
    else:
        schedule_row_epilogue(sch, bx, rest, outputs, cfg.warps, getattr(cfg, "epilogue_vec", 1), (cfg.bm, m_rows))
        tile_symbolic_rows(sch, cfg.bm)
    _check_row_tiles(sch)
    if getattr(cfg, "min_ctas", 1) > 1:
        sch.annotate(sch.get_sblock("root"), MIN_CTAS_ATTR, cfg.min_ctas)
    return sch


def _check_row_tiles(sch: s_tir.Schedule) -> None:
    """Raise ValueError if, with static shapes, a block writing an output has a loop whose
    extent depends on the thread block.

    Why: that is TVM bounding a block's region by more than the block's row tile. With 3-D
    rows read through ``r -> (r // S, r % S)`` (a kept output, a ``keepdims`` statistic) it
    bounds them by whole sequences, so a thread block also wrote rows of its neighbours from
    data it does not hold: a race, wrong results on the H200 (GPU fuzz seed 78, S = 17). The
    configuration is then not used (DLight schedules the group if none is left)."""
    params = output_buffers(sch.mod["main"])
    if any(not isinstance(d, tirx.IntImm) for p in params for d in p.shape):
        return  # a symbolic M: extents legitimately depend on the row tile
    for block, _, buf in written_buffers(sch):
        if buf not in params:
            continue  # an on-chip copy that over-fetches (x rows of whole sequences) only reads
        for loop in sch.get_loops(block):
            if not isinstance(sch.get(loop).extent, tirx.IntImm):
                raise ValueError(f"block {sch.get(block).name_hint} iterates beyond its row tile")


def mma_candidates(arch: str, n: int, rows) -> list:
    """The tensor-core configurations for ``rows x n`` (defaults first): a row split over a
    cluster and recomputed rows need whole row tiles, so only a static ``rows``, a multiple of
    ``bm``, gets them."""
    static = rows if isinstance(rows, int) else int(rows) if isinstance(rows, tirx.IntImm) else None
    whole_tiles = lambda c: static is not None and static % c.bm == 0  # noqa: E731
    return [c for c in candidates(MmaConfig, arch, n) if c.splits == 1 and c.stage_rows or whole_tiles(c)]


def _keep_outputs_on_chip(sch: s_tir.Schedule, rest: list, outputs: set, copies: list) -> list:
    """A block that writes an output later blocks read (the residual sum before a LayerNorm,
    a value the model keeps and then scales) computes into shared memory; a copy block,
    placed right after it, writes the output, and the readers read the shared copy.

    Why: read back from global memory, the value would need a grid-wide barrier between the
    threads that write and read it, and with 3-D rows (``r -> (r // S, r % S) -> r``) the
    reader's region is a bounding box of whole ``S``-row batches, so a thread block also
    recomputed rows of its neighbours from data it does not hold (wrong results on the H200
    when S is not a multiple of the row tile: GPU fuzz seed 78)."""
    out = []
    for i, rv in enumerate(rest):
        out.append(rv)
        if not writes_output(sch, rv, outputs) or is_reduction(sch, rv):
            continue
        written = sch.get(rv).writes[0].source
        readers = [c for c in rest[i + 1 :] if any(r.source.same_as(written) for r in sch.get(c).reads)]
        if readers:
            copies.append(sch.cache_write(rv, 0, "shared", consumer_blocks=readers))
            out.append(copies[-1])
            if not any(is_reduction(sch, c) for c in readers):
                # elementwise readers (a LayerNorm output kept in fp32 and also cast) recompute
                # the value instead: a bm x N static copy in shared memory (96 KiB for BERT's
                # fp32 LayerNorm) failed to launch next to the dynamic ring on the H200
                out.remove(rv)
                sch.compute_inline(rv)
    return out


def _operand_bytes(sch: s_tir.Schedule, mm) -> int:
    return max(r.source.dtype.bits for r in sch.get(mm).reads) // 8


def _tensor_core_dtype_ok(dtype: str, n, k, arch: str) -> bool:
    """fp16 with 8-aligned N and K (cp.async moves 16 aligned bytes) on an sm_* target."""
    return dtype == "float16" and isinstance(k, int) and n % 8 == 0 and k % 8 == 0 and arch.startswith("sm_")


def _tensor_core_eligible(sch: s_tir.Schedule, g, n: int, arch: str) -> bool:
    """Whether the group's (2-D) GEMM takes the tensor-core mainloop: only with the weight
    as PyTorch's linear stores it (``[N, K]``, seen once the transpose prologue is inlined);
    the ``[K, N]`` layout's transposed shared-memory copy does not generate valid CUDA yet
    (vector loads TVM cannot print)."""
    probe = sch.copy()
    for rv in g.prologue:
        probe.compute_inline(rv)
    block = probe.get(g.mainloop)
    maps = gemm_maps(block)
    if maps is None or not maps[0]:
        return False
    operands = {str(r.source.dtype) for r in block.reads if r.source not in {w.source for w in block.writes}}
    k = [iv.dom.extent for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if len(operands) != 1 or len(block.iter_vars) != 3 or len(k) != 1 or not isinstance(k[0], tirx.IntImm):
        return False
    rows = block.iter_vars[0].dom.extent
    return _tensor_core_dtype_ok(operands.pop(), n, int(k[0]), arch) and bool(mma_candidates(arch, n, rows))


def _inline_epilogue(sch: s_tir.Schedule, c_tile, tile):
    """Inline the layout copies after the C tile, and the row tile, into the C tile's reader;
    return the block that now writes the row tile (or the GEMM result)."""
    name = sch.get(tile).name_hint if tile is not None else None
    current = c_tile
    while True:
        consumers = [c for c in sch.get_consumers(current) if not is_reduction(sch, c)]
        nxt = next((c for c in consumers if copied_buffer(sch, c) is not None or sch.get(c).name_hint == name), None)
        if nxt is None:
            return current
        done = sch.get(nxt).name_hint == name
        sch.reverse_compute_inline(nxt)
        if done:
            return current


def row_tile_fits(gemm: tuple, dtype: str, target) -> bool:
    """Whether a gemm_reduce group with GEMM shape ``(batch, M, N, K)`` gets this rule's
    one-kernel schedule on ``target``: the pass outlines only such groups on GPUs, so a row too
    wide for one thread block, or a symbolic N, keeps vanilla TVM's kernels rather than a slow
    fallback. M may be symbolic (one row tile per thread block, whatever M is at run time)."""
    batch, m, n, k = gemm
    if not isinstance(n, int) or batch != 1 and not (isinstance(batch, int) and isinstance(m, int)):
        return False
    arch = str(target.attrs.get("arch", ""))
    if _tensor_core_dtype_ok(dtype, n, k, arch) and mma_candidates(arch, n, m if batch == 1 else batch * m):
        return True
    return default(RowTileConfig, arch, n, 2 if dtype in ("float16", "bfloat16") else 4) is not None
