"""GEMM + elementwise chain on the Hopper mainloop: ``gemm_elementwise`` groups on sm_90.

Why: in an imported BERT encoder the groups that are not post-norms are a GEMM plus a short
chain, ``gelu(x @ w.T + b)`` (FFN1) and ``x @ w.T + b`` (the Q, K and V projections). Scheduled
by the mma.sync rule they took 1226 of ComFuse's 5346 us at BERT-base, batch 32 x 128 (H200,
session 10: FFN1 alone 102 us a layer, where cuBLAS needs ~27 for the same GEMM), and the
rule's mainloop tops out near 0.55x of cuBLAS. The wgmma mainloop (:mod:`.wgmma_mainloop`)
reached 0.77-0.88x as a plain GEMM (session 8). This kernel is that plain GEMM with the
group's chain applied to each accumulator before its one store: the GEMM's result never
leaves the registers unfinished, as the rule's epilogue does for the same groups.

The chain is the post-norm kernel's (:mod:`.chain`: casts and adds of a ``[N]`` vector or an
``[M, N]`` tile, each rounded to the dtype the graph computes it in), plus activations,
evaluated in fp32 as TVM legalises them. Tiles are whole CTAs of ``bm / 64`` consumer
warpgroups (``wg_n = 1``, as the plain GEMM measured fastest); :func:`default_config` picks the
tile that fills the SMs' waves best. A row-major output leaves by TMA stores
(:mod:`.staged_store`), staged in the ring's shared memory once every consumer warpgroup's
mainloop is done (session 15: FFN1's 25 MB of output went out as 4-byte pieces of eight rows per
warp store before); head layouts, whose elements do not form boxes, by each thread's stores.
Written in sessions 14 and 15 on CPU, first run on the H200 in session 15: FFN1 48.1 us against
eager's 48.2 (73.3 with the register stores; ``notebooks/results/session15-h200-2026-12-05/``).

Where the tiles take more than one wave, the CTAs are persistent (``WgmmaConfig.persistent``,
session 16): one an SM, each looping over tiles ``bx, bx + grid, ...`` through one ring, so the
producer loads the next tile's K steps while the consumers run this tile's chain and stores;
each consumer warpgroup then stages its output in a buffer of its own beside the ring. On the
H200 that took FFN1 4-6% off (``experiments/persistent_gemm.py``). ``pingpong`` has the two
consumer warpgroups take alternate 64-row tiles, mainloops in turn, so one's epilogue runs
beside the other's wgmmas; measured slower at every shape there (a 64-row tile reads its W
slice from L2 twice as often; 1.35x at 4096^3), it is an opt-in knob.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm.script import tirx as T

from ..errors import ComFuseError
from .chain import ACTIVATIONS, chain_value, np_chain, np_dtype
from . import row_exchange
from .staged_store import STAGE_BARRIER, box_cols, buffer_shape, drain, size, staged_at, staged_bytes, staged_store, tma_store
from .wgmma_mainloop import TMA_LOAD, Ring, WgmmaConfig, box_rows, consumer_sync, fragment, mainloop, roles, tensor_map
from .wgmma_postnorm import ACTIVE_CLUSTERS, FEW_CTAS_STAGES, SM_COUNT, few_ctas

#: Row statistics the kernel can write beside its output (:attr:`Elementwise.stats`).
STATS = ("", "layer_norm", "rms_norm", "softmax")
#: L2 of the H100 and H200 (50 MB), and the row tiles a group of a persistent walk takes where x
#: outgrows half of it beside a tile operand (:func:`group_rows`).
L2_BYTES = 50 * 2**20
GROUP_ROWS = 16
#: Least K a split-K CTA of the default takes (:func:`split_config`): 12 steps of 64, so that the
#: ring fills and the gather's cost (one cluster barrier, its partials pushed) stays small beside it.
SPLIT_MIN_K = 768
#: CTA tiles the default chooses from, with their throughput relative to 128 x 256 as plain
#: GEMMs at 4096^3 on the H200 (session 8, ``wgmma-gemm-ws.json``: 0.77x cuBLAS for 128 x 256;
#: 128 x 192 and 64 x 128 not measured there, interpolated).
TILES = {(128, 256): 1.0, (256, 128): 0.97, (128, 192): 0.97, (128, 128): 0.91, (64, 256): 0.91, (64, 128): 0.85}


@dataclass(frozen=True)
class Elementwise:
    """The fused group: ``out = chain(x @ w.T)`` in ``out_dtype``; ``operands`` are the added
    tensors' ``(dtype, is_tile)`` (a tile is ``[M, N]``, else ``[N]``).

    ``layout``: ``()`` writes ``out`` as ``[*rows, N]``; ``(dims, axes, shape)`` writes
    ``out.reshape(dims).transpose(axes).reshape(shape)`` instead, ``dims`` being the rows' dims
    followed by N split in two (BERT's heads: ``(B, S, H, D)``), so a multi-head attention's
    ``reshape -> permute_dims -> astype`` after the projection costs no kernel of its own
    (:mod:`tvm_comfuse.transform.offload_hopper_elementwise`)."""

    dtype: str = "float16"
    steps: tuple = ()
    operands: tuple = ()
    out_dtype: str = "float16"
    layout: tuple = ()
    #: Also write each row's statistics over each consumer warpgroup's ``wg_cols`` columns, as
    #: a ``[M, N / wg_cols, 2]`` float32 output after ``out``: ``"layer_norm"``, the part's mean
    #: and centred sum of squares; ``"rms_norm"``, its mean of squares (and 0); ``"softmax"``, its
    #: max and the sum of ``exp(value - max)``. What the norm of a row too wide for one cluster
    #: is applied from (:mod:`.split_norm`).
    stats: str = ""

    def problems(self) -> list:
        """What the kernel cannot compute of this description (empty if nothing)."""
        found = []
        ops = {s.op for s in self.steps} - {"cast", "add", *ACTIVATIONS}
        if ops:
            found.append(f"ops {sorted(ops)} in the chain (casts, adds and {', '.join(ACTIVATIONS)})")
        used = sorted(s.operand for s in self.steps if s.op == "add")
        if used != list(range(len(self.operands))):
            found.append(f"added operands {used} (each of the {len(self.operands)} operands once)")
        if self.layout:
            dims, axes, shape = self.layout
            if sorted(axes) != list(range(len(dims))) or len(dims) < 3 or math.prod(shape) != math.prod(dims):
                found.append(f"layout {self.layout} (dims: the rows' then N's two, axes a permutation of them, "
                             "shape as many elements)")
        if self.stats not in STATS:
            found.append(f"row statistics {self.stats!r} (one of {STATS})")
        elif self.stats and self.layout:
            found.append("row statistics of an output in a head layout (a row-major output only)")
        return found

    def out_shape(self, lead, n: int) -> tuple:
        """The shape the kernel writes for rows ``lead`` and ``n`` columns."""
        return tuple(self.layout[2]) if self.layout else (*lead, n)


def reference(spec: Elementwise, x, w, *operands):
    """NumPy model of what the kernel computes for ``spec`` (fp32 accumulation, each step
    rounded to its dtype): the oracle of the offload's CPU tests, which run it in the kernel's
    place."""
    f32 = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
    with np.errstate(over="ignore", invalid="ignore"):  # NaN and Inf inputs propagate (the fuzzer's)
        v = np_chain(f32(x).reshape(-1, x.shape[-1]) @ f32(w).T, spec.steps, [f32(p) for p in operands])
    if spec.layout:
        dims, axes, shape = spec.layout
        return v.reshape(dims).transpose(axes).reshape(shape).astype(np_dtype(spec.out_dtype))
    return v.reshape(*x.shape[:-1], v.shape[1]).astype(np_dtype(spec.out_dtype))


def layout_offset(layout: tuple, row, col):
    """The flat offset of element ``(row, col)`` of the GEMM's ``[M, N]`` result in the output
    written in ``layout`` (``Elementwise.layout``): ``row`` split over the rows' dims, ``col``
    over the last two, those indices permuted by ``axes`` and laid out row-major. Integers or
    TIR expressions alike."""
    dims, axes, _ = layout
    index, rest = [col // dims[-1], col % dims[-1]], row
    for d in reversed(dims[:-2]):
        index.insert(0, rest % d)
        rest = rest // d
    offset = 0
    for a in axes:
        offset = offset * dims[a] + index[a]
    return offset


def epilogue_value(spec: Elementwise, P, v, row, col, dtype: str | None = None, staged: dict | None = None):
    """``spec``'s chain on the fp32 accumulator ``v`` at ``(row, col)`` of the GEMM's result,
    held in ``dtype`` (default ``spec.out_dtype``); ``P`` are the operands' buffers (a tile
    read at ``(row, col)``, a vector at ``col``), ``staged`` the operands read elsewhere (index
    -> the element: a tile staged in shared memory). Plain Python, run while a kernel is parsed:
    one expression per accumulator."""
    dtype, staged = dtype or spec.out_dtype, staged or {}
    v, cur = chain_value(v, spec.steps, [d for d, _ in spec.operands],
                         lambda j: staged[j] if j in staged else P[j][row, col] if spec.operands[j][1] else P[j][col])
    return v if cur == dtype else T.cast(v if cur == "float32" else T.cast(v, "float32"), dtype)


def _padded(m: int, bm: int) -> int:
    """Rows of the CTAs' tiles over ``m`` rows: TMA reads the rows past M as zeros, and their
    results are not stored (any M works)."""
    return -(-m // bm) * bm


def problems(m: int, n: int, k: int, spec: Elementwise, cfg: WgmmaConfig | None = None) -> list:
    """What keeps the kernel from computing this group (empty if nothing). Any M (the last row
    tile may be partial); N and K multiples of the tile."""
    found = spec.problems()
    if spec.layout and (math.prod(spec.layout[0][:-2]) != m or math.prod(spec.layout[0][-2:]) != n):
        found.append(f"layout dims {spec.layout[0]} (the rows' dims, multiplying to M = {m}, then two multiplying to N = {n})")
    if cfg is None:
        cfg = default_config(m, n, k, spec)
        if cfg is None:
            return found + [f"M, N, K = {m}, {n}, {k}: no tile of {sorted(TILES)} divides N with K a multiple of 32"]
    if cfg.resident:
        found.append("a resident B (the post-norm kernel's, for short K: here B streams through the ring)")
    if cfg.multicast:
        found.append("multicast (the post-norm kernel's: its cluster's CTAs share A's rows; here a cluster splits K)")
    if cfg.pingpong and (cfg.bm != 64 or cfg.wg_n != 1):
        found.append(f"ping-pong with {cfg.bm} x {cfg.bn} tiles of {cfg.wg_n} column warpgroups (one warpgroup a tile: bm = 64, wg_n = 1)")
    if cfg.turns != 2:
        found.append(f"turns = {cfg.turns} (this kernel's ping-pong has two groups; more take turns on the post-norm kernel's resident W)")
    if cfg.stage_tiles and (cfg.pingpong or not stages_output(spec, cfg) or staged_tile(spec) is None):
        found.append(f"stage_tiles with {'ping-pong' if cfg.pingpong else 'persistent' if persistent(cfg) else 'one tile a CTA'}, "
                     f"{'a staged' if stages_output(spec, cfg) else 'an unstaged'} output and tile operands {spec.operands} (not "
                     f"ping-pong, an output staged beside the ring, a tile operand in the output's dtype {spec.out_dtype})")
    if cfg.tile_step and not cfg.stage_tiles:
        found.append(f"tile_step = {cfg.tile_step} without stage_tiles (when a staged tile operand loads)")
    if spec.stats and not stages_output(spec, cfg):
        found.append(f"row statistics with {cfg.bm} x {cfg.bn} tiles whose output is not staged (they are read back from "
                     "the staging buffers: a row-major output, one column warpgroup, whole 128-byte boxes)")
    if cfg.group_rows and not persistent(cfg):
        found.append(f"group_rows = {cfg.group_rows} with one tile a CTA (a persistent walk's groups)")
    if persistent(cfg) and (cfg.producer_warps or cfg.ctas_per_sm != 1):
        found.append("persistent CTAs with producer warps or two CTAs an SM (persistent CTAs are one an SM, with a producer warpgroup)")
    if cfg.split_k > 1 and cfg.stage_tiles:
        found.append("split_k with stage_tiles (one tile operand load for a cluster's CTAs: not built)")
    if cfg.split_k > 1 and cfg.smem_bytes + own_buffers_bytes(spec, cfg) * beside_ring(cfg) + gathered_bytes(cfg) > cfg.smem_limit:
        found.append(f"split_k = {cfg.split_k}: the ring and {gathered_bytes(cfg) // 1024} KiB of gathered partials over "
                     f"{cfg.smem_limit // 1024} KiB of shared memory (fewer stages or CTAs)")
    return found + cfg.problems(_padded(m, cfg.bm), n, k, spec.dtype)


def gathered_bytes(cfg: WgmmaConfig) -> int:
    """Shared memory rank 0 of a split-K cluster receives its peers' partials in (0 without split-K)."""
    return (cfg.split_k - 1) * cfg.consumers * 64 * cfg.wg_cols * 4


