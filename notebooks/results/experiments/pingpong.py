"""Ping-pong consumer warpgroups on a resident W: does one group's epilogue hide behind the other's
mainloop? (issues 3 and 8; prepared in session 12, run in session 13)

At short K the post-norm is bound by its epilogue (Nsight Compute, session 11: warps stalled on
barriers and long scoreboard as much as they issue, eight consumer warps a CTA), and the resident
kernel's two consumer warpgroups split each row block's columns, so they meet at every barrier of
the row exchange and the tensor cores idle through every epilogue. With ``WgmmaConfig(pingpong=
True)`` each warpgroup owns a whole 64-row block's slice (one m64nN wgmma tile) and the two take
alternate row blocks, their mainloops in turn (two mbarriers), CUTLASS's ping-pong schedule: while
one runs its chain, row exchange and stores, the other's wgmmas run, and neither waits at the
other's barriers (a named barrier and two exchange sets each).

Prediction: correct everywhere with the resident kernel's error. Where the resident kernel won
(N = 768, K = 256) 10-25% faster than it, so 16384x256x768 clearly under torch.compile (32.8 us);
at 16384x256x1024 (a two-stage ring of A beside the 128 KiB W slice) faster than the resident
kernel but still behind torch.compile (43.4).

Outcome (H200, session 13, commit 8ef18ad, ``session13-h200-2026-12-04/pingpong-8ef18ad.json``):
**held, and more than predicted** (device us, all correct with the same error):

| M x K x N | torch.compile | streaming | resident | ping-pong |
|---|---|---|---|---|
| 16384x256x768 | 32.5 | 38.7 | 32.6 | 30.1 |
| 65536x256x768 | 124.9 | 144.5 | 112.2 | 94.6 |
| 16384x256x1024 | 43.6 | 48.5 | 50.6 | 43.3 |

Ping-pong is now the resident default (``wgmma_postnorm.resident_pays``), also at 16384x256x1024
with its two-stage ring, where the resident kernel without it lost.

Same inputs for every contender, correctness checked before timing; ``kernel_us`` is the
profiler's device time per call. Run on the GPU:
``bash .ci/gpu-run notebooks/results/experiments/pingpong.py`` (writes ``$OUT/pingpong.json``).
"""

import dataclasses

from wgmma_gemm import first_fitting, measure_postnorm, save, suite_cases  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, resident_config, wgmma_postnorm

#: (M, K, N): the resident kernel's wins, and the suite's wide-short-k.
SHAPES = [(16384, 256, 768), (65536, 256, 768), (16384, 256, 1024)]


def variants(m, k, n, spec):
    """``(name, cfg)``: the streaming and the resident default, and the resident slices with
    ping-pong groups (one warpgroup a slice), the deepest ring (up to 4 stages) that fits."""
    found = [("streaming", default_config(n, m, k, spec, resident=False))]
    resident = resident_config(n, m, k, spec, pingpong=False)  # the session-11 kernel, without ping-pong
    if resident is not None:
        found.append(("resident", resident))
    pingpong = first_fitting(m, n, k, spec, found[-1][1], wg_n=1, pingpong=True) if found[-1][0] == "resident" else None
    return found + ([("pingpong", pingpong)] if pingpong else [])


def main():
    rows, spec = [], PostNorm.suite("float16", "layer_norm")
    for m, k, n, inputs, ref, base in suite_cases(SHAPES, 14, rows):
        for name, cfg in variants(m, k, n, spec):
            make = lambda: wgmma_postnorm(m, n, k, spec, cfg)  # noqa: E731,B023
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, name, make, config=dataclasses.asdict(cfg)))
    save("pingpong.json", rows)


if __name__ == "__main__":
    main()
