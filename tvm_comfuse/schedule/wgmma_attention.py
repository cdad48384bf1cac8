"""Hopper fused attention (issue 5's attention-like chain): ``softmax(scale * q @ k.T) @ v``, one kernel.

The scores and probabilities never leave the registers. A CTA takes ``bm`` query rows of one
(batch, head) and walks the keys in blocks of up to 128 (flash attention's online softmax): its
consumer warpgroups (64 rows each) compute the rows' scores against a block on
:mod:`.wgmma_mainloop`, round and scale them as the graph does, update each row's running max
and sum (a row's values sit in the four lanes of a quad: butterfly shuffles), rescale the
output accumulators, and pack the block's probabilities into the register-A fragments of the
second GEMM, as :mod:`.wgmma_b2b` does with its intermediate; the block's ``v`` streams through
the same TMA ring in 64-key chunks. The output is divided by the row sums once, at the end.

The operands are laid out for TMA and wgmma without transposes: ``q`` and ``k`` in the
projections' own ``[B * S, H * D]`` rows (a head is a 64-column box of them), ``v`` transposed,
``[B * H * D, S]`` (the second GEMM's B operand ``[n = D, k = S]``, K-major, as the wgmma
descriptors here read it); :mod:`tvm_comfuse.transform.offload_hopper_attention` has the V
projection write that layout (:mod:`.wgmma_elementwise`'s ``layout``). The output is written in
``[B * S, H * D]``, the heads merged, as the attention-output GEMM reads it.

Written in session 14 without a GPU: checked on CPU (nvcc for sm_90a, no spills, no
accumulator hazards; the NumPy model in the kernel's place gives the graph's values), not yet run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm.script import tirx as T

from ..errors import ComFuseError
from .chain import np_dtype
from .wgmma_mainloop import (_PTX_TYPE, SMEM_LIMIT, TMA_LOAD, Ring, WgmmaConfig, box_rows, fragment, mainloop, roles,
                             tensor_map)
from .wgmma_postnorm import few_ctas

#: Keys a block of the online softmax holds: a row's scores in one warpgroup's registers beside
#: the second GEMM's accumulators and fragments (KEYS / 2 + D / 2 + KEYS / 4 of them).
KEYS = 128
#: Longest sequence taken (a bound of the tests, not of the kernel's registers).
MAX_SEQ = 8192


@dataclass(frozen=True)
class Attention:
    """``out = round(softmax(fp32(round(round(q @ k.T) (*|/) scale)) (+ mask)) @ v)`` per (batch,
    head), each rounding to the dtype the graph computes that value in: ``score_dtype`` (the
    first batched matmul's output), the scaling's (``scale_op`` ``"multiply"`` or ``"divide"`` by
    ``scale`` in ``score_dtype``), ``dtype`` (the probabilities, cast before the second matmul)
    and ``out_dtype``. Shapes: ``batch`` B, ``heads`` H, ``seq`` S, ``head_dim`` D.

    ``mask``: ``""``, or ``"keys"``: an additive mask per batch row and key (a padding mask, as
    HuggingFace encoders add it: ``[B, 1, 1, S]``, or ``[1, 1, 1, S]`` with ``mask_batch`` 1), in
    ``mask_dtype``, added in fp32 before the softmax."""

    batch: int
    heads: int
    seq: int
    head_dim: int = 64
    dtype: str = "float16"
    score_dtype: str = "float16"
    scale: float = 0.125
    scale_op: str = "multiply"
    out_dtype: str = "float16"
    mask: str = ""
    mask_batch: int = 1
    mask_dtype: str = "float32"
    #: Query rows a CTA takes, 64 or 128 (0: :attr:`rows`' default). Why 64: at a few (batch, head)
    #: pairs (BERT-base at batch 1: 12) 128-row CTAs fill 12 of 132 SMs; 64-row ones twice as
    #: many, each warpgroup with an SM's tensor cores to itself. Measured on the H100 (session 34,
    #: ``experiments/small_m.py``, device us): 3.30 against 4.76 at batch 1 x 12 heads x 128
    #: (PyTorch's SDPA 4.73), 3.74 against 5.03 at batch 4 (SDPA 4.97).
    q_rows: int = 0

    def problems(self) -> list:
        """What the kernel cannot compute of this description (empty if nothing)."""
        found = []
        if self.dtype not in _PTX_TYPE:
            found.append(f"dtype {self.dtype} (wgmma here takes {sorted(_PTX_TYPE)})")
        if self.head_dim not in (64, 128):
            found.append(f"head dim {self.head_dim} (64 or 128: 64-column boxes, the second GEMM's N)")
        if not 8 <= self.seq <= MAX_SEQ or self.seq % 8:
            found.append(f"sequence {self.seq} (a multiple of 8 up to {MAX_SEQ}: v.T's rows are TMA rows, whole 16-byte units)")
        if self.scale_op not in ("multiply", "divide"):
            found.append(f"scaling by {self.scale_op!r} (multiply or divide)")
        if self.score_dtype not in ("float16", "bfloat16", "float32") or self.out_dtype not in ("float16", "bfloat16", "float32"):
            found.append(f"dtypes {self.score_dtype}, {self.out_dtype}")
        if self.q_rows not in (0, 64, 128):
            found.append(f"{self.q_rows} query rows a CTA (64 or 128: one or two consumer warpgroups)")
        if self.mask not in ("", "keys") or self.mask_batch not in (1, self.batch):
            found.append(f"mask {self.mask!r} of batch {self.mask_batch} (none, or keys: one per batch row or for all)")
        return found

    @property
    def rows(self) -> int:
        """Query rows a CTA takes (64 per consumer warpgroup): :attr:`q_rows`, else 64 where the
        sequence is no longer or where 128-row CTAs would be few (:func:`~.wgmma_postnorm.few_ctas`:
        each warpgroup then has an SM to itself), else 128."""
        if self.q_rows:
            return self.q_rows
        return 64 if self.seq <= 64 or few_ctas(self.batch * self.heads * -(-self.seq // 128)) else 128

    @property
    def keys(self) -> int:
        """Keys a block of the online softmax takes (the last block may be partial)."""
        return 64 if self.seq <= 64 else KEYS


def reference(spec: Attention, q, k, vt, mask=None):
    """NumPy model of the kernel on ``q``, ``k`` (``[B * S, H * D]``), ``vt`` (``[B * H * D,
    S]``) and the ``mask`` (``spec.mask_batch * S`` values): ``[B * S, H * D]`` in ``out_dtype``;
    the oracle of the offload's CPU tests."""
    b, h, s, d = spec.batch, spec.heads, spec.seq, spec.head_dim
    f32 = lambda a, dt=None: np.asarray(a).astype(np_dtype(dt)).astype(np.float32) if dt else np.asarray(a).astype(np.float32)  # noqa: E731
    qh = f32(q).reshape(b, s, h, d).transpose(0, 2, 1, 3)
    kh = f32(k).reshape(b, s, h, d).transpose(0, 2, 1, 3)
    vh = f32(vt).reshape(b, h, d, s).transpose(0, 1, 3, 2)
    scores = f32(qh @ kh.transpose(0, 1, 3, 2), spec.score_dtype)
    scale = f32(np.float32(spec.scale), spec.score_dtype)
    scores = f32(scores * scale if spec.scale_op == "multiply" else scores / scale, spec.score_dtype)
    if spec.mask:
        scores = scores + f32(mask).reshape(spec.mask_batch, 1, 1, s)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    p = f32(e / e.sum(-1, keepdims=True), spec.dtype)
    out = f32(p @ vh, spec.out_dtype)
    return out.transpose(0, 2, 1, 3).reshape(b * s, h * d).astype(np_dtype(spec.out_dtype))


def wgmma_attention(spec: Attention, q_shape=None, k_shape=None, vt_shape=None, out_shape=None, mask_shape=None):
    """The fused kernel, a tirx PrimFunc for sm_90a with parameters ``(q, k, vt[, mask], out)``,
    read and written as ``[B * S, H * D]``, ``[B * S, H * D]``, ``[B * H * D, S]``, ``[mask_batch
    * S]`` and ``[B * S, H * D]`` through views of tensors of the given shapes (any with those
    element counts)."""
    found = spec.problems()
    if found:
        raise ComFuseError("wgmma attention cannot take " + "; ".join(found))
    b, h, s, d, bm, kb = spec.batch, spec.heads, spec.seq, spec.head_dim, spec.rows, spec.keys
    rows, cols, kt, chunks, blocks = b * s, h * d, d // 64, kb // 64, -(-s // kb)
    # a sequence no block divides: the last key block reads past the head's keys (the next
    # batch row's, or TMA's zeros past the tensor) and masks them out; the last query tile's
    # rows past S are computed and not stored
    ragged_keys, ragged_rows = s % kb != 0, s % bm != 0
    per_block = kt + chunks  # ring steps a key block takes: q and the block's keys, then its v.T chunks
    for name, shape, size in (("q", q_shape, rows * cols), ("k", k_shape, rows * cols), ("vt", vt_shape, rows * cols),
                              ("out", out_shape, rows * cols), ("mask", mask_shape, spec.mask_batch * s)):
        if shape is not None and math.prod(shape) != size:
            raise ComFuseError(f"wgmma attention: {name} of shape {tuple(shape)} does not hold {size} elements of {spec}")
    stages = max(2, min(per_block * blocks, SMEM_LIMIT // ((bm + kb) * 64 * 2)))
    cfg = WgmmaConfig(bm=bm, bn=kb, stages=stages, bk=64, wg_n=1)
    _, consume = mainloop(cfg, d, spec.dtype)
    ring = Ring(stages, cfg.consumers)
    init, acquire, wait, release = ring.init(), ring.acquire(), ring.wait(), ring.release()
    producer, consumer = roles(cfg)
    maps = {"q": tensor_map(rows, cols, box_rows(bm), 64, spec.dtype), "k": tensor_map(rows, cols, box_rows(kb), 64, spec.dtype),
            "vt": tensor_map(b * h * d, s, box_rows(d), 64, spec.dtype)}
    acc1_n, acc2_n, slices = kb // 2, d // 2, kb // 16
    t = _PTX_TYPE[spec.dtype]
    mma2 = f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{t}.{t}"
    pack = f"cvt.rn.{t}x2.f32"

    def score(v, mask, bh, key):
        """The graph's score: the first matmul's result rounded, scaled in its dtype, widened,
        the key's mask added."""
        sd = spec.score_dtype
        v = T.cast(v, sd) if sd != "float32" else v
        c = T.Cast(sd, T.float32(spec.scale)) if sd != "float32" else T.float32(spec.scale)
        v = v * c if spec.scale_op == "multiply" else v / c
        v = T.cast(v, "float32") if sd != "float32" else v
        at = T.min(key, s - 1) if ragged_keys else key  # (a key past S is masked out below: read a real one)
        v = v + T.cast(mask[(bh // h if spec.mask_batch > 1 else 0) * s + at], "float32") if spec.mask else v
        return T.if_then_else(key < s, v, T.float32(-math.inf)) if ragged_keys else v

    def across(v, lane_mask):  # the value of the lane lane_mask apart (a row's four values sit in a quad's lanes)
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, lane_mask, 32, 32)

    # pylint: disable=invalid-name,unused-variable,too-many-locals
    @T.macro
    def body(q_map, k_map, vt_map, mask, out):
        bh, qb = T.cta_id([b * h, -(-s // bm)])
        wg = T.warpgroup_id([cfg.consumers + 1])
        tw = T.thread_id_in_wg([128])
        S = T.alloc_shared([stages, bm + kb, 64], spec.dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared([stages], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([stages], "uint64", scope="shared", align=8)
        acc1 = T.alloc_local([acc1_n], "float32")
        acc2 = T.alloc_local([acc2_n], "float32")
        frag = T.alloc_local([slices * 4], "uint32")
        # [row half, running max / this thread's share of the running sum / the block's max / rescale]
        stat = T.alloc_local([2, 4], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        init(full, empty, wg * 128 + tw)
        row0 = T.meta_var(bh // h * s + qb * bm)  # the CTA's first query row in [B * S, H * D]
        key0 = T.meta_var(bh // h * s)  # the head's first key row
        if wg == 0:
            producer()
            if tw == 0:
                for n in T.serial(blocks):
                    for kk in T.serial(kt):  # q's rows and the block's keys, 64 of the head's columns a step
                        step = T.meta_var(n * per_block + kk)
                        acquire(full, empty, step, (bm + kb) * 64 * 2)
                        for j in T.unroll(bm // box_rows(bm)):
                            T.ptx[TMA_LOAD](S.ptr_to([step % stages, j * box_rows(bm), 0]), T.address_of(q_map),
                                            bh % h * d + kk * 64, row0 + j * box_rows(bm), full.ptr_to([step % stages]))
                        for j in T.unroll(kb // box_rows(kb)):
                            T.ptx[TMA_LOAD](S.ptr_to([step % stages, bm + j * box_rows(kb), 0]), T.address_of(k_map),
                                            bh % h * d + kk * 64, key0 + n * kb + j * box_rows(kb), full.ptr_to([step % stages]))
                    for c in T.unroll(chunks):  # then the block's v.T, 64 keys a step
                        step = T.meta_var(n * per_block + kt + c)
                        acquire(full, empty, step, d * 64 * 2)
                        T.ptx[TMA_LOAD](S.ptr_to([step % stages, 0, 0]), T.address_of(vt_map), n * kb + c * 64, bh * d,
                                        full.ptr_to([step % stages]))
        else:
            consumer()
            for i in T.unroll(acc2_n):
                acc2[i] = T.float32(0)
            for r in T.unroll(2):
                stat[r, 0] = T.float32(-math.inf)
                stat[r, 1] = T.float32(0)
            for n in T.serial(blocks):  # accumulator i of either GEMM holds row half (i // 2) % 2
                consume(S, S, full, empty, acc1, da, db, wg - 1, tw, n * per_block)
                for i in T.unroll(acc1_n):
                    acc1[i] = score(acc1[i], mask, bh, n * kb + fragment(tw, i)[1])
                for r in T.unroll(2):
                    stat[r, 2] = stat[r, 0]
                for i in T.unroll(acc1_n):
                    stat[i // 2 % 2, 2] = T.max(stat[i // 2 % 2, 2], acc1[i])
                for r in T.unroll(2):  # the new running max (the row's, over the quad), and the old values' rescale
                    for x in T.unroll(2):
                        stat[r, 2] = T.max(stat[r, 2], across(stat[r, 2], 1 << x))
                    stat[r, 3] = T.exp(stat[r, 0] - stat[r, 2])
                    stat[r, 0] = stat[r, 2]
                    stat[r, 1] = stat[r, 1] * stat[r, 3]
                for i in T.unroll(acc2_n):
                    acc2[i] = acc2[i] * stat[i // 2 % 2, 3]
                for i in T.unroll(acc1_n):
                    acc1[i] = T.exp(acc1[i] - stat[i // 2 % 2, 0])
                    stat[i // 2 % 2, 1] = stat[i // 2 % 2, 1] + acc1[i]
                for j in T.unroll(slices):  # the block's probabilities as fp16 pairs: the A fragments of GEMM 2
                    for p in T.unroll(4):
                        T.ptx[pack](frag[4 * j + p], acc1[8 * j + 2 * p + 1], acc1[8 * j + 2 * p])
                for c in T.unroll(chunks):
                    wait(full, n * per_block + kt + c)
                    T.ptx["wgmma.fence.sync.aligned"]()
                    for jj in T.unroll(4):
                        j = T.meta_var(4 * c + jj)
                        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(db[0]), S.ptr_to([(n * per_block + kt + c) % stages, 0, jj * 16]),
                                                              1, 1024 >> 4, 3)
                        T.ptx[mma2](*[acc2[i] for i in range(acc2_n)], frag[4 * j], frag[4 * j + 1], frag[4 * j + 2], frag[4 * j + 3],
                                    db[0], T.ptx.pred(True), 1, 1, 0)
                T.ptx["wgmma.commit_group.sync.aligned"]()
                T.ptx["wgmma.wait_group.sync.aligned"](0)
                for c in T.unroll(chunks):
                    release(empty, n * per_block + kt + c, tw)
            for r in T.unroll(2):  # the row sums, over the quad
                for x in T.unroll(2):
                    stat[r, 1] = stat[r, 1] + across(stat[r, 1], 1 << x)
            for q2 in T.unroll(acc2_n // 2):
                for v in T.vectorized(2):
                    row, col = T.meta_var(fragment(tw, 2 * q2 + v))
                    if ragged_rows:  # the last query tile's rows past S (the next batch row's, or nothing)
                        if qb * bm + (wg - 1) * 64 + row < s:
                            out[row0 + (wg - 1) * 64 + row, bh % h * d + col] = T.cast(acc2[2 * q2 + v] / stat[q2 % 2, 1], spec.out_dtype)
                    else:
                        out[row0 + (wg - 1) * 64 + row, bh % h * d + col] = T.cast(acc2[2 * q2 + v] / stat[q2 % 2, 1], spec.out_dtype)

    signature = [("q", q_shape or (rows, cols), spec.dtype, (rows, cols)), ("k", k_shape or (rows, cols), spec.dtype, (rows, cols)),
                 ("vt", vt_shape or (b * h * d, s), spec.dtype, (b * h * d, s))]
    signature += [("mask", mask_shape or (spec.mask_batch * s,), spec.mask_dtype, (spec.mask_batch * s,))] if spec.mask else []
    signature += [("out", out_shape or (rows, cols), spec.out_dtype, (rows, cols))]
    lines = [f"def attention({', '.join(f'{p}_h: T.handle' for p, *_ in signature)}):"]
    lines += [f"    {p}_p = T.match_buffer({p}_h, {tuple(shp)}, {dt!r}, align=16)" for p, shp, dt, _ in signature]
    lines += [f"    {p}_map: T.let[T.handle('tensormap')] = T.tvm_stack_alloca('tensormap', 1)" for p in maps]
    lines += [f"    encode_{p}({p}_map, {p}_p.data)" for p in maps] + ["    T.device_entry()"]
    lines += [f"    {p} = T.decl_buffer({view}, {dt!r}, data={p}_p.data)" for p, _, dt, view in signature[3:]]
    lines += [f"    body(q_map, k_map, vt_map, {'mask' if spec.mask else 'None'}, out)"]
    return tvm.script.from_source("@T.prim_func\n" + "\n".join(lines),
                                  extra_vars={"T": T, "body": body, **{f"encode_{p}": enc for p, enc in maps.items()}})
