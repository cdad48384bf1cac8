"""Three-CTA clusters of 128 x 256 tiles, and two CTAs an SM: do they close the post-norm's gap
to torch.compile? (issues 3 and 8)

Session 11 left the fused post-norm faster than torch.compile on one suite shape of five. Two
causes were measured, one per kind of shape:

- K >= 3072 (ffn2 4096x3072x768): the 64-row mainloop. A 128-row plain GEMM was faster (30.8
  against 35.1 us, session 10), but fused its rows took clusters of four 192-column CTAs, and
  only 30 such clusters fit the H200 at once where M = 4096 needs 32: two waves. Three CTAs of
  256 columns (cuBLAS's 128 x 256 tile, two consumer warpgroups of m64n256) hold a 768-wide
  row, and 39 three-CTA clusters fit (``cluster-occupancy.json``): 32 clusters, one wave.
- Short K (wide-short-k 16384x256x1024): the epilogue. Nsight Compute showed 12 warps an SM,
  stalled on barriers and long scoreboard as much as they issue, the tensor cores idle while
  the CTA's one epilogue runs. Two CTAs an SM (``WgmmaConfig(ctas_per_sm=2)``:
  ``__launch_bounds__(threads, 2)``, half the registers and shared memory each) let one CTA's
  epilogue run beside the other's mainloop. Session 6 refuted two CTAs an SM for the mma.sync
  kernel, whose 128-register cap spilled; a 64 x 256 CTA here has one consumer warpgroup of
  128 accumulators under a 216-register cap.

Prediction: correct everywhere. ffn2 on 128 x 256 three-CTA clusters under torch.compile
(~32.5 us; from 33.5); attnout no worse than its default. wide-short-k with two 64 x 256 CTAs
an SM from ~50 to under torch.compile's ~43.5.

Outcome (H200, session 12, commit 19da73d, ``../session12-h200-2026-12-04/tile-occupancy-19da73d.json``,
device us): correct everywhere (the default's max error), both refuted:

    shape            cuBLAS  torch.compile  default  bm128 3-stage staged  2 CTAs/SM (1 wg | 2 wg)  plain GEMM bm128 | 2 CTAs
    4096x3072x768     27.1      32.9          32.9         37.6                58.2 | 50.5           37.4 | 42.5
    4096x768x768       9.2      14.9          13.4         15.8                21.0 | 17.8           15.8 | 15.2
    16384x256x1024    19.5      43.4          50.4         57.2                80.7 | 54.7           42.5 | 46.4
    4096x4096x1024    45.5      52.3          60.3         96.1               140.8 | 132.4          50.8 | 71.8

The 128 x 256 tile is slower as a plain GEMM too (37.4 at ffn2, against session 10's 30.8 for
128 x 192): 96 CTAs leave 36 of 132 SMs idle. Two CTAs an SM lose everywhere: ptxas compiles
the whole kernel to the launch bounds' registers, whatever ``setmaxnreg`` grants later, and
rounds an SM's threads up to a multiple of 128 (2 x 160 threads get 168 registers, 2 x 288
get 96; checked with ``-Xptxas -v``), so the epilogue spills 92-360 bytes with one consumer
warpgroup, and two of 128 columns halve each wgmma. The defaults stay as they were: clusters of
three are allowed (``CLUSTER_SIZES``) but not chosen (``DEFAULT_CLUSTER_SIZES``);
``WgmmaConfig.ctas_per_sm`` and ``producer_warps`` stay available, off by default, and the
register check now uses ptxas's budget (``WgmmaConfig.compiled_regs``).

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/tile_occupancy.py`` (writes ``$OUT/tile-occupancy.json``).
"""

import dataclasses

import torch
from wgmma_gemm import first_fitting, measure, measure_postnorm, save, suite_cases  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig, wgmma_gemm
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, problems, wgmma_postnorm

#: (M, K, N): ffn2, attnout, wide-short-k, large-ffn2.
SHAPES = [(4096, 3072, 768), (4096, 768, 768), (16384, 256, 1024), (4096, 4096, 1024)]


def variants(m, k, n, spec):
    """``(name, cfg, stage)``, those that fit: the default; 128 x 256 CTAs (clusters of ``n / 256``),
    staged on three stages or unstaged on four; 64 x 256 CTAs two an SM, one consumer
    warpgroup or two of 128 columns, and a producer warp (ptxas compiles 2 x 160 threads to 168
    registers a thread, 2 x 256 to 128), the deepest ring that fits beside the staged tiles."""
    found = [("default", default_config(n, m, k, spec), None), ("bm128_bn256_staged", WgmmaConfig(128, 256, 3, 64, 1), True),
             ("bm128_bn256_unstaged", WgmmaConfig(128, 256, 4, 64, 1), False)]
    for wg_n in (1, 2):
        cfg = first_fitting(m, n, k, spec, WgmmaConfig(64, 256, wg_n=wg_n, ctas_per_sm=2, producer_warps=1),
                            ((4, 32), (2, 64), (3, 32), (2, 32)), True)
        found += [(f"bm64_bn256_wg{wg_n}_2ctas", cfg, True)] if cfg else []
    return [(name, cfg, stage) for name, cfg, stage in found if not problems(m, n, k, spec, cfg, stage)]


def main():
    rows, spec = [], PostNorm.suite("float16", "layer_norm")
    for m, k, n, inputs, ref, base in suite_cases(SHAPES, 12, rows):
        x, w = inputs[:2]
        gemm_ref = x.float() @ w.float().T
        for name, cfg, stage in variants(m, k, n, spec):
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg, stage=stage)  # noqa: E731,B023
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, name, make, config=dataclasses.asdict(cfg), staged=stage))
        for name, cfg in (("bm128_bn256", WgmmaConfig(128, 256, 4, 64, 1)),
                          ("bm64_bn256_2ctas", WgmmaConfig(64, 256, 4, 32, 1, ctas_per_sm=2, producer_warps=1))):
            if cfg.problems(m, n, k, "float16"):
                continue
            row = dict(base, contender=f"wgmma_gemm_{name}", config=dataclasses.asdict(cfg))
            make = lambda: wgmma_gemm(m, n, k, "float16", cfg)  # noqa: E731,B023
            rows.append(measure(row, make, [x, w], torch.empty(m, n, device="cuda", dtype=torch.float16), gemm_ref))
            text = f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]
            print(f"  plain GEMM {name}: {text}", flush=True)
    save("tile-occupancy.json", rows)


if __name__ == "__main__":
    main()
