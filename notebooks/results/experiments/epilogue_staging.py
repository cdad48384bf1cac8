"""Does staging the post-norm epilogue's tiles through shared memory by TMA pay? (issues 3 and 8)

Session 8 left the Hopper post-norm 1.2-1.8x behind torch.compile, with the epilogue as the limit:
at 16384x256x1024 the kernel took 77 us for a 20 us GEMM. Its residual was read after the K loop
in the accumulator fragment layout (16-byte pieces of eight rows per warp instruction) and its
output written the same way, by a CTA alone on its SM, so nothing hid that traffic.

Session 9's epilogue (``wgmma_postnorm.Staging``): the producer warpgroup first issues TMA
loads of the CTA's residual tile (64-column boxes, 128-byte swizzle) into shared memory beside
the ring, so it lands while the K loop runs; the consumers read it conflict-free, write the
normalised tile in its place and one thread TMA-stores it. The ring gives up stages for it
(N = 1024: 3 -> 2 stages of bk 64), and is no deeper than K's steps.

Prediction: correct everywhere; wide-short-k (16384x256x1024) from ~77 to 40-50 us, closing
most of the gap to torch.compile (43); N = 768 shapes 10-20% faster; the K = 4096 shapes
unchanged within 5% (the epilogue is a small part there), unless two stages starve the ring,
which the bk 32 variant (4 stages, the same bytes in flight) would show.

Outcome (H200, session 9, ``../session9-h200-2026-12-04/epilogue-staging.json``): correct
everywhere; 78.2 -> 53.9 us at 16384x256x1024, 18.4 -> 14.0 at 4096x768x768 (now faster than
torch.compile's 14.9), 39.5 -> 33.7 at 4096x3072x768; at K = 4096 two 64-deep stages starved
the ring (+39%, +19%) while four 32-deep ones were as fast or faster than unstaged, so the
default now keeps three stages at least (NOTES, session 9).

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/epilogue_staging.py`` (writes
``$OUT/epilogue-staging.json``).
"""

import torch
from wgmma_gemm import deepest_bk32, measure, postnorm_baselines, save  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, staging, wgmma_postnorm

SHAPES = [(16384, 256, 1024), (4096, 768, 768), (4096, 3072, 768), (4096, 4096, 1024), (8192, 4096, 4096)]


def variants(m, k, n, spec):
    """``(name, cfg, stage)``: session 8's default unstaged, the staged default, and the staged
    tile on the deepest bk-32 ring that fits beside it."""
    old, new = default_config(n, m), default_config(n, m, k, spec)
    return [("unstaged", old, False), ("staged", new, None), ("staged_bk32", deepest_bk32(spec, new, k), True)]


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(9)
    for m, k, n in SHAPES:
        spec = PostNorm.suite("float16", "layer_norm")
        inputs, ref, base, baselines = postnorm_baselines(m, k, n, gen)
        rows += baselines
        for name, cfg, stage in variants(m, k, n, spec):
            row = dict(base, contender=f"wgmma_postnorm_{name}", config=dict(bn=cfg.bn, bk=cfg.bk, stages=cfg.stages, wg_n=cfg.wg_n),
                       staging=str(staging(spec, cfg, stage)))
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg, stage=stage)  # noqa: E731,B023
            rows.append(measure(row, make, inputs, torch.empty(m, n, device="cuda", dtype=torch.float16), ref))
            print(f"  {name} {cfg}: " + (f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]),
                  flush=True)
    save("epilogue-staging.json", rows)


if __name__ == "__main__":
    main()
