"""More consumer groups taking turns on a resident W (issue 3's wide-short-k; session 25).

At 16384 x 256 -> 1024 the post-norm's default is the resident W with two ping-pong groups in
four-CTA clusters (256-column slices): 41.6 us on the H100 (session 23), 37.2 on the H200
(session 22), against ~24 and ~17 us of HBM traffic (72 MB) and cuBLAS's GEMM alone at 21-23.
Per row block a group's mainloop (64 x 256 x 256) takes ~1.1 us of tensor-core time, while its
epilogue (~1,800 instructions a thread, one warp a scheduler, plus its waits on the staged
residual, the cluster's row exchange and the TMA store) takes several: the kernel is bound by
its epilogues, and two groups overlap only one epilogue with a mainloop. With 128-column slices
(eight-CTA clusters, 64 accumulators a thread) three or four groups fit the registers
(``WgmmaConfig(turns=3)``: 512 threads, 128 registers; four: 96, no spills), each with a staged
set of its own, so two or three epilogues run beside each mainloop and each group's next
residual loads while the other groups' mainloops run.

Prediction: three groups at 128 columns beat two at 256 (the default) by 15-30% at 16384 x 256
-> 1024 and 16384 x 256 -> 768; four no better than three (96 registers, and the fourth set's
shared memory shortens the ring); two groups at 128 columns as the H200's tuning measured them
(41.4 against 38.8 us: slower than the default). All correct, with the default's error.

Outcome (H100, session 25, commit 16aee22, ``session25-h100-2026-12-06/turns-16aee22.json``):
**held in direction, not in size**; four groups beat three (device us, all correct, same error):

| M x K x N | cuBLAS | torch.compile | default (2 x 256 or 192) | 2 x 128 | 3 groups | 4 x 128 |
|---|---|---|---|---|---|---|
| 16384x256x1024 | 20.9 | 58.3 | 41.7 | 42.4 | 38.2 (128) | 36.7 |
| 16384x256x768 | 16.6 | 40.2 | 33.1 | - | 30.7 (192) | - |

The most groups that fit are now the resident default (``wgmma_postnorm.resident_config``).

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/turns.py`` (writes ``$OUT/turns.json``).
"""

import dataclasses

from wgmma_gemm import measure_postnorm, save, suite_cases  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, problems, wgmma_postnorm
from tvm_comfuse.schedule.wgmma_space import configs

#: (M, K, N): the suite's wide-short-k, and the resident W's first win.
SHAPES = [(16384, 256, 1024), (16384, 256, 768)]


def variants(m, k, n, spec):
    """``(name, cfg)``: the default, then per slice width of eight- and four-CTA clusters and
    per number of groups taking turns (but the default's) the deepest ring (of 64-deep K steps,
    else 32) the space has for it."""
    found = [("default", default_config(n, m, k, spec))]
    space = [c for c in configs(m, n, k, spec) if c.resident and c.pingpong]
    for bn in (n // 8, n // 4):
        for turns in (2, 3, 4):
            fit = [c for c in space if c.bn == bn and c.turns == turns and (bn, turns) != (found[0][1].bn, found[0][1].turns)]
            if fit:
                best = max(fit, key=lambda c: (c.bk == 64, c.stages))
                found.append((f"{n // bn}x{bn}_turns{turns}", best))
    return found


def main():
    rows, spec = [], PostNorm.suite("float16", "layer_norm")
    for m, k, n, inputs, ref, base in suite_cases(SHAPES, 25, rows):
        for name, cfg in variants(m, k, n, spec):
            assert not problems(m, n, k, spec, cfg), (name, cfg)
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg)  # noqa: E731,B023
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, name, make, config=dataclasses.asdict(cfg)))
    save("turns.json", rows)


if __name__ == "__main__":
    main()
