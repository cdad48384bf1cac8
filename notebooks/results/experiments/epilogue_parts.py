"""What each part of the post-norm's chain costs a one-wave GEMM (issue 3: BERT-base's FFN2).

Why: at 4096 x 3072 -> 768 the split post-norm's GEMM (one wave of 128 x 192 tiles, one a CTA)
takes 32.1 us against 27.9 as a plain GEMM on the H100 (session 21,
``split_epilogue.py``); under Nsight Compute the bias and residual add 2.8 us and the row
statistics 1.0. Session 21 refuted the two obvious causes: reading the statistics back from
shared memory (summed in registers instead: no change) and the residual's per-thread loads
(loaded by TMA during the mainloop instead: -0.2 us). The chain adds ~180 SASS instructions a
thread (1696 -> 1880), ~0.3 us of issue at eight consumer warps an SM, and its 72 global loads
(48 of the residual, 24 of the bias) all issue before the first use (SASS, CPU), one round trip
of latency: which part costs the rest?

Kernels, each timed alone (device time, profiler), on one shape per row of ``SHAPES``:
``cast`` (the plain GEMM: the accumulator rounded to fp16 and stored), ``bias`` (+ the [N]
bias), ``residual`` (+ the [M, N] residual, per-thread loads), ``residual_staged`` (the same
loaded by TMA: persistent CTAs of one tile), ``chain`` (bias and residual), ``chain_staged``,
``stats`` (the split's GEMM: the chain and the row statistics) and ``registers`` (the chain with
each thread storing its accumulators to global memory, no staging). Prediction: ``bias``
within 0.3 us of ``cast`` (L1 hits), ``residual`` ~1 us more (one round trip to L2 or HBM) and
``residual_staged`` close to ``cast``; if so, the 2.8 us lie in how the chain's parts combine
(``chain`` against ``bias`` + ``residual``), not in any one of them.

Run: ``bash .ci/gpu-run notebooks/results/experiments/epilogue_parts.py`` (``$OUT/epilogue-parts.json``).
"""

import dataclasses
import sys

import torch
import tvm

from split_epilogue import variants  # the same directory: sys.path[0] when run as a script
from wgmma_gemm import build, error_text, save, timed

from tvm_comfuse.schedule import split_norm as sn, wgmma_postnorm as wp
from tvm_comfuse.schedule.chain import Step
from tvm_comfuse.schedule.wgmma_elementwise import Elementwise, wgmma_elementwise

#: BERT-base's FFN2, its attention output, BERT-large's FFN2 (M, K, N)
SHAPES = [(4096, 3072, 768), (4096, 768, 768), (4096, 4096, 1024)]
F16 = "float16"
BIAS, TILE = (F16, False), (F16, True)


def parts():
    """``(name, Elementwise, staged, stage)``: each part of the suite's chain (``staged``: the tile
    operand loaded by TMA on persistent CTAs of one tile; ``stage``: the output staged for TMA
    stores, as every other row is, or stored by each thread)."""
    full = sn.gemm_spec(wp.PostNorm.suite(F16))
    cast = (Step("cast", F16),)
    found = [("cast", Elementwise(F16, cast, (), F16), False, None),
             ("bias", Elementwise(F16, cast + (Step("add", F16, 0),), (BIAS,), F16), False, None)]
    residual = Elementwise(F16, cast + (Step("add", F16, 0),), (TILE,), F16)
    chain = dataclasses.replace(full, stats="")
    found += [("residual", residual, False, None), ("residual_staged", residual, True, None),
              ("chain", chain, False, None), ("chain_staged", chain, True, None), ("stats", full, False, None),
              ("registers", chain, False, False)]
    return found


def main():
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a] or SHAPES
    for m, k, n in shapes:
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731,B023
        x, w, b, r = rnd(m, k), rnd(n, k) / k**0.5, rnd(n), rnd(m, n)
        base = dict(M=m, K=k, N=n, dtype=F16)
        row = timed(dict(base, contender="cublas_gemm_alone"), lambda: torch.matmul(x, w.T))  # noqa: B023
        rows.append(row)
        print(f"{m}x{k}x{n}: cuBLAS {row['kernel_us']:.1f} us device", flush=True)
        # the split's one-tile configuration, or its persistent one-tile variant that stages the residual
        configs = dict(variants(m, n, k, wp.PostNorm.suite(F16)))
        for name, spec, staged, stage in parts():
            cfg = configs.get("staged" if staged else "one_tile")
            row = dict(base, contender=name, config=cfg and dataclasses.asdict(cfg))
            try:
                fn = build(wgmma_elementwise(m, n, k, spec, cfg, stage=stage))["main"]
                ops = [b if not tile else r for _, tile in spec.operands]
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                out = [torch.empty(m, n // cfg.wg_cols, 2, device="cuda")] if spec.stats else []
                args = [tvm.runtime.from_dlpack(t) for t in (x, w, *ops, y, *out)]
                fn(*args)
                torch.cuda.synchronize()
                ref = x.float() @ w.float().T + sum(o.float() for o in ops)
                row["max_abs_err"] = float((y.float() - ref).abs().max())
                timed(row, lambda: fn(*args))  # noqa: B023
            except Exception as err:  # pylint: disable=broad-except
                row["error"] = error_text(err)
            print(f"  {name}: {row.get('kernel_us', row.get('error'))}", flush=True)
            rows.append(row)
        save("epilogue-parts.json", rows)


if __name__ == "__main__":
    main()