def gather_split(cfg: WgmmaConfig):
    """The tirx macro ``gather(G, acc, cw, tw, rank)`` of a split-K kernel (``cfg.split_k`` CTAs
    of a cluster, each a part of K): once its mainloop is done, thread ``tw`` of consumer
    warpgroup ``cw`` of rank ``q > 0`` pushes its fp32 partials (``acc``) into slot ``q - 1`` of
    rank 0's buffer ``G`` (``[split_k - 1, consumers, registers, 128 threads]``: conflict-free;
    ``st.shared::cluster``, which does not wait); after one cluster barrier (release / acquire)
    rank 0 adds them to its own ``acc`` in rank order (deterministic) and alone goes on to the
    epilogue. Why not through global memory (CUTLASS's serial split-K): the partials never leave
    the chip, and no CTA waits for one that is not resident (a cluster is co-scheduled). Why
    pushed, not read: a remote load waits its round trip, one after another (H100, session 32:
    a rank 0 reading 32 values from each peer took 1.4-3.5 us more than no split)."""
    acc_n, ranks = cfg.wg_cols // 2, cfg.split_k

    # pylint: disable=invalid-name
    @T.macro
    def gather(G, acc, cw, tw, rank):
        peer = T.alloc_local([1], "uint32")
        if rank > 0:
            T.ptx["mapa.shared::cluster.u32"](peer[0], T.cuda.cvta_generic_to_shared(G.ptr_to([rank - 1, cw, 0, tw])), T.uint32(0))
            for i in T.unroll(acc_n):
                T.ptx["st.shared::cluster.f32"](peer[0] + T.uint32(i * 128 * 4), acc[i])
        T.cuda.cluster_sync()  # the partials have landed (release / acquire)
        if rank == 0:
            for q in T.unroll(ranks - 1):
                for i in T.unroll(acc_n):
                    acc[i] = acc[i] + G[q, cw, i, tw]

    return gather


