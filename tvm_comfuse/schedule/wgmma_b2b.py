"""Hopper back-to-back GEMM (issue 5): ``chain2(chain1(x @ w1.T) @ w2.T)`` in one kernel.

The MLP ``act(x @ w1.T + b1) @ w2.T + b2 (+ r)`` with a narrow intermediate (``N1 <= 256``): the
intermediate never leaves the chip, and not even the registers. Each consumer warpgroup
computes 64 rows of the first GEMM on :mod:`.wgmma_mainloop`, applies the first chain (bias,
activation, as the graph rounds them: :class:`~.wgmma_elementwise.Elementwise`) to the fp32
accumulators and packs them to 16-bit pairs that are exactly the A-operand fragments of the
second GEMM's register-A ``wgmma.mma_async`` (accumulator pair ``(8j + 2p, 8j + 2p + 1)`` is A
register ``p`` of k-slice ``j``: the m64nNk16 D layout and the m64k16 A layout coincide per warp).

Why this shape (the first version, session 8, was correct on the H200 but slower than eager
PyTorch on every MLP shape of issue 5, 151 against 101 us at 65536 x 1024 -> 64 -> 1024): the
kernel moves ``x`` in and ``out`` out, 256 MB there, a memory-bound job, and by its code (not
profiled) the first version did neither at full speed: its second GEMM's output left from
registers in the accumulator layout (16-byte pieces of eight rows per warp store, 4096 store
instructions a 128-row block), and each CTA took one row block, so nothing overlapped a block's
loads with its stores. Here:

- ``out`` leaves by TMA (:mod:`.staged_store`): each output tile is written once to shared
  memory (the 128-byte swizzle, no bank conflicts) and stored by one ``cp.async.bulk.tensor``
  per 64-row box, in two staging buffers, so the next tile's wgmmas run while the last one
  drains (rows past M are clipped by the TMA unit: any M; a float32 output is staged as such);
- CTAs are persistent (one an SM, row blocks ``bx, bx + grid, ...``) and fed by two rings with a
  producer thread each: GEMM 1's (``x`` and ``w1`` tiles) and ``w2``'s (``bn2 x 64`` chunks),
  so the next block's ``x`` streams in while this block's second GEMM and stores run.

Written in session 15 on CPU and measured on the H200 the same day: correct at once; at 65536 x
1024 -> 64 -> 1024 80 us against eager's 100 (session 8's kernel: 151), faster than eager and
torch.compile at five of issue 5's six MLP shapes (``notebooks/results/session15-h200-2026-12-05/``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm.script import tirx as T

from ..errors import ComFuseError
from .chain import Step
from .staged_store import box_cols, buffer_shape, staged_bytes, staged_store
from .staged_store import drain as staged_drain
from .staged_store import size as _size
from .wgmma_elementwise import Elementwise, epilogue_value
from .wgmma_elementwise import reference as elementwise_reference
from .wgmma_mainloop import _PTX_TYPE, SMEM_LIMIT, TMA_LOAD, Ring, WgmmaConfig, box_rows, fragment, mainloop, roles, tensor_map
from .wgmma_postnorm import SM_COUNT

#: Widths of the intermediate the kernel takes: a 64-row slab of it in one warpgroup's registers.
INTERMEDIATE = (64, 128, 192, 256)
#: Output dtypes: what the staging buffers hold (a 128-byte swizzled row: 64 or 32 columns a box).
OUT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class B2B:
    """The fused pair: ``out = second(first(x @ w1.T) @ w2.T)``, each half a GEMM + elementwise
    chain (:class:`~.wgmma_elementwise.Elementwise`, no layout). ``first`` ends in ``dtype`` (the
    intermediate as the graph rounds it, the second GEMM's input); ``second`` ends in
    ``out_dtype`` (16-bit, or float32 as a mixed-precision graph returns it), what the staging
    buffers hold and the TMA stores write."""

    first: Elementwise = Elementwise("float16", (Step("cast", "float16"), Step("add", "float16", 0), Step("gelu", "float16")),
                                     (("float16", False),), "float16")
    second: Elementwise = Elementwise("float16", (Step("cast", "float16"), Step("add", "float16", 0)), (("float16", False),),
                                      "float16")

    @classmethod
    def mlp(cls, dtype: str = "float16", act: str | None = "gelu", bias2: bool = True, residual: bool = False) -> B2B:
        """``act(x @ w1.T + b1) @ w2.T (+ b2) (+ r)`` computed in ``dtype`` as a Relax graph of
        that dtype rounds it (after the GEMM and after each op)."""
        first = (Step("cast", dtype), Step("add", dtype, 0)) + ((Step(act, dtype),) if act else ())
        second, ops2 = [Step("cast", dtype)], []
        for tile in [False] * bias2 + [True] * residual:
            second.append(Step("add", dtype, len(ops2)))
            ops2.append((dtype, tile))
        return cls(Elementwise(dtype, first, ((dtype, False),), dtype), Elementwise(dtype, tuple(second), tuple(ops2), dtype))

    @property
    def dtype(self) -> str:
        return self.first.dtype

    @property
    def out_dtype(self) -> str:
        return self.second.out_dtype

    def problems(self) -> list:
        """What the kernel cannot compute of this description (empty if nothing)."""
        found = [f"first chain: {p}" for p in self.first.problems()] + [f"second chain: {p}" for p in self.second.problems()]
        if self.first.layout or self.second.layout:
            found.append("an output layout (the intermediate and the output are row-major [M, N])")
        if self.first.out_dtype != self.dtype or self.second.dtype != self.dtype:
            found.append(f"an intermediate in {self.first.out_dtype} (the second GEMM takes {self.dtype}, as the first does)")
        if self.out_dtype not in OUT_DTYPES:
            found.append(f"output dtype {self.out_dtype} (one of {OUT_DTYPES})")
        return found


def reference(spec: B2B, x, w1, *rest, out_lead=None):
    """NumPy model of the kernel (``rest``: the first chain's operands, ``w2``, the second's;
    the output's row dims ``out_lead``, default x's): the oracle the offload's CPU tests run in
    the kernel's place."""
    n1 = len(spec.first.operands)  # (np_chain reads a tile operand's rows flat, whatever its row dims)
    h = elementwise_reference(spec.first, np.asarray(x).reshape(-1, x.shape[-1]), w1, *rest[:n1])
    out = elementwise_reference(spec.second, h, rest[n1], *rest[n1 + 1:])
    return out.reshape(*(out_lead or x.shape[:-1]), out.shape[-1])


@dataclass(frozen=True)
class B2BConfig:
    """A CTA takes row blocks of ``bm`` rows (``bm / 64`` consumer warpgroups): GEMM 1 in ``bk``
    steps through a ``stages``-deep ring; GEMM 2 in output tiles of ``bn2`` columns, ``w2``'s
    ``bn2 x 64`` chunks through a ``stages2``-deep ring of their own; each output tile staged in
    one of two shared buffers for its TMA stores."""

    bm: int = 128
    stages: int = 4
    bk: int = 64
    bn2: int = 128
    stages2: int = 2
    #: One CTA an SM looping over row blocks (the next block's x loads during this one's second
    #: GEMM), or one CTA a block. The default above N1 = 128 is not: across the loop ptxas
    #: (CUDA 13.0) keeps GEMM 1's accumulators apart from GEMM 2's fragments and accumulators,
    #: and spills (32 to 736 bytes at N1 = 192 and 256, none one block a CTA).
    persistent: bool = True
    #: Two sets of GEMM 2 accumulators: each output tile's epilogue (the second chain, staging,
    #: TMA store) runs once the next tile's first w2 chunk is issued, beside its wgmmas, instead
    #: of after a ``wait_group 0`` with the tensor cores idle (the warpgroup's other chunks wait
    #: for it either way). Needs an even number of output tiles. Measured (H100, session 26): at
    #: N1 = 128 on persistent CTAs, beside a six-slot w2 ring (a slot stays held through the
    #: epilogue), 7% faster; one block a CTA at N1 = 256 17% slower, at N1 = 64 6% slower.
    overlap: bool = False

    def phase1(self, n1: int) -> WgmmaConfig:
        """GEMM 1's mainloop: the CTA's rows, the whole intermediate row."""
        return WgmmaConfig(self.bm, n1, self.stages, self.bk, 1)

    def ring2_bytes(self) -> int:
        return self.stages2 * self.bn2 * 64 * 2

    def staging_bytes(self, out_dtype: str = "float16") -> int:
        return staged_bytes(self.bm, self.bn2, out_dtype, buffers=2)

    def smem_bytes(self, n1: int, out_dtype: str = "float16") -> int:
        return self.phase1(n1).smem_bytes + self.ring2_bytes() + self.staging_bytes(out_dtype)

    def problems(self, m: int, n1: int, n2: int, k: int, dtype: str, out_dtype: str = "float16") -> list:
        """What keeps this configuration from these shapes (empty if nothing)."""
        found = []
        if n1 not in INTERMEDIATE:
            found.append(f"N1 = {n1} (one of {INTERMEDIATE}: the intermediate row in one warpgroup's registers)")
        if self.bn2 not in (64, 128) or n2 % self.bn2:
            found.append(f"bn2 = {self.bn2} for N2 = {n2} (64 or 128, dividing N2: 64-column staging boxes)")
        if self.overlap and (n2 // self.bn2) % 2:
            found.append(f"overlap with {n2 // self.bn2} output tiles (an even number: the two accumulator sets alternate)")
        if self.stages2 < 2:
            found.append(f"stages2 = {self.stages2} (at least 2: the next w2 chunk loads while one is read)")
        if self.bm not in (64, 128):
            found.append(f"bm = {self.bm} (64 or 128: the registers of more row warpgroups do not hold both GEMMs' tiles)")
        if n1 in INTERMEDIATE and self.smem_bytes(n1, out_dtype) > SMEM_LIMIT:
            found.append(f"{self.smem_bytes(n1, out_dtype) // 1024} KiB of shared memory (at most {SMEM_LIMIT // 1024}: fewer stages, "
                         "a smaller bk or bn2)")
        p1 = self.phase1(n1 if n1 in INTERMEDIATE else 64)
        found += [p for p in p1.problems(-(-m // self.bm) * self.bm, p1.bn, k, dtype) if "shared memory" not in p]
        return found


def default_config(m: int, n1: int, n2: int, k: int, dtype: str = "float16", out_dtype: str = "float16") -> B2BConfig | None:
    """128-row blocks (two consumer warpgroups share each w1 and w2 tile: faster than 64 rows at
    every N1 on the H200, sessions 8 and 15), and the deepest GEMM 1 ring (up to 4 steps of 64,
    else of 32) that fits beside the w2 ring and the staging buffers. Up to N1 = 64: 128-column
    output tiles (64 for a float32 output: its staging buffers would take 128 KiB) and two w2
    stages. Wider: 64-column tiles and four w2 stages (session 15, ``experiments/b2b_configs.py``:
    the two warpgroups share each w2 chunk, and a two-slot ring keeps them in step, their
    epilogues at the same time; 65536 x 1024 -> 128 went from 118 to 104.5 us, 16384 -> 256 from
    61 to 42.9, 65536 -> 256 from 237 to 166). Session 26 (H100, ``experiments/b2b_overlap.py``):
    where the CTAs are persistent and the tiles 64 columns wide, the tiles stored beside the next
    tile's wgmmas (``overlap``) on the deepest w2 ring of up to six slots beside the GEMM 1 ring
    (65536 -> 128: 113.5 against 121.5 us; either alone no better than 118.9); where the blocks
    are one wave and not persistent, GEMM 1 on up to six 32-deep steps (16384 -> 256: 45.1 against
    49.5: a CTA's first wgmmas start on a smaller first load). None if nothing fits."""
    narrow, persistent = n1 <= 64, n1 <= 128
    bn2 = 128 if narrow and n2 % 128 == 0 and _size(out_dtype) == 2 else 64
    rings = ((4, 64), (3, 64), (2, 64), (4, 32), (3, 32), (2, 32))
    if not persistent and -(-m // 128) <= SM_COUNT:
        rings = ((6, 32), (5, 32)) + rings
    overlap = persistent and not narrow and bn2 == 64  # (measured at N1 = 128; at 64 with 128-column tiles it lost)
    w2 = ((6, True), (5, True), (4, True), (4, False)) if overlap else ((2 if narrow else 4, False),)
    for stages, bk in rings:
        for stages2, over in w2:
            cfg = B2BConfig(128, stages, bk, bn2, stages2, persistent, over)
            if not cfg.problems(m, n1, n2, k, dtype, out_dtype):
                return cfg
    return None


def problems(m: int, n1: int, n2: int, k: int, spec: B2B, cfg: B2BConfig | None = None) -> list:
    """What keeps the kernel from this pair (empty if nothing): any M, N1 in :data:`INTERMEDIATE`,
    N2 a multiple of 64, K of 32, static shapes."""
    found = spec.problems()
    if not all(isinstance(d, int) for d in (m, n1, n2, k)):
        return found + ["symbolic shapes (static only)"]
    out_dtype = spec.out_dtype if spec.out_dtype in OUT_DTYPES else "float16"
    cfg = cfg or default_config(m, n1, n2, k, spec.dtype, out_dtype)
    if cfg is None:
        return found + (B2BConfig(bk=32, stages=2, bn2=64).problems(m, n1, n2, k, spec.dtype, out_dtype)
                        or [f"M, N1, N2, K = {m}, {n1}, {n2}, {k}: no configuration fits"])
    return found + cfg.problems(m, n1, n2, k, spec.dtype, out_dtype)


def _intermediate(spec: B2B) -> Elementwise:
    """The first chain with its last rounding left to the pack into GEMM 2's A fragments
    (``cvt.rn`` rounds as the graph's cast does: one instruction for two values)."""
    steps = spec.first.steps
    if steps and steps[-1].dtype == spec.dtype:
        steps = steps[:-1] + (dataclasses.replace(steps[-1], dtype="float32"),)
    return dataclasses.replace(spec.first, steps=steps, out_dtype="float32")


def wgmma_b2b(m: int, n1: int, n2: int, k: int, spec: B2B = B2B(), cfg: B2BConfig | None = None, lead=None, out_lead=None):
    """The fused kernel, a tirx PrimFunc for sm_90a with parameters ``(x[*lead, k], w1[n1, k],
    the first chain's operands, w2[n2, n1], the second chain's operands, out[*out_lead, n2])``
    (operands: ``[n]`` vectors, or tiles ``[*lead, n1]`` in the first chain and ``[*out_lead,
    n2]`` in the second); ``lead`` are the row dimensions (``(m,)`` by default; ``(B, S)`` for
    3-D activations, read as ``B * S`` rows in place), ``out_lead`` the output's (default
    ``lead``: a graph may reshape the rows between the GEMMs). fp32 accumulation in both GEMMs."""
    found = problems(m, n1, n2, k, spec, cfg)
    if found:
        raise ComFuseError("wgmma b2b cannot take " + "; ".join(found))
    cfg = cfg or default_config(m, n1, n2, k, spec.dtype, spec.out_dtype)
    lead = tuple(lead or (m,))
    out_lead = tuple(out_lead or lead)
    if math.prod(lead) != m or math.prod(out_lead) != m:
        raise ComFuseError(f"wgmma b2b: row dimensions {lead} and {out_lead} do not both multiply to M = {m}")
    c1, dtype, odt = cfg.phase1(n1), spec.dtype, spec.out_dtype
    bm, bn2, st2, kt, chunks, tiles = cfg.bm, cfg.bn2, cfg.stages2, k // cfg.bk, n1 // 64, n2 // cfg.bn2
    blocks = -(-m // bm)
    grid = min(blocks, SM_COUNT) if cfg.persistent else blocks
    produce, consume = mainloop(c1, k, dtype)
    ring1, ring2 = Ring(c1.stages, c1.consumers), Ring(st2, c1.consumers)
    init1, init2 = ring1.init(), ring2.init()
    acquire2, wait2, release2 = ring2.acquire(), ring2.wait(), ring2.release()
    producer, consumer = roles(c1)
    maps = {"x": tensor_map(m, k, box_rows(bm), cfg.bk, dtype), "w1": tensor_map(n1, k, box_rows(n1), cfg.bk, dtype),
            "w2": tensor_map(n2, n1, bn2, 64, dtype), "out": tensor_map(m, n2, 64, box_cols(odt), odt)}
    t = _PTX_TYPE[dtype]
    mma2, pack = f"wgmma.mma_async.sync.aligned.m64n{bn2}k16.f32.{t}.{t}", f"cvt.rn.{t}x2.f32"
    first = _intermediate(spec)
    ring1_elems, ring2_elems = c1.smem_bytes // 2, cfg.ring2_bytes() // 2
    staged_at = (c1.smem_bytes + cfg.ring2_bytes()) // _size(odt)  # the staging buffers' offset, in output elements

    def clamp(row):  # a tile operand's row past M (the last block's TMA zeros): read row M - 1, not stored
        return T.min(row, m - 1) if m % bm else row

    # the second chain on each output tile, staged in shared memory and stored by TMA
    store_tile = staged_store(bn2, odt, lambda P, v, row, col, _here: epilogue_value(spec.second, P, v, clamp(row), col))
    drain = staged_drain()

    # pylint: disable=invalid-name,unused-variable,too-many-locals
    @T.macro
    def gemm2_chunk(S2, full2, acc2, frag, db, step, c):
        """Chunk ``c`` of an output tile (``step`` counted over the CTA's chunks): its wgmmas
        into ``acc2``, A from the registers, committed as one group."""
        wait2(full2, step)
        T.ptx["wgmma.fence.sync.aligned"]()
        for jj in T.unroll(4):
            j = T.meta_var(4 * c + jj)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(db[0]), S2.ptr_to([step % st2, 0, jj * 16]), 1, 1024 >> 4, 3)
            T.ptx[mma2](*[acc2[i] for i in range(bn2 // 2)], frag[4 * j], frag[4 * j + 1], frag[4 * j + 2], frag[4 * j + 3],
                        db[0], T.ptx.pred(j > 0), 1, 1, 0)
        T.ptx["wgmma.commit_group.sync.aligned"]()

    @T.macro
    def gemm2_tile(S2, full2, empty2, acc2, frag, db, tw, tile_no):
        """Output tile ``tile_no`` (counted over the CTA's blocks) of GEMM 2 into ``acc2``: its
        ``N1 / 64`` w2 chunks from the second ring; each chunk's slot is released once the next
        chunk's wgmmas are issued and its own have completed."""
        for c in T.unroll(chunks):
            gemm2_chunk(S2, full2, acc2, frag, db, tile_no * chunks + c, c)
            if c == chunks - 1:
                T.ptx["wgmma.wait_group.sync.aligned"](0)
                if c > 0:
                    release2(empty2, tile_no * chunks + c - 1, tw)
                release2(empty2, tile_no * chunks + c, tw)
            elif c > 0:
                T.ptx["wgmma.wait_group.sync.aligned"](1)
                release2(empty2, tile_no * chunks + c - 1, tw)

    @T.macro
    def gemm2_block(S2, full2, empty2, acc2, frag, db, tw, out_map, O, P2, cw, row0, first):
        """GEMM 2 and the second chain of one row block, its tiles ``first, first + 1, ...``
        (counted over the CTA's blocks) one after another."""
        for tile in T.serial(tiles):
            gemm2_tile(S2, full2, empty2, acc2, frag, db, tw, first + tile)
            store_tile(out_map, O, P2, acc2, cw, tw, row0, tile * bn2, (first + tile) % 2)

    @T.macro
    def overlapped_tile(S2, full2, empty2, acc2, prev, frag, db, tw, out_map, O, P2, cw, row0, first, t, after):
        """Tile ``t`` of the block into ``acc2``, its chunks' slots released as
        :func:`gemm2_tile`'s; with ``after`` (a tile precedes), the one before, in ``prev``, is
        stored once this tile's first chunk is issued and the ``wait_group 1`` after it has seen
        the previous tile's last group complete."""
        for c in T.unroll(chunks):
            step = T.meta_var((first + t) * chunks + c)
            gemm2_chunk(S2, full2, acc2, frag, db, step, c)
            if c > 0 or after:
                T.ptx["wgmma.wait_group.sync.aligned"](1)
                release2(empty2, step - 1, tw)
            if c == 0 and after:
                store_tile(out_map, O, P2, prev, cw, tw, row0, (t - 1) * bn2, (first + t - 1) % 2)

    @T.macro
    def overlapped_block(S2, full2, empty2, acc2, acc3, frag, db, tw, out_map, O, P2, cw, row0, first):
        """:func:`gemm2_block` with two accumulator sets (``B2BConfig.overlap``): tiles alternate
        between ``acc2`` and ``acc3``, each stored beside the next one's first wgmmas."""
        overlapped_tile(S2, full2, empty2, acc2, acc3, frag, db, tw, out_map, O, P2, cw, row0, first, 0, False)
        # unrolled: in a loop ptxas cannot tell the sets apart and waits for every wgmma group (C7514)
        for p in T.unroll(tiles // 2 - 1):
            overlapped_tile(S2, full2, empty2, acc3, acc2, frag, db, tw, out_map, O, P2, cw, row0, first, 2 * p + 1, True)
            overlapped_tile(S2, full2, empty2, acc2, acc3, frag, db, tw, out_map, O, P2, cw, row0, first, 2 * p + 2, True)
        overlapped_tile(S2, full2, empty2, acc3, acc2, frag, db, tw, out_map, O, P2, cw, row0, first, tiles - 1, True)
        T.ptx["wgmma.wait_group.sync.aligned"](0)
        release2(empty2, (first + tiles) * chunks - 1, tw)
        store_tile(out_map, O, P2, acc3, cw, tw, row0, (tiles - 1) * bn2, (first + tiles - 1) % 2)

    @T.macro
    def body(x_map, w1_map, w2_map, out_map, P1, P2):
        bx = T.cta_id([grid])
        wg = T.warpgroup_id([c1.consumers + 1])
        tw = T.thread_id_in_wg([128])
        # one dynamic buffer (tirx allows one): GEMM 1's ring, w2's ring, the two staging buffers
        flat = T.alloc_shared([ring1_elems + ring2_elems + cfg.staging_bytes(odt) // 2], dtype, scope="shared.dyn", align=1024)
        S1 = T.decl_buffer([c1.stages, bm + n1, cfg.bk], dtype, data=flat.data, scope="shared.dyn")
        S2 = T.decl_buffer([st2, bn2, 64], dtype, data=flat.data, elem_offset=ring1_elems, scope="shared.dyn")
        O = T.decl_buffer(buffer_shape(2, bm // 64, bn2, odt), odt, data=flat.data, elem_offset=staged_at, scope="shared.dyn")
        full = T.alloc_shared([c1.stages], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([c1.stages], "uint64", scope="shared", align=8)
        full2 = T.alloc_shared([st2], "uint64", scope="shared", align=8)
        empty2 = T.alloc_shared([st2], "uint64", scope="shared", align=8)
        acc1 = T.alloc_local([n1 // 2], "float32")
        acc2 = T.alloc_local([bn2 // 2], "float32")
        acc3 = T.alloc_local([bn2 // 2 if cfg.overlap else 1], "float32")  # the second set (overlap)
        frag = T.alloc_local([n1 // 4], "uint32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        init1(full, empty, wg * 128 + tw)
        init2(full2, empty2, wg * 128 + tw)
        iters = T.meta_var((blocks - 1 - bx) // grid + 1)  # row blocks bx, bx + grid, ...
        if wg == 0:
            producer()
            if tw == 0:  # GEMM 1's x and w1 tiles, block after block
                for it in T.serial(iters):
                    produce(x_map, w1_map, S1, S1, full, empty, (bx + it * grid) * bm, 0, it * kt)
            if tw == 32:  # w2's chunks (a second warp: its waits do not hold up x)
                for it in T.serial(iters):
                    for tile in T.serial(tiles):
                        for c in T.unroll(chunks):
                            step = T.meta_var((it * tiles + tile) * chunks + c)
                            acquire2(full2, empty2, step, bn2 * 64 * 2)
                            T.ptx[TMA_LOAD](S2.ptr_to([step % st2, 0, 0]), T.address_of(w2_map), c * 64, tile * bn2,
                                            full2.ptr_to([step % st2]))
        else:
            consumer()
            cw = T.meta_var(wg - 1)
            for it in T.serial(iters):
                row0 = T.meta_var((bx + it * grid) * bm + cw * 64)
                consume(S1, S1, full, empty, acc1, da, db, cw, tw, it * kt)
                for j in T.unroll(n1 // 16):  # the first chain, packed: the A fragments of GEMM 2
                    for p in T.unroll(4):
                        lrow, col = T.meta_var(fragment(tw, 8 * j + 2 * p))
                        lo = T.meta_var(epilogue_value(first, P1, acc1[8 * j + 2 * p], clamp(row0 + lrow), col))
                        hi = T.meta_var(epilogue_value(first, P1, acc1[8 * j + 2 * p + 1], clamp(row0 + lrow), col + 1))
                        T.ptx[pack](frag[4 * j + p], hi, lo)
                if cfg.overlap:
                    overlapped_block(S2, full2, empty2, acc2, acc3, frag, db, tw, out_map, O, P2, cw, row0, it * tiles)
                else:
                    gemm2_block(S2, full2, empty2, acc2, frag, db, tw, out_map, O, P2, cw, row0, it * tiles)
            drain(tw)

    # the parameter list depends on the operands: the signature is generated, the body is the macro above
    def operands(prefix, half, n, rows):
        return [(f"{prefix}{j}", (*rows, n) if tile else (n,), d, (m, n) if tile else None) for j, (d, tile) in enumerate(half.operands)]

    signature = [("x", (*lead, k), dtype, (m, k)), ("w1", (n1, k), dtype, None), *operands("p", spec.first, n1, lead),
                 ("w2", (n2, n1), dtype, None), *operands("q", spec.second, n2, out_lead), ("out", (*out_lead, n2), odt, (m, n2))]
    lines = [f"def b2b_gemm({', '.join(f'{p}_h: T.handle' for p, *_ in signature)}):"]
    lines += [f"    {p}_p = T.match_buffer({p}_h, {shp}, {dt!r}, align=16)" for p, shp, dt, _ in signature]
    lines += [f"    {p}_map: T.let[T.handle('tensormap')] = T.tvm_stack_alloca('tensormap', 1)" for p in maps]
    lines += [f"    encode_{p}({p}_map, {p}_p.data)" for p in maps] + ["    T.device_entry()"]
    lines += [f"    {p} = T.decl_buffer({view}, {dt!r}, data={p}_p.data)" if view else f"    {p} = {p}_p"
              for p, _, dt, view in signature if p[0] in "pq"]
    ops1, ops2 = (", ".join(f"{c}{j}" for j in range(len(h.operands))) for c, h in (("p", spec.first), ("q", spec.second)))
    lines += [f"    body(x_map, w1_map, w2_map, out_map, ({ops1}{',' if ops1 else ''}), ({ops2}{',' if ops2 else ''}))"]
    return tvm.script.from_source("@T.prim_func\n" + "\n".join(lines),
                                  extra_vars={"T": T, "body": body, **{f"encode_{p}": enc for p, enc in maps.items()}})
