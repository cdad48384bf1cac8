"""How close do TVM's tirx wgmma kernels get to cuBLAS? (issue 8)

Session 8 ran the first version on the H200 (cp.async ring, all threads loading then computing,
``wait_group 0`` each K step: ``../session8-h200-2026-12-03/wgmma-gemm.json``): correct
everywhere, 0.59-0.65x of cuBLAS as a plain GEMM (430 TFLOP/s at 4096^3, the mma.sync
prototype's level), and the fused post-norm on it already faster than ComFuse's mma.sync kernel
on every suite shape (22.1 against 26.3 us at 4096x768x768, 82 against 163 at 4096x4096x1024).

This run times the warp-specialised rewrite (``tvm_comfuse.schedule.wgmma_mainloop``: a TMA
producer warpgroup, mbarrier ring, consumers keeping one wgmma group in flight). Prediction:
correct everywhere; the plain GEMM at 0.75-0.85x of cuBLAS at 4096^3 (the K loop no longer
waits for its own group or a CTA barrier, and no consumer thread computes an address); the
fused post-norm 1.2-1.5x faster than session 8's, so within ~1.3x of cuBLAS's GEMM alone at
N = 768 and 1024; the back-to-back GEMM (two consumer warpgroups, w2 through the same ring)
faster than eager at M = 65536 where session 8's lost.

Times: ``us`` is the median CUDA-event mean of back-to-back calls (launch overhead included:
TVM's and PyTorch's calls differ), ``kernel_us`` the profiler's device time per call (the
number issue 3's targets use).

Run on the GPU: ``bash .ci/gpu-run notebooks/results/experiments/wgmma_gemm.py`` (writes
``$OUT/wgmma-gemm.json``).
"""

import dataclasses
import json
import os

import torch

from tvm_comfuse import bench
from tvm_comfuse.schedule.space_check import _median_us
from tvm_comfuse.schedule.wgmma_b2b import B2B, B2BConfig, wgmma_b2b
from tvm_comfuse.schedule.wgmma_mainloop import SMEM_LIMIT, WgmmaConfig, build, wgmma_gemm
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config, problems, staging, wgmma_postnorm

import tvm

SHAPES = {  # M, K, N, dtype -> configurations; most telling first (a run cut short keeps them)
    (4096, 4096, 4096, "float16"): [WgmmaConfig(128, 256, 4), WgmmaConfig(128, 256, 3), WgmmaConfig(256, 128, 4),
                                    WgmmaConfig(128, 128, 6), WgmmaConfig(64, 256, 4)],
    (4096, 4096, 4096, "bfloat16"): [WgmmaConfig(128, 256, 4), WgmmaConfig(256, 128, 4)],
    (8192, 4096, 4096, "float16"): [WgmmaConfig(128, 256, 4), WgmmaConfig(256, 128, 4)],
    (4096, 768, 768, "float16"): [WgmmaConfig(128, 256, 4), WgmmaConfig(128, 128, 4), WgmmaConfig(64, 128, 6)],
}
#: Post-norm configurations besides the default, per N: 4-CTA clusters, and a 64-byte swizzle.
POSTNORM_ALT = {768: [WgmmaConfig(64, 192, 4, 64, 1), WgmmaConfig(64, 384, 6, 32, 2)],
                1024: [WgmmaConfig(64, 256, 4, 64, 1)], 4096: []}


def measure(row: dict, make, inputs: list, out, ref) -> dict:
    """Build the tirx kernel ``make()`` returns, run it on ``inputs`` into ``out`` (NaN-filled
    first), then record its max error against ``ref`` and its times in ``row``; a failure
    is recorded there, not raised, so one bad configuration does not end the run."""
    try:
        kernel = build(make())["main"]
        out.fill_(float("nan"))
        args = [tvm.runtime.from_dlpack(t) for t in (*inputs, out)]
        kernel(*args)
        torch.cuda.synchronize()
        row["max_abs_err"] = float((out.float() - ref).abs().max())
        timed(row, lambda: kernel(*args))
    except Exception as err:  # pylint: disable=broad-except
        row["error"] = error_text(err)
    return row


