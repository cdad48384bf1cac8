"""Split post-norms: the GEMM kernel writes the sum and its row statistics, a norm kernel follows (issues 3 and 8).

Why: the post-norm kernel keeps a row on chip by slicing it over a cluster of 64-row CTAs, and
64-row tiles read W from L2 twice as often per output as the plain GEMM's 128 x 256 ones: at
gpt-4k (8192 x 4096 -> 4096) it took 594 us against cuBLAS's GEMM alone 418 and torch.compile's
487 (session 12). Rows wider than 4096 it cannot take at all. ``schedule/split_norm.py`` runs
the persistent 128 x 256 GEMM + elementwise kernel (0.99x cuBLAS at 4096^3 in session 16) with
the bias and residual in its epilogue, writes the sum once by TMA and, reading its staged tile
back, each row's mean and centred sum of squares over every 256 columns; one light kernel then
combines them and writes the norm. Against torch.compile's plan (cuBLAS GEMM with its bias,
then Triton reading the GEMM's output and the residual) it saves the residual's read from the
norm kernel; against the cluster kernel it gives up the on-chip row for the faster mainloop.

Prediction (device us, both correct within the cluster kernel's error): gpt-4k ~460 (cluster
~590, torch.compile ~487: faster than both, within 1.15x of cuBLAS); wide-short-k (16384 x 256
-> 1024) ~35 (the GEMM moves x, the residual and y, ~72 MB; the norm reads y and writes the
output, 64 MB), under the cluster kernel's ~43 and torch.compile's ~43; the BERT shapes (N <=
1024, one wave of tiles, K of 768 to 4096) within 10% of the cluster kernel either way (the
norm kernel costs ~5 us there, about what the slower mainloop costs the cluster kernel);
4096 x 1024 -> 8192 (only the split takes it) under torch.compile. ``WgmmaConfig.stage_tiles``
(the residual loaded into the staging buffers by TMA while the mainloop runs, not by each
thread after it): 10-25% off the split's GEMM at wide-short-k, where the epilogue is most of a
tile's time, within 3% at gpt-4k.
Outcome on the H100 (session 17, ``session17-h100-2026-12-05/split-norm-4ec9681.json``): 1.28x
faster than the cluster kernel at gpt-4k but 1.07x slower than torch.compile; see NOTES. Session
18 adds the split's GEMM with less in its epilogue (``gemm_parts``) and each kernel's time.

Run: ``bash .ci/gpu-run notebooks/results/experiments/split_norm.py`` (``$OUT/split-norm.json``);
``python3 notebooks/results/experiments/split_norm.py --breakdown`` for the defaults' breakdown only.
"""

import dataclasses
import sys

import torch
import tvm

from wgmma_gemm import build, error_text, measure_postnorm, save, suite_cases, timed  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule import split_norm as sn, wgmma_elementwise as we, wgmma_postnorm as wp
from tvm_comfuse.schedule.wgmma_elementwise import Elementwise, wgmma_elementwise
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig

#: the post-norm suite (fp16 LayerNorm), then rows wider than a cluster holds
SHAPES = [(8192, 4096, 4096), (16384, 256, 1024), (4096, 4096, 1024), (4096, 3072, 768), (4096, 768, 768), (4096, 1024, 8192)]
#: ``--breakdown``: gpt-4k, BERT-large's FFN2 and attention output (issue 6's gap)
QUICK_SHAPES = [(8192, 4096, 4096), (4096, 4096, 1024), (4096, 1024, 1024)]
#: GEMM tiles besides the default: (bm, bn, stages, bk, persistent)
VARIANTS = [(128, 256, 4, 32, True), (128, 256, 3, 64, False), (128, 192, 4, 64, False), (128, 128, 4, 64, True)]


def split(m, n, k, spec, cfg, inputs, out, ref, base, sn=sn, contender="split"):
    """The row of the split kernels with GEMM configuration ``cfg`` (None: the default): both
    built, run once into NaN-filled outputs and checked against ``ref``, then timed together; a
    failure is recorded, not raised. ``sn``: the split module (another version's, to compare)."""
    row = dict(base, contender=contender, config=dataclasses.asdict(cfg or sn.config(m, n, k, spec)), default=cfg is None)
    try:
        gemm, norm, parts = sn.kernels(m, n, k, spec, cfg)
        gemm, norm = build(gemm)["main"], build(norm, tir_pipeline="default")["main"]
        y = torch.empty(m, n, device="cuda", dtype=inputs[0].dtype)
        stats = torch.empty(m, parts, 2, device="cuda")
        for t in (y, stats, out):
            t.fill_(float("nan"))
        x, w, b, r, g, *be = [tvm.runtime.from_dlpack(t) for t in inputs]
        ys, st, o = (tvm.runtime.from_dlpack(t) for t in (y, stats, out))

        def run():
            gemm(x, w, b, r, ys, st)
            norm(ys, st, g, *be, o)

        run()
        torch.cuda.synchronize()
        row["max_abs_err"] = float((out.float() - ref).abs().max())
        timed(row, run)
    except Exception as err:  # pylint: disable=broad-except
        row["error"] = error_text(err)
    text = f"err {row['max_abs_err']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row else row["error"]
    print(f"  {contender} {'default' if cfg is None else cfg}: {text}", flush=True)
    return row


