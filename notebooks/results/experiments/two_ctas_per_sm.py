"""Does a second CTA per SM hide the fused kernel's latency? (H200 experiment, prepared in session 5)

Nsight Compute on the default whole-row kernel (4096x768x768) shows one CTA of 8 warps per
SM, 24% SM throughput and 8.45 warp cycles per issued instruction: latency bound, with both
registers (168 per thread) and shared memory (196 KiB) allowing one CTA per SM. With the row
recomputed instead of staged (``MmaConfig(stage_rows=False)``) the bm 32 kernel needs 100 KiB,
and ``min_ctas=2`` (``__launch_bounds__(256, 2)``) makes ptxas fit it in 128 registers (4 bytes
of spill at N = 768, checked on CPU with nvcc 13), so two CTAs fit an SM: 16 warps, and one
CTA's epilogue can run beside the other's mainloop. Prediction: clearly faster than the
one-CTA kernels (30.4 and 31.5 µs at attnout). At N = 1024 the C tile alone is 128 KiB and
ptxas spills 564 bytes: expect no gain there. If the driver's shared-memory carve-out still
gives one CTA per SM, ncu's "Block Limit Shared Mem" will show it.

Times the four combinations per suite shape and writes ``$OUT/two-ctas-per-sm.json``:
``bash .ci/gpu-run notebooks/results/experiments/two_ctas_per_sm.py``. If it wins, the
``min_ctas=2`` configurations go into the search space and ``schedules/sm_90.json``.
"""

from sweep_configs import sweep

from tvm_comfuse.schedule.config import MmaConfig

BASE = dict(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4)
CONFIGS = [MmaConfig(**BASE, stage_rows=staged, min_ctas=ctas) for staged in (True, False) for ctas in (1, 2)]


if __name__ == "__main__":
    sweep("two-ctas-per-sm", CONFIGS)
