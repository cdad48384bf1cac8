"""The Hopper mainloop (issue 8), first step: a plain GEMM on ``wgmma.mma_async``, in TVM's tirx.

Why a second mainloop: the mma.sync one (:mod:`.mma_mainloop`) tops out near 0.55x of cuBLAS on
the H200 (428 TFLOP/s as a plain 4096^3 GEMM), and the fused kernels inherit that ceiling.
sm_90a's warpgroup MMA reads both operands straight from shared memory through 64-bit matrix
descriptors, so no ldmatrix and no register staging of A and B, and one instruction covers a
``64 x bn x 16`` step for a whole warpgroup (128 threads).

s_tir has no wgmma intrinsic, so this is written in TVM 0.27's tirx dialect (``T.ptx[...]``,
``T.cuda.wgmma``: TVM's own certified PTX table), compiled with ``tir_pipeline="tirx"``:

    global --cp.async 16 B--> shared.dyn, ``stages``-deep ring, 128-byte swizzle
        (row ``r``'s 16-byte chunk ``j`` at chunk ``j ^ (r % 8)``: the layout
        TMA's SWIZZLE_128B writes, so a TMA producer can replace cp.async unchanged)
    shared --wgmma.mma_async m64n{bn}k16 (descriptors, SBO 1024 B)--> fp32 registers
    registers --cast--> global C

One warpgroup per 64 rows of the ``bm x bn`` tile. The ring keeps ``stages - 1`` tile loads in
flight: iteration ``k`` refills the slot iteration ``k - 1`` read, released by ``wgmma.wait_group
0`` at the end of ``k - 1`` and the barrier at the top of ``k``. (Keeping one wgmma group in
flight across iterations, ``wait_group 1``, makes ptxas serialize the wgmmas anyway: its C7514
warning, "non wgmma instructions reading accumulator registers", even with the accumulators
pinned by empty asm; a warp-specialised producer is the way to overlap more.) Not yet used by the gemm_reduce rule: its speed against cuBLAS is to be measured
(``notebooks/results/experiments/wgmma_gemm.py``); then it takes the row epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from ..errors import ComFuseError

#: K step of one ring slot: 64 fp16/bf16 elements are one 128-byte swizzle row.
BK = 64
#: Shared memory one thread block may use on sm_90 (227 KiB).
SMEM_LIMIT = 227 * 1024
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class WgmmaConfig:
    """A CTA computes a ``bm x bn`` tile with ``bm // 64`` warpgroups and a ``stages``-deep ring."""

    bm: int = 128
    bn: int = 256
    stages: int = 4

    @property
    def threads(self) -> int:
        return 2 * self.bm  # 128 threads per 64-row warpgroup

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * BK * 2

    def check(self, m: int, n: int, k: int, dtype: str) -> None:
        """Raise ComFuseError naming what does not fit, and what would."""
        problems = []
        if dtype not in _PTX_TYPE:
            problems.append(f"dtype {dtype} (wgmma here takes {sorted(_PTX_TYPE)})")
        if self.bm % 64 or not 64 <= self.bm <= 192:
            problems.append(f"bm = {self.bm} (64, 128 or 192: one warpgroup per 64 rows)")
        if self.bn % 16 or not 16 <= self.bn <= 256:
            problems.append(f"bn = {self.bn} (a multiple of 16 up to 256, wgmma's N)")
        if self.stages < 2:
            problems.append(f"stages = {self.stages} (at least 2: a load in flight while the tensor cores work)")
        if (self.bm * BK // 8) % self.threads or (self.bn * BK // 8) % self.threads:
            problems.append(f"bm, bn = {self.bm}, {self.bn} (each thread copies whole 16-byte chunks)")
        if self.smem_bytes > SMEM_LIMIT:
            problems.append(f"{self.smem_bytes // 1024} KiB of shared memory (at most {SMEM_LIMIT // 1024}: fewer stages)")
        if m % self.bm or n % self.bn or k % BK:
            problems.append(f"M, N, K = {m}, {n}, {k} (multiples of bm = {self.bm}, bn = {self.bn}, {BK})")
        if problems:
            raise ComFuseError("wgmma GEMM cannot use " + "; ".join(problems))


def wgmma_gemm(m: int, n: int, k: int, dtype: str = "float16", cfg: WgmmaConfig = WgmmaConfig()):
    """``C[m, n] = A[m, k] @ B[n, k].T`` (PyTorch's linear layout), fp32 accumulation, C in
    ``dtype``; a tirx PrimFunc for sm_90a. Static shapes, multiples of the tile."""
    cfg.check(m, n, k, dtype)
    bm, bn, st, nt = cfg.bm, cfg.bn, cfg.stages, cfg.threads
    kt, lead = k // BK, cfg.stages - 1
    acc_n = bn // 2  # fp32 accumulators per thread for m64 x bn
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{_PTX_TYPE[dtype]}.{_PTX_TYPE[dtype]}"
    sbo = 1024 >> 4  # 8 rows x 128 B between core-matrix groups, in 16-byte units

    @T.macro(hygienic=False)
    def load(slot, kk):  # the A and B tiles of K step kk into ring slot ``slot``
        for i in T.unroll(bm * BK // 8 // nt):
            r = T.meta_var((i * nt + tx) // 8)
            j = T.meta_var((i * nt + tx) % 8)
            T.ptx["cp.async.cg.shared.global"](
                S.ptr_to([slot, r, (j ^ (r % 8)) * 8]), A.ptr_to([bx * bm + r, kk * BK + j * 8]), 16
            )
        for i in T.unroll(bn * BK // 8 // nt):
            r = T.meta_var((i * nt + tx) // 8)
            j = T.meta_var((i * nt + tx) % 8)
            T.ptx["cp.async.cg.shared.global"](
                S.ptr_to([slot, bm + r, (j ^ (r % 8)) * 8]), B.ptr_to([by * bn + r, kk * BK + j * 8]), 16
            )

    # pylint: disable=invalid-name,too-many-locals
    @T.prim_func
    def gemm(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, (m, k), dtype, align=16)
        B = T.match_buffer(b, (n, k), dtype, align=16)
        C = T.match_buffer(c, (m, n), dtype, align=16)
        T.device_entry()
        bx, by = T.cta_id([m // bm, n // bn])
        tx = T.thread_id([nt])
        # one dynamic buffer (tirx allows one): per slot, the A tile's bm rows, then B's bn
        S = T.alloc_shared([st, bm + bn, BK], dtype, scope="shared.dyn", align=1024)
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        wg = T.meta_var(tx // 128)

        for s in T.unroll(lead):
            if s < kt:
                load(s, s)
            T.ptx["cp.async.commit_group"]()
        for kk in T.serial(kt):
            T.ptx["cp.async.wait_group"](lead - 1)
            T.ptx["fence.proxy.async.shared::cta"]()  # cp.async wrote through the generic proxy
            T.cuda.cta_sync()
            if kk + lead < kt:
                load((kk + lead) % st, kk + lead)
            T.ptx["cp.async.commit_group"]()
            T.ptx["wgmma.fence.sync.aligned"]()
            for ks in T.unroll(BK // 16):
                T.cuda.wgmma.encode_matrix_descriptor(
                    T.address_of(da[0]), S.ptr_to([kk % st, wg * 64, ks * 16]), 1, sbo, 3
                )
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(db[0]), S.ptr_to([kk % st, bm, ks * 16]), 1, sbo, 3)
                T.ptx[mma](*[acc[i] for i in range(acc_n)], da[0], db[0], T.ptx.pred(kk > 0 or ks > 0), 1, 1, 0, 0)
            T.ptx["wgmma.commit_group.sync.aligned"]()
            T.ptx["wgmma.wait_group.sync.aligned"](0)
        # the m64nNk16 accumulator layout: register i of lane l in warp w of the warpgroup
        w = T.meta_var((tx % 128) // 32)
        ln = T.meta_var(tx % 32)
        for i in T.unroll(acc_n):
            C[bx * bm + wg * 64 + w * 16 + ln // 4 + 8 * ((i // 2) % 2), by * bn + (i // 4) * 8 + (ln % 4) * 2 + i % 2] = (
                T.cast(acc[i], dtype)
            )

    return gemm


def build(func, arch: str = "sm_90a"):
    """Compile a tirx PrimFunc from :func:`wgmma_gemm` (wgmma needs the ``a`` of sm_90a)."""
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    return tvm.compile(tvm.IRModule({"main": func}), target=target, tir_pipeline="tirx")
