"""Where do the warp-specialised post-norm kernels go wrong? (session 8 diagnostic)

The first H200 run of the TMA mainloop (``wgmma_gemm.py``): plain GEMMs correct everywhere; the
fused post-norm correct with 64-column K steps only up to K = 512 (and with 32-column steps
everywhere), wrong (max error ~1) at K >= 768, in clusters of 2 and of 4. This isolates the
parts: the same mainloop as a plain GEMM (no cluster, no row epilogue), the post-norm without a
cluster (N = 512 in one CTA), with one, and with 32-column steps; and, for the failing kernel,
which rows and column blocks are wrong, twice (is it deterministic?).
"""

import torch

import tvm
from tvm.script import tirx as T
from tvm_comfuse.schedule.wgmma_mainloop import (Ring, WgmmaConfig, box_rows, build, fragment, mainloop, roles, tensor_map,
                                                 wgmma_gemm)
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, wgmma_postnorm


def cluster_gemm(m, n, k, cfg, ranks):
    """``wgmma_gemm`` launched as clusters of ``ranks`` CTAs along N (no DSMEM, no row epilogue)."""
    bm, bn, acc_n, dtype = cfg.bm, cfg.bn, cfg.wg_cols // 2, "float16"
    produce, consume = mainloop(cfg, k, dtype)
    init = Ring(cfg.stages, cfg.consumers).init()
    producer, consumer = roles(cfg)
    encode_a, encode_b = tensor_map(m, k, box_rows(bm), cfg.bk, dtype), tensor_map(n, k, box_rows(bn), cfg.bk, dtype)

    # pylint: disable=invalid-name,unused-variable
    @T.prim_func
    def gemm(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, (m, k), dtype, align=16)
        B = T.match_buffer(b, (n, k), dtype, align=16)
        C = T.match_buffer(c, (m, n), dtype, align=16)
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        encode_a(A_map, A.data)
        encode_b(B_map, B.data)
        T.device_entry()
        bx = T.cluster_id([m // bm])
        by = T.cta_id_in_cluster([ranks])
        wg = T.warpgroup_id([cfg.consumers + 1])
        tw = T.thread_id_in_wg([128])
        S = T.alloc_shared([cfg.stages, bm + bn, cfg.bk], dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        init(full, empty, wg * 128 + tw)
        if wg == 0:
            producer()
            if tw == 0:
                produce(A_map, B_map, S, full, empty, bx * bm, by * bn)
        else:
            consumer()
            consume(S, full, empty, acc, da, db, wg - 1, tw)
            for q in T.unroll(acc_n // 2):
                for j in T.vectorized(2):
                    row, col = T.meta_var(fragment(tw, 2 * q + j))
                    C[bx * bm + (wg - 1) // cfg.wg_n * 64 + row, by * bn + (wg - 1) % cfg.wg_n * cfg.wg_cols + col] = T.cast(
                        acc[2 * q + j], dtype)

    return gemm


def gemm_case(m, k, n, cfg, ranks=0):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) / k**0.5
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    kern = build(cluster_gemm(m, n, k, cfg, ranks) if ranks else wgmma_gemm(m, n, k, "float16", cfg))["main"]
    for rep in range(2):
        c.fill_(float("nan"))
        kern(*[tvm.runtime.from_dlpack(t) for t in (a, b, c)])
        err = (c.float() - a.float() @ b.float().T).abs()
        bad = err > 0.05
        line = f"gemm {m}x{k}x{n} {cfg} clusters of {ranks}: max err {err.max().item():.3g}"
        if bad.any():
            line += f", wrong col blocks of 64 {bad.reshape(m, n // 64, 64).any(2).any(0).nonzero().flatten().tolist()}, wrong {bad.float().mean().item():.4f}"
        print(line, flush=True)


def postnorm_case(m, k, n, cfg, detail=False):
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=g)  # noqa: E731
    x, w, b, r, ga, be = rnd(m, k), rnd(n, k) / k**0.5, rnd(n), rnd(m, n), rnd(n), rnd(n)
    ref = torch.nn.functional.layer_norm(x.float() @ w.float().T + b.float() + r.float(), (n,), ga.float(), be.float())
    kern = build(wgmma_postnorm(m, n, k, PostNorm.suite("float16", "layer_norm"), cfg))["main"]
    for rep in range(2 if detail else 1):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        kern(*[tvm.runtime.from_dlpack(t) for t in (x, w, b, r, ga, be, out)])
        err = (out.float() - ref).abs()
        bad = err > 0.05
        line = f"postnorm {m}x{k}x{n} {cfg or default_config(n, m)} run {rep}: max err {err.max().item():.3g}, wrong {bad.float().mean().item():.4f}"
        if detail and bad.any():
            rows = bad.any(1).nonzero().flatten()
            line += (f"; wrong rows {rows.numel()} of {m}, first {rows[:8].tolist()}, rows mod 64 {sorted(set((rows % 64).tolist()))[:16]}"
                     f"; wrong col blocks of 64 {bad.reshape(m, n // 64, 64).any(2).any(0).nonzero().flatten().tolist()}"
                     f"; wrong row blocks of 64 {bad.reshape(m // 64, 64, n).any(2).any(1).float().sum().item():.0f} of {m // 64}")
        print(line, flush=True)


def main():
    gemm_case(4096, 768, 512, WgmmaConfig(64, 256, 4, 64, 1), ranks=2)
    gemm_case(4096, 768, 768, WgmmaConfig(64, 384, 3, 64, 2), ranks=2)
    gemm_case(4096, 3072, 768, WgmmaConfig(64, 384, 3, 64, 2), ranks=2)
    gemm_case(4096, 768, 512, WgmmaConfig(64, 256, 4, 64, 1, inflight=0), ranks=2)
    postnorm_case(4096, 768, 512, WgmmaConfig(64, 256, 4, 64, 1), detail=True)


if __name__ == "__main__":
    main()
