"""Hopper back-to-back GEMM (issue 5, first step): ``act(x @ w1.T + b1) @ w2.T + b2``, one kernel.

The intermediate never leaves the chip, and not even the registers: each consumer warpgroup
computes 64 rows of the first GEMM on :mod:`.wgmma_mainloop` (``N1 <= 256``: the whole
intermediate row), adds the bias and applies the activation on the fp32 accumulators, and packs
them to fp16 pairs that are exactly the A-operand fragments of the second GEMM's
``wgmma.mma_async`` in its register-A form (accumulator pair ``(8j + 2p, 8j + 2p + 1)`` is A
register ``p`` of k-slice ``j``: the m64nNk16 D layout and the m64k16 A layout coincide per
warp). The second GEMM's ``w2`` streams through the same TMA ring, after GEMM 1's K steps: its
``bn2``-row tiles as ``N1 / 64`` chunks of 64 columns, one ring step each, so the producer loads
w2 while the consumers still finish GEMM 1 or store the previous output tile.

``bm / 64`` consumer warpgroups per CTA share each w1 and w2 tile; the intermediate is rounded
to fp16 once, after the activation (the graph rounds after the GEMM, the bias and the
activation: within fp16 rounding). Not yet in the Relax pipeline (the pass detects
``b2b_gemm`` groups; outlining them comes with the measurement). The first version (one
warpgroup, cp.async) was correct on the H200 but slower than eager PyTorch at M = 65536
(``notebooks/results/session8-h200-2026-12-03/``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..errors import ComFuseError
from .chain import activation
from .wgmma_mainloop import (_PTX_TYPE, SMEM_LIMIT, TMA_LOAD, Ring, WgmmaConfig, box_rows, fragment, mainloop, roles,
                             tensor_map)

ACTIVATIONS = ("identity", "relu", "gelu", "silu")


def _activate(v, act: str):
    return v if act == "identity" else activation(v, act)


def b2b_config(n1: int, n2: int, bm: int = 128) -> tuple:
    """``(phase-1 WgmmaConfig, bn2)``: ``bm`` rows a CTA (``bm / 64`` consumer warpgroups), the
    deepest ring (up to 4), and the widest ``bn2 <= 128`` that divides ``n2`` (a w2 chunk,
    ``bn2 x 64``, takes one ring slot)."""
    bn2 = next((b for b in (128, 96, 64, 48, 32, 16) if n2 % b == 0), None)
    if bn2 is None:
        raise ComFuseError(f"wgmma b2b: N2 = {n2} is not a multiple of 16")
    stages = min(4, SMEM_LIMIT // ((bm + n1) * 64 * 2))
    return WgmmaConfig(bm=bm, bn=n1, stages=stages, bk=64, wg_n=1), bn2


def b2b_problems(m, n1, n2, k, dtype, act, bm: int = 128) -> list:
    """What keeps :func:`wgmma_b2b` from these shapes (empty if nothing)."""
    found = []
    if act not in ACTIVATIONS:
        found.append(f"activation {act!r} (one of {ACTIVATIONS})")
    if not all(isinstance(d, int) for d in (m, n1, n2, k)):
        return found + ["symbolic shapes (static only)"]
    if n1 % 64 or not 64 <= n1 <= 256:
        found.append(f"N1 = {n1} (64, 128, 192 or 256: the intermediate row in one warpgroup's registers)")
    try:
        cfg, bn2 = b2b_config(n1, n2, bm)
    except ComFuseError as err:
        return found + [str(err)]
    if cfg.stages < n1 // 64:
        found.append(f"a {cfg.stages}-slot ring for {n1 // 64} w2 chunks a tile (a smaller bm)")
    return found + cfg.problems(m, n1, k, dtype)


def wgmma_b2b(m: int, n1: int, n2: int, k: int, dtype: str = "float16", act: str = "relu", bm: int = 128):
    """``out[m, n2] = act(x[m, k] @ w1[n1, k].T + b1) @ w2[n2, n1].T + b2``, fp32 accumulation,
    a tirx PrimFunc for sm_90a with parameters ``(x, w1, b1, w2, b2, out)``."""
    found = b2b_problems(m, n1, n2, k, dtype, act, bm)
    if found:
        raise ComFuseError("wgmma b2b cannot take " + "; ".join(found))
    cfg, bn2 = b2b_config(n1, n2, bm)
    st, kt, chunks, tiles = cfg.stages, k // 64, n1 // 64, n2 // bn2
    produce, consume = mainloop(cfg, k, dtype)
    ring = Ring(st, cfg.consumers)
    init, acquire, wait, release = ring.init(), ring.acquire(), ring.wait(), ring.release()
    producer, consumer = roles(cfg)
    encode_x, encode_w1 = tensor_map(m, k, box_rows(bm), 64, dtype), tensor_map(n1, k, box_rows(n1), 64, dtype)
    encode_w2 = tensor_map(n2, n1, bn2, 64, dtype)
    acc1_n, acc2_n, slices = n1 // 2, bn2 // 2, n1 // 16
    t = _PTX_TYPE[dtype]
    mma2 = f"wgmma.mma_async.sync.aligned.m64n{bn2}k16.f32.{t}.{t}"
    pack = f"cvt.rn.{t}x2.f32"

    # pylint: disable=invalid-name,unused-variable,too-many-locals
    @T.prim_func
    def b2b(x: T.handle, w1: T.handle, b1: T.handle, w2: T.handle, b2: T.handle, o: T.handle):
        A = T.match_buffer(x, (m, k), dtype, align=16)
        B1 = T.match_buffer(w1, (n1, k), dtype, align=16)
        bias1 = T.match_buffer(b1, (n1,), dtype)
        W2 = T.match_buffer(w2, (n2, n1), dtype, align=16)
        bias2 = T.match_buffer(b2, (n2,), dtype)
        out = T.match_buffer(o, (m, n2), dtype, align=16)
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        B1_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        W2_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        encode_x(A_map, A.data)
        encode_w1(B1_map, B1.data)
        encode_w2(W2_map, W2.data)
        T.device_entry()
        bx = T.cta_id([m // bm])
        wg = T.warpgroup_id([cfg.consumers + 1])
        tw = T.thread_id_in_wg([128])
        S = T.alloc_shared([st, bm + n1, 64], dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared([st], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([st], "uint64", scope="shared", align=8)
        acc1 = T.alloc_local([acc1_n], "float32")
        acc2 = T.alloc_local([acc2_n], "float32")
        frag = T.alloc_local([slices * 4], "uint32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        init(full, empty, wg * 128 + tw)
        if wg == 0:
            producer()
            if tw == 0:
                produce(A_map, B1_map, S, S, full, empty, bx * bm, 0, 0)
                for tile in T.serial(tiles):  # then w2, a bn2 x 64 chunk a step
                    for c in T.unroll(chunks):
                        step = T.meta_var(kt + tile * chunks + c)
                        acquire(full, empty, step, bn2 * 64 * 2)
                        T.ptx[TMA_LOAD](S.ptr_to([step % st, 0, 0]), T.address_of(W2_map), c * 64, tile * bn2, full.ptr_to([step % st]))
        else:
            consumer()
            row0 = T.meta_var(bx * bm + (wg - 1) * 64)
            consume(S, S, full, empty, acc1, da, db, wg - 1, tw, 0)
            for j in T.unroll(slices):  # bias, activation, fp16 pairs: the A fragments of GEMM 2
                for p in T.unroll(4):
                    col = T.meta_var(fragment(tw, 8 * j + 2 * p)[1])
                    lo = T.meta_var(_activate(acc1[8 * j + 2 * p] + T.cast(bias1[col], "float32"), act))
                    hi = T.meta_var(_activate(acc1[8 * j + 2 * p + 1] + T.cast(bias1[col + 1], "float32"), act))
                    T.ptx[pack](frag[4 * j + p], hi, lo)
            for tile in T.serial(tiles):
                for c in T.unroll(chunks):
                    step = T.meta_var(kt + tile * chunks + c)
                    wait(full, step)
                    T.ptx["wgmma.fence.sync.aligned"]()
                    for jj in T.unroll(4):
                        j = T.meta_var(4 * c + jj)
                        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(db[0]), S.ptr_to([step % st, 0, jj * 16]), 1, 1024 >> 4, 3)
                        T.ptx[mma2](*[acc2[i] for i in range(acc2_n)], frag[4 * j], frag[4 * j + 1], frag[4 * j + 2],
                                    frag[4 * j + 3], db[0], T.ptx.pred(j > 0), 1, 1, 0)
                T.ptx["wgmma.commit_group.sync.aligned"]()
                T.ptx["wgmma.wait_group.sync.aligned"](0)
                for c in T.unroll(chunks):
                    release(empty, kt + tile * chunks + c, tw)
                for q in T.unroll(acc2_n // 2):
                    for v in T.vectorized(2):
                        row, col = T.meta_var(fragment(tw, 2 * q + v))
                        out[row0 + row, tile * bn2 + col] = T.cast(acc2[2 * q + v] + T.cast(bias2[tile * bn2 + col], "float32"), dtype)

    return b2b
