"""Do the barriers in the row-tile writeback cost the epilogue? (H200 experiment, session 5)

The vectorised whole-row kernel (30.2 µs at 4096x768x768) still spends ~20 µs after its
~8 µs mainloop. Its generated CUDA has 31 ``__syncthreads``, 24 of them between the unrolled
statements of the writeback (C tile + bias + residual -> the row tile in shared memory):
TVM's ThreadSync plans every ``shared.dyn`` buffer as one (they are merged later), so each
vector write of the row tile conflicts with the next read of the C tile. Each barrier waits
for that statement's residual load from HBM, so the 24 loads run one after another.

``MmaConfig(stage_rows=False)`` drops the row tile: each reader (the two reductions and the
normalisation) recomputes C + bias + residual from the C tile, so the epilogue writes no
dynamic shared memory and has 7 barriers in all (reading the residual three times, twice from
L2). Freed of the 48 KiB tile, 64-row tiles fit 768-wide rows, halving the weight traffic
from L2. Prediction: 4096x768x768 well under 30 µs (~18), the other shapes 1.2-1.5x faster.

Times the current default against every recompute configuration that fits, per suite shape,
and writes ``$OUT/recompute-rows.json``:
``bash .ci/gpu-run notebooks/results/experiments/recompute_rows.py``.
"""

from sweep_configs import sweep

from tvm_comfuse.schedule.config import SPACES, MmaConfig

CONFIGS = [MmaConfig(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4)] + [
    c for c in SPACES[MmaConfig] if not c.stage_rows
]


if __name__ == "__main__":
    sweep("recompute-rows", CONFIGS)
