"""x's tile loaded once for the cluster by TMA multicast (issue 3's short-K shapes; session 34).

The post-norm kernel slices a row block's columns over the CTAs of a cluster, and every one of
them loads the same ``bm x bk`` tile of x into its ring: at 16384 x 256 -> 1024 (eight 128-column
ranks, W resident, so x is the ring's only operand) each tile crosses from L2 eight times, 64 MB
of the kernel's ~136 MB of L2 traffic. The kernel took 37.2 us on the H200 (session 22) and 36.7
on the H100 (session 30), whose HBM is 30% slower: not HBM-bound. With
``WgmmaConfig(multicast=True)`` each rank loads ``bm / ranks`` of the tile's rows into every
rank's slot (``cp.async.bulk.tensor ... .multicast::cluster``), and a slot is refilled once the
consumers of every rank have released it (remote arrives on each rank's "empty" barrier).

Prediction: 10-20% faster at 16384 x 256 -> 1024 (eight ranks) and 16384 x 256 -> 768 (four);
within 3% at the streaming shapes (two ranks, x a seventh of a slot's bytes beside W's slice);
at 128 rows (BERT at batch 1: eight ranks of 96 columns, x 40% of a slot) a few percent faster.
All correct with the default's error.

Outcome (H100, session 34, ``../session34-h100-2026-12-08/multicast-b93472b.json``, device us):
**refuted: slower at all seven shapes**, all correct with the default's error.

| M x K -> N | ranks | cuBLAS | torch.compile | default | multicast |
|---|---|---|---|---|---|
| 16384 x 256 -> 1024 (resident W) | 8 | 21.0 | 58.1 | **36.3** | 38.5 |
| 16384 x 256 -> 768 (resident W) | 4 | 16.4 | 40.4 | **30.5** | 30.7 |
| 4096 x 768 -> 768 | 2 | 9.2 | 15.2 | **13.7** | 14.7 |
| 4096 x 3072 -> 768 | 2 | 27.0 | 33.4 | **37.5** | 41.7 |
| 4096 x 4096 -> 1024 | 2 | 45.2 | 53.7 | **60.8** | 67.1 |
| 128 x 768 -> 768 | 8 | 3.4 | 5.1 | **6.7** | 7.8 |
| 128 x 3072 -> 768 | 8 | 6.4 | 8.3 | **12.0** | 15.2 |

(The suite's streaming shapes run other kernels in the pipeline: these rows compare the cluster
kernel with itself.) L2's re-reads of x were not what bound these kernels; with multicast every
slot waits for the slowest rank's consumers before any rank refills it, which couples the
ranks' K loops. The first version (``multicast-membar-060f836.json``) was 1.8-13x slower: its
remote arrives were ``mbarrier.arrive.release.cluster``, which ptxas preceded with a
``MEMBAR.ALL.GPU`` each; CUTLASS's ``release.cta`` form has none. ``multicast`` stays an opt-in
knob, out of the tuning space.

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/multicast.py`` (writes ``$OUT/multicast.json``).
"""

import dataclasses

from wgmma_gemm import measure_postnorm, save, suite_cases  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, problems, wgmma_postnorm

#: (M, K, N): the resident W's shapes first (eight and four ranks), then the streaming suite
#: shapes (two ranks) and BERT-base's attention output and FFN2 at batch 1 (eight ranks).
SHAPES = [(16384, 256, 1024), (16384, 256, 768), (4096, 768, 768), (4096, 3072, 768), (4096, 4096, 1024),
          (128, 768, 768), (128, 3072, 768)]


def main():
    rows, spec = [], PostNorm.suite("float16", "layer_norm")
    for m, k, n, inputs, ref, base in suite_cases(SHAPES, 34, rows):
        default = default_config(n, m, k, spec)
        for name, cfg in (("default", default), ("multicast", dataclasses.replace(default, multicast=True))):
            if problems(m, n, k, spec, cfg):
                print(f"  {name}: {problems(m, n, k, spec, cfg)}", flush=True)
                continue
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg)  # noqa: E731,B023
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, name, make, config=dataclasses.asdict(cfg)))
    save("multicast.json", rows)


if __name__ == "__main__":
    main()
