"""Split post-norms: the row statistics in the GEMM's epilogue, the norm in a kernel after it.

Why: the post-norm kernel (:mod:`.wgmma_postnorm`) keeps a row on chip by slicing it over the
CTAs of a thread-block cluster, at most 8 x 512 columns, and pays for it with 64-row tiles, which
read W from L2 twice as often as the plain GEMM's 128 x 256 ones. At N = 4096 (8192 x 4096 ->
4096) that made it 1.42x cuBLAS's GEMM alone and 1.22x torch.compile's GEMM + LayerNorm (H200,
session 12); wider rows (LLaMA's 5120, 8192) it cannot take at all, and those groups were left to
vanilla TVM. Issue 3 names the scheme for wide rows: per-tile partial statistics combined
across CTAs. Here:

1. The GEMM + elementwise kernel (:mod:`.wgmma_elementwise`, persistent 128 x 256 tiles, 0.99x
   cuBLAS as a plain GEMM in session 16) applies the chain up to the norm (bias, residual) to its
   accumulators, writes that sum ``y`` once by TMA, and, reading its staged tile back, writes
   each row's mean and centred sum of squares over every 256-column part
   (``Elementwise.stats``): the row statistics cost no pass over HBM.
2. One light kernel (:func:`norm_func`, scheduled by :func:`schedule_norm`) combines each row's
   parts (Chan et al.: ``M2 = sum M2_i + n_i sum (mean_i - mean)^2``, no cancellation) and
   writes ``norm(y) * gamma + beta``. Softmax (session 24) the same way: each part's max and
   sum of ``exp(y - max)``, combined as ``S = sum_i S_i exp(max_i - max)`` (the online
   softmax's rescaling), then ``exp(y - max) / S``.

Against cuBLAS + a separate LayerNorm (torch.compile's plan) this saves the residual's read and
the statistics' pass from the norm kernel, which reads ``y`` and writes the output, nothing else.
The sum does make one round trip through HBM, which the cluster kernel avoids; that is the price
of rows wider than a cluster holds, and of a mainloop at the plain GEMM's speed. Because ``y``
is written anyway, a graph that also returns the sum before the norm (a pre-norm transformer's
residual stream) costs nothing more; and as the GEMM kernel takes any chain of casts and adds,
so do chains the post-norm kernel does not express (a bias-less projection's residual alone).
Where each runs: :func:`tvm_comfuse.transform.offload_hopper.postnorm_kernel`.

Where one wave of the GEMM's tiles covers the rows (:func:`exchange_problems`), the two kernels
become one (:func:`exchange_kernel`, :mod:`.row_exchange`): the CTAs of a row tile combine their
statistics through global memory, and each normalises its staged sum before its one store, so
the sum makes no round trip either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import te

from ..errors import ComFuseError
from . import row_exchange
from .chain import np_dtype
from .staged_store import size
from .wgmma_elementwise import Elementwise, default_config, problems as gemm_problems, reference as elementwise_reference, wgmma_elementwise
from .wgmma_mainloop import WgmmaConfig
from .wgmma_postnorm import PostNorm

#: Threads a row of the norm kernel takes: the most that divide the row's 16-byte vectors (a CTA
#: holds up to 256 threads, several rows where a row takes fewer).
NORM_THREADS = (256, 128, 64, 32)


@dataclass(frozen=True)
class NormKernel:
    """The norm kernel of a split post-norm ``spec`` whose rows' statistics come in ``parts``:
    what the offload hands its kernel builder beside the PrimFunc."""

    spec: PostNorm
    parts: int


@dataclass(frozen=True)
class ExchangeKernel:
    """The one-kernel form of a split post-norm ``spec`` (:func:`exchange_kernel`) whose rows'
    statistics come in ``parts``: what the offload hands its kernel builder beside the PrimFunc."""

    spec: PostNorm
    parts: int


def sum_steps(spec: PostNorm) -> tuple:
    """The chain steps whose value the GEMM kernel writes: all of them, but a last cast to fp32
    of a 16-bit value (the norm's input is then that value widened: written in 16 bits, it loses
    nothing and moves half the bytes). BERT's imported chains end in an fp32 add, the suite's in
    that cast."""
    steps = spec.steps
    return steps[:-1] if len(steps) > 1 and steps[-1].op == "cast" and steps[-2].dtype != "float32" else steps


def sum_dtype(spec: PostNorm) -> str:
    """The dtype of the sum the GEMM kernel writes (:func:`sum_steps`)."""
    steps = sum_steps(spec)
    return steps[-1].dtype if steps else "float32"


def gemm_spec(spec: PostNorm) -> Elementwise:
    """The GEMM + elementwise description of ``spec``'s chain up to the norm, with its row statistics."""
    return Elementwise(spec.dtype, sum_steps(spec), spec.operands, sum_dtype(spec), (), spec.norm)


