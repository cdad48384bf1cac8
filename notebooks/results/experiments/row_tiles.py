"""Do 128-row CTAs make the Hopper post-norm faster than 64-row ones? (issues 3 and 8)

Session 9 left the fused post-norm 1.05-1.25x behind torch.compile on four of five suite shapes.
Its CTAs owned 64 rows of a slice of up to 512 columns (two column warpgroups), so every K step
brought a 512-row slice of W into shared memory for 64 rows of output: per FLOP, 1.5x the
shared-memory fill of a 128 x 256 tile (cuBLAS's shape), all of it from L2. At 16384x256x1024 W
alone was 128 MB of L2 reads (512 CTAs x 256 KiB) for 72 MB of HBM traffic.

This run compares, per suite shape, the session-9 default (``bm = 64``) with 128-row CTAs (two
row warpgroups over the same columns, four CTAs of a cluster per row at N = 768 and 1024; the
8192x4096x4096 row would need 16 and keeps 64 rows), each on the default ring and on a deeper
bk-32 ring; and, to split mainloop from epilogue, the plain GEMM on the same tiles.

Prediction: correct everywhere; wide-short-k (16384x256x1024) from 54 to 35-45 us (W's L2 reads
halved), now faster than torch.compile (43.5); the K >= 3072 shapes 5-10% faster (ffn2 under
torch.compile's 32.4); attnout within 5% either way (its K loop is short); the plain GEMM on the
128-row tiles within 10% of cuBLAS at K >= 3072.

Outcome (H200, session 10, commit 7fc67ac, ``../session10-h200-2026-12-04/row-tiles.json``,
device us): correct everywhere (same max error), but the prediction is refuted: 128-row CTAs
were much slower fused, though faster as a plain GEMM on the same tiles:

    shape              cuBLAS  torch.compile  fused bm 64  fused bm 128  plain bm 64  plain bm 128
    16384x256x1024      19.4       43.8          54.0         61.9         43.3          41.3
    4096x3072x768       26.5       32.6          35.2         58.5         35.1          30.8
    4096x4096x1024      44.5       51.4          60.2         97.9         58.8          50.8
    4096x768x768         9.1       14.9          14.0         25.2         13.3          13.1

The fused bm-128 kernels differ from their plain GEMMs by about one more mainloop: their rows
take clusters of four CTAs (the plain GEMM needs none), each CTA alone on its SM, and fewer
such clusters fit the GPCs at once than the 32 a wave needs, so a second wave runs (session 3
measured the same cost on the mma.sync kernel, and session 8 on 64 x 192 slices). bk 32 rings
changed nothing. So the default keeps 64 rows (``wgmma_postnorm.DEFAULT_ROWS``); at 64 rows the
fused kernel costs about what its plain GEMM does at K >= 3072 (35.2 against 35.1), i.e. the
remaining gap to cuBLAS is the 64-row mainloop's, not the epilogue's.

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/row_tiles.py`` (writes ``$OUT/row-tiles.json``).
"""

import torch
from wgmma_gemm import deepest_bk32, measure, postnorm_baselines, save  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.errors import ComFuseError
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig, wgmma_gemm
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, staging, wgmma_postnorm

SHAPES = [(16384, 256, 1024), (4096, 3072, 768), (4096, 4096, 1024), (4096, 768, 768), (8192, 4096, 4096)]


def variants(m, k, n, spec):
    """``(name, cfg)``: the default of each row tile, and the same tile on the deepest bk-32 ring
    (up to 8 stages) that fits beside its staged epilogue tiles."""
    found = []
    for bm in (64, 128):
        try:
            cfg = default_config(n, m, k, spec, bm=bm)
        except ComFuseError:  # rows too wide for a cluster of 128-row CTAs
            continue
        deep = deepest_bk32(spec, cfg, k)
        found += [(f"bm{bm}", cfg)] + ([(f"bm{bm}_bk32", deep)] if deep != cfg else [])
    return found


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(10)
    for m, k, n in SHAPES:
        spec = PostNorm.suite("float16", "layer_norm")
        inputs, ref, base, baselines = postnorm_baselines(m, k, n, gen, ("cublas_gemm_alone", "inductor"))
        rows += baselines
        x, w = inputs[:2]
        gemm_ref = x.float() @ w.float().T
        for name, cfg in variants(m, k, n, spec):
            conf = dict(bm=cfg.bm, bn=cfg.bn, bk=cfg.bk, stages=cfg.stages, wg_n=cfg.wg_n)
            row = dict(base, contender=f"wgmma_postnorm_{name}", config=conf, staging=str(staging(spec, cfg)))
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg)  # noqa: E731,B023
            rows.append(measure(row, make, inputs, torch.empty(m, n, device="cuda", dtype=torch.float16), ref))
            text = f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]
            if name.endswith(str(cfg.bm)):  # the mainloop alone on the default tile: a plain GEMM, bm x bn CTAs
                plain = WgmmaConfig(cfg.bm, cfg.bn, cfg.stages, cfg.bk, cfg.wg_n)
                row = dict(base, op="gemm", contender=f"wgmma_gemm_{name}", config=conf)
                rows.append(measure(row, lambda: wgmma_gemm(m, n, k, "float16", plain), [x, w],  # noqa: B023
                                    torch.empty(m, n, device="cuda", dtype=torch.float16), gemm_ref))
                text += "; plain GEMM " + (f"{row['kernel_us']:.1f} us" if "us" in row else row["error"])
            print(f"  {name} {cfg}: {text}", flush=True)
    save("row-tiles.json", rows)


if __name__ == "__main__":
    main()
