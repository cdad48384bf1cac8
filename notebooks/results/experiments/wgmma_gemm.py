"""How close do TVM's tirx wgmma kernels get to cuBLAS? (issue 8, prepared in session 7 on CPU)

The mma.sync mainloop reaches 428 TFLOP/s as a plain 4096^3 fp16 GEMM on the H200 (0.55x of
cuBLAS's ~780), and the fused kernels inherit that ceiling. ``tvm_comfuse.schedule.wgmma_mainloop``
is a plain GEMM on sm_90a's ``wgmma.mma_async`` (both operands from 128-byte-swizzled shared
memory, cp.async ring, one warpgroup per 64 rows), written in TVM's tirx dialect. It has only
been compiled (nvcc 13, sm_90a: 166 registers at 128x256, no spills), never run.

Prediction: correct to fp32-accumulation accuracy (max abs error like cuBLAS's) at every shape;
faster than the mma.sync prototype, ~0.6-0.7x of cuBLAS at 4096^3 with 128x256 tiles (all threads
both load and compute, and ``wait_group 0`` each K step leaves the tensor cores idle across the
barrier); well below cuBLAS on the N = 768 shapes (too few tiles for 132 SMs). If it is at or
above 0.6x, the next steps are a TMA + warp-specialised producer and the row epilogue.

The fused kernel on it (``wgmma_postnorm``: a CTA owns 64 rows of a column slice, a cluster of
CTAs the whole row, row sums through distributed shared memory, LayerNorm in registers) is
timed against cuBLAS's GEMM alone and eager PyTorch (GEMM, adds, ``F.layer_norm``) on the four
suite shapes, where ComFuse's mma.sync kernel takes 26.3, 73.0, 162.9 and 79.6 us (commit
1fd9920) and cannot fuse gpt-4k-proj (8192x4096x4096: 8-CTA clusters of 512 columns here;
vanilla TVM 3546 us, torch.compile 500); at N = 768 also with whole rows in one CTA (64 CTAs for M = 4096: under half
of the 132 SMs), against the default's 2-CTA clusters of 384-column slices (128 CTAs).
Prediction: correct; the clusters beat whole rows; ~1.5x cuBLAS's GEMM time (~14 and ~40 us at
N = 768): faster than today's kernel, near torch.compile (15.0, 33.0).

And the back-to-back GEMM (``wgmma_b2b``, issue 5: ``gelu(x @ w1.T + b1) @ w2.T + b2`` with the
intermediate in registers) on issue 5's MLP shapes (intermediate 64, 128, 256; M = 16384 and
65536; d_model 1024) against eager PyTorch (two cuBLAS GEMMs and the elementwise kernels) and
torch.compile. Prediction: correct; faster than eager wherever the intermediate is 128 or
narrower (the round trip of the intermediate dominates two skinny GEMMs).

Run on the GPU: ``bash .ci/gpu-run notebooks/results/experiments/wgmma_gemm.py`` (writes
``$OUT/wgmma-gemm.json``).
"""

import json
import os

import torch

from tvm_comfuse import bench
from tvm_comfuse.schedule.space_check import _median_us
from tvm_comfuse.schedule.wgmma_b2b import wgmma_b2b
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig, build, wgmma_gemm
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, wgmma_postnorm

import tvm

SHAPES = [(4096, 4096, 4096, "float16"), (4096, 768, 768, "float16"), (4096, 4096, 4096, "bfloat16"),
          (8192, 4096, 4096, "float16")]  # M, K, N; most telling first (a run cut short keeps them)
CONFIGS = [WgmmaConfig(128, 256, 4), WgmmaConfig(128, 128, 4), WgmmaConfig(128, 256, 3), WgmmaConfig(64, 256, 4),
           WgmmaConfig(128, 128, 6)]


