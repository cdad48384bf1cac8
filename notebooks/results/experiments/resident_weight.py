"""Does a resident W slice make the short-K post-norm faster? (issues 3 and 8)

At 16384x256x1024 the Hopper post-norm took 54 us where cuBLAS's GEMM alone takes 19 and
torch.compile 44 (session 10). Its 512 CTAs (64 rows x 512 columns, clusters of two) each read
their 256 KiB slice of W from L2 for a GEMM of four K steps: 128 MiB of L2 reads against the 72
MiB that x, the residual and the output move through HBM, and each CTA's epilogue then ran with
nothing else in flight on its SM.

The resident kernel (``WgmmaConfig(resident=True)``, :func:`~tvm_comfuse.schedule.wgmma_postnorm.resident_config`)
launches one wave of clusters (30 clusters of four 64 x 256 CTAs here); each CTA loads its W
slice into shared memory once and loops over row blocks: the producer warpgroup streams x
through the ring and, from a second warp, the next block's residual tile into the other of two
staged sets, while the consumers run the current block's GEMM and epilogue; the output leaves by
TMA store from the set it was read from. The row statistics cross the cluster by ``st.async``
onto mbarriers, since the producer, a block ahead, never meets a cluster barrier.

Prediction: correct everywhere; 16384x256x1024 from ~54 to 25-32 us (the HBM traffic at ~3
TB/s plus a block's epilogue), faster than torch.compile; the other short-K shapes likewise
well under their streaming kernels; at M = 4096 (two blocks a cluster) no gain.

Outcome (H200, session 11, device us, all correct with the streaming kernel's max error).
Refuted at the shape it was built for, held at its neighbour:

    M x K x N        cuBLAS  torch.compile  streaming  resident  (commit)
    16384x256x1024    19.4       43.5          53.7       56.6    5e720d9
    16384x256x768     15.3       32.3          42.8       36.4    5e720d9
    16384x512x1024    29.7       55.1          64.8       89.0    5e720d9 (8-CTA clusters)
    16384x1024x256    14.5       22.8          25.0       55.8    5e720d9 (64-column slices)
    4096x256x1024      6.4       12.5          12.8       17.1    5e720d9 (2 blocks a cluster)
    16384x256x1024    19.3       43.3          49.7       52.8    c44421c (16-bit adds in the chain)
    16384x256x768     15.1       32.3          39.8       33.8    c44421c
    65536x256x768     53.0      123.8         149.9      116.4    c44421c (faster than torch.compile)
    16384x256x1024    19.4       43.7          50.1       53.1    6dd327e; 8-CTA clusters, 4 stages: 55.4

``resident-weight.json`` (6dd327e), ``-c44421c``, ``-5e720d9``, and ``-wg4-a1f1668`` (four
consumer warpgroups, twice the epilogue's warps: slower everywhere, 56.0 against 53.8 streaming
and 64.8 against 56.4 resident at 16384x256x1024) in ``../session11-h200-2026-12-04/``.
Where it won, the ring held all four K steps of a row block (the producer loads the next
block's x during this block's epilogue); where it lost, it did not, or the cluster had few
blocks: that is the default's rule (``wgmma_postnorm.resident_pays``). The W traffic was not
what bound the streaming kernel at 16384x256x1024: Nsight Compute on the resident kernel
(``ncu-resident-a1f1668.txt``) shows 18% DRAM and 12% L2 throughput, 12 warps a SM, and warps
stalled on barriers (2.1 cycles per issued instruction) and long scoreboard (2.1) as much as
they issue: the epilogue's ~25 instructions per element, run by eight consumer warps, are the
time. The 16-bit adds (one instruction where an unpack, an fp32 add and a repack were)
removed 16% of the resident kernel's instructions and took the streaming kernel from 53.7 to
49.7 us.

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/resident_weight.py`` (writes ``$OUT/resident-weight.json``).
"""

import dataclasses

import torch
from wgmma_gemm import measure, save, suite_cases  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.errors import ComFuseError
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, problems, wgmma_postnorm

#: (M, K, N): the suite's wide-short-k, a narrower neighbour, and that with four times the rows.
SHAPES = [(16384, 256, 1024), (16384, 256, 768), (65536, 256, 768)]


def variants(m, k, n, spec, wide=False):
    """``(name, cfg)``: the streaming and the resident default; with ``wide``, each also with
    four consumer warpgroups (twice the epilogue's warps, a quarter of the slice each) where
    that fits (run at a1f1668: slower everywhere)."""
    found = []
    for name, resident in (("streaming", False), ("resident", True)):
        try:
            cfg = default_config(n, m, k, spec, resident=resident)
        except ComFuseError:
            continue
        found.append((name, cfg))
        for stages in range(cfg.stages, 1, -1) if wide else ():
            four = dataclasses.replace(cfg, wg_n=4, stages=stages)
            if not problems(m, n, k, spec, four):
                found.append((name + "_wg4", four))
                break
    return found


def more_ranks(m, k, n, spec):
    """Resident configurations over more CTAs a row than the default's (narrower W slices, so
    a deeper ring fits beside them), the deepest ring (up to 4 stages) each."""
    found, first = [], default_config(n, m, k, spec, resident=True)
    for ranks in (r for r in (2, 4, 8) if r > n // first.bn and n % r == 0):
        for stages in (4, 3, 2):
            cfg = dataclasses.replace(first, bn=n // ranks, stages=stages)
            if not problems(m, n, k, spec, cfg):
                found.append((f"resident_r{ranks}", cfg))
                break
    return found


def main():
    rows, spec = [], PostNorm.suite("float16", "layer_norm")
    for m, k, n, inputs, ref, base in suite_cases(SHAPES, 11, rows):
        for name, cfg in variants(m, k, n, spec) + (more_ranks(m, k, n, spec) if (m, k, n) == SHAPES[0] else []):
            row = dict(base, contender=f"wgmma_postnorm_{name}", config=dataclasses.asdict(cfg))
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg)  # noqa: E731,B023
            rows.append(measure(row, make, inputs, torch.empty(m, n, device="cuda", dtype=torch.float16), ref))
            text = f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]
            print(f"  {name} {cfg}: {text}", flush=True)
    save("resident-weight.json", rows)


if __name__ == "__main__":
    main()