def vector(spec: PostNorm) -> int:
    """Elements of ``y`` one thread of the norm kernel moves at a time: 16 bytes."""
    return 16 // size(sum_dtype(spec))


def problems(m, n, k, spec: PostNorm, cfg: WgmmaConfig | None = None) -> list:
    """What keeps the split kernels from this group (empty if nothing). Unlike the post-norm
    kernel they take any number of added operands (a pre-norm block's residual alone: LLaMA's
    projections have no bias)."""
    found = spec.problems(two_operands=False)
    if found or not all(isinstance(d, int) for d in (m, n, k)):
        return found or [f"symbolic shape M, N, K = {m}, {n}, {k} (static only)"]
    if n % (32 * vector(spec)):
        found.append(f"N = {n} (a multiple of {32 * vector(spec)}: the norm kernel's warps move 16 bytes a thread)")
    return found + gemm_problems(m, n, k, gemm_spec(spec), cfg)


def config(m: int, n: int, k: int, spec: PostNorm, cfg: WgmmaConfig | None = None) -> WgmmaConfig:
    """The GEMM kernel's configuration: ``cfg``, or the GEMM + elementwise default."""
    return cfg or default_config(m, n, k, gemm_spec(spec))


def kernels(m: int, n: int, k: int, spec: PostNorm, cfg: WgmmaConfig | None = None, lead=None) -> tuple:
    """``(gemm, norm, parts)``: the GEMM kernel (tirx, sm_90a; ``(x, w, the added operands..., y,
    stats)``, ``y`` of shape ``[*lead, N]`` in :func:`sum_dtype`, ``stats`` ``[M, parts, 2]``), the
    norm's scheduled PrimFunc (:func:`norm_func`, :func:`schedule_norm`),
    and the parts a row's statistics come in."""
    found = problems(m, n, k, spec, cfg)
    if found:
        raise ComFuseError("split post-norm cannot take " + "; ".join(found))
    cfg = config(m, n, k, spec, cfg)
    parts = n // cfg.wg_cols
    gemm = wgmma_elementwise(m, n, k, gemm_spec(spec), cfg, lead=lead)
    return gemm, schedule_norm(norm_func(m, n, parts, spec, lead), m, n, spec), parts


def exchange_problems(m, n, k, spec: PostNorm, cfg: WgmmaConfig | None = None) -> list:
    """What keeps the one-kernel form (:func:`exchange_kernel`) from this group (empty if nothing)."""
    found = problems(m, n, k, spec, cfg)
    return found or row_exchange.problems(m, n, config(m, n, k, spec, cfg), spec, sum_dtype(spec))


def exchange_kernel(m: int, n: int, k: int, spec: PostNorm, cfg: WgmmaConfig | None = None, lead=None):
    """The split post-norm as one kernel (:mod:`.row_exchange`; tirx, sm_90a): parameters ``(x,
    w, the added operands..., gamma, beta (LayerNorm), flags, out, stats)``, ``flags`` the
    ``[row tiles, 2]`` int32 words of its barriers (:func:`flags_shape`; zero before the first
    launch, and left so), ``stats`` ``[M, parts, 2]`` float32 scratch (the GEMM kernel's)."""
    found = exchange_problems(m, n, k, spec, cfg)
    if found:
        raise ComFuseError("split post-norm in one kernel cannot take " + "; ".join(found))
    return wgmma_elementwise(m, n, k, gemm_spec(spec), config(m, n, k, spec, cfg), lead=lead, norm=spec)


