"""Is the epilogue latency bound? (H200 experiment, session 4, 2026-12-02)

Session 3 measured the whole-row kernel (41 µs at 4096x768x768) no faster than a 128x192
tile without its cluster exchange (46.6 µs), although the latter streams 2.5x fewer bytes
from L2 and has a 4x denser warp tile. Both share the epilogue: rolled loops of scalar loads
of the residual from HBM, one in flight per thread. Prediction: ``epilogue_vec`` (2 or 4
columns per thread as one vector access, the per-thread loop unrolled) cuts the whole-row
kernel well below 41 µs, and more for the cluster splits, whose mainloop is the denser one.

Times, per suite shape, the scalar default against vectorised whole-row and split
configurations (all on the same inputs, each checked against a float32 reference first) and
writes ``$OUT/epilogue-vec.json``. Run on the GPU machine:
``bash .ci/gpu-run notebooks/results/experiments/epilogue_vec.py``.
"""

from sweep_configs import sweep

from tvm_comfuse.schedule.config import MmaConfig

WHOLE = dict(bm=32, bk=32, warps_m=2, warps_n=8)
CONFIGS = [
    MmaConfig(**WHOLE, stages=2),  # the scalar default
    MmaConfig(**WHOLE, stages=2, epilogue_vec=4),
    MmaConfig(**WHOLE, stages=2, epilogue_vec=2),
    MmaConfig(**WHOLE, stages=3, epilogue_vec=4),
    MmaConfig(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4),
    MmaConfig(bm=64, bk=32, warps_m=2, warps_n=8, stages=3, splits=2, epilogue_vec=4),
    MmaConfig(bm=64, bk=32, warps_m=2, warps_n=4, stages=3, splits=4, epilogue_vec=4),
    MmaConfig(bm=128, bk=32, warps_m=2, warps_n=4, stages=3, splits=4, epilogue_vec=4),
    MmaConfig(bm=128, bk=32, warps_m=2, warps_n=4, stages=3, splits=4),
]


def main():
    sweep("epilogue-vec", CONFIGS)


if __name__ == "__main__":
    main()