def error_text(err: Exception) -> str:
    """What a row records of a failed build or run: the error's last line, at most 200 characters."""
    return (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]


def measure_postnorm(base: dict, inputs: list, ref, m, n, k, spec, name: str, make, **fields) -> dict:
    """The row of post-norm kernel ``make()`` (``wgmma_postnorm_<name>``, ``fields`` recorded
    with it) on :func:`postnorm_inputs`' ``inputs``, measured by :func:`measure`; prints one line."""
    row = measure(dict(base, contender=f"wgmma_postnorm_{name}", **fields), make, inputs,
                  torch.empty(m, n, device="cuda", dtype=torch.float16), ref)
    text = f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]
    print(f"  {name} {fields.get('config', '')}: {text}", flush=True)
    return row


def timed(row: dict, fn) -> dict:
    """``row`` with ``us`` (CUDA events, back to back), ``kernel_us`` (profiler device time) and
    ``kernels`` (device time per kernel name, where a call runs several)."""
    row["us"] = _median_us(torch, fn)
    row["kernel_us"], calls, breakdown = bench.kernel_us(torch, fn)
    if calls > 1:
        row["kernels"] = breakdown
    return row


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for (m, k, n, dtype), configs in SHAPES.items():
        tdt = getattr(torch, dtype)
        a = torch.randn(m, k, device="cuda", dtype=tdt, generator=gen)
        b = torch.randn(n, k, device="cuda", dtype=tdt, generator=gen) / k**0.5
        ref = a.float() @ b.float().T
        flops = 2 * m * n * k
        cublas = torch.matmul(a, b.T)
        base = dict(M=m, K=k, N=n, dtype=dtype)
        row = timed(dict(base, contender="cublas", max_abs_err=float((cublas.float() - ref).abs().max())),
                    lambda: torch.matmul(a, b.T))  # noqa: B023
        rows.append(row)
        floor = row["kernel_us"]
        print(f"{m}x{k}x{n} {dtype} cuBLAS: {floor:.1f} us device, {flops / floor / 1e6:.0f} TFLOP/s", flush=True)
        c = torch.empty(m, n, device="cuda", dtype=tdt)
        for cfg in configs:
            row = dict(base, contender="wgmma", config=dict(bm=cfg.bm, bn=cfg.bn, stages=cfg.stages, bk=cfg.bk))
            measure(row, lambda: wgmma_gemm(m, n, k, dtype, cfg), [a, b], c, ref)  # noqa: B023
            if "us" in row:
                row.update(tflops=flops / row["kernel_us"] / 1e6, vs_cublas=floor / row["kernel_us"])
            rows.append(row)
            print(f"  {cfg}: " + (f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device, {row['tflops']:.0f} TFLOP/s, "
                                  f"{row['vs_cublas']:.2f}x cuBLAS" if "us" in row else row["error"]), flush=True)
    rows += postnorm()
    rows += b2b()
    save("wgmma-gemm.json", rows)


def save(name: str, rows: list) -> None:
    """``rows`` with the environment and the units, as ``$OUT/name``."""
    with open(os.path.join(os.environ.get("OUT", "."), name), "w", encoding="utf-8") as f:
        json.dump({"environment": bench.environment(), "units": "us: median CUDA-event mean of back-to-back calls; "
                   "kernel_us: profiler device time per call", "rows": rows}, f, indent=1)


def postnorm_inputs(m, k, n, gen):
    """fp16 ``[x, w, b, r, gamma, beta]`` of ``LayerNorm(x @ w.T + b + r)`` from ``gen``, its fp32
    reference, and eager PyTorch on them."""
    f = torch.nn.functional
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
    x, w, b, r, g, be = rnd(m, k), rnd(n, k) / k**0.5, rnd(n), rnd(m, n), rnd(n), rnd(n)
    ref = f.layer_norm(x.float() @ w.float().T + b.float() + r.float(), (n,), g.float(), be.float())
    return [x, w, b, r, g, be], ref, lambda: f.layer_norm(torch.matmul(x, w.T) + b + r, (n,), g, be)


