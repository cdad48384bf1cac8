"""One exchange round for LayerNorm, and the bias, gamma and beta staged in shared memory: a
shorter post-norm epilogue? (issues 3 and 8)

Nsight Compute on the short-K post-norm (session 11) showed warps stalled on barriers (2.1
cycles per issued instruction) and on long scoreboard (2.1) as much as they issue. The epilogue
has two rounds of barriers for LayerNorm: the row sums meet across quad lanes and warpgroups
(a named barrier) and across the cluster (a cluster barrier), then the centred squares the same
way. And every column pair's bias, gamma and beta is a global load behind a 64-bit address.

- ``one_round``: each thread takes the mean and the centred sum of squares of its own values
  (two passes over its registers), and those pairs are combined in one round by Chan et al.'s
  formula for equal parts (``M2 = sum M2_i + n_i sum (mean_i - mean)^2``: no cancellation, as
  the two-pass form). One named barrier and one cluster barrier fewer.
- ``params``: the producer warpgroup's third warp, idle during the K loop, copies the slice's
  bias, gamma and beta (widened to fp32) into shared memory; the epilogue reads them at fixed
  offsets.

Prediction: correct everywhere with the old kernel's error; each lever a few percent at the short-K
shapes (wide-short-k 50.4 toward torch.compile's 43.4), less at K >= 3072, where the epilogue
is a small part of the kernel.

Outcome (H200, session 12, commit 236902c, ``../session12-h200-2026-12-04/epilogue-rounds-236902c.json``,
device us; "default" is the kernel before both levers): correct everywhere with the same error,
small gains at short K and within noise elsewhere:

    shape             cuBLAS  torch.compile  default  one_round  params  both
    16384x256x1024     19.5       43.4         50.3      50.6      48.8   48.5
    4096x3072x768      27.0       32.9         34.7      35.0      35.0   35.1
    4096x768x768        9.1       15.0         13.4      13.3      13.4   13.4
    4096x4096x1024     45.3       52.2         61.2      59.5      59.4   61.8
    16384x256x768      16.6       32.8         33.9      33.4      32.9   32.7   (resident W)
    8192x4096x4096    412.7      469.7        587.5     587.4     585.6  580.5

Both became the default (``wgmma_postnorm(one_round=True, params=None)``): 3.6% at
wide-short-k, 3.5% with a resident W (now under torch.compile there), 1.2% at gpt-4k; ffn2
+1.2% and large-ffn2 +1% are within this run's spread (each lever alone was 3% faster there).
Not enough to close a gap to torch.compile on any suite shape. Between device sessions the same
kernel varies by up to 5% (ffn2's default: 32.9 us at 19da73d, 34.7 here, identical SASS), so
only contenders of one run are compared.

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/epilogue_rounds.py`` (writes ``$OUT/epilogue-rounds.json``).
"""

import dataclasses

from wgmma_gemm import measure_postnorm, save, suite_cases  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, wgmma_postnorm

#: (M, K, N): wide-short-k, ffn2, attnout, large-ffn2, a resident-W default, gpt-4k.
SHAPES = [(16384, 256, 1024), (4096, 3072, 768), (4096, 768, 768), (4096, 4096, 1024), (16384, 256, 768), (8192, 4096, 4096)]
#: Each lever alone and both (the default since session 12); "default" is the kernel before them.
VARIANTS = {"default": dict(one_round=False, params=False), "one_round": dict(one_round=True, params=False),
            "params": dict(one_round=False, params=True), "both": dict(one_round=True, params=True)}


def main():
    rows, spec = [], PostNorm.suite("float16", "layer_norm")
    for m, k, n, inputs, ref, base in suite_cases(SHAPES, 13, rows):
        cfg = default_config(n, m, k, spec)
        for name, opts in VARIANTS.items():
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg, **opts)  # noqa: E731,B023
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, name, make, config=dataclasses.asdict(cfg), **opts))
    save("epilogue-rounds.json", rows)


if __name__ == "__main__":
    main()
