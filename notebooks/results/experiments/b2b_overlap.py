"""The back-to-back GEMM's output tiles stored beside the next tile's wgmmas (session 26).

Why: issue 5's one losing MLP shape is 65536 x 1024 -> 256 -> 1024 (ComFuse 165.0 us against
eager's 159.4 on the H200 in session 15, 182.1 against 176.4 on the H100 in session 18). There a
128-row block runs GEMM 2 as 16 output tiles of 64 columns; each tile's epilogue (bias, staging,
TMA store: ~32 values a thread) ran after a ``wait_group 0``, its warpgroup's tensor-core work
stopped, the other warpgroup's only cover (session 15: a two-slot w2 ring kept the two in step
and cost 30%). ``B2BConfig.overlap`` keeps two accumulator sets and stores each tile once the
next tile's first w2 chunk is issued (ptxas serialises every wgmma of the kernel, its C7514,
unless the tile loop is unrolled: it is). Also here: w2 rings deeper than session 15's four
slots, GEMM 1 on 32-deep K steps, and the first chain without its GELU (what the activation
costs).

Prediction: overlap 3-8% faster at N1 = 256 (the epilogues are ~1/3 of GEMM 2's issue slots,
half of them already covered by the other warpgroup), 0-3% at N1 = 64 and 128 (eight or sixteen
tiles, persistent CTAs whose next block's loads already overlap); at 65536 x 256 faster than
eager. Same inputs for every contender; correctness checked before timing.

Run on the GPU: ``bash .ci/gpu-run notebooks/results/experiments/b2b_overlap.py`` (writes
``$OUT/b2b-overlap.json``); ``MODE=proposals bash .ci/gpu-run ...`` (or the argument
``proposals``) times the default against session 15's rule at every MLP shape of issue 5.

Outcome (H100, session 26, ``session26-h100-2026-12-06/``): refuted at N1 = 256 (overlap 17%
slower one block a CTA) and 64 (6% slower); at 128 it wins only beside a six-slot w2 ring
(113.5 against 121.5 us). One wave at 16384 x 256 gained 9% from six 32-deep GEMM 1 steps.
Both became the default; 65536 x 256 still trails eager and torch.compile by 1-5%.
"""

import dataclasses
import os
import sys

import torch

from wgmma_gemm import measure, save, timed  # the same directory: sys.path[0] when run as a script

from tvm_comfuse import bench
from tvm_comfuse.schedule import wgmma_b2b as wb

F = torch.nn.functional
SHAPES = ((65536, 256), (16384, 256), (65536, 128), (65536, 64))


def candidates(m: int, n1: int, width: int) -> list:
    """``(label, spec, config)``: the default with and without overlap, then on deeper w2 rings
    or 32-deep GEMM 1 steps without overlap, the deeper w2 rings with it; at 65536 x 256 also
    the chain without its GELU."""
    default, mlp = wb.default_config(m, n1, width, width), wb.B2B.mlp()
    on = dataclasses.replace(default, overlap=True)
    found = [("default", mlp, default), ("overlap", mlp, on)]
    deeper = [dict(stages2=s2) for s2 in (3, 5, 6, 8) if s2 > default.stages2]
    rings = deeper + [dict(bk=32, stages=s, stages2=s2) for s, s2 in ((6, 4), (5, 6), (4, 8))]
    found += [(f"{ring}", mlp, dataclasses.replace(default, **ring)) for ring in rings]
    found += [(f"overlap {ring}", mlp, dataclasses.replace(on, **ring)) for ring in deeper]
    if (m, n1) == (65536, 256):
        found += [("default, no gelu", wb.B2B.mlp(act=None), default), ("overlap, no gelu", wb.B2B.mlp(act=None), on)]
    return [(label, spec, cfg) for label, spec, cfg in found if not wb.problems(m, n1, width, width, spec, cfg)]


def session15_rule(m: int, n1: int, width: int) -> wb.B2BConfig:
    """The default before session 26 (``wgmma_b2b.default_config`` then): the deepest GEMM 1
    ring of 64-deep steps beside two w2 slots (N1 = 64) or four, no overlap."""
    narrow = n1 <= 64
    for stages in (4, 3, 2):
        cfg = wb.B2BConfig(128, stages, 64, 128 if narrow else 64, 2 if narrow else 4, n1 <= 128)
        if not cfg.problems(m, n1, width, width, "float16"):
            return cfg
    raise AssertionError("no session-15 configuration fits")


def proposals(m: int, n1: int, width: int) -> list:
    """``(label, spec, config)`` for the second run, every MLP shape of issue 5: the session-15
    rule and the default that follows the first run (overlap on a six-slot w2 ring for persistent
    CTAs with 64-column tiles, six 32-deep GEMM 1 steps for one wave of blocks)."""
    mlp, old, new = wb.B2B.mlp(), session15_rule(m, n1, width), wb.default_config(m, n1, width, width)
    return [("session 15 rule", mlp, old)] + ([("default", mlp, new)] if new != old else [])


def main(width=1024, shapes=SHAPES, configs=candidates):
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for m, n1 in shapes:
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
        x, w1, b1, w2, b2 = rnd(m, width), rnd(n1, width) / width**0.5, rnd(n1), rnd(width, n1) / n1**0.5, rnd(width)
        base = dict(op="mlp_gelu", M=m, K=width, N1=n1, N=width)
        ref = F.gelu(x.float() @ w1.float().T + b1.float()) @ w2.float().T + b2.float()
        eager = lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)  # noqa: E731
        compiled = bench._torch_compile(torch, lambda a, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(a, w1, b1)), w2, b2),
                                        dynamic=False)  # pylint: disable=protected-access
        line = f"{m} x {width} -> {n1}:"
        for name, fn in (("eager", eager), ("inductor", lambda x=x, c=compiled: c(x))):
            rows.append(timed(dict(base, contender=name, max_abs_err=float((fn().float() - ref).abs().max())), fn))
            line += f" {name} {rows[-1]['kernel_us']:.1f}"
        print(line, flush=True)
        nogelu = F.linear(F.linear(x.float(), w1.float(), b1.float()).half().float(), w2.float(), b2.float())
        for label, spec, cfg in configs(m, n1, width):
            row = measure(dict(base, contender=f"b2b {label}", config=dataclasses.asdict(cfg)),
                          lambda s=spec, c=cfg, m=m, n1=n1: wb.wgmma_b2b(m, n1, width, width, s, c), [x, w1, b1, w2, b2],
                          torch.empty(m, width, device="cuda", dtype=torch.float16), nogelu if "no gelu" in label else ref)
            rows.append(row)
            print(f"  {label}: " + (f"{row['kernel_us']:.1f} us, err {row['max_abs_err']:.3g}" if "us" in row else row["error"]),
                  flush=True)
        save("b2b-overlap.json", rows)  # after each shape: a cut call keeps what was measured


if __name__ == "__main__":
    if sys.argv[1:] == ["proposals"] or os.environ.get("MODE") == "proposals":  # every MLP shape: the default against session 15's rule
        main(shapes=[(m, n1) for m in (16384, 65536) for n1 in (64, 128, 256)], configs=proposals)
    else:
        main()