def postnorm_baselines(m, k, n, gen, names=("cublas_gemm_alone", "eager", "inductor")):
    """``(inputs, ref, base row, rows)``: :func:`postnorm_inputs` and the timed rows of the
    library contenders ``names`` (cuBLAS's GEMM alone, eager, torch.compile), each checked
    against ``ref`` first; prints their device times on one line."""
    f = torch.nn.functional
    (x, w, b, r, g, be), ref, eager = postnorm_inputs(m, k, n, gen)
    base = dict(M=m, K=k, N=n, dtype="float16", op="layer_norm")
    compiled = torch.compile(lambda a: f.layer_norm(f.linear(a, w, b) + r, (n,), g, be), dynamic=False)
    fns = {"cublas_gemm_alone": lambda: torch.matmul(x, w.T), "eager": eager, "inductor": lambda: compiled(x)}
    rows, line = [], f"{m}x{k}x{n}:"
    for name in names:
        err = None if name == "cublas_gemm_alone" else float((fns[name]().float() - ref).abs().max())
        rows.append(timed(dict(base, contender=name, max_abs_err=err), fns[name]))
        line += f" {name} {rows[-1]['kernel_us']:.1f}"
    print(line + " us device", flush=True)
    return [x, w, b, r, g, be], ref, base, rows


def suite_cases(shapes, seed: int, rows: list, names=("cublas_gemm_alone", "inductor")):
    """Per ``(M, K, N)`` of ``shapes``: ``(m, k, n, inputs, ref, base)`` of
    :func:`postnorm_baselines` (fp16 LayerNorm, one generator seeded ``seed`` for all shapes),
    the timed rows of the contenders ``names`` appended to ``rows`` first."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for m, k, n in shapes:
        inputs, ref, base, baselines = postnorm_baselines(m, k, n, gen, names)
        rows += baselines
        yield m, k, n, inputs, ref, base


def cluster_cases(shapes, rows: list):
    """:func:`suite_cases` (seed 0) as ``(m, k, n, spec, inputs, ref, base, out)``, ``spec`` the
    fp16 LayerNorm post-norm and ``out`` an fp16 buffer of the output's shape, with the cluster
    kernel's default row appended to ``rows`` first where it takes the shape: what each
    experiment comparing the split's forms against it starts from."""
    for m, k, n, inputs, ref, base in suite_cases(shapes, 0, rows):
        spec = PostNorm.suite("float16")
        if not problems(m, n, k, spec):
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, "default", lambda: wgmma_postnorm(m, n, k, spec)))  # noqa: B023
        yield m, k, n, spec, inputs, ref, base, torch.empty(m, n, device="cuda", dtype=torch.float16)