def other_walk(cfg: WgmmaConfig) -> WgmmaConfig:
    """``cfg`` with the persistent walk it does not take: groups of row tiles, or whole columns."""
    return dataclasses.replace(cfg, group_rows=we.GROUP_ROWS - cfg.group_rows)


def gemm_parts(m, n, k, spec, inputs, base):
    """Rows of the default split's GEMM kernel with less in its epilogue, to say where its time
    goes: ``gemm_plain`` (no chain, no statistics: the mainloop and the store), ``gemm_chain``
    (the bias and residual loaded by each thread, no statistics); where its CTAs are persistent,
    ``gemm_plain`` again with the other tile walk (``WgmmaConfig.group_rows``: groups of 16 row
    tiles, or whole columns where the default groups) and ``gemm_chain`` with the residual loaded
    by TMA (``stage_tiles``, the persistent default since session 20). Timed alone, outputs not
    checked (the split rows are)."""
    cfg, full = dataclasses.replace(sn.config(m, n, k, spec), stage_tiles=False), sn.gemm_spec(spec)
    plain, chain, ops = Elementwise(full.dtype, out_dtype=full.out_dtype), dataclasses.replace(full, stats=""), len(full.operands)
    cases = [("gemm_plain", plain, 0, cfg), ("gemm_chain", chain, ops, cfg)]
    if cfg.persistent:
        cases += [("gemm_plain", plain, 0, other_walk(cfg)), ("gemm_chain", chain, ops, dataclasses.replace(cfg, stage_tiles=True))]
    rows = []
    for name, gspec, ops, c in cases:
        row = dict(base, contender=name, config=dataclasses.asdict(c))
        try:
            fn = build(wgmma_elementwise(m, n, k, gspec, c))["main"]
            x, w, *rest = [tvm.runtime.from_dlpack(t) for t in inputs[:2 + ops]]
            y = tvm.runtime.from_dlpack(torch.empty(m, n, device="cuda", dtype=getattr(torch, gspec.out_dtype)))
            timed(row, lambda: fn(x, w, *rest, y))
        except Exception as err:  # pylint: disable=broad-except
            row["error"] = error_text(err)
        print(f"  {name} {c}: {row.get('kernel_us', row.get('error'))}", flush=True)
        rows.append(row)
    return rows


def main(quick: bool):
    """Every shape and variant; ``quick`` (``--breakdown``): the default split, its GEMM's parts
    and the cluster kernel at gpt-4k and BERT-large's two post-norms only (one device call)."""
    rows = []
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a] or (QUICK_SHAPES if quick else SHAPES)
    for m, k, n, inputs, ref, base in suite_cases(shapes, 0, rows, ("cublas_gemm_alone", "inductor") if quick else
                                                  ("cublas_gemm_alone", "eager", "inductor")):
        spec = wp.PostNorm.suite("float16")
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        if not wp.problems(m, n, k, spec):
            rows.append(measure_postnorm(base, inputs, ref, m, n, k, spec, "default", lambda: wp.wgmma_postnorm(m, n, k, spec)))
        default = sn.config(m, n, k, spec)
        # persistent: the other walk too, and the residual loaded by each thread (before session 20's default)
        looped = [other_walk(default), dataclasses.replace(default, stage_tiles=False)] if default.persistent else []
        for cfg in [None] + looped + ([] if quick else [WgmmaConfig(bm, bn, s, bk, persistent=p) for bm, bn, s, bk, p in VARIANTS]):
            if cfg is None or not sn.problems(m, n, k, spec, cfg):
                rows.append(split(m, n, k, spec, cfg, inputs, out, ref, base))
        rows += gemm_parts(m, n, k, spec, inputs, base)
        save("split-norm.json", rows)


if __name__ == "__main__":
    main("--breakdown" in sys.argv[1:])
