"""Does a second CTA per SM hide the fused kernel's latency? (H200 experiment, prepared in session 5)

Nsight Compute on the default whole-row kernel (4096x768x768) shows one CTA of 8 warps per
SM, 24% SM throughput and 8.45 warp cycles per issued instruction: latency bound, with both
registers (168 per thread) and shared memory (196 KiB) allowing one CTA per SM. With the row
recomputed instead of staged (``MmaConfig(stage_rows=False)``) the bm 32 kernel needs 100 KiB,
and ``__launch_bounds__(256, 2)`` makes ptxas fit it in 128 registers (4 bytes of spill,
checked on CPU with nvcc 13), so two CTAs fit an SM: 16 warps, and one CTA's epilogue can run
beside the other's mainloop. Prediction: clearly faster than the one-CTA kernels (30.4 and
31.5 µs at attnout); if it is, ``min_ctas`` becomes a real configuration field.

TVM prints ``__launch_bounds__(threads)`` only, so this experiment adds the second argument in
the CUDA post-processing hook for its own builds. Writes ``$OUT/two-ctas-per-sm.json``:
``bash .ci/gpu-run notebooks/results/experiments/two_ctas_per_sm.py``.
"""

import re

import tvm_ffi
from sweep_configs import sweep

from tvm_comfuse.schedule import lowering
from tvm_comfuse.schedule.config import MmaConfig

BASE = dict(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4)
CONFIGS = [MmaConfig(**BASE), MmaConfig(**BASE, stage_rows=False)]
_BOUNDS = re.compile(r"__launch_bounds__\((\d+)\)")


def _sweep_with_min_ctas(name: str, min_ctas: int):
    @tvm_ffi.register_global_func("tvm_callback_cuda_postproc", override=True)
    def _postproc(code, target=None):  # pylint: disable=unused-argument
        code = lowering.add_cluster_dims(lowering.fold_fragment_indices(code))
        return _BOUNDS.sub(lambda m: f"__launch_bounds__({m.group(1)}, {min_ctas})", code) if min_ctas > 1 else code

    return sweep(name, CONFIGS)


if __name__ == "__main__":
    _sweep_with_min_ctas("one-cta-per-sm", 1)
    _sweep_with_min_ctas("two-ctas-per-sm", 2)
