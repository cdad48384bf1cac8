"""The Hopper mainloop (issue 8): GEMM tiles on ``wgmma.mma_async`` fed by TMA, in TVM's tirx.

Why a second mainloop: the mma.sync one (:mod:`.mma_mainloop`) tops out near 0.55x of cuBLAS on
the H200 (428 TFLOP/s as a plain 4096^3 GEMM), and the fused kernels inherit that ceiling.
sm_90a's warpgroup MMA reads both operands straight from shared memory through 64-bit matrix
descriptors (no ldmatrix, no register staging), one instruction per ``64 x n x 16`` step of a
whole warpgroup (128 threads).

Why warp-specialised: the first version (session 7) had every thread issue cp.async and then
compute, each K step waiting for its own wgmma group (``wait_group 0``) behind a CTA barrier;
on the H200 it reached 0.59-0.65x of cuBLAS (``notebooks/results/session8-h200-2026-12-03/``),
no better than mma.sync. Here the CTA is split by role, as CUTLASS's sm90 kernels are:

    warpgroup 0, the producer (40 registers): one thread issues TMA loads
        (``cp.async.bulk.tensor.2d``, completing on the slot's "full" mbarrier with the byte
        count) into a ``stages``-deep ring, after waiting for the slot's "empty" mbarrier;
    warpgroups 1..C, the consumers (the freed registers): wait for "full", issue the
        ``bk / 16`` wgmmas of the K step, and keep that group in flight while waiting for the
        previous one (``wait_group 1``), whose slot they then release on "empty".

So loads run ``stages`` K steps ahead without any CTA barrier, and the tensor cores always have
the next group queued. The last K step is issued after the loop and waited for at once: with it
inside, ptxas (CUDA 13.0) hoisted epilogue arithmetic on the accumulators above the final
``wait_group 0``, and the fused post-norm read registers the last wgmma was still writing
(wrong results on the H200, session 8; :func:`tvm_comfuse.codegen.wgmma_hazards` checks the SASS). TMA writes the ``2 * bk``-byte swizzle (row ``r``'s 16-byte chunk ``j``
at ``j ^ ((r * row_bytes >> 7) % chunks)``) that the descriptors read. The tensor maps are
encoded by the host code of the kernel on every call (``T.tensormap_encode_tiled``: TVM's CUDA
runtime, ``cuTensorMapEncodeTiled``), passed as ``__grid_constant__`` parameters.

A CTA's ``bm x bn`` tile is a grid of ``bm / 64 x wg_n`` consumer warpgroups: the plain GEMM
splits rows (``wg_n = 1``), a row epilogue splits the row's columns (:mod:`.wgmma_postnorm`).
The ring's steps are a sequence the producer and the consumers walk in the same order, so a
kernel may stream more than one GEMM's operands through it (:mod:`.wgmma_b2b`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import tvm
from tvm.script import tirx as T

from ..errors import ComFuseError

#: Shared memory one thread block may use on sm_90 (227 KiB), less 8 KiB for static buffers.
SMEM_LIMIT = 219 * 1024
#: An sm_90 SM's shared memory (228 KiB), and what the driver reserves of it per thread block.
SMEM_PER_SM, SMEM_RESERVED = 228 * 1024, 1024
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
#: bk -> the swizzle code of 64- and 128-byte rows: the same number in a wgmma descriptor and
#: in a CUtensorMap (CU_TENSOR_MAP_SWIZZLE_64B = 2, _128B = 3).
_SWIZZLE = {32: 2, 64: 3}
TMA_LOAD = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
#: The same load into the same offset of every CTA of the cluster in a 16-bit mask, completing
#: bytes on each one's mbarrier at the same offset (:attr:`WgmmaConfig.multicast`).
TMA_MULTICAST = TMA_LOAD + ".multicast::cluster"
#: Registers the producer warpgroup keeps (setmaxnreg.dec): it only computes addresses.
PRODUCER_REGS = 40
#: Named barrier of the consumer warpgroups (0 is the CTA's ``__syncthreads``).
CONSUMER_BARRIER = 1


@dataclass(frozen=True)
class WgmmaConfig:
    """A CTA computes a ``bm x bn`` tile, K in ``bk`` steps through a ``stages``-deep ring, with
    ``bm / 64 x wg_n`` consumer warpgroups (each a ``64 x bn / wg_n`` wgmma tile) and one
    producer warpgroup (or ``producer_warps`` warps)."""

    bm: int = 128
    bn: int = 256
    stages: int = 4
    bk: int = 64
    wg_n: int = 1
    #: The fields below are keyword-only: the tile above is positional, and a field added among
    #: these later must not change what an existing call means (session 33: GPU test cases written
    #: before ``turns`` and ``tile_step`` had come to mean ``turns = True`` and ``tile_step = 16``).
    _: KW_ONLY
    #: wgmma groups a consumer keeps in flight while it waits for the next slot (0 or 1).
    inflight: int = 1
    #: B (the weight's ``bn``-row slice, all of K) is loaded once into shared memory beside the
    #: ring, which then carries only A: for a CTA that loops over row blocks (short K, where
    #: re-reading W from L2 for every 64 rows costs more than the GEMM; :mod:`.wgmma_postnorm`).
    resident: bool = False
    #: Thread blocks an SM runs at once (``__launch_bounds__(threads, ctas_per_sm)``): with two,
    #: one CTA's epilogue runs beside the other's mainloop, in half the registers and shared memory
    #: (measured slower for the post-norm on the H200, session 12: ``experiments/tile_occupancy.py``).
    ctas_per_sm: int = 1
    #: 0: the producer is a warpgroup (warpgroup 0) that gives its registers back
    #: (``setmaxnreg``); 1 or 2: it is that many warps after the consumer warpgroups, and no
    #: registers move. Why: ptxas allocates the whole kernel within the launch bounds' budget
    #: (:attr:`compiled_regs`: 168 at 384 threads, whatever ``setmaxnreg`` later grants), so
    #: two CTAs an SM of a 256-column consumer warpgroup (154 registers) compile only with a
    #: producer warp (2 x 160 threads: 168 registers; with a warpgroup 2 x 256: 128).
    producer_warps: int = 0
    #: Two groups of consumer warpgroups take alternate tiles (row blocks of a CTA that loops
    #: over them: :mod:`.wgmma_postnorm`'s resident W), their mainloops in turn, so one group's
    #: epilogue runs beside the other's mainloop (CUTLASS's "ping-pong" schedule).
    pingpong: bool = False
    #: How many such groups take turns (``pingpong`` only; the post-norm kernel's resident W only
    #: beyond two): with narrow slices (64 accumulators a thread at 128 columns) three groups fit
    #: the registers, so two epilogues run beside each mainloop (session 25).
    turns: int = 2
    #: CTAs are persistent: one an SM, each looping over tiles ``bx, bx + grid, ...`` through one
    #: ring, so the producer loads the next tile's K steps while the consumers finish this one
    #: (no fill of an empty ring a tile, no launch a tile). Implied by ``pingpong`` outside the
    #: post-norm kernel (:mod:`.wgmma_elementwise`).
    persistent: bool = False
    #: A GEMM + elementwise kernel's consumer warpgroups load their part of the tile operand in
    #: the output's dtype (the residual) into their staging buffer by TMA while their mainloop
    #: runs, and read it from there, in place of per-thread global loads in the accumulator
    #: layout (:mod:`.wgmma_elementwise`; the post-norm kernel stages its own). The buffers lie
    #: beside the ring: persistent CTAs have them anyway, one tile a CTA where they fit.
    stage_tiles: bool = False
    #: With ``stage_tiles``: the K step before whose wgmmas a consumer warpgroup issues its tile
    #: operand's TMA load (0: before the first; past the last: before the last). Why not always
    #: the first: at one wave every CTA fills its ring at once, and a tile operand loaded beside
    #: those first K steps delays them (session 23, ``experiments/residual_load.py``).
    tile_step: int = 0
    #: A persistent GEMM + elementwise kernel walks its tiles in groups of this many row tiles,
    #: every column slice of a group before the next group (0: all the row tiles at once, column
    #: slice by column slice). Why: a wave of CTAs then reads ``group_rows`` row tiles of x and
    #: ``SMs / group_rows`` column slices of w, where walking whole columns reads all of x every
    #: wave; at 8192 x 4096 -> 4096 that is x's 64 MB, more than L2 holds, once a wave
    #: (:mod:`.wgmma_elementwise`; the post-norm kernels walk rows their own way).
    group_rows: int = 0
    #: The K loop split over this many CTAs, a thread-block cluster, each a ``K / split_k`` part
    #: (split-K): the others push their fp32 partial tiles into rank 0's shared memory
    #: (distributed shared memory), which adds them and runs the epilogue alone
    #: (:mod:`.wgmma_elementwise`, :func:`.wgmma_elementwise.gather_split`). Why: at a few rows
    #: (BERT at batch 1: M = 128) a GEMM has a handful of tiles, and split-K is how they fill the SMs.
    split_k: int = 1
    #: The CTAs of a cluster that share A's rows (the post-norm kernel's column slices of one row
    #: block: :mod:`.wgmma_postnorm`) load each A tile once for the cluster: rank ``r`` loads
    #: ``bm / ranks`` of its rows by TMA multicast into every rank's ring slot, and a slot is
    #: refilled once the consumers of every rank have released it (they arrive on each rank's
    #: "empty" barrier). Why it was tried: otherwise every rank reads the same tile from L2, eight
    #: times over at 16384 x 256 -> 1024, where A is the ring's only operand (a resident W) and the
    #: kernel ran as fast on the H200 as on the H100, whose HBM is 30% slower (sessions 22, 30).
    #: Measured slower at all seven shapes tried (H100, session 34, ``experiments/multicast.py``):
    #: 38.5 against 36.3 us there, 0.7-27% elsewhere; each slot now waits for the slowest rank's
    #: release. Correct (GPU tests), opt-in, not in the tuning space.
    multicast: bool = False

    def loading_ranks(self, ranks: int) -> int:
        """CTAs of a ``ranks``-CTA cluster that share each A tile's load: all with :attr:`multicast`, else one."""
        return ranks if self.multicast else 1

    @property
    def slot_readers(self) -> int:
        """Consumer warpgroups that read each ring slot: those of one tile."""
        return self.bm // 64 * self.wg_n

    @property
    def consumers(self) -> int:
        return self.slot_readers * (self.turns if self.pingpong else 1)

    @property
    def threads(self) -> int:
        return 128 * self.consumers + (32 * self.producer_warps or 128)

    @property
    def compiled_regs(self) -> int:
        """Registers ptxas (CUDA 13.0) compiles every thread to: the SM's 65536 over the launch
        bounds' threads an SM rounded up to a multiple of 128, in steps of 8, at most 255
        (measured with ``-Xptxas -v``: 288 threads, or 2 x 160, get 168; 2 x 288 get 96)."""
        per_sm = -(-self.threads * self.ctas_per_sm // 128) * 128
        return min(255, 65536 // per_sm // 8 * 8)

    @property
    def reallocates(self) -> bool:
        """Whether the producer gives registers to the consumers (``setmaxnreg``): only a producer
        warpgroup, and only when ``__launch_bounds__`` caps a thread below the 255 it may have
        anyway (ptxas ignores setmaxnreg where the entry count is not fixed, its C7508)."""
        return self.producer_warps == 0 and 65536 // (self.threads * self.ctas_per_sm) < 256

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread: after the producer gives its share back, the
        ``65536 / threads`` the kernel starts with (in steps of 8, at most 240)."""
        if not self.reallocates:
            return self.compiled_regs
        start = 65536 // (self.threads * self.ctas_per_sm) // 8 * 8
        return min(240, (start * self.threads - PRODUCER_REGS * 128) // (128 * self.consumers) // 8 * 8)

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory a CTA may use: :data:`SMEM_LIMIT`, or with several CTAs an SM
        its share of the SM (less the driver's reserve) less the same 8 KiB of static buffers."""
        return SMEM_LIMIT if self.ctas_per_sm == 1 else SMEM_PER_SM // self.ctas_per_sm - SMEM_RESERVED - 8 * 1024

    @property
    def wg_cols(self) -> int:
        return self.bn // self.wg_n

    @property
    def smem_bytes(self) -> int:
        """The ring's bytes (A and B tiles per slot; A only where B is resident)."""
        return self.stages * (self.bm + (0 if self.resident else self.bn)) * self.bk * 2

    def resident_bytes(self, k: int) -> int:
        """Bytes of the resident B slice for a K of ``k`` (0 where B streams through the ring)."""
        return self.bn * k * 2 if self.resident else 0

    def problems(self, m: int, n: int, k: int, dtype: str) -> list:
        """What keeps this configuration from computing an ``m x n x k`` GEMM (empty if nothing)."""
        found = []
        if dtype not in _PTX_TYPE:
            found.append(f"dtype {dtype} (wgmma here takes {sorted(_PTX_TYPE)})")
        if self.bm % 64 or not 64 <= self.bm <= 256:
            found.append(f"bm = {self.bm} (64 to 256 in steps of 64: 64 rows per warpgroup)")
        if self.bn % self.wg_n or self.wg_cols % 16 or not 16 <= self.wg_cols <= 256:
            found.append(f"bn / wg_n = {self.bn} / {self.wg_n} (a multiple of 16 up to 256, wgmma's N)")
        if self.bn % 8:
            found.append(f"bn = {self.bn} (a multiple of 8: TMA boxes of whole swizzle atoms)")
        if self.bk not in _SWIZZLE:
            found.append(f"bk = {self.bk} (32 or 64: one 64- or 128-byte swizzled row)")
        if self.stages < 2:
            found.append(f"stages = {self.stages} (at least 2: a load in flight while the tensor cores work)")
        if self.inflight not in (0, 1):
            found.append(f"inflight = {self.inflight} (0 or 1 wgmma groups kept in flight)")
        if self.threads > 1024:
            found.append(f"{self.threads} threads (at most 1024)")
        if self.producer_warps not in (0, 1, 2):
            found.append(f"producer_warps = {self.producer_warps} (0: a warpgroup, or 1 or 2 warps)")
        if self.compiled_regs < self.wg_cols // 2 + 32:  # ptxas: m64n256 (128 accumulators) needs 154
            found.append(f"{self.consumers} consumer warpgroups of {self.wg_cols // 2} accumulators each ({self.compiled_regs} "
                         f"registers per thread: fewer warpgroups{', or a producer warp' if not self.producer_warps else ''})")
        if self.tile_step < 0:
            found.append(f"tile_step = {self.tile_step} (the K step before which the tile operand loads: 0 or more)")
        if self.turns < 2 or self.turns != 2 and not self.pingpong:
            found.append(f"turns = {self.turns} (groups of consumer warpgroups taking turns: 2 or more, with pingpong)")
        if self.group_rows < 0:
            found.append(f"group_rows = {self.group_rows} (0: whole columns, or the row tiles a group)")
        if not 1 <= self.split_k <= 8 or k % (self.split_k * self.bk):
            found.append(f"split_k = {self.split_k} at K = {k} (1 to 8 CTAs of a cluster, each K / split_k, a multiple of bk = {self.bk})")
        elif self.split_k > 1 and (self.resident or self.persistent or self.pingpong or self.ctas_per_sm != 1):
            found.append("split_k with a resident B, persistent CTAs or two CTAs an SM (split-K CTAs take one tile's part each)")

        if self.ctas_per_sm not in (1, 2):
            found.append(f"ctas_per_sm = {self.ctas_per_sm} (1 or 2)")
        if self.smem_bytes + self.resident_bytes(k) > self.smem_limit:
            found.append(f"{(self.smem_bytes + self.resident_bytes(k)) // 1024} KiB of shared memory "
                         f"(at most {self.smem_limit // 1024}: fewer stages, a smaller bk{', a narrower resident B' if self.resident else ''})")
        if m % self.bm or n % self.bn or k % self.bk:
            found.append(f"M, N, K = {m}, {n}, {k} (multiples of bm = {self.bm}, bn = {self.bn}, bk = {self.bk})")
        return found

    def check(self, m: int, n: int, k: int, dtype: str) -> None:
        """Raise ComFuseError naming what does not fit, and what would."""
        found = self.problems(m, n, k, dtype)
        if found:
            raise ComFuseError("wgmma GEMM cannot use " + "; ".join(found))


def box_rows(rows: int) -> int:
    """Rows per TMA box for a ``rows``-row tile: the largest divisor up to 256 (a box's limit)
    that is a multiple of 8 (a swizzle atom)."""
    return next(b for b in range(min(rows, 256), 0, -8) if rows % b == 0)


def tensor_map(rows: int, cols: int, box: int, bk: int, dtype: str):
    """The tirx macro ``encode(tmap, data)``: host code that fills ``tmap`` with the CUtensorMap
    of the row-major ``[rows, cols]`` matrix of ``dtype`` at ``data``, boxes of ``box`` rows x
    ``bk`` columns (a 64- or 128-byte row), swizzled as the ring's 16-bit rows of that width are."""
    size = tvm.DataType(dtype).bits // 8
    swizzle = _SWIZZLE[bk * size // 2]

    # pylint: disable=invalid-name
    @T.macro
    def encode(tmap, data):
        T.tensormap_encode_tiled(tmap, data, cols, rows, cols * size, bk, box, 1, 1, descriptor_dtype=dtype, rank=2,
                                 interleave=0, swizzle=swizzle, l2_promotion=2, oob_fill=0)

    return encode


class Ring:
    """The mbarrier protocol of a ``stages``-deep ring shared by one producer thread and
    ``consumers`` warpgroups; step ``s`` uses slot ``s % stages`` in phase ``s // stages``.
    Each method returns a tirx macro; ``full`` and ``empty`` are ``[stages]`` uint64 buffers.
    With ``ranks`` > 1 (:attr:`WgmmaConfig.multicast`) every rank's producer writes into every
    rank's slots, so a slot's "empty" barrier counts the consumers of all ``ranks`` CTAs."""

    def __init__(self, stages: int, consumers: int, ranks: int = 1):
        self.stages, self.consumers, self.ranks = stages, consumers, ranks

    def init(self):
        """``init(full, empty, tx)``: thread ``tx == 0`` initialises the barriers, then the CTA syncs."""
        st, consumers = self.stages, self.consumers * self.ranks

        # pylint: disable=invalid-name
        @T.macro
        def init(full, empty, tx):
            if tx == 0:
                for s in T.unroll(st):
                    T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))  # the producer's arrive + bytes
                    T.ptx.mbarrier.init.shared.b64(empty.ptr_to([s]), T.uint32(consumers))  # one per consumer warpgroup
                T.ptx.fence.mbarrier_init.release.cluster()
            T.cuda.cta_sync()

        return init

    def acquire(self):
        """``acquire(full, empty, step, nbytes)`` (producer): wait until the consumers released
        the slot's previous use (a fresh barrier has completed the phase before phase 0), then
        announce ``nbytes`` of TMA on its "full" barrier."""
        st = self.stages

        @T.macro
        def acquire(full, empty, step, nbytes):
            T.cuda.mbarrier_wait(empty.ptr_to([step % st]), (step // st) % 2 ^ 1)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([step % st]), T.uint32(nbytes))

        return acquire

    def wait(self):
        """``wait(full, step)`` (consumers): until the slot's loads have landed."""
        st = self.stages

        @T.macro
        def wait(full, step):
            T.cuda.mbarrier_wait(full.ptr_to([step % st]), (step // st) % 2)

        return wait

    def release(self):
        """``release(empty, step, tw, peer=None)`` (consumers, after their reads of the slot
        completed): one arrive per consumer warpgroup, on the "empty" barrier of every rank
        (``peer``: a uint32 register for its address, with more than one rank)."""
        st, ranks = self.stages, self.ranks

        @T.macro
        def release(empty, step, tw, peer=None):
            if tw == 0:
                if ranks == 1:
                    T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([step % st]), T.uint32(1))
                else:
                    for q in T.unroll(ranks):
                        T.ptx["mapa.shared::cluster.u32"](peer[0], T.cuda.cvta_generic_to_shared(empty.ptr_to([step % st])), T.uint32(q))
                        T.ptx["mbarrier.arrive.shared::cluster.b64"](peer[0], T.uint32(1))  # (release.cta, as CUTLASS: .cluster fences the GPU, 1.8-13x slower)

        return release


def roles(cfg: WgmmaConfig):
    """``(producer_entry, consumer_entry)`` macros, each ``f()``: the register reallocation that
    opens the producer's and the consumers' branch of a warp-specialised kernel (nothing where
    ``cfg`` does not reallocate)."""

    @T.macro
    def producer():
        T.ptx["setmaxnreg.dec.sync.aligned.u32"](PRODUCER_REGS)

    @T.macro
    def consumer():
        T.ptx["setmaxnreg.inc.sync.aligned.u32"](cfg.consumer_regs)

    @T.macro
    def keep():
        T.evaluate(0)

    return (producer, consumer) if cfg.reallocates else (keep, keep)


def consumer_sync(cfg: WgmmaConfig):
    """``sync(group)``: a barrier of the consumer warpgroups of one tile only (the producer does
    not take part; with ``pingpong`` each of the groups taking turns has its own)."""

    @T.macro
    def sync(group):
        if cfg.pingpong:  # one named barrier a group (group is the warpgroup's, at run time)
            T.ptx["bar.sync"](T.uint32(CONSUMER_BARRIER) + T.cast(group, "uint32"), 128 * cfg.slot_readers)
        else:
            T.ptx["bar.sync"](CONSUMER_BARRIER, 128 * cfg.consumers)

    return sync


def mainloop(cfg: WgmmaConfig, k: int, dtype: str, during=None, ranks: int = 1):
    """The K loop as two tirx macros, ``(produce, consume)``, over ring steps ``base .. base + k
    / bk - 1`` (``base`` 0 for one tile; a CTA that loops over tiles walks on, ``k / bk`` steps
    a tile, so slots and phases carry over):

    - ``produce(A_map, B_map, S, W, full, empty, a_row, b_row, base, k0=0, rank=0)``, by the
      producer's one thread: K step ``kk`` loads rows ``[a_row, + bm)`` of A and ``[b_row, + bn)``
      of B (not where B is resident: :func:`load_resident`), columns ``[k0 + kk * bk, + bk)``, into
      slot ``(base + kk) % stages`` of ``S`` (``[stages, bm + bn, bk]``; ``[stages, bm, bk]`` with B
      resident); with ``cfg.multicast``, A's rows ``[a_row + rank * bm / ranks, + bm / ranks)``
      only, into the slot of each of the cluster's ``ranks`` CTAs (``A_map``'s boxes that many rows);
    - ``consume(S, W, full, empty, acc, da, db, cw, tw, base)``, by consumer warpgroup ``cw``
      (thread ``tw`` of it): ``acc`` (``wg_cols / 2`` fp32 per thread) ends holding the thread's
      share of the warpgroup's ``64 x wg_cols`` tile of ``A @ B.T``, B read from the ring or from
      the resident ``W`` (``[k / bk, bn, bk]``; pass ``S`` where B is not resident); ``da``,
      ``db`` one uint64 each for the descriptors. Every slot is released when it returns.
      With ``during`` (a tirx macro ``during(kk, extra)``), the warpgroup runs it before K step
      ``kk``'s wgmmas, ``kk`` from 0 to ``k / bk - 1``, ``extra`` what the kernel passed
      ``consume`` after ``base`` (its buffers, as a tuple): work that belongs at a point of the
      K loop (:mod:`.wgmma_elementwise`'s tile operand loads)."""
    bm, bn, bk, st, res = cfg.bm, cfg.bn, cfg.bk, cfg.stages, cfg.resident
    kt, acc_n, wg_cols = k // bk, cfg.wg_cols // 2, cfg.wg_cols
    mma = f"wgmma.mma_async.sync.aligned.m64n{wg_cols}k16.f32.{_PTX_TYPE[dtype]}.{_PTX_TYPE[dtype]}"
    sbo = 8 * bk * 2 >> 4  # 8 swizzled rows between core-matrix groups, in 16-byte units
    a_box, b_box = box_rows(bm), box_rows(bn)
    ranks = cfg.loading_ranks(ranks)
    ring = Ring(st, cfg.consumers, ranks)
    acquire, wait, release = ring.acquire(), ring.wait(), ring.release()
    a_part, mask = bm // ranks, (1 << ranks) - 1  # with multicast: a rank's rows of A, and every rank
    tail = min(kt, cfg.inflight + 1)  # steps whose slots are released after the loop

    # pylint: disable=invalid-name
    @T.macro
    def produce(A_map, B_map, S, W, full, empty, a_row, b_row, base, k0=0, rank=0):
        for kk in T.serial(kt):
            acquire(full, empty, base + kk, cfg.smem_bytes // st)  # one slot's bytes (with multicast: from every rank)
            if ranks > 1:
                T.ptx[TMA_MULTICAST](S.ptr_to([(base + kk) % st, rank * a_part, 0]), T.address_of(A_map), k0 + kk * bk,
                                     a_row + rank * a_part, full.ptr_to([(base + kk) % st]), T.uint16(mask))
            else:
                for j in T.unroll(bm // a_box):
                    T.ptx[TMA_LOAD](S.ptr_to([(base + kk) % st, j * a_box, 0]), T.address_of(A_map), k0 + kk * bk, a_row + j * a_box,
                                    full.ptr_to([(base + kk) % st]))
            if not res:
                for j in T.unroll(bn // b_box):
                    T.ptx[TMA_LOAD](S.ptr_to([(base + kk) % st, bm + j * b_box, 0]), T.address_of(B_map), k0 + kk * bk, b_row + j * b_box,
                                    full.ptr_to([(base + kk) % st]))

    def b_tile(S, W, slot, kk, cw, ks):  # where the warpgroup's B columns of K step kk lie
        return W.ptr_to([kk, cw % cfg.wg_n * wg_cols, ks * 16]) if res else S.ptr_to([slot, bm + cw % cfg.wg_n * wg_cols, ks * 16])

    @T.macro
    def step(S, W, full, acc, da, db, cw, kk, base):  # wait for step base + kk's slot, issue its wgmmas as one group
        wait(full, base + kk)
        T.ptx["wgmma.fence.sync.aligned"]()
        for ks in T.unroll(bk // 16):
            T.cuda.wgmma.encode_matrix_descriptor(
                T.address_of(da[0]), S.ptr_to([(base + kk) % st, cw // cfg.wg_n * 64, ks * 16]), 1, sbo, _SWIZZLE[bk]
            )
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(db[0]), b_tile(S, W, (base + kk) % st, kk, cw, ks), 1, sbo, _SWIZZLE[bk])
            T.ptx[mma](*[acc[i] for i in range(acc_n)], da[0], db[0], T.ptx.pred(kk > 0 or ks > 0), 1, 1, 0, 0)
        T.ptx["wgmma.commit_group.sync.aligned"]()

    @T.macro
    def consume(S, W, full, empty, acc, da, db, cw, tw, base, extra=None):
        peer = T.alloc_local([1], "uint32") if ranks > 1 else T.meta_var(None)  # a peer's barrier (multicast)
        for kk in T.serial(kt - 1):
            if during is not None:
                during(kk, extra)
            step(S, W, full, acc, da, db, cw, kk, base)
            T.ptx["wgmma.wait_group.sync.aligned"](cfg.inflight)  # step kk - inflight's group is done: its slot is free
            if kk >= cfg.inflight:
                release(empty, base + kk - cfg.inflight, tw, peer)
        if during is not None:
            during(kt - 1, extra)
        step(S, W, full, acc, da, db, cw, kt - 1, base)
        T.ptx["wgmma.wait_group.sync.aligned"](0)
        for j in T.unroll(tail):
            release(empty, base + kt - tail + j, tw, peer)

    return produce, consume


def load_resident(cfg: WgmmaConfig, k: int):
    """``load(B_map, W, wfull, b_row)`` (the producer's one thread, once): rows ``[b_row, +
    bn)`` of B, all of K, into ``W`` (``[k / bk, bn, bk]``, each K step in the ring's swizzle),
    completing on the mbarrier ``wfull`` (``[1]``, phase 0)."""
    bk, b_box = cfg.bk, box_rows(cfg.bn)

    # pylint: disable=invalid-name
    @T.macro
    def load(B_map, W, wfull, b_row):
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(wfull.ptr_to([0]), T.uint32(cfg.bn * k * 2))
        for kk in T.serial(k // bk):
            for j in T.unroll(cfg.bn // b_box):
                T.ptx[TMA_LOAD](W.ptr_to([kk, j * b_box, 0]), T.address_of(B_map), kk * bk, b_row + j * b_box, wfull.ptr_to([0]))

    return load


def fragment(tx, i):
    """``(row, col)`` inside its warpgroup's ``64 x n`` tile of accumulator register ``i`` of
    thread ``tx`` (PTX ISA, wgmma m64nNk16 fp32 D fragments: per warp 16 rows, per 8 columns
    four registers)."""
    lane = tx % 32
    return (tx % 128) // 32 * 16 + lane // 4 + 8 * ((i // 2) % 2), (i // 4) * 8 + (lane % 4) * 2 + i % 2


def wgmma_gemm(m: int, n: int, k: int, dtype: str = "float16", cfg: WgmmaConfig = WgmmaConfig()):
    """``C[m, n] = A[m, k] @ B[n, k].T`` (PyTorch's linear layout), fp32 accumulation, C in
    ``dtype``; a tirx PrimFunc for sm_90a. Static shapes, multiples of the tile. The GEMM +
    elementwise kernel with an empty chain (:mod:`.wgmma_elementwise`)."""
    from .wgmma_elementwise import Elementwise, wgmma_elementwise  # pylint: disable=import-outside-toplevel  (it imports us)

    cfg.check(m, n, k, dtype)
    return wgmma_elementwise(m, n, k, Elementwise(dtype, (), (), dtype), cfg)


def build(func, arch: str = "sm_90a", host=None, symbol: str | None = None, tir_pipeline: str = "tirx"):
    """Compile a tirx PrimFunc from this module, as ``main`` or exported as ``symbol`` (wgmma
    needs the ``a`` of sm_90a; the target is also made the current one, which TVM's NVRTC
    callback reads the architecture from: inside a Relax pipeline that would otherwise be the
    pipeline's). ``tir_pipeline="default"`` compiles a scheduled s_tir PrimFunc instead (the
    split post-norm's norm kernel, :mod:`.split_norm`)."""
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host=host)
    mod = tvm.IRModule({symbol: func.with_attr("global_symbol", symbol)} if symbol else {"main": func})
    with target:
        return tvm.compile(mod, target=target, tir_pipeline=tir_pipeline)