def flags_shape(m: int, n: int, k: int, spec: PostNorm, cfg: WgmmaConfig | None = None) -> tuple:
    """The shape of :func:`exchange_kernel`'s ``flags``: two words a row tile."""
    return (-(-m // config(m, n, k, spec, cfg).bm), 2)


def reference_exchange(spec: PostNorm, x, w, operands, parts: int, gamma=None, beta=None):
    """NumPy model of :func:`exchange_kernel`: ``(out, stats)`` (the norm as the split's kernels
    compute it, from the same rounded sum and statistics)."""
    y, stats = reference_gemm(spec, x, w, operands, parts)
    return reference_norm(spec, y, stats, gamma, beta, lead=x.shape[:-1])[0], stats


def norm_func(m: int, n: int, parts: int, spec: PostNorm, lead=None) -> tvm.tirx.PrimFunc:
    """The norm from the row statistics, as a TE PrimFunc (unscheduled: it runs on llvm as it
    is, which is how the CPU tests check its numerics): parameters ``(y[*lead, N], stats[M, parts,
    2], gamma[N] (not softmax), beta[N] (LayerNorm), out[*lead, N] (, norm[*lead, N] float32 with
    spec.norm_out))``, ``lead`` the rows' dims (``(M,)`` by default; ``y`` too is ``[*lead, N]``)."""
    lead = tuple(lead or (m,))
    y = te.placeholder((*lead, n), sum_dtype(spec), "y")
    stats = te.placeholder((m, parts, 2), "float32", "stats")
    gamma, beta = (te.placeholder((n,), spec.params_dtype, name) if name in spec.params else None for name in ("gamma", "beta"))
    f32 = lambda v: v.astype("float32") if v.dtype != "float32" else v  # noqa: E731
    p = te.reduce_axis((0, parts), "p")
    if spec.norm == "softmax":  # the row's max, then its sum of exponentials, each part's rescaled to that max
        mean = te.compute((m,), lambda i: te.max(stats[i, p, 0], axis=p), name="row_max")
        q = te.reduce_axis((0, parts), "q")
        total = te.compute((m,), lambda i: te.sum(stats[i, q, 1] * te.exp(stats[i, q, 0] - mean[i]), axis=q), name="exp_sum")
        inv = te.compute((m,), lambda i: te.const(1.0, "float32") / total[i], name="inv_sum")
    else:
        mean = te.compute((m,), lambda i: te.sum(stats[i, p, 0], axis=p), name="mean_sum")  # of squares for RMSNorm
    if spec.norm == "layer_norm":
        q, cols = te.reduce_axis((0, parts), "q"), n // parts
        dev = te.compute((m,), lambda i: te.sum(stats[i, q, 1] + cols * (stats[i, q, 0] - mean[i] / parts) * (stats[i, q, 0] - mean[i] / parts),
                                                axis=q), name="dev_sum")
        rstd = te.compute((m,), lambda i: te.rsqrt(dev[i] / n + te.const(spec.eps, "float32")), name="rstd")
    elif spec.norm == "rms_norm":
        rstd = te.compute((m,), lambda i: te.rsqrt(mean[i] / parts + te.const(spec.eps, "float32")), name="rstd")

    def row(idx):  # the flat row of index idx of the rows' dims
        return sum(i * math.prod(lead[d + 1:]) for d, i in enumerate(idx))

    def value(*idx):
        r, j = row(idx[:-1]), idx[-1]
        if spec.norm == "layer_norm":
            return (f32(y[idx]) - mean[r] / parts) * rstd[r] * f32(gamma[j]) + f32(beta[j])
        if spec.norm == "softmax":
            return te.exp(f32(y[idx]) - mean[r]) * inv[r]
        return f32(y[idx]) * rstd[r] * f32(gamma[j])

    if spec.norm_out:  # the float32 norm, and its cast
        normed = te.compute((*lead, n), value, name="norm")
        outs = [te.compute((*lead, n), lambda *idx: normed(*idx).astype(spec.out_dtype), name="out"), normed]
    else:
        outs = [te.compute((*lead, n), lambda *idx: value(*idx).astype(spec.out_dtype), name="out")]
    params = [y, stats] + [t for t in (gamma, beta) if t is not None] + outs
    return te.create_prim_func(params)


def schedule_norm(func: tvm.tirx.PrimFunc, m: int, n: int, spec: PostNorm) -> tvm.tirx.PrimFunc:
    """``func`` (:func:`norm_func`, ``m`` rows of ``n``) scheduled for a GPU: up to 256 threads a
    row (a CTA holds up to 8 rows where a row has fewer, so short rows still fill the SMs' thread
    slots). Each thread combines all the row's parts itself (``N / 256`` of them, read from L1),
    with no barrier, so its loads of ``y`` can issue before the statistics are done, then moves
    its share of the row 16 bytes at a time: ``y``, gamma and beta are read into registers by
    vector loads, the values computed one by one (TVM's CUDA codegen miswrites eight-wide
    float32 vectors) and the output written back by vector stores.
    Why not TVM's cross-thread reduction of the parts (shuffles and CTA barriers): on the H100
    (session 17) that schedule wrote wrong rows wherever a row's reduction spanned several warps
    (8 GPU tests failed, not understood), and where it was right it measured no faster
    (``session17-h100-2026-12-05/split-norm-4ec9681.json``); it was removed in session 18."""
    sch = tvm.s_tir.Schedule(func)
    vec = vector(spec)
    threads = next(t for t in NORM_THREADS if n % (t * vec) == 0)
    rows_per_cta = next(r for r in (8, 4, 2, 1) if r * threads <= max(NORM_THREADS) and m % r == 0)
    out = sch.get_sblock("out")
    compute = sch.get_sblock("norm") if spec.norm_out else out  # the block that computes the values
    reads = [str(r.source.name) for r in sch.get(compute).reads]
    loads = [sch.cache_read(compute, reads.index(name), "local") for name in ("y", "gamma", "beta") if name in reads]
    stores = [sch.cache_write(out, 0, "local")]
    if spec.norm_out:  # the float32 values stay in registers for their cast
        stores.append(sch.cache_write(compute, 0, "local", consumer_blocks=[out]))
    loops = sch.get_loops(compute)
    ctas, rows = sch.split(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0], [None, rows_per_cta])
    chunks, tx, v = sch.split(loops[-1], [None, threads, vec])
    sch.reorder(tx, chunks)  # each thread's chunks in one unrolled loop: their loads in flight together
    sch.bind(ctas, "blockIdx.x")
    sch.bind(rows, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.unroll(chunks)
    sch.unroll(v)
    for b in loads:
        sch.compute_at(b, chunks)
        sch.vectorize(sch.get_loops(b)[-1])
    if spec.norm_out:
        sch.reverse_compute_at(out, chunks)
        sch.unroll(sch.get_loops(out)[-1])
    for b in stores:
        sch.reverse_compute_at(b, chunks)
        inner = sch.get_loops(b)[-1]
        sch.vectorize(sch.split(inner, [None, 16 // size(sch.get(b).writes[0].source.dtype)])[-1])
    for name in _STAT_BLOCKS[spec.norm]:
        block = sch.get_sblock(name)
        sch.compute_at(block, tx)
        sch.set_scope(block, 0, "local")
    return sch.mod["main"]


#: The norm kernel's per-row blocks (:func:`norm_func`), each consumer before what it reads: what
#: :func:`schedule_norm` computes in each thread's registers.
_STAT_BLOCKS = {"layer_norm": ("rstd", "dev_sum", "mean_sum"), "rms_norm": ("rstd", "mean_sum"),
                "softmax": ("inv_sum", "exp_sum", "row_max")}


def reference_gemm(spec: PostNorm, x, w, operands, parts: int):
    """NumPy model of the GEMM kernel on the added ``operands``: ``(y, stats)``."""
    y = elementwise_reference(gemm_spec(spec), x, w, *operands)
    return y, row_statistics(y, parts, spec.norm)


def row_statistics(y, parts: int, norm: str):
    """NumPy model of ``Elementwise.stats``: ``[M, parts, 2]`` float32 over each row's ``parts``
    equal parts of ``y``: mean and centred sum of squares (LayerNorm), mean of squares and 0
    (RMSNorm), or max and sum of ``exp(y - max)`` (softmax)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    pieces = np.asarray(y).astype(np.float32).reshape(-1, parts, y.shape[-1] // parts)
    if norm == "softmax":
        top = pieces.max(-1)
        stats = np.stack([top, np.exp(pieces - top[..., None]).sum(-1)], -1)
    elif norm == "layer_norm":
        mean = pieces.mean(-1)
        stats = np.stack([mean, ((pieces - mean[..., None]) ** 2).sum(-1)], -1)
    else:
        stats = np.stack([(pieces**2).mean(-1), np.zeros(pieces.shape[:2], np.float32)], -1)
    return stats.astype(np.float32)


def reference_norm(spec: PostNorm, y, stats, gamma=None, beta=None, lead=None) -> list:
    """NumPy model of the norm kernel (Chan et al.'s combination of the parts; softmax's by
    rescaling)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    f32 = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
    n = y.shape[-1]
    y = np.asarray(y).reshape(-1, n)
    cols = n // stats.shape[1]
    mean = stats[:, :, 0].mean(1, keepdims=True)
    if spec.norm == "softmax":
        top = stats[:, :, 0].max(1, keepdims=True)
        out = np.exp(f32(y) - top) / (stats[:, :, 1] * np.exp(stats[:, :, 0] - top)).sum(1, keepdims=True)
    elif spec.norm == "layer_norm":
        dev = (stats[:, :, 1] + cols * (stats[:, :, 0] - mean) ** 2).sum(1, keepdims=True)
        out = (f32(y) - mean) / np.sqrt(dev / y.shape[1] + spec.eps) * f32(gamma) + f32(beta)
    else:
        out = f32(y) / np.sqrt(mean + spec.eps) * f32(gamma)
    out = out.reshape(*(lead or y.shape[:1]), n).astype(np.float32)
    cast = out.astype(np_dtype(spec.out_dtype))
    return [cast, out] if spec.norm_out else [cast]


