"""The split post-norm in one kernel: row statistics exchanged across a row tile's CTAs (issue 3).

Why: at BERT's post-norms (4096 tokens, N <= 1024) one wave of 128-row tiles covers the GEMM, and
both Hopper kernels lose to torch.compile at BERT-base's FFN2 (H100, session 21: split 36.0 us,
cluster kernel 37.1, torch.compile 34.1), while the split's GEMM with its epilogue took 32.1 and
its norm kernel ~4. ``schedule/row_exchange.py`` folds the norm kernel into the GEMM's: every CTA
is resident, so a row tile's CTAs meet at a barrier in global memory once their statistics are
written, and each normalises its staged sum in place before its one TMA store. No second kernel,
no sum through HBM, the split GEMM's tiles.

Prediction (H100, device us): the split's GEMM time plus ~1 us for the barrier and the pass over
the staged tile: BERT-base's FFN2 ~33 (torch.compile ~33-34: a tie or a small win), BERT-large's
FFN2 (4096 x 4096 -> 1024) ~51.5 against torch.compile's ~53-54 and the split's ~54.6 (a win),
the attention outputs (4096 x 768 -> 768, 4096 x 1024 -> 1024) under the cluster kernel (13.8,
19.4-20.7). Correct after the timing's hundreds of launches too (checked again after).

Contenders per shape, one process, on the same inputs: cuBLAS's GEMM alone, torch.compile, the
cluster kernel (where it takes the shape), the split (two kernels), the one-kernel form.

Run: ``bash .ci/gpu-run notebooks/results/experiments/row_exchange.py`` (``$OUT/row-exchange.json``).
"""

import dataclasses
import sys

import torch
import tvm

from split_norm import split  # the same directory: sys.path[0] when run as a script
from wgmma_gemm import build, cluster_cases, error_text, save, timed

from tvm_comfuse.schedule import row_exchange, split_norm as sn

#: BERT-base's FFN2 and attention output, BERT-large's FFN2 and attention output (M, K, N)
SHAPES = [(4096, 3072, 768), (4096, 768, 768), (4096, 4096, 1024), (4096, 1024, 1024)]


def exchange(m, n, k, spec, inputs, out, ref, base, contender="exchange", cfg=None) -> dict:
    """The row of the one-kernel form (GEMM configuration ``cfg``; None: the default): built, run
    into a NaN-filled output and checked against ``ref``, timed, then checked again (the barrier's
    words after hundreds of launches).
    ``exchange_no_barrier``, a diagnostic: the barrier a no-op (its CTAs read statistics their
    peers may not have written yet: the error is recorded, not a result), what the rest costs."""
    cfg = cfg or sn.config(m, n, k, spec)
    row = dict(base, contender=contender, config=dataclasses.asdict(cfg))
    source = row_exchange._BARRIER_SOURCE  # pylint: disable=protected-access
    try:
        if contender == "exchange_no_barrier":
            row_exchange._BARRIER_SOURCE = source[:source.index("{") + 1] + "}"  # pylint: disable=protected-access
        kernel = build(sn.exchange_kernel(m, n, k, spec, cfg))["main"]
        row_exchange._BARRIER_SOURCE = source  # pylint: disable=protected-access
        flags = torch.zeros(sn.flags_shape(m, n, k, spec, cfg), device="cuda", dtype=torch.int32)
        stats = torch.empty(m, n // cfg.wg_cols, 2, device="cuda")
        args = [tvm.runtime.from_dlpack(t) for t in (*inputs, flags, out, stats)]
        errors = []
        for phase in ("before", "after"):
            out.fill_(float("nan"))
            kernel(*args)
            torch.cuda.synchronize()
            errors.append(float((out.float() - ref).abs().max()))
            if phase == "before":
                timed(row, lambda: kernel(*args))  # noqa: B023
        ctas = n // cfg.bn
        row.update(max_abs_err=errors[0], max_abs_err_after_timing=errors[1],
                   counts_whole=bool((flags.view(torch.int64)[:, 0] % ctas == 0).all()))
    except Exception as err:  # pylint: disable=broad-except
        row["error"] = error_text(err)
    row_exchange._BARRIER_SOURCE = source  # pylint: disable=protected-access
    text = f"err {row['max_abs_err']:.3g} / {row['max_abs_err_after_timing']:.3g}, {row['kernel_us']:.1f} us device" if "us" in row \
        else row["error"]
    print(f"  {contender}: {text}", flush=True)
    return row


def split_gemm(m, n, k, spec, inputs, base, cfg=None, contender="split_gemm") -> dict:
    """The split's GEMM kernel alone (the sum and its statistics) in configuration ``cfg`` (None:
    the default), its sum checked against PyTorch's: what the one-kernel form adds to."""
    cfg = cfg or sn.config(m, n, k, spec)
    row = dict(base, contender=contender, config=dataclasses.asdict(cfg))
    try:
        gemm = build(sn.kernels(m, n, k, spec, cfg)[0])["main"]
        y = torch.full((m, n), float("nan"), device="cuda", dtype=inputs[0].dtype)
        stats = torch.empty(m, n // cfg.wg_cols, 2, device="cuda")
        args = [tvm.runtime.from_dlpack(t) for t in (*inputs[:4], y, stats)]
        gemm(*args)
        torch.cuda.synchronize()
        x, w, b, r = (t.float() for t in inputs[:4])
        row["max_abs_err"] = float((y.float() - ((x @ w.T).half().float() + b).half().float() - r).abs().max())
        timed(row, lambda: gemm(*args))
    except Exception as err:  # pylint: disable=broad-except
        row["error"] = error_text(err)
    print(f"  {contender}: {row.get('kernel_us', row.get('error'))}", flush=True)
    return row


def main():
    rows = []
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a] or SHAPES
    for m, k, n, spec, inputs, ref, base, out in cluster_cases(shapes, rows):
        rows.append(split(m, n, k, spec, None, inputs, out, ref, base))
        rows.append(exchange(m, n, k, spec, inputs, out, ref, base))
        rows.append(exchange(m, n, k, spec, inputs, out, ref, base, "exchange_no_barrier"))
        rows.append(split_gemm(m, n, k, spec, inputs, base))
        save("row-exchange.json", rows)


if __name__ == "__main__":
    main()
