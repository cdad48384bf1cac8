"""Hopper back-to-back GEMM (issue 5, first step): ``act(x @ w1.T + b1) @ w2.T + b2``, one kernel.

The intermediate never leaves the chip, and not even the registers: a CTA computes 64 rows of
the first GEMM on :mod:`.wgmma_mainloop` (``N1 <= 256``: the whole intermediate row), adds the
bias and applies the activation on the fp32 accumulators, and packs them to fp16 pairs that are
exactly the A-operand fragments of the second GEMM's ``wgmma.mma_async`` in its register-A
form (accumulator pair ``(8j + 2p, 8j + 2p + 1)`` is A register ``p`` of k-slice ``j``: the
m64nNk16 D layout and the m64k16 A layout coincide per warp). The second GEMM then streams
``w2`` in ``bn2``-row tiles (double-buffered with cp.async, in the space phase 1's ring used)
and writes each ``64 x bn2`` output tile with its bias.

One warpgroup per CTA, ``M / 64`` CTAs; the intermediate is rounded to fp16 once, after the
activation (the graph rounds after the GEMM, the bias and the activation: within fp16 rounding).
Not yet in the Relax pipeline (the pass detects ``b2b_gemm`` groups; outlining them comes with
the measurement) and not yet run on a GPU: ``notebooks/results/experiments/wgmma_gemm.py``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..errors import ComFuseError
from .wgmma_mainloop import _PTX_TYPE, SMEM_LIMIT, WgmmaConfig, fragment, mainloop, swizzled_copy

ACTIVATIONS = ("identity", "relu", "gelu", "silu")


def _activate(v, act: str):
    if act == "relu":
        return T.max(v, T.float32(0))
    if act == "silu":
        return v / (T.float32(1) + T.exp(-v))
    if act == "gelu":
        return T.float32(0.5) * v * (T.float32(1) + T.erf(v * T.float32(0.7071067811865476)))
    return v


def b2b_config(n1: int, n2: int) -> tuple:
    """``(phase-1 WgmmaConfig, bn2)``: the deepest ring (up to 4) whose space also holds two
    ``w2`` tiles, and the widest ``bn2 <= 128`` that divides ``n2``."""
    bn2 = next((b for b in (128, 96, 64, 48, 32, 16) if n2 % b == 0), None)
    if bn2 is None:
        raise ComFuseError(f"wgmma b2b: N2 = {n2} is not a multiple of 16")
    stages = min(4, SMEM_LIMIT // ((64 + n1) * 64 * 2))
    return WgmmaConfig(bm=64, bn=n1, stages=stages, bk=64, wg_n=1), bn2


def b2b_problems(m, n1, n2, k, dtype, act) -> list:
    """What keeps :func:`wgmma_b2b` from these shapes (empty if nothing)."""
    found = []
    if act not in ACTIVATIONS:
        found.append(f"activation {act!r} (one of {ACTIVATIONS})")
    if not all(isinstance(d, int) for d in (m, n1, n2, k)):
        return found + ["symbolic shapes (static only)"]
    if n1 % 64 or not 64 <= n1 <= 256:
        found.append(f"N1 = {n1} (64, 128, 192 or 256: the intermediate row in one warpgroup's registers)")
    try:
        cfg, bn2 = b2b_config(n1, n2)
    except ComFuseError as err:
        return found + [str(err)]
    if 2 * n1 * bn2 * 2 > SMEM_LIMIT:
        found.append(f"two {bn2} x {n1} w2 tiles ({4 * n1 * bn2 // 1024} KiB) do not fit shared memory")
    return found + cfg.problems(m, n1, k, dtype)


def wgmma_b2b(m: int, n1: int, n2: int, k: int, dtype: str = "float16", act: str = "relu"):
    """``out[m, n2] = act(x[m, k] @ w1[n1, k].T + b1) @ w2[n2, n1].T + b2``, fp32 accumulation,
    a tirx PrimFunc for sm_90a with parameters ``(x, w1, b1, w2, b2, out)``."""
    found = b2b_problems(m, n1, n2, k, dtype, act)
    if found:
        raise ComFuseError("wgmma b2b cannot take " + "; ".join(found))
    cfg, bn2 = b2b_config(n1, n2)
    run = mainloop(cfg, k, dtype)
    ring = cfg.stages * (64 + n1) * 64
    pool = max(ring, 2 * n1 * bn2)  # phase 2's w2 tiles reuse phase 1's ring
    acc1_n, acc2_n, slices, tiles = n1 // 2, bn2 // 2, n1 // 16, n2 // bn2
    t = _PTX_TYPE[dtype]
    mma2 = f"wgmma.mma_async.sync.aligned.m64n{bn2}k16.f32.{t}.{t}"
    pack = f"cvt.rn.{t}x2.f32"

    copy_rows = swizzled_copy(64, 128)

    # pylint: disable=invalid-name,unused-variable,too-many-locals
    @T.macro
    def load_w2(W2, W2v, tx, slot, tile):  # rows [tile * bn2, +bn2) of w2, as n1 / 64 swizzled sub-tiles
        for c in T.unroll(n1 // 64):
            copy_rows(W2v, tx, slot * (n1 // 64) + c, 0, W2, bn2, tile * bn2, c)

    @T.prim_func
    def b2b(x: T.handle, w1: T.handle, b1: T.handle, w2: T.handle, b2: T.handle, o: T.handle):
        A = T.match_buffer(x, (m, k), dtype, align=16)
        B1 = T.match_buffer(w1, (n1, k), dtype, align=16)
        bias1 = T.match_buffer(b1, (n1,), dtype)
        W2 = T.match_buffer(w2, (n2, n1), dtype, align=16)
        bias2 = T.match_buffer(b2, (n2,), dtype)
        out = T.match_buffer(o, (m, n2), dtype, align=16)
        T.device_entry()
        bx = T.cta_id([m // 64])
        tx = T.thread_id([128])
        P = T.alloc_shared([pool], dtype, scope="shared.dyn", align=1024)
        S = T.decl_buffer((cfg.stages, 64 + n1, 64), dtype, data=P.data, scope="shared.dyn")
        W2s = T.decl_buffer((2, n1 // 64, bn2, 64), dtype, data=P.data, scope="shared.dyn")
        W2v = T.decl_buffer((2 * (n1 // 64), bn2, 64), dtype, data=P.data, scope="shared.dyn")  # one slot per sub-tile
        acc1 = T.alloc_local([acc1_n], "float32")
        acc2 = T.alloc_local([acc2_n], "float32")
        frag = T.alloc_local([slices * 4], "uint32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        run(A, B1, S, acc1, da, db, tx, bx, 0)
        for j in T.unroll(slices):  # bias, activation, fp16 pairs: the A fragments of GEMM 2
            for p in T.unroll(4):
                col = T.meta_var(fragment(tx, 8 * j + 2 * p)[1])
                lo = T.meta_var(_activate(acc1[8 * j + 2 * p] + T.cast(bias1[col], "float32"), act))
                hi = T.meta_var(_activate(acc1[8 * j + 2 * p + 1] + T.cast(bias1[col + 1], "float32"), act))
                T.ptx[pack](frag[4 * j + p], hi, lo)
        T.cuda.cta_sync()  # the ring is free: w2 tiles take its place
        load_w2(W2, W2v, tx, 0, 0)
        T.ptx["cp.async.commit_group"]()
        for tile in T.serial(tiles):
            if tile + 1 < tiles:
                load_w2(W2, W2v, tx, (tile + 1) % 2, tile + 1)
            T.ptx["cp.async.commit_group"]()
            T.ptx["cp.async.wait_group"](1)
            T.ptx["fence.proxy.async.shared::cta"]()
            T.cuda.cta_sync()
            T.ptx["wgmma.fence.sync.aligned"]()
            for j in T.unroll(slices):
                T.cuda.wgmma.encode_matrix_descriptor(
                    T.address_of(db[0]), W2s.ptr_to([tile % 2, j // 4, 0, j % 4 * 16]), 1, 1024 >> 4, 3
                )
                T.ptx[mma2](*[acc2[i] for i in range(acc2_n)], frag[4 * j], frag[4 * j + 1], frag[4 * j + 2],
                            frag[4 * j + 3], db[0], T.ptx.pred(j > 0), 1, 1, 0)
            T.ptx["wgmma.commit_group.sync.aligned"]()
            T.ptx["wgmma.wait_group.sync.aligned"](0)
            for q in T.unroll(acc2_n // 2):
                for v in T.vectorized(2):
                    row, col = T.meta_var(fragment(tx, 2 * q + v))
                    out[bx * 64 + row, tile * bn2 + col] = T.cast(
                        acc2[2 * q + v] + T.cast(bias2[tile * bn2 + col], "float32"), dtype
                    )
            T.cuda.cta_sync()  # this tile's slot is refilled two tiles on

    return b2b
