"""When the residual's TMA load issues, at one wave (issue 3: the one-wave post-norms).

Why: at BERT's post-norms (4096 tokens, one wave of 128-row tiles) the split's GEMM with its
chain cost 1.8-4.9 us over the plain GEMM, which runs at cuBLAS's speed, and the residual is most
of it: 0.9-3.6 us even loaded by TMA into the staging buffers while the mainloop runs (H100,
session 22, ``epilogue_parts.py``). That load issued before the first K step, while every CTA of
the wave fills its ring at once, so the residual's 6-8 MB compete with the ring's first loads
and the whole wave's mainloop starts later. ``WgmmaConfig.tile_step`` issues it before a later
K step instead, once the ring is full and the loads run at the mainloop's pace; and
``stage_tiles`` now also takes one tile a CTA (the staging buffers beside the ring), so the
one-kernel form (``row_exchange``), which cannot be persistent, can stage its residual too.

Prediction (device us): staging the one-kernel form's residual at step 0 takes ~0.8 us off it
(as staging did for the split's GEMM, ``epilogue_parts``); at ``tile_step = stages`` most of the
residual's remaining cost goes: the one-kernel form at BERT-base's FFN2 under torch.compile's
34.0 (H100) and the split's GEMM within ~1 us of the plain GEMM + bias.

Contenders per shape, one process, on the same inputs: cuBLAS's GEMM alone, torch.compile, the
cluster kernel (where it takes the shape), the split (two kernels), the one-kernel form as the
offload builds it (the residual loaded by each thread), and staged with the load before K step
0, ``stages`` and half of K's steps; the split's GEMM likewise (per-thread, staged at 0 and at
``stages``).

Run: ``bash .ci/gpu-run notebooks/results/experiments/residual_load.py`` (``$OUT/residual-load.json``).
"""

import dataclasses
import sys

from row_exchange import SHAPES, exchange, split_gemm  # the same directory: sys.path[0] when run as a script
from split_norm import split
from wgmma_gemm import cluster_cases, save

from tvm_comfuse.schedule import split_norm as sn


def staged(m, n, k, spec, step: int):
    """The default one-tile configuration with the residual staged, its load before K step
    ``step``, on the deepest ring (4 or 3 stages) that fits beside the staging buffers; None if none."""
    for stages in (4, 3):
        cfg = dataclasses.replace(sn.config(m, n, k, spec), stage_tiles=True, stages=stages)
        cfg = dataclasses.replace(cfg, tile_step=cfg.stages if step == "stages" else step)
        if not sn.exchange_problems(m, n, k, spec, cfg):
            return cfg
    return None


def main():
    rows = []
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a] or SHAPES
    for m, k, n, spec, inputs, ref, base, out in cluster_cases(shapes, rows):
        rows.append(split(m, n, k, spec, None, inputs, out, ref, base))
        rows.append(exchange(m, n, k, spec, inputs, out, ref, base))
        for step in (0, "stages", k // 64 // 2):
            cfg = staged(m, n, k, spec, step)
            if cfg is not None:
                rows.append(exchange(m, n, k, spec, inputs, out, ref, base, f"exchange_staged_{step}", cfg))
        rows.append(split_gemm(m, n, k, spec, inputs, base))
        for step in (0, "stages"):
            cfg = staged(m, n, k, spec, step)
            if cfg is not None:
                rows.append(split_gemm(m, n, k, spec, inputs, base, cfg, f"split_gemm_staged_{step}"))
        save("residual-load.json", rows)


if __name__ == "__main__":
    main()
