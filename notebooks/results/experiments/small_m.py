"""A few rows (batch 1 and 4 of BERT-base at sequence 128): narrow tiles to fill the SMs? (issue 6)

Why: session 31 measured BERT-base at batch 1 x 128 (M = 128) on the H100: ComFuse 649.6 us against
torch.compile's 477.3. The defaults launch too few CTAs for 128 rows: the post-norm's cluster
kernel slices a row over at most 8 CTAs of 64 rows (16 CTAs on 132 SMs: FFN2's post-norm 17.4 us a
layer), and the GEMM + elementwise default's 64 x 128 tiles give 12 CTAs at N = 768 (Q/K/V 5.4 us
each against cuBLAS's ~2). The one-kernel split post-norm (:mod:`tvm_comfuse.schedule.row_exchange`)
is not bound to a cluster: with 64 x 32 tiles M = 128, N = 768 is 48 CTAs, with 64 x 16 96.

Prediction (H100 or H200, device us): at M = 128 the exchange kernel with bn 32 or 16 takes
FFN2's post-norm (128 x 3072 -> 768) from ~17 to ~6-8 and the attention output (128 x 768 ->
768) from ~8 to ~4, each within ~1.3x of torch.compile's cuBLAS + Triton; the plain GEMM at 128 x
768 -> 768 from ~5 with 64 x 128 tiles to ~3 with 64 x 32. At M = 512 (batch 4) the gain is
smaller (the defaults already launch 32-64 CTAs).

Contenders per post-norm shape, one process, the same inputs, correctness checked first:
cuBLAS's GEMM alone, torch.compile, the cluster kernel's default, the one-kernel split form at
each ``bn``; per plain GEMM shape: cuBLAS and the wgmma GEMM at each tile.

Run: ``bash .ci/gpu-run notebooks/results/experiments/small_m.py`` (``$OUT/small-m.json``).
"""

import torch

from row_exchange import exchange  # the same directory: sys.path[0] when run as a script
from wgmma_gemm import cluster_cases, measure, save, timed

from tvm_comfuse.schedule import split_norm as sn
from tvm_comfuse.schedule.wgmma_elementwise import Elementwise, problems as ew_problems, wgmma_elementwise
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig

#: post-norm (M, K, N): BERT-base's FFN2 and attention output at batch 1 and 4, sequence 128
POSTNORM = [(128, 3072, 768), (128, 768, 768), (512, 3072, 768), (512, 768, 768)]
#: plain GEMM (M, K, N): the Q/K/V projections and FFN1 at batch 1, then the projections at batch 4
GEMMS = [(128, 768, 768), (128, 768, 3072), (512, 768, 768)]
#: (column tile, split-K CTAs) tried, 64 rows each: post-norms, plain GEMMs
TILES = [(bn, s) for bn in (192, 128, 64) for s in (1, 2, 4, 8)]
GEMM_TILES = [(128, 1), (128, 2), (128, 4), (64, 1), (64, 2), (64, 4), (64, 8), (32, 1), (32, 4)]


def ring(m, n, k, bn, split, fits):
    """The deepest ring (up to 4 stages, bk 64 then 32, no more stages than a split's K steps)
    on which ``fits(cfg)`` holds for a 64 x ``bn`` tile over ``split`` CTAs, or None."""
    for bk in (64, 32):
        steps = k // split // bk
        for stages in range(min(4, steps), 1, -1):
            cfg = WgmmaConfig(64, bn, stages, bk, split_k=split)
            if fits(cfg):
                return cfg
    return None


def main():
    rows = []
    for m, k, n, spec, inputs, ref, base, out in cluster_cases(POSTNORM, rows):
        for bn, split in TILES:
            cfg = ring(m, n, k, bn, split, lambda c: not sn.exchange_problems(m, n, k, spec, c))  # noqa: B023
            if cfg is not None:
                rows.append(exchange(m, n, k, spec, inputs, out, ref, base, f"exchange_bn{bn}_k{split}", cfg))
        save("small-m.json", rows)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m, k, n in GEMMS:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        b = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) / k**0.5
        ref = a.float() @ b.float().T
        base = dict(M=m, K=k, N=n, dtype="float16", op="gemm")
        rows.append(timed(dict(base, contender="cublas", max_abs_err=float((torch.matmul(a, b.T).float() - ref).abs().max())),
                          lambda: torch.matmul(a, b.T)))  # noqa: B023
        print(f"{m}x{k}x{n} gemm: cublas {rows[-1]['kernel_us']:.1f} us device", flush=True)
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        for bn, split in GEMM_TILES:
            cfg = ring(m, n, k, bn, split, lambda c: not ew_problems(m, n, k, Elementwise(), c))  # noqa: B023
            for stage in ((None, False) if cfg is not None and bn == 64 and split > 1 else (None,) if cfg is not None else ()):  # staged by TMA where it can be; per-thread stores (the head layouts')
                row = measure(dict(base, contender=f"wgmma_bn{bn}_k{split}{'_unstaged' if stage is False else ''}",
                                   config=dict(bn=bn, stages=cfg.stages, bk=cfg.bk, split_k=split)),
                              lambda: wgmma_elementwise(m, n, k, Elementwise(), cfg, stage=stage), [a, b], c, ref)  # noqa: B023
                rows.append(row)
                print(f"  {row['contender']} {cfg.stages}x{cfg.bk}: "
                      + (f"{row['kernel_us']:.1f} (err {row['max_abs_err']:.2g})" if "kernel_us" in row else row["error"][:100]), flush=True)
        save("small-m.json", rows)


if __name__ == "__main__":
    main()
