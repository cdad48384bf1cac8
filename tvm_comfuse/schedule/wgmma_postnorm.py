"""Hopper fused post-norm (issue 8, step 2): ``norm(x @ w.T + b + r)`` on the wgmma mainloop.

ComFuse's row epilogue on :mod:`.wgmma_mainloop`'s accumulators. A CTA owns 64 whole rows;
``wg_n`` warpgroups split the row's N columns (``N / wg_n <= 256``, wgmma's N), so the GEMM
result never leaves the chip: bias and residual are added to the fp32 accumulators in
registers, each thread sums its share of its two rows, the partial sums meet in a small shared
buffer (4 quad lanes x ``wg_n`` warpgroups per row), and the normalised row is written once.
LayerNorm takes two passes over the registers (mean, then the centred variance: no
cancellation), RMSNorm one.

Limits, from the register file: the 64 x N fp32 accumulators take ``N`` KiB... of a 256 KiB
register file at 64 rows, so whole-row CTAs stop at N = 768 (384 threads, 128 accumulators
each); wider rows need the row split over a thread-block cluster that the mma.sync rule has
(:mod:`.cluster`). Not yet used by the gemm_reduce rule and not yet run: timed against cuBLAS
+ normalisation in ``notebooks/results/experiments/wgmma_gemm.py``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..errors import ComFuseError
from .wgmma_mainloop import SMEM_LIMIT, WgmmaConfig, fragment, mainloop

NORMS = ("layer_norm", "rms_norm")
#: Widest row a 64-row CTA holds in registers (64 x 768 fp32 = 192 of the SM's 256 KiB).
MAX_ROW = 768


def default_config(n: int) -> WgmmaConfig:
    """Whole rows of ``n`` columns: the fewest warpgroups with wgmma N <= 256, and the deepest
    ring (``bk`` 64 when two stages fit, else 32) that fits shared memory."""
    wg_n = next((w for w in range(1, 9) if n % w == 0 and (n // w) % 16 == 0 and n // w <= 256), None)
    if wg_n is None:
        raise ComFuseError(f"wgmma post-norm cannot split N = {n} into warpgroup tiles (a multiple of 16 up to 256 each)")
    for bk in (64, 32):
        stages = min(4, SMEM_LIMIT // ((64 + n) * bk * 2))
        if stages >= 2:
            return WgmmaConfig(bm=64, bn=n, stages=stages, bk=bk, wg_n=wg_n)
    raise ComFuseError(f"wgmma post-norm: a 64 x {n} row tile does not fit shared memory twice over")


def wgmma_postnorm(m: int, n: int, k: int, dtype: str = "float16", norm: str = "layer_norm",
                   cfg: WgmmaConfig | None = None, eps: float = 1e-5):
    """``out = norm(x[m, k] @ w[n, k].T + b[n] + r[m, n]) * gamma (+ beta)``, one kernel for
    sm_90a, ``norm`` in :data:`NORMS` (RMSNorm takes no ``beta``). Static shapes, ``m`` a
    multiple of 64, ``k`` of ``cfg.bk``, ``n`` at most :data:`MAX_ROW`."""
    if norm not in NORMS:
        raise ComFuseError(f"wgmma post-norm: norm {norm!r} is not one of {NORMS}")
    if n > MAX_ROW:
        raise ComFuseError(f"wgmma post-norm: N = {n} is wider than the {MAX_ROW} columns a 64-row CTA holds in registers")
    cfg = cfg or default_config(n)
    if cfg.bm != 64 or cfg.bn != n:
        raise ComFuseError(f"wgmma post-norm: a CTA owns 64 whole rows (bm = 64, bn = N = {n}), got {cfg}")
    cfg.check(m, n, k, dtype)
    acc_n, wg_n, wg_cols, parts = cfg.wg_cols // 2, cfg.wg_n, cfg.wg_cols, 4 * cfg.wg_n
    run = mainloop(cfg, k, dtype)
    rms = norm == "rms_norm"

    # pylint: disable=invalid-name,unused-variable,too-many-locals
    @T.prim_func
    def postnorm(x: T.handle, w: T.handle, b: T.handle, r: T.handle, g: T.handle, be: T.handle, o: T.handle):
        A = T.match_buffer(x, (m, k), dtype, align=16)
        B = T.match_buffer(w, (n, k), dtype, align=16)
        bias = T.match_buffer(b, (n,), dtype)
        res = T.match_buffer(r, (m, n), dtype)
        gamma = T.match_buffer(g, (n,), dtype)
        beta = T.match_buffer(be, (n,), dtype)
        out = T.match_buffer(o, (m, n), dtype)
        T.device_entry()
        bx = T.cta_id([m // 64])
        tx = T.thread_id([cfg.threads])
        S = T.alloc_shared([cfg.stages, 64 + n, cfg.bk], dtype, scope="shared.dyn", align=1024)
        part = T.alloc_shared([2, 64, parts], "float32")  # per row: 4 quad lanes x wg_n warpgroups
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        s = T.alloc_local([2], "float32")  # this thread's partial sums of its rows r0 and r0 + 8
        stat = T.alloc_local([2, 2], "float32")  # [row half, mean / rstd]
        run(A, B, S, acc, da, db, tx, bx, 0)
        c0 = T.meta_var(tx // 128 * wg_cols)
        slot = T.meta_var(tx // 128 * 4 + tx % 4)
        for h in T.unroll(2):
            s[h] = T.float32(0)
        for i in T.unroll(acc_n):
            row, col = T.meta_var(fragment(tx, i))
            acc[i] = acc[i] + T.cast(bias[c0 + col], "float32") + T.cast(res[bx * 64 + row, c0 + col], "float32")
            s[i // 2 % 2] = s[i // 2 % 2] + (acc[i] * acc[i] if rms else acc[i])
        for h in T.unroll(2):
            part[0, fragment(tx, 0)[0] + 8 * h, slot] = s[h]
        T.cuda.cta_sync()
        for h in T.unroll(2):
            stat[h, 0] = T.float32(0)
            for j in T.unroll(parts):
                stat[h, 0] = stat[h, 0] + part[0, fragment(tx, 0)[0] + 8 * h, j]
            stat[h, 0] = stat[h, 0] / T.float32(n)  # mean, or mean square for RMSNorm
        if not rms:
            for h in T.unroll(2):
                s[h] = T.float32(0)
            for i in T.unroll(acc_n):
                s[i // 2 % 2] = s[i // 2 % 2] + (acc[i] - stat[i // 2 % 2, 0]) * (acc[i] - stat[i // 2 % 2, 0])
            for h in T.unroll(2):
                part[1, fragment(tx, 0)[0] + 8 * h, slot] = s[h]
            T.cuda.cta_sync()
        for h in T.unroll(2):
            stat[h, 1] = T.float32(0)
            if not rms:
                for j in T.unroll(parts):
                    stat[h, 1] = stat[h, 1] + part[1, fragment(tx, 0)[0] + 8 * h, j]
                stat[h, 1] = T.rsqrt(stat[h, 1] / T.float32(n) + T.float32(eps))
            else:
                stat[h, 1] = T.rsqrt(stat[h, 0] + T.float32(eps))
                stat[h, 0] = T.float32(0)
        for i in T.unroll(acc_n):
            row, col = T.meta_var(fragment(tx, i))
            y = T.meta_var((acc[i] - stat[i // 2 % 2, 0]) * stat[i // 2 % 2, 1] * T.cast(gamma[c0 + col], "float32"))
            out[bx * 64 + row, c0 + col] = T.cast(y if rms else y + T.cast(beta[c0 + col], "float32"), dtype)

    return postnorm