def measure(row: dict, make, inputs: list, out, ref) -> dict:
    """Build the tirx kernel ``make()`` returns, run it on ``inputs`` into ``out`` (NaN-filled
    first), then record its max error against ``ref`` and its median time in ``row``; a failure
    is recorded there, not raised, so one bad configuration does not end the run."""
    try:
        kernel = build(make())["main"]
        out.fill_(float("nan"))
        args = [tvm.runtime.from_dlpack(t) for t in (*inputs, out)]
        kernel(*args)
        torch.cuda.synchronize()
        row["max_abs_err"] = float((out.float() - ref).abs().max())
        row["us"] = _median_us(torch, lambda: kernel(*args))
    except Exception as err:  # pylint: disable=broad-except
        row["error"] = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
    return row


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for m, k, n, dtype in SHAPES:
        tdt = getattr(torch, dtype)
        a = torch.randn(m, k, device="cuda", dtype=tdt, generator=gen)
        b = torch.randn(n, k, device="cuda", dtype=tdt, generator=gen) / k**0.5
        ref = a.float() @ b.float().T
        flops = 2 * m * n * k
        cublas = torch.matmul(a, b.T)
        base = dict(M=m, K=k, N=n, dtype=dtype)
        us = _median_us(torch, lambda: torch.matmul(a, b.T))  # noqa: B023
        rows.append(dict(base, contender="cublas", us=us, tflops=flops / us / 1e6,
                         max_abs_err=float((cublas.float() - ref).abs().max())))
        print(f"{m}x{k}x{n} {dtype} cuBLAS: {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s", flush=True)
        c = torch.empty(m, n, device="cuda", dtype=tdt)
        for cfg in CONFIGS:
            row = dict(base, contender="wgmma", config=dict(bm=cfg.bm, bn=cfg.bn, stages=cfg.stages))
            measure(row, lambda: wgmma_gemm(m, n, k, dtype, cfg), [a, b], c, ref)  # noqa: B023
            if "us" in row:
                row.update(tflops=flops / row["us"] / 1e6, vs_cublas=us / row["us"])
            rows.append(row)
            print(f"  {cfg}: " + (f"err {row['max_abs_err']:.3g}, {row['us']:.1f} us, {row['tflops']:.0f} TFLOP/s, "
                                  f"{row['vs_cublas']:.2f}x cuBLAS" if "us" in row else row["error"]), flush=True)
    rows += postnorm()
    rows += b2b()
    out = os.path.join(os.environ.get("OUT", "."), "wgmma-gemm.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"environment": bench.environment(), "units": "us per call (median of CUDA-event means)", "rows": rows}, f, indent=1)


def postnorm():
    """LayerNorm(x @ w.T + b + r) on the N = 768 suite shapes: the fused wgmma kernel (both ring
    depths) against cuBLAS's GEMM alone and eager PyTorch."""
    rows, gen, f = [], torch.Generator(device="cuda").manual_seed(1), torch.nn.functional
    for m, k, n in [(4096, 768, 768), (4096, 3072, 768), (4096, 4096, 1024), (16384, 256, 1024), (8192, 4096, 4096)]:
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
        x, w, b, r, g, be = rnd(m, k), rnd(n, k) / k**0.5, rnd(n), rnd(m, n), rnd(n), rnd(n)
        ref = f.layer_norm(x.float() @ w.float().T + b.float() + r.float(), (n,), g.float(), be.float())
        base = dict(M=m, K=k, N=n, dtype="float16", op="layer_norm")
        eager = lambda: f.layer_norm(torch.matmul(x, w.T) + b + r, (n,), g, be)  # noqa: E731
        for name, fn in [("cublas_gemm_alone", lambda: torch.matmul(x, w.T)), ("eager", eager)]:  # noqa: B023
            rows.append(dict(base, contender=name, us=_median_us(torch, fn)))
            print(f"{m}x{k}x{n} layer_norm {name}: {rows[-1]['us']:.1f} us", flush=True)
        whole = [WgmmaConfig(64, n, 2, 64, 3), WgmmaConfig(64, n, 4, 32, 3)] if n == 768 else []  # one CTA per row
        for cfg in [default_config(n, m), *whole]:
            row = dict(base, contender="wgmma_postnorm",
                       config=dict(ranks=n // cfg.bn, bn=cfg.bn, bk=cfg.bk, stages=cfg.stages, wg_n=cfg.wg_n))
            make = lambda: wgmma_postnorm(m, n, k, PostNorm.suite("float16", "layer_norm"), cfg)  # noqa: E731,B023
            rows.append(measure(row, make, [x, w, b, r, g, be], torch.empty(m, n, device="cuda", dtype=torch.float16), ref))
            print(f"  {cfg}: " + (f"err {row['max_abs_err']:.3g}, {row['us']:.1f} us" if "us" in row else row["error"]), flush=True)
    return rows


def b2b(d_model: int = 1024):
    """gelu(x @ w1.T + b1) @ w2.T + b2: the back-to-back kernel against eager and torch.compile."""
    rows, gen, f = [], torch.Generator(device="cuda").manual_seed(2), torch.nn.functional
    for m in (16384, 65536):
        for n1 in (64, 128, 256):
            rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
            x, w1, b1, w2, b2 = rnd(m, d_model), rnd(n1, d_model) / d_model**0.5, rnd(n1), rnd(d_model, n1) / n1**0.5, rnd(d_model)
            ref = f.gelu(x.float() @ w1.float().T + b1.float()) @ w2.float().T + b2.float()
            eager = lambda: f.linear(f.gelu(f.linear(x, w1, b1)), w2, b2)  # noqa: E731,B023
            compiled = torch.compile(lambda a: f.linear(f.gelu(f.linear(a, w1, b1)), w2, b2), dynamic=False)  # noqa: B023
            base = dict(M=m, K=d_model, N1=n1, N=d_model, dtype="float16", op="b2b_gelu")
            for name, fn in [("eager", eager), ("inductor", lambda: compiled(x))]:  # noqa: B023
                rows.append(dict(base, contender=name, us=_median_us(torch, fn)))
            row = dict(base, contender="wgmma_b2b")
            make = lambda: wgmma_b2b(m, n1, d_model, d_model, "float16", "gelu")  # noqa: E731,B023
            rows.append(measure(row, make, [x, w1, b1, w2, b2], torch.empty(m, d_model, device="cuda", dtype=torch.float16), ref))
            print(f"{m}x{d_model} -> {n1} -> {d_model}: eager {rows[-3]['us']:.1f}, inductor {rows[-2]['us']:.1f}, "
                  + (f"b2b {row['us']:.1f} us (err {row['max_abs_err']:.3g})" if "us" in row else row["error"]), flush=True)
    return rows


if __name__ == "__main__":
    main()