def default_config(m: int, n: int, k: int, spec: Elementwise = Elementwise()) -> WgmmaConfig | None:
    """The tile of :data:`TILES` whose whole waves over the SMs take least time (its waves times
    its work over its throughput), on the deepest ring (up to 4 stages of 64) that fits; None
    if no tile divides N (and K). Where its tiles take more than one wave and the output is
    staged, the CTAs are persistent, on the deepest ring of at least three stages that fits
    beside the staging buffers: on the H200 (session 16, ``experiments/persistent_gemm.py``)
    that took FFN1 from 74.9 to 71.8 us at BERT-large and from 48.0 to 44.9 at BERT-base, and
    the plain 4096^3 GEMM from 214.1 to 210.7, while at one wave (the projections) there is no
    next tile to load ahead and 128 x 192 tiles without persistence stayed fastest. Persistent
    walks go in groups of row tiles where :func:`group_rows` says, and load the tile operand (the
    residual) by TMA into the staging buffers while the mainloop runs (``stage_tiles``) where
    there is one: on the H200 (session 19, ``experiments/split_norm.py --breakdown``) that took the
    bias + residual GEMM from 453.1 to 437.8 us at 8192 x 4096 -> 4096 (the plain GEMM: 421.0),
    139.9 to 131.9 at 4096 x 1024 -> 8192 and 35.5 to 31.9 at 16384 x 256 -> 1024: per-thread
    loads in the accumulator's layout filled the load/store queue (``lg_throttle`` 5.0 of 16.4
    cycles an instruction, gone when staged). On the H100 (session 20) it took the split
    post-norm from 494.8 to 491.0 us at 8192 x 4096 -> 4096 and from 199.7 to 186.6 at 4096 x
    1024 -> 8192.

    At one wave the tiles stay one a CTA and the tile operand is staged too, its buffers beside
    the ring (on the deepest ring of at least three stages that leaves room), its load issued
    once the ring is full (``tile_step = stages``): every CTA of the wave fills its ring at once,
    and a residual loaded beside those first loads delays them. On the H100 (session 23,
    ``experiments/residual_load.py``, device us, against per-thread loads) that took the
    one-kernel split post-norm (:mod:`.row_exchange`) from 33.8 to 32.1 at 4096 x 3072 -> 768,
    14.8 to 13.6 at 4096 x 768 -> 768 and 20.9 to 19.8 at 4096 x 1024 -> 1024; at 4096 x 4096 ->
    1024, where 128 x 256 tiles keep three stages of four, 53.9 against 54.0 (the split's GEMM
    alone: 51.6 against 52.5). Loaded before the first K step instead: 32.9, 14.2, 20.0, 54.6.

    Where the chosen tiles fill under half the SMs (a few rows: :func:`few_tiles`), the default
    takes 64 x 64 tiles, K split over a cluster where each split keeps enough of it
    (:func:`split_config`), else its tile on a deeper ring (:func:`deeper`; session 32)."""
    best = None
    for (bm, bn), rate in TILES.items():
        for bk in (64, 32):
            for stages in (4, 3, 2):
                cfg = WgmmaConfig(bm, bn, stages, bk)
                if not cfg.problems(_padded(m, bm), n, k, spec.dtype):
                    cost = math.ceil(_padded(m, bm) // bm * (n // bn) / SM_COUNT) * bm * bn / rate
                    if best is None or cost < best[0]:
                        best = (cost, cfg)
                    break
            else:
                continue
            break
    if best is None:
        return None
    cfg = best[1]
    split = split_config(m, n, k, spec, cfg)
    if split is not None:
        return split
    cfg = deeper(m, n, k, spec, cfg)
    if _padded(m, cfg.bm) // cfg.bm * (n // cfg.bn) > SM_COUNT:
        for bk in (64, 32):
            for stages in (4, 3):
                looped = dataclasses.replace(cfg, stages=stages, bk=bk, persistent=True)
                if not looped.problems(_padded(m, cfg.bm), n, k, spec.dtype) and stages_output(spec, looped):
                    looped = dataclasses.replace(looped, group_rows=group_rows(m, k, spec, looped))
                    return staging(looped) if staged_tile(spec) is not None else looped
    if staged_tile(spec) is not None:
        for stages in range(cfg.stages, 2, -1):
            staged = staging(dataclasses.replace(cfg, stages=stages))
            if not problems(m, n, k, spec, staged):
                return staged
    return cfg


def few_tiles(m: int, n: int, cfg: WgmmaConfig) -> bool:
    """Whether ``cfg``'s tiles (one a CTA) are few (:func:`~.wgmma_postnorm.few_ctas`)."""
    return few_ctas(_padded(m, cfg.bm) // cfg.bm * (n // cfg.bn))


def _deepest(m: int, n: int, k: int, spec: Elementwise, cfg: WgmmaConfig, least: int) -> WgmmaConfig | None:
    """``cfg`` on the deepest ring of at least ``least`` stages, up to :data:`FEW_CTAS_STAGES` and
    no more than its K steps, that the kernel can run, or None."""
    for stages in range(min(FEW_CTAS_STAGES, k // cfg.split_k // cfg.bk), least - 1, -1):
        found = dataclasses.replace(cfg, stages=stages)
        if not problems(m, n, k, spec, found):
            return found
    return None


def split_config(m: int, n: int, k: int, spec: Elementwise, cfg: WgmmaConfig) -> WgmmaConfig | None:
    """Where ``cfg``'s tiles are few (:func:`few_tiles`), the configuration of 64 x 64 tiles the
    default takes instead, or None: K split over the most CTAs of a cluster (8, 4, 2 or none:
    ``WgmmaConfig.split_k``) that leave each at least :data:`SPLIT_MIN_K` of K and the grid one
    wave (as many clusters as run at once: a post-norm's one-kernel form needs every CTA
    resident), on the deepest ring (up to :data:`~.wgmma_postnorm.FEW_CTAS_STAGES`) that fits beside rank 0's
    gathered partials; without a split, where the 64 x 64 tiles are one wave at most (a
    post-norm's split GEMM, ``spec.stats``: only where they are still few, since its tile count
    also routes the group between the cluster kernel and the one-kernel split form,
    :func:`~tvm_comfuse.transform.offload_hopper.fills_a_wave`, measured at 4096 rows only).
    Measured on the H100 (``experiments/small_m.py``, w cold in L2 as in a model, device us):
    BERT-base's FFN2 post-norm at 128 rows (128 x 3072 -> 768) 10.3 on 4-way split-K against
    the cluster kernel's 18.3 (torch.compile 10.1); its Q/K/V GEMM (128 x 768 -> 768) 3.9 on
    8-stage 64 x 64 tiles against the default's 64 x 128 on 4 stages, 5.3 (cuBLAS 3.8; session
    32); its FFN1 GEMM (128 x 768 -> 3072, 96 such tiles) 4.4 on them against 4.8 on 8-stage
    64 x 128 tiles in session 32 and 4.42 against 4.77 in session 34 (cuBLAS 4.79)."""
    if not few_tiles(m, n, cfg) or n % 64:
        return None
    tiles = _padded(m, 64) // 64 * (n // 64)
    for split in (8, 4, 2, 1):
        if k % (split * 64) or k // split < min(SPLIT_MIN_K, k) or tiles * split > SM_COUNT or split > 1 and tiles > ACTIVE_CLUSTERS[split]:
            continue
        if split == 1 and not few_ctas(tiles) and (spec.stats or tiles > SM_COUNT):
            return None
        found = _deepest(m, n, k, spec, WgmmaConfig(64, 64, 2, 64, split_k=split), 2)
        if found is not None:
            return found
    return None


def deeper(m: int, n: int, k: int, spec: Elementwise, cfg: WgmmaConfig) -> WgmmaConfig:
    """``cfg`` on the deepest ring up to :data:`~.wgmma_postnorm.FEW_CTAS_STAGES` (no deeper than
    K's steps) where its tiles are few (:func:`few_tiles`): one CTA's loads in flight bound its
    bandwidth. Measured on
    the H100 (session 32, ``experiments/small_m.py``, w cold): 64 x 128 tiles at 128 x 768 ->
    768 took 4.4 us on 8 stages against 5.3 on 4, at 128 x 768 -> 3072 4.8 against 5.8."""
    return (few_tiles(m, n, cfg) and _deepest(m, n, k, spec, cfg, cfg.stages + 1)) or cfg


def staging(cfg: WgmmaConfig) -> WgmmaConfig:
    """``cfg`` loading its tile operand by TMA into the staging buffers (``stage_tiles``): one tile
    a CTA once its ring is full (``tile_step = stages``, session 23), persistent CTAs before the
    first K step (sessions 19-20: measured so). What the default and the tuning space stage."""
    return dataclasses.replace(cfg, stage_tiles=True, tile_step=0 if persistent(cfg) else cfg.stages)


def group_rows(m: int, k: int, spec: Elementwise, cfg: WgmmaConfig) -> int:
    """``WgmmaConfig.group_rows`` for a persistent kernel: :data:`GROUP_ROWS` where x (``m x k``)
    takes more than half of L2 and the chain streams a tile operand (the residual) beside it, else
    0 (whole columns). Measured on the H100 (session 18, ``experiments/split_norm.py
    --breakdown``): the split post-norm's GEMM at 8192 x 4096 -> 4096 took 446.9 us against 475.7
    walking whole columns (every wave read all of x's 64 MB); the plain GEMM there, 428.2 against
    422.0, and where x fits L2 (4096 x 1024 -> 8192, 16384 x 256 -> 1024) either way within 3%."""
    big = m * k * size(spec.dtype) > L2_BYTES // 2
    return GROUP_ROWS if persistent(cfg) and big and any(tile for _, tile in spec.operands) else 0


def staged_tile(spec: Elementwise) -> int | None:
    """The tile operand a kernel with ``WgmmaConfig.stage_tiles`` loads into its staging
    buffers (the first in the output's dtype: it lands in the output's swizzled layout), or None."""
    return next((j for j, (d, tile) in enumerate(spec.operands) if tile and d == spec.out_dtype), None)


def persistent(cfg: WgmmaConfig) -> bool:
    """Whether the kernel's CTAs loop over tiles (ping-pong groups always do)."""
    return cfg.persistent or cfg.pingpong


def tile_walk(cfg: WgmmaConfig, wg):
    """How consumer warpgroup ``wg`` (from 1; an int, or the kernel's warpgroup index) of a
    persistent CTA walks the CTA's tiles: ``(first, step, cw)``, taking the CTA's tiles ``first,
    first + step, ...`` (of ``bx, bx + grid, ...``) as warpgroup ``cw`` of each. Ping-pong
    groups take alternate tiles whole; otherwise every warpgroup takes every tile, its own part
    of it. One definition for the kernel's loops and the CPU test that every tile is computed
    once (session 16's first ping-pong kernel wrote its second group's tiles 64 rows low)."""
    return (wg - 1, 2, 0) if cfg.pingpong else (0, 1, wg - 1)


def tile_origin(cfg: WgmmaConfig, tiles_m: int, tiles_n: int, t, cw):
    """``(row, col)`` of warpgroup ``cw``'s ``64 x wg_cols`` part of tile ``t`` of a persistent
    kernel of ``tiles_m x tiles_n`` tiles. Tiles are numbered down the row tiles first (a wave's
    CTAs share a few column slices of w), in groups of ``cfg.group_rows`` row tiles (all of them
    where 0) taken column slice by column slice (the last group has what rows are left).
    Integers or TIR expressions alike."""
    group = cfg.group_rows if 0 < cfg.group_rows < tiles_m else tiles_m
    if group == tiles_m:
        tile_row, tile_col = t % tiles_m, t // tiles_m
    else:
        first = t // (group * tiles_n) * group
        rows = group
        if tiles_m % group:  # the last group has the rows left
            left = tiles_m - first
            rows = min(left, group) if isinstance(left, int) else T.min(left, group)
        at = t - first * tiles_n  # the tile's index in its group
        tile_row, tile_col = first + at % rows, at // rows
    return tile_row * cfg.bm + cw // cfg.wg_n * 64, tile_col * cfg.bn + cw % cfg.wg_n * cfg.wg_cols


def own_buffers_bytes(spec: Elementwise, cfg: WgmmaConfig) -> int:
    """Shared memory of the staging buffers beside the ring (:func:`beside_ring`), one ``64 x
    wg_cols`` tile of the output for each consumer warpgroup."""
    return staged_bytes(64 * cfg.consumers, cfg.wg_cols, spec.out_dtype)


def beside_ring(cfg: WgmmaConfig) -> bool:
    """Whether the output is staged in buffers beside the ring, not in the ring once the mainloop
    is done: where CTAs loop over tiles (the ring is never free), or where a tile operand lands
    in the buffers while the mainloop runs (``stage_tiles``)."""
    return persistent(cfg) or cfg.stage_tiles


def stages_output(spec: Elementwise, cfg: WgmmaConfig) -> bool:
    """Whether the output can leave by TMA stores (:mod:`.staged_store`): a row-major output (not
    a head layout, whose elements do not form boxes) of whole 128-byte boxes, staged in the
    ring's shared memory once every consumer warpgroup's mainloop is done (one tile a CTA), or
    in a buffer of each consumer warpgroup's own beside it (:func:`beside_ring`)."""
    fits = (cfg.smem_bytes + own_buffers_bytes(spec, cfg) <= cfg.smem_limit if beside_ring(cfg)
            else staged_bytes(cfg.bm, cfg.bn, spec.out_dtype) <= cfg.smem_bytes)
    return not spec.layout and cfg.wg_n == 1 and cfg.wg_cols % box_cols(spec.out_dtype) == 0 and fits


def statistics(spec: Elementwise, cfg: WgmmaConfig, m: int):
    """The tirx macro ``row_stats(stats, O, wg, tw, row0, col0)`` of a kernel with
    ``spec.stats``: once thread ``tw`` of consumer warpgroup ``wg`` has staged its share of the
    ``64 x wg_cols`` output part at ``(row0, col0)`` in its buffer of ``O`` (the values the graph's
    norm reads), it reads them back and writes each of its two rows' statistics over the part to
    ``stats[row, col0 / wg_cols]``: the sum of its ``wg_cols / 4`` values, then its quad's
    (butterfly shuffles), for the mean (of squares: RMSNorm's); then LayerNorm's centred sum of
    squares the same way (two passes: no cancellation). Softmax's: the max the same way (a
    max, not a sum), then the sum of ``exp(value - max)``.
    Why read back: the values die as they are staged; kept in registers for the statistics, all
    of a part's accumulators and residual loads are live at once and ptxas spills (60 bytes a
    thread at 8192 x 4096 -> 4096 with a residual). A no-op without ``spec.stats``."""
    acc_n, cols, wanted = cfg.wg_cols // 2, cfg.wg_cols, bool(spec.stats)
    rms, softmax = spec.stats == "rms_norm", spec.stats == "softmax"
    wide = lambda v: T.cast(v, "float32") if spec.out_dtype != "float32" else v  # noqa: E731

    def first(total, v):  # the first pass's reduction: a sum (of squares for RMSNorm), softmax's max
        return T.max(total, v) if softmax else total + (v * v if rms else v)

    def second(v, mean):  # the second pass's terms, about the first's result
        return T.exp(v - mean) if softmax else (v - mean) * (v - mean)

    # pylint: disable=invalid-name
    @T.macro
    def quad_reduce(part, j, combine):  # part[j] reduced over the four lanes of a quad (which hold a row's values between them)
        for lanes in T.unroll(2):
            part[j] = combine(part[j], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), part[j], 1 << lanes, 32, 32))

    @T.macro
    def row_stats(stats, O, wg, tw, row0, col0):
        if wanted:
            part = T.alloc_local([4], "float32")
            for h in T.unroll(2):  # the thread's rows: accumulators 4q + 2h + (0, 1)
                part[h] = T.min_value("float32") if softmax else T.float32(0)
                part[2 + h] = T.float32(0)
                for q in T.unroll(acc_n // 4):
                    for j in T.unroll(2):
                        v = T.meta_var(wide(O[(0, wg, *staged_at(fragment(tw, 4 * q + 2 * h + j), spec.out_dtype))]))
                        part[h] = first(part[h], v)
                quad_reduce(part, h, T.max if softmax else lambda a, b: a + b)
                if not softmax:
                    part[h] = part[h] * T.float32(1.0 / cols)
                if not rms:
                    for q in T.unroll(acc_n // 4):
                        for j in T.unroll(2):
                            v = T.meta_var(wide(O[(0, wg, *staged_at(fragment(tw, 4 * q + 2 * h + j), spec.out_dtype))]))
                            part[2 + h] = part[2 + h] + second(v, part[h])
                    quad_reduce(part, 2 + h, lambda a, b: a + b)
            if tw % 4 == 0:
                for h in T.unroll(2):
                    row = T.meta_var(row0 + fragment(tw, 2 * h)[0])
                    if row < m:
                        stats[row, col0 // cols, 0] = part[h]
                        stats[row, col0 // cols, 1] = part[2 + h]

    return row_stats


def wgmma_elementwise(m: int, n: int, k: int, spec: Elementwise = Elementwise(), cfg: WgmmaConfig | None = None, lead=None,
                      stage: bool | None = None, norm=None):
    """The fused kernel, a tirx PrimFunc for sm_90a with parameters ``(x[*lead, k], w[n, k],
    operand 0, ..., out)``, ``out`` of ``spec.out_shape(lead, n)``: ``lead`` are the row dimensions (``(m,)`` by default;
    ``(B, S)`` for 3-D activations, read as ``B * S`` rows through 2-D views of the same memory).
    Static shapes, any M, N a multiple of the tile (:func:`problems`). ``stage``: the output
    staged in shared memory and stored by TMA (None: where :func:`stages_output`; False: each
    thread stores its accumulators, as the head layouts always are).

    ``norm`` (a :class:`~.wgmma_postnorm.PostNorm` whose statistics ``spec.stats`` are): the
    kernel also normalises each row, its statistics combined across the row tile's CTAs
    (:mod:`.row_exchange`), and writes ``out`` as the norm; the parameters are then ``(x, w,
    operands..., gamma, beta (LayerNorm), flags[row tiles, 2] int32, out, stats)``."""
    found = problems(m, n, k, spec, cfg)
    cfg = cfg or (None if found else default_config(m, n, k, spec))
    if norm is not None and not found:
        found = row_exchange.problems(m, n, cfg, norm, spec.out_dtype)
        found += [] if spec.stats == norm.norm else [f"row statistics {spec.stats!r} for a {norm.norm}"]
    if found:
        raise ComFuseError("wgmma GEMM + elementwise cannot take " + "; ".join(found))
    lead = tuple(lead or (m,))
    if math.prod(lead) != m:
        raise ComFuseError(f"wgmma GEMM + elementwise: row dimensions {lead} do not multiply to M = {m}")
    bm, bn, acc_n = cfg.bm, cfg.bn, cfg.wg_cols // 2
    ragged = m % bm != 0
    # loaded into the staging buffers (problems checked it can be)
    tile_in = staged_tile(spec) if cfg.stage_tiles else None
    box, tile_bytes = box_cols(spec.out_dtype), 64 * cfg.wg_cols * size(spec.out_dtype)

    # pylint: disable=invalid-name
    @T.macro
    def load_tile(tile_map, O, rfull, tw, slot, row0, col0):  # warpgroup `slot`'s part of the tile operand, into its buffer
        T.ptx["bar.sync"](T.uint32(STAGE_BARRIER) + T.cast(slot, "uint32"), 128)  # no thread still reads the buffer
        if tw == 0:
            T.ptx["cp.async.bulk.wait_group.read"](0)  # nor does the warpgroup's last TMA store
            T.ptx["fence.proxy.async.shared::cta"]()
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(rfull.ptr_to([slot]), T.uint32(tile_bytes))
            for b in T.unroll(cfg.wg_cols // box):
                T.ptx[TMA_LOAD](O.ptr_to([0, slot, b, 0, 0]), T.address_of(tile_map), col0 + b * box, row0, rfull.ptr_to([slot]))

    @T.macro
    def load_early(extra):  # the tile operand's load where tile_step is 0: before the mainloop
        if cfg.tile_step == 0:
            load_tile(extra[0], extra[1], extra[2], extra[3], extra[4], extra[5], extra[6])

    @T.macro
    def during(kk, extra):  # else in the K loop, before K step tile_step (or the last)
        if kk == min(cfg.tile_step, k // cfg.bk - 1):
            load_tile(extra[0], extra[1], extra[2], extra[3], extra[4], extra[5], extra[6])

    ks = k // cfg.split_k  # each split-K CTA's part of K
    produce, consume = mainloop(cfg, ks, spec.dtype, during if tile_in is not None and cfg.tile_step > 0 else None)
    gather = gather_split(cfg)
    init = Ring(cfg.stages, cfg.slot_readers).init()
    producer, consumer = roles(cfg)
    maps = {"x": tensor_map(m, k, box_rows(bm), cfg.bk, spec.dtype), "w": tensor_map(n, k, box_rows(bn), cfg.bk, spec.dtype)}
    staged = stages_output(spec, cfg) if stage is None else stage
    # one dynamic buffer (tirx allows one): the ring (per slot the A tile's bm rows, then B's bn),
    # then, beside it, each consumer warpgroup's staging buffer (1 KiB aligned: the ring's slots are)
    ring_elems = cfg.stages * (bm + bn) * cfg.bk
    own_elems = own_buffers_bytes(spec, cfg) // size(spec.dtype) if staged and beside_ring(cfg) else 0
    gather_elems = gathered_bytes(cfg) // size(spec.dtype)  # after the ring: split-K's partials
    if staged and not stages_output(spec, cfg) or spec.stats and not staged:
        raise ComFuseError(f"wgmma GEMM + elementwise: the output cannot be staged for TMA stores ({spec.layout or spec.out_dtype}, "
                           f"{bm} x {bn} tiles in a {cfg.smem_bytes // 1024} KiB ring, row statistics {spec.stats!r}); "
                           "pass stage=None")
    if staged:
        maps["out"] = tensor_map(m, n, 64, box_cols(spec.out_dtype), spec.out_dtype)
    if tile_in is not None:
        maps[f"p{tile_in}"] = tensor_map(m, n, 64, box_cols(spec.out_dtype), spec.out_dtype)
    sync = consumer_sync(cfg)

    @T.macro
    def init_tiles(rfull, thread):  # the tile operand's mbarriers, one a consumer warpgroup
        if thread == 0:  # before the ring's init: its fence and CTA barrier cover these
            for c in T.unroll(cfg.consumers):
                T.ptx.mbarrier.init.shared.b64(rfull.ptr_to([c]), T.uint32(1))
    # rows past M (the last tile's, on TMA's zeros) read a tile operand at row M - 1; the TMA store clips them
    def staged_value(P, v, row, col, here):  # (the staged tile operand: `here`, where the value goes)
        return epilogue_value(spec, P, v, T.min(row, m - 1) if ragged else row, col, staged={} if tile_in is None else {tile_in: here})

    # with a norm, the sum is staged, normalised in place once the row tile's statistics are in, then stored
    store = staged_store(cfg.wg_cols, spec.out_dtype, staged_value, issue=norm is None)
    wait_stores = drain()
    row_stats = statistics(spec, cfg, m)
    if norm is not None:
        send = tma_store(cfg.wg_cols, spec.out_dtype)
        normalize = row_exchange.normalize(norm, cfg, m, n, lambda at: staged_at(at, spec.out_dtype))

    def at(row, col):
        """Where ``(row, col)`` of the GEMM's result lies in the output (Python, at parse time)."""
        return (layout_offset(spec.layout, row, col),) if spec.layout else (row, col)

    @T.macro
    def register_store(out, P, acc, tw, row0, col0):  # each thread its accumulators, from (row0, col0) of the result
        for q in T.unroll(acc_n // 2):  # accumulators 2q, 2q + 1: one row's adjacent columns
            for j in T.vectorized(2):
                lrow, lcol = T.meta_var(fragment(tw, 2 * q + j))
                row, col = T.meta_var((row0 + lrow, col0 + lcol))
                if ragged:  # the last row tile's rows past M: computed on TMA's zeros, not stored
                    if row < m:
                        out[at(row, col)] = epilogue_value(spec, P, acc[2 * q + j], row, col)
                else:
                    out[at(row, col)] = epilogue_value(spec, P, acc[2 * q + j], row, col)

    @T.macro
    def body(x_map, w_map, out_map, P, out, stats, tile_map, gamma, beta, flags):
        if cfg.ctas_per_sm > 1:  # __launch_bounds__(threads, ctas_per_sm)
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": cfg.ctas_per_sm})
        if cfg.split_k > 1:  # a cluster of split_k CTAs a tile, the tiles numbered as below
            tile = T.cluster_id([_padded(m, bm) // bm * (n // bn)])
            rank = T.cta_id_in_cluster([cfg.split_k])
            if norm is not None:
                bx, by = T.meta_var((tile // (n // bn), tile % (n // bn)))
            else:
                bx, by = T.meta_var((tile % (_padded(m, bm) // bm), tile // (_padded(m, bm) // bm)))
        elif norm is not None:  # a row tile's CTAs consecutive in the grid (they wait for each other)
            by, bx = T.cta_id([n // bn, _padded(m, bm) // bm])
            rank = 0
        else:
            bx, by = T.cta_id([_padded(m, bm) // bm, n // bn])
            rank = 0
        if cfg.producer_warps > 0:  # producer warps after the consumers: role 0 all the same, its threads 0, 1, ...
            warp = T.warp_id([cfg.threads // 32])
            lane = T.lane_id([32])
            wg = T.meta_var((warp // 4 + 1) % (cfg.consumers + 1))
            tw = T.meta_var(warp % 4 * 32 + lane)
        else:
            wg = T.warpgroup_id([cfg.consumers + 1])
            tw = T.thread_id_in_wg([128])
        if cfg.stage_tiles:  # the staging buffers beside the ring: the tile operand lands there during the mainloop
            flat = T.alloc_shared([ring_elems + own_elems], spec.dtype, scope="shared.dyn", align=1024)
            S = T.decl_buffer([cfg.stages, bm + bn, cfg.bk], spec.dtype, data=flat.data, scope="shared.dyn")
            O = T.decl_buffer(buffer_shape(1, cfg.consumers, cfg.wg_cols, spec.out_dtype), spec.out_dtype, data=flat.data,
                              elem_offset=ring_elems * 2 // size(spec.out_dtype), scope="shared.dyn")
            rfull = T.alloc_shared([cfg.consumers], "uint64", scope="shared", align=8)  # [warpgroup]: its tile operand landed
            init_tiles(rfull, wg * 128 + tw)
        else:  # the output staged in the ring once it is free (split-K's partials land beside it)
            flat = T.alloc_shared([ring_elems + gather_elems], spec.dtype, scope="shared.dyn", align=1024)
            S = T.decl_buffer([cfg.stages, bm + bn, cfg.bk], spec.dtype, data=flat.data, scope="shared.dyn")
            O = T.decl_buffer(buffer_shape(1, cfg.consumers, cfg.wg_cols, spec.out_dtype), spec.out_dtype, data=flat.data, scope="shared.dyn")
            G = T.decl_buffer([max(1, cfg.split_k - 1), cfg.consumers, acc_n, 128], "float32", data=flat.data,
                              elem_offset=ring_elems * size(spec.dtype) // 4, scope="shared.dyn")
        full = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        init(full, empty, wg * 128 + tw)
        if cfg.split_k > 1:
            T.cuda.cluster_sync()  # every CTA of the cluster has started before a peer pushes into it
        row0, col0 = T.meta_var((bx * bm + (wg - 1) // cfg.wg_n * 64, by * bn + (wg - 1) % cfg.wg_n * cfg.wg_cols))
        if wg == 0:
            producer()
            if tw == 0:
                produce(x_map, w_map, S, S, full, empty, bx * bm, by * bn, 0, rank * ks)
        elif staged:
            consumer()
            if cfg.stage_tiles:  # its part of the tile operand loads while the mainloop runs (during)
                load_early((tile_map, O, rfull, tw, wg - 1, row0, col0))
                consume(S, S, full, empty, acc, da, db, wg - 1, tw, 0, (tile_map, O, rfull, tw, wg - 1, row0, col0))
                T.cuda.mbarrier_wait(rfull.ptr_to([wg - 1]), 0)
            else:
                consume(S, S, full, empty, acc, da, db, wg - 1, tw, 0)
                if cfg.split_k > 1:
                    gather(G, acc, wg - 1, tw, rank)
                sync(0)  # every consumer warpgroup's wgmmas are done and every load has landed: the ring is free
            if rank == 0:
                store(out_map, O, P, acc, wg - 1, tw, row0, col0, 0)
                row_stats(stats, O, wg - 1, tw, row0, col0)
                if norm is not None:
                    normalize(O, stats, flags, gamma, beta, wg - 1, tw, row0, col0, bx)
                    send(out_map, O, wg - 1, tw, row0, col0, 0)
                wait_stores(tw)
        else:
            consumer()
            consume(S, S, full, empty, acc, da, db, wg - 1, tw, 0)
            if cfg.split_k > 1:
                gather(G, acc, wg - 1, tw, rank)
            if rank == 0:
                register_store(out, P, acc, tw, row0, col0)

    # persistent CTAs: one an SM, tiles t = bx, bx + grid, ... (tile_walk, tile_origin); each
    # consumer warpgroup stages into a buffer of its own
    tiles_m, tiles_n, kt = _padded(m, bm) // bm, n // bn, k // cfg.bk
    tiles = tiles_m * tiles_n
    grid = min(tiles, SM_COUNT)
    # a buffer of its own, written once a tile (in place over its staged tile operand, if any)
    loop_store = staged_store(cfg.wg_cols, spec.out_dtype, staged_value, buffers=1)

    @T.macro
    def finish(out_map, O, P, out, stats, acc, slot, cw, tw, t):  # warpgroup cw's part of tile t, staged in buffer `slot`
        row0, col0 = T.meta_var(tile_origin(cfg, tiles_m, tiles_n, t, cw))
        if staged:
            loop_store(out_map, O, P, acc, slot, tw, row0, col0, 0)
            row_stats(stats, O, slot, tw, row0, col0)
        else:
            register_store(out, P, acc, tw, row0, col0)

    @T.macro
    def loop_body(x_map, w_map, out_map, P, out, stats, tile_map, _gamma, _beta, _flags):  # (no norm: one tile a CTA)
        bx = T.cta_id([grid])
        wg = T.warpgroup_id([cfg.consumers + 1])
        tw = T.thread_id_in_wg([128])
        # one dynamic buffer (tirx allows one): the ring (per slot the A tile's bm rows, then B's
        # bn), then each consumer warpgroup's staging buffer (1 KiB aligned: the ring's slots are)
        flat = T.alloc_shared([ring_elems + own_elems], spec.dtype, scope="shared.dyn", align=1024)
        S = T.decl_buffer([cfg.stages, bm + bn, cfg.bk], spec.dtype, data=flat.data, scope="shared.dyn")
        O = T.decl_buffer(buffer_shape(1, cfg.consumers, cfg.wg_cols, spec.out_dtype), spec.out_dtype, data=flat.data,
                          elem_offset=ring_elems * 2 // size(spec.out_dtype), scope="shared.dyn")
        full = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        if cfg.pingpong:
            turn = T.alloc_shared([2], "uint64", scope="shared", align=8)  # [group]: the other group's mainloop is done
            if wg * 128 + tw == 0:  # before the ring's init: its fence and CTA barrier cover these
                for j in T.unroll(2):
                    T.ptx.mbarrier.init.shared.b64(turn.ptr_to([j]), T.uint32(1))
        if cfg.stage_tiles:
            rfull = T.alloc_shared([cfg.consumers], "uint64", scope="shared", align=8)  # [warpgroup]: its tile operand landed
            init_tiles(rfull, wg * 128 + tw)
        init(full, empty, wg * 128 + tw)
        iters = T.meta_var((tiles - 1 - bx) // grid + 1)  # tiles bx, bx + grid, ...
        if wg == 0:
            producer()
            if tw == 0:
                for it in T.serial(iters):
                    row, col = T.meta_var(tile_origin(cfg, tiles_m, tiles_n, bx + it * grid, 0))
                    produce(x_map, w_map, S, S, full, empty, row, col, it * kt)
        else:
            consumer()
            first, step, cw = T.meta_var(tile_walk(cfg, wg))
            for j in T.serial((iters - first + step - 1) // step):
                if cfg.pingpong:  # the groups' mainloops alternate: wait until the other's previous tile has left the ring
                    if j + wg - 2 >= 0:
                        T.cuda.mbarrier_wait(turn.ptr_to([wg - 1]), (j + wg - 2) % 2)
                if cfg.stage_tiles:  # its part of the tile operand loads while the mainloop runs (during)
                    row0, col0 = T.meta_var(tile_origin(cfg, tiles_m, tiles_n, bx + (first + step * j) * grid, cw))
                    load_early((tile_map, O, rfull, tw, wg - 1, row0, col0))
                    consume(S, S, full, empty, acc, da, db, cw, tw, (first + step * j) * kt, (tile_map, O, rfull, tw, wg - 1, row0, col0))
                else:
                    consume(S, S, full, empty, acc, da, db, cw, tw, (first + step * j) * kt)
                if cfg.pingpong:
                    if tw == 0:
                        T.ptx.mbarrier.arrive.shared.b64(turn.ptr_to([2 - wg]), T.uint32(1))
                if cfg.stage_tiles:
                    T.cuda.mbarrier_wait(rfull.ptr_to([wg - 1]), j % 2)
                finish(out_map, O, P, out, stats, acc, wg - 1, cw, tw, bx + (first + step * j) * grid)
            if staged:
                wait_stores(tw)

    # the parameter list depends on the operands: the signature is generated, the body is the macro above
    signature = [("x", (*lead, k), spec.dtype, (m, k)), ("w", (n, k), spec.dtype, None)]
    signature += [(f"p{j}", (*lead, n) if tile else (n,), d, (m, n) if tile else None) for j, (d, tile) in enumerate(spec.operands)]
    params = [] if norm is None else list(norm.params)
    signature += [(p, (n,), norm.params_dtype, None) for p in params]
    signature += [] if norm is None else [("flags", (tiles_m, 2), "int32", None)]
    signature += [("out", spec.out_shape(lead, n), spec.out_dtype, (m * n,) if spec.layout else (m, n))]
    signature += [("stats", (m, n // cfg.wg_cols, 2), "float32", None)] if spec.stats else []
    lines = [f"def gemm_elementwise({', '.join(f'{p}_h: T.handle' for p, *_ in signature)}):"]
    lines += [f"    {p}_p = T.match_buffer({p}_h, {shp}, {dt!r}, align=16)" for p, shp, dt, _ in signature]
    lines += [f"    {p}_map: T.let[T.handle('tensormap')] = T.tvm_stack_alloca('tensormap', 1)" for p in maps]
    lines += [f"    encode_{p}({p}_map, {p}_p.data)" for p in maps] + ["    T.device_entry()"]
    lines += [f"    {p} = T.decl_buffer({view}, {dt!r}, data={p}_p.data)" if view else f"    {p} = {p}_p" for p, _, dt, view in signature[2:]]
    operands = ", ".join(f"p{j}" for j in range(len(spec.operands)))
    extra = "None, None, None" if norm is None else ", ".join(p if p in params else "None" for p in ("gamma", "beta")) + ", flags"
    lines += [f"    body(x_map, w_map, {'out_map' if staged else 'None'}, ({operands}{',' if operands else ''}), out, "
              f"{'stats' if spec.stats else 'None'}, {'None' if tile_in is None else f'p{tile_in}_map'}, {extra})"]
    return tvm.script.from_source("@T.prim_func\n" + "\n".join(lines), extra_vars={
        "T": T, "body": loop_body if persistent(cfg) else body, **{f"encode_{p}": enc for p, enc in maps.items()}})