def deepest_bk32(spec, cfg, k):
    """``cfg``'s tile on the deepest bk-32 ring (up to 8 stages, no deeper than K's steps) that
    fits shared memory beside its staged epilogue tiles."""
    shallow = WgmmaConfig(cfg.bm, cfg.bn, 2, 32, cfg.wg_n)
    stages = (SMEM_LIMIT - staging(spec, shallow).smem_bytes(shallow)) // ((cfg.bm + cfg.bn) * 32 * 2)
    return WgmmaConfig(cfg.bm, cfg.bn, min(8, stages, max(2, k // 32)), 32, cfg.wg_n)


def first_fitting(m, n, k, spec, cfg, rings=((4, 64), (3, 64), (2, 64)), stage=None, **changes):
    """``cfg`` with ``changes`` on the first of ``rings`` (``(stages, bk)``, deepest first) that
    the post-norm kernel can run for this shape (:func:`~tvm_comfuse.schedule.wgmma_postnorm.problems`), or None."""
    for stages, bk in rings:
        found = dataclasses.replace(cfg, stages=stages, bk=bk, **changes)
        if not problems(m, n, k, spec, found, stage):
            return found
    return None


def postnorm():
    """LayerNorm(x @ w.T + b + r) on the suite shapes: the fused wgmma kernel (default and
    alternative configurations) against cuBLAS's GEMM alone and eager PyTorch."""
    rows, gen = [], torch.Generator(device="cuda").manual_seed(1)
    for m, k, n in [(4096, 768, 768), (4096, 3072, 768), (4096, 4096, 1024), (16384, 256, 1024), (8192, 4096, 4096)]:
        (x, w, b, r, g, be), ref, eager = postnorm_inputs(m, k, n, gen)
        base = dict(M=m, K=k, N=n, dtype="float16", op="layer_norm")
        for name, fn in [("cublas_gemm_alone", lambda: torch.matmul(x, w.T)), ("eager", eager)]:  # noqa: B023
            rows.append(timed(dict(base, contender=name), fn))
            print(f"{m}x{k}x{n} layer_norm {name}: {rows[-1]['kernel_us']:.1f} us device", flush=True)
        for cfg in [default_config(n, m), *POSTNORM_ALT[n]]:
            row = dict(base, contender="wgmma_postnorm",
                       config=dict(ranks=n // cfg.bn, bn=cfg.bn, bk=cfg.bk, stages=cfg.stages, wg_n=cfg.wg_n))
            make = lambda: wgmma_postnorm(m, n, k, PostNorm.suite("float16", "layer_norm"), cfg)  # noqa: E731,B023
            rows.append(measure(row, make, [x, w, b, r, g, be], torch.empty(m, n, device="cuda", dtype=torch.float16), ref))
            print(f"  {cfg}: " + (f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]),
                  flush=True)
    return rows


def b2b(d_model: int = 1024):
    """gelu(x @ w1.T + b1) @ w2.T + b2: the back-to-back kernel (64 and 128 rows a CTA) against
    eager and torch.compile. (Session 8's kernel; the current one, rebuilt in session 15, is
    measured with its own configurations by ``hopper_opt_in.py``.)"""
    rows, gen, f = [], torch.Generator(device="cuda").manual_seed(2), torch.nn.functional
    for m in (16384, 65536):
        for n1 in (64, 128, 256):
            rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
            x, w1, b1, w2, b2 = rnd(m, d_model), rnd(n1, d_model) / d_model**0.5, rnd(n1), rnd(d_model, n1) / n1**0.5, rnd(d_model)
            ref = f.gelu(x.float() @ w1.float().T + b1.float()) @ w2.float().T + b2.float()
            eager = lambda: f.linear(f.gelu(f.linear(x, w1, b1)), w2, b2)  # noqa: E731,B023
            compiled = torch.compile(lambda a: f.linear(f.gelu(f.linear(a, w1, b1)), w2, b2), dynamic=False)  # noqa: B023
            base = dict(M=m, K=d_model, N1=n1, N=d_model, dtype="float16", op="b2b_gelu")
            line = f"{m}x{d_model} -> {n1} -> {d_model}:"
            for name, fn in [("eager", eager), ("inductor", lambda: compiled(x))]:  # noqa: B023
                rows.append(timed(dict(base, contender=name), fn))
                line += f" {name} {rows[-1]['kernel_us']:.1f}"
            for bm in (128, 64):
                row = dict(base, contender="wgmma_b2b", config=dict(bm=bm))
                cfg = B2BConfig(bm, 4 if n1 == 64 else 3 if n1 < 256 else 2, persistent=False)  # the session-8 kernel's blocks and rings
                make = lambda: wgmma_b2b(m, n1, d_model, d_model, B2B.mlp(), cfg)  # noqa: E731,B023
                rows.append(measure(row, make, [x, w1, b1, w2, b2], torch.empty(m, d_model, device="cuda", dtype=torch.float16), ref))
                line += f", b2b bm {bm} " + (f"{row['kernel_us']:.1f} (err {row['max_abs_err']:.3g})" if "us" in row else row["error"])
            print(line + " us device", flush=True)
    return rows


if __name__ == "__main__":
    main()
