"""Where do the warp-specialised post-norm kernels go wrong? (session 8 diagnostic)

The first H200 run of the TMA mainloop (``wgmma_gemm.py``): plain GEMMs correct everywhere; the
fused post-norm correct with 64-column K steps only up to K = 512 (and with 32-column steps
everywhere), wrong (max error ~1) at K >= 768, in clusters of 2 and of 4. This isolates the
parts: the same mainloop as a plain GEMM (no row epilogue), the post-norm without a cluster
(N = 512 in one CTA), with one, with 32-column steps and with no wgmma group kept in flight;
and, for the failing kernels, which rows and column blocks are wrong, twice (deterministic?).

Outcome (session 8, at 425a82d's parent; NOTES.md): the plain GEMMs (also launched as clusters,
a variant since removed) and ``inflight=0`` were correct, the post-norm kernels not, at random
positions concentrated in each consumer's last 64 columns. Cause: ptxas hoisted the epilogue's
accumulator conversions above the final ``wait_group 0`` (``codegen.wgmma_hazards`` finds it in
the SASS); the mainloop now issues its last step outside the loop. After that fix the post-norm
kernels of ``wgmma_gemm.py`` and the GPU tests were correct; this script was not re-run.
"""

import torch

import tvm
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig, build, wgmma_gemm
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, wgmma_postnorm


def gemm_case(m, k, n, cfg):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) / k**0.5
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    kern = build(wgmma_gemm(m, n, k, "float16", cfg))["main"]
    for rep in range(2):
        c.fill_(float("nan"))
        kern(*[tvm.runtime.from_dlpack(t) for t in (a, b, c)])
        err = (c.float() - a.float() @ b.float().T).abs()
        bad = err > 0.05
        line = f"gemm {m}x{k}x{n} {cfg}: max err {err.max().item():.3g}"
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
    gemm_case(4096, 768, 768, WgmmaConfig(64, 384, 3, 64, 2))
    gemm_case(4096, 768, 768, WgmmaConfig(64, 192, 4, 64, 1))
    gemm_case(4096, 3072, 768, WgmmaConfig(64, 384, 3, 64, 2))
    postnorm_case(4096, 768, 512, WgmmaConfig(64, 512, 3, 64, 2))
    postnorm_case(4096, 768, 512, WgmmaConfig(64, 256, 4, 64, 1), detail=True)
    postnorm_case(4096, 768, 512, WgmmaConfig(64, 256, 6, 32, 1))
    postnorm_case(4096, 768, 768, WgmmaConfig(64, 384, 3, 64, 2, inflight=0))
    postnorm_case(4096, 768, 768, None, detail=True)
    postnorm_case(4096, 3072, 768, None, detail=True)


if __name__ == "__main__":
    main()
