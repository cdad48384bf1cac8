"""The Hopper mainloop (issue 8), first step: GEMM tiles on ``wgmma.mma_async``, in TVM's tirx.

Why a second mainloop: the mma.sync one (:mod:`.mma_mainloop`) tops out near 0.55x of cuBLAS on
the H200 (428 TFLOP/s as a plain 4096^3 GEMM), and the fused kernels inherit that ceiling.
sm_90a's warpgroup MMA reads both operands straight from shared memory through 64-bit matrix
descriptors, so no ldmatrix and no register staging of A and B, and one instruction covers a
``64 x n x 16`` step for a whole warpgroup (128 threads).

s_tir has no wgmma intrinsic, so this is written in TVM 0.27's tirx dialect (``T.ptx[...]``,
``T.cuda.wgmma``: TVM's own certified PTX table), compiled with ``tir_pipeline="tirx"``:

    global --cp.async 16 B--> shared.dyn, ``stages``-deep ring, ``2 * bk``-byte swizzle
        (row ``r``'s 16-byte chunk ``j`` at ``j ^ ((r * row_bytes >> 7) % chunks)``: the layout
        TMA's SWIZZLE_64B/128B writes, so a TMA producer can replace cp.async unchanged)
    shared --wgmma.mma_async m64n{bn / wg_n}k16 (descriptors, SBO = 8 rows)--> fp32 registers

A CTA's ``bm x bn`` tile is a grid of ``bm / 64 x wg_n`` warpgroups: the plain GEMM splits rows
(``wg_n = 1``), a whole-row epilogue splits the row's columns (:mod:`.wgmma_postnorm`). The
ring keeps ``stages - 1`` tile loads in flight: iteration ``k`` refills the slot iteration
``k - 1`` read, released by ``wgmma.wait_group 0`` at the end of ``k - 1`` and the barrier at
the top of ``k``. (Keeping one wgmma group in flight across iterations, ``wait_group 1``, makes
ptxas serialize the wgmmas anyway: its C7514 warning, "non wgmma instructions reading
accumulator registers", even with the accumulators pinned by empty asm; a warp-specialised TMA
producer is the way to overlap more.) :mod:`.wgmma_postnorm` builds the fused kernel on it.
Not yet run on a GPU: its speed against cuBLAS is to be measured
(``notebooks/results/experiments/wgmma_gemm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from ..errors import ComFuseError

#: Shared memory one thread block may use on sm_90 (227 KiB), less 8 KiB for static buffers.
SMEM_LIMIT = 219 * 1024
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
_SWIZZLE = {32: 2, 64: 3}  # bk -> the descriptor's swizzle code: 64-byte rows, 128-byte rows


@dataclass(frozen=True)
class WgmmaConfig:
    """A CTA computes a ``bm x bn`` tile, K in ``bk`` steps through a ``stages``-deep ring, with
    ``bm / 64 x wg_n`` warpgroups (each a ``64 x bn / wg_n`` wgmma tile)."""

    bm: int = 128
    bn: int = 256
    stages: int = 4
    bk: int = 64
    wg_n: int = 1

    @property
    def threads(self) -> int:
        return 128 * self.bm // 64 * self.wg_n

    @property
    def wg_cols(self) -> int:
        return self.bn // self.wg_n

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.bk * 2

    def problems(self, m: int, n: int, k: int, dtype: str) -> list:
        """What keeps this configuration from computing an ``m x n x k`` GEMM (empty if nothing)."""
        found = []
        if dtype not in _PTX_TYPE:
            found.append(f"dtype {dtype} (wgmma here takes {sorted(_PTX_TYPE)})")
        if self.bm % 64 or not 64 <= self.bm <= 192:
            found.append(f"bm = {self.bm} (64, 128 or 192: 64 rows per warpgroup)")
        if self.bn % self.wg_n or self.wg_cols % 16 or not 16 <= self.wg_cols <= 256:
            found.append(f"bn / wg_n = {self.bn} / {self.wg_n} (a multiple of 16 up to 256, wgmma's N)")
        if self.bk not in _SWIZZLE:
            found.append(f"bk = {self.bk} (32 or 64: one 64- or 128-byte swizzled row)")
        if self.stages < 2:
            found.append(f"stages = {self.stages} (at least 2: a load in flight while the tensor cores work)")
        if self.threads > 1024:
            found.append(f"{self.threads} threads (at most 1024)")
        if self.smem_bytes > SMEM_LIMIT:
            found.append(f"{self.smem_bytes // 1024} KiB of shared memory (at most {SMEM_LIMIT // 1024}: fewer stages or a smaller bk)")
        if m % self.bm or n % self.bn or k % self.bk:
            found.append(f"M, N, K = {m}, {n}, {k} (multiples of bm = {self.bm}, bn = {self.bn}, bk = {self.bk})")
        return found

    def check(self, m: int, n: int, k: int, dtype: str) -> None:
        """Raise ComFuseError naming what does not fit, and what would."""
        found = self.problems(m, n, k, dtype)
        if found:
            raise ComFuseError("wgmma GEMM cannot use " + "; ".join(found))


def swizzled_copy(bk: int, nt: int):
    """The tirx macro ``copy_rows(S, tx, slot, base, src, rows, row0, kk)``: ``nt`` threads copy
    rows ``[row0, row0 + rows)`` of ``src``'s K step ``kk`` (``bk`` columns) by cp.async into
    rows ``[base, base + rows)`` of ``S[slot]``, in the ``2 * bk``-byte swizzle the descriptors
    of :func:`mainloop` read (``base`` a multiple of 8)."""
    chunks = bk // 8
    phase = 128 // (bk * 2)  # rows per 128 bytes: the swizzle's XOR term is (row // phase) % chunks

    # pylint: disable=invalid-name
    @T.macro
    def copy_rows(S, tx, slot, base, src, rows, row0, kk):
        for i in T.unroll((rows * chunks + nt - 1) // nt):
            if rows * chunks % nt == 0 or i * nt + tx < rows * chunks:
                r = T.meta_var((i * nt + tx) // chunks)
                j = T.meta_var((i * nt + tx) % chunks)
                T.ptx["cp.async.cg.shared.global"](
                    S.ptr_to([slot, base + r, (j ^ ((r // phase) % chunks)) * 8]), src.ptr_to([row0 + r, kk * bk + j * 8]), 16
                )

    return copy_rows


def mainloop(cfg: WgmmaConfig, k: int, dtype: str):
    """The K loop as a tirx macro ``run(A, B, S, acc, da, db, tx, bx, by)``: ``acc`` (``wg_cols /
    2`` fp32 per thread) ends holding thread ``tx``'s share of its warpgroup's ``64 x wg_cols``
    tile of ``A @ B.T`` for the CTA at row tile ``bx``, column tile ``by``. ``S`` is the
    ``[stages, bm + bn, bk]`` ring, ``da``, ``db`` one uint64 each for the descriptors."""
    bm, bn, bk, st, nt = cfg.bm, cfg.bn, cfg.bk, cfg.stages, cfg.threads
    kt, lead = k // bk, cfg.stages - 1
    acc_n, wg_cols = cfg.wg_cols // 2, cfg.wg_cols
    mma = f"wgmma.mma_async.sync.aligned.m64n{wg_cols}k16.f32.{_PTX_TYPE[dtype]}.{_PTX_TYPE[dtype]}"
    sbo = 8 * bk * 2 >> 4  # 8 swizzled rows between core-matrix groups, in 16-byte units

    copy_rows = swizzled_copy(bk, nt)

    # pylint: disable=invalid-name
    @T.macro
    def load(A, B, S, tx, bx, by, slot, kk):
        copy_rows(S, tx, slot, 0, A, bm, bx * bm, kk)
        copy_rows(S, tx, slot, bm, B, bn, by * bn, kk)

    @T.macro
    def run(A, B, S, acc, da, db, tx, bx, by):
        wg = T.meta_var(tx // 128)
        for s in T.unroll(lead):
            if s < kt:
                load(A, B, S, tx, bx, by, s, s)
            T.ptx["cp.async.commit_group"]()
        for kk in T.serial(kt):
            T.ptx["cp.async.wait_group"](lead - 1)
            T.ptx["fence.proxy.async.shared::cta"]()  # cp.async wrote through the generic proxy
            T.cuda.cta_sync()
            if kk + lead < kt:
                load(A, B, S, tx, bx, by, (kk + lead) % st, kk + lead)
            T.ptx["cp.async.commit_group"]()
            T.ptx["wgmma.fence.sync.aligned"]()
            for ks in T.unroll(bk // 16):
                T.cuda.wgmma.encode_matrix_descriptor(
                    T.address_of(da[0]), S.ptr_to([kk % st, wg // cfg.wg_n * 64, ks * 16]), 1, sbo, _SWIZZLE[bk]
                )
                T.cuda.wgmma.encode_matrix_descriptor(
                    T.address_of(db[0]), S.ptr_to([kk % st, bm + wg % cfg.wg_n * wg_cols, ks * 16]), 1, sbo, _SWIZZLE[bk]
                )
                T.ptx[mma](*[acc[i] for i in range(acc_n)], da[0], db[0], T.ptx.pred(kk > 0 or ks > 0), 1, 1, 0, 0)
            T.ptx["wgmma.commit_group.sync.aligned"]()
            T.ptx["wgmma.wait_group.sync.aligned"](0)

    return run


def fragment(tx, i):
    """``(row, col)`` inside its warpgroup's ``64 x n`` tile of accumulator register ``i`` of
    thread ``tx`` (PTX ISA, wgmma m64nNk16 fp32 D fragments: per warp 16 rows, per 8 columns
    four registers)."""
    lane = tx % 32
    return (tx % 128) // 32 * 16 + lane // 4 + 8 * ((i // 2) % 2), (i // 4) * 8 + (lane % 4) * 2 + i % 2


def wgmma_gemm(m: int, n: int, k: int, dtype: str = "float16", cfg: WgmmaConfig = WgmmaConfig()):
    """``C[m, n] = A[m, k] @ B[n, k].T`` (PyTorch's linear layout), fp32 accumulation, C in
    ``dtype``; a tirx PrimFunc for sm_90a. Static shapes, multiples of the tile."""
    cfg.check(m, n, k, dtype)
    bm, bn, acc_n = cfg.bm, cfg.bn, cfg.wg_cols // 2
    run = mainloop(cfg, k, dtype)

    # pylint: disable=invalid-name,unused-variable
    @T.prim_func
    def gemm(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, (m, k), dtype, align=16)
        B = T.match_buffer(b, (n, k), dtype, align=16)
        C = T.match_buffer(c, (m, n), dtype, align=16)
        T.device_entry()
        bx, by = T.cta_id([m // bm, n // bn])
        tx = T.thread_id([cfg.threads])
        # one dynamic buffer (tirx allows one): per slot, the A tile's bm rows, then B's bn
        S = T.alloc_shared([cfg.stages, bm + bn, cfg.bk], dtype, scope="shared.dyn", align=1024)
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        wg = T.meta_var(tx // 128)
        run(A, B, S, acc, da, db, tx, bx, by)
        for i in T.unroll(acc_n):
            row, col = T.meta_var(fragment(tx, i))
            C[bx * bm + wg // cfg.wg_n * 64 + row, by * bn + wg % cfg.wg_n * cfg.wg_cols + col] = T.cast(acc[i], dtype)

    return gemm


def build(func, arch: str = "sm_90a"):
    """Compile a tirx PrimFunc from this module (wgmma needs the ``a`` of sm_90a)."""
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    return tvm.compile(tvm.IRModule({"main": func}), target=target, tir_pipeline="tirx")
