"""A row's statistics combined across the CTAs of its row tile through global memory, in one kernel.

Why: where one wave of 128-row tiles covers the GEMM (BERT's projections at 4096 tokens: 128 CTAs of
128 x 192 or 128 x 256), the split post-norm (:mod:`.split_norm`) runs the plain GEMM's tiles at
the plain GEMM's speed, but writes the sum ``y`` to HBM and reads it back in a second kernel; the
cluster kernel (:mod:`.wgmma_postnorm`) keeps the row on chip but only in 64-row tiles (a cluster
of two holds 2 x 384 columns), which read W from L2 twice as often. On the H100 at BERT-base's
FFN2 (4096 x 3072 -> 768, session 21) the split took 36.0 us and the cluster kernel 37.1 against
torch.compile's 34.1, while the split's GEMM with its epilogue took 32.1. Issue 3 names this
scheme for wide rows: per-tile partial statistics combined across CTAs. With every CTA of the grid
resident at once, the CTAs of a row tile can wait for each other: each stages its tile's sum in
shared memory as the split's GEMM does, writes its rows' statistics over its columns, meets the
other CTAs of its row tile at a barrier in global memory (:func:`barrier`), reads their statistics
back (from L2), normalises its staged tile in place and stores the output once. The sum never
leaves the chip, the tiles are the plain GEMM's, and there is no second kernel.

Measured (H100, session 22, ``experiments/row_exchange.py``): 0.6-2.9 us faster than the split's
two kernels at BERT's four post-norm shapes, not faster than the cluster kernel at the attention
outputs nor than torch.compile at BERT-base's FFN2 (34.8 against 34.0 us). The barrier costs
0-0.8 us; the pass after it (the peers' statistics from L2, the pass over the staged tile, then
the store) 2.4-4.1, all exposed at one wave. With the residual loaded by TMA once the ring is
full (session 23, ``experiments/residual_load.py``) it is faster than the cluster kernel at
BERT's three shapes the cluster kernel takes (32.1 against 37.5 us at BERT-base's FFN2,
torch.compile 34.1), and runs them by default where its grid fills the SMs.

Forward progress: a CTA waits only for the other CTAs of its row tile, which are consecutive in
the grid (the column tile varies fastest), so with the CTAs dispatched in order a row tile's CTAs
are all resident once any SMs are free for them, even where fewer SMs than CTAs are available
(the same assumption as CUTLASS's stream-K fix-up). The kernel takes only grids of one wave
(:func:`problems`), so on an idle H100 or H200 every CTA is resident from the start. A barrier
that has waited 10 s traps (a CUDA error) rather than hang.

The barrier's words, ``[row tiles, 2]`` int32, hold a 64-bit count a row tile of its CTAs
arrived over all launches: a CTA adds one and waits until the count reaches the next multiple of
the row tile's CTAs, so one atomic and the polls of one word are the whole barrier (a first
version, whose last CTA reset the count and advanced a generation word its peers polled, between
two full fences, measured no faster than the split's two kernels on the H200). The count must be
a multiple of the row tile's CTAs before the first launch, and every launch leaves it so; the
offload passes a zero constant of the module, which the VM keeps on the device across calls
(:func:`tvm_comfuse.transform.offload_hopper.exchange_call`). Two launches sharing those words
must not overlap (one stream), as any kernel's workspace.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .wgmma_mainloop import CONSUMER_BARRIER, WgmmaConfig, fragment
from .wgmma_postnorm import ACTIVE_CLUSTERS, SM_COUNT, PostNorm

#: How long a CTA waits at the row tile's barrier before it traps (ns): far beyond any wait of a
#: resident row tile (a few us), short enough to turn a grid that cannot be resident into an error.
TIMEOUT_NS = 10_000_000_000

_BARRIER = "comfuse_row_tile_barrier"
_BARRIER_SOURCE = f"""
__forceinline__ __device__ void {_BARRIER}(int* flags, unsigned int ctas) {{
  // flags[0:2]: a 64-bit count of the row tile's CTAs arrived, over all launches (a multiple of
  // ctas between launches). One thread of each CTA calls this after a CTA barrier (as CUTLASS's
  // GenericBarrier is used): its release covers the CTA's writes, its acquire the peers'.
  unsigned long long* count = reinterpret_cast<unsigned long long*>(flags);
  unsigned long long old, now;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(count) : "memory");
  const unsigned long long target = (old / ctas + 1) * ctas;
  if (old + 1 == target) return;  // the last to arrive: its acquire saw every peer's release
  unsigned long long start, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {{
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(count) : "memory");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - start > {TIMEOUT_NS}ull) __trap();  // the row tile's CTAs are not all resident
  }} while (now < target);
}}
"""
_LOAD = "comfuse_load_l2"
_LOAD_SOURCE = f"""
__forceinline__ __device__ float {_LOAD}(const float* p) {{
  return __ldcg(p);  // at L2: another SM wrote it during this kernel
}}
"""


def tiles(m: int, n: int, cfg: WgmmaConfig) -> int:
    """The CTAs of the kernel's grid: ``split_k`` a ``bm x bn`` tile (the last row tile may be partial)."""
    return -(-m // cfg.bm) * (n // cfg.bn) * cfg.split_k


def one_wave(m: int, n: int, cfg: WgmmaConfig) -> bool:
    """Whether configuration ``cfg`` has every CTA resident at once, one tile each, as the row
    tiles' barriers need (the part of :func:`problems` that depends on the configuration):
    at most an SM's worth of CTAs, and with split-K clusters at most as many clusters as the
    GPU runs at once (:data:`~.wgmma_postnorm.ACTIVE_CLUSTERS`)."""
    clusters = tiles(m, n, cfg) // cfg.split_k
    return (not (cfg.persistent or cfg.pingpong) and tiles(m, n, cfg) <= SM_COUNT
            and (cfg.split_k == 1 or clusters <= ACTIVE_CLUSTERS.get(cfg.split_k, 0)))


def problems(m: int, n: int, cfg: WgmmaConfig, spec: PostNorm, sum_dtype: str) -> list:
    """What keeps the kernel from normalising ``spec``'s rows in the GEMM kernel of configuration
    ``cfg`` (empty if nothing), beyond what keeps the split's GEMM (:func:`.split_norm.problems`)."""
    ctas = tiles(m, n, cfg)
    found = []
    if not one_wave(m, n, cfg):
        found.append(f"{ctas} CTAs of {cfg.bm} x {cfg.bn} tiles{' on persistent CTAs' if cfg.persistent or cfg.pingpong else ''}"
                     f"{f' in clusters of {cfg.split_k}' if cfg.split_k > 1 else ''} (one tile a CTA, at most {SM_COUNT}, "
                     f"clusters at most {ACTIVE_CLUSTERS}: every CTA resident at once)")
    if spec.norm_out or spec.sum_out:
        found.append("a second output (the float32 norm or the sum): the norm is written once, in place of the sum")
    if sum_dtype != spec.out_dtype:
        found.append(f"a sum in {sum_dtype} normalised to {spec.out_dtype} (in place: one dtype)")
    return found


def barrier(flags, tile, ctas: int):
    """The call by which one thread of its CTA waits until all ``ctas`` CTAs of row tile ``tile``
    have arrived (``flags``: the ``[row tiles, 2]`` words)."""
    return T.cuda.func_call(_BARRIER, flags.ptr_to([tile, 0]), T.uint32(ctas), source_code=_BARRIER_SOURCE)


def normalize(spec: PostNorm, cfg: WgmmaConfig, m: int, n: int, staged_at):
    """The tirx macro ``normalize(O, stats, flags, gamma, beta, wg, tw, row0, col0, tile)``: for
    thread ``tw`` of consumer warpgroup ``wg`` (from 0), whose ``64 x wg_cols`` part of the sum
    at ``(row0, col0)`` is staged in ``O[0, wg]`` and whose statistics over it are written to
    ``stats[row, col0 / wg_cols]``: meet the other CTAs of row tile ``tile`` (:func:`barrier`),
    combine its two rows' ``n / wg_cols`` parts (Chan et al., as the split's norm kernel does:
    :func:`.split_norm.norm_func`; softmax's maxima and sums of exponentials by rescaling each
    part's sum to the row's max) and rewrite its staged values as ``norm(y) * gamma (+ beta)``
    (softmax: ``exp(y - max) / sum``) in ``spec.out_dtype``, ready for the TMA store.
    ``staged_at(at)``: where element ``at`` of the part lies in ``O[0, wg]``."""
    parts, cols = n // cfg.wg_cols, cfg.wg_cols  # (N: a multiple of the tile)
    rms, softmax = spec.norm == "rms_norm", spec.norm == "softmax"
    acc_n, ctas = cols // 2, n // cfg.bn

    def load(stats, row, p, j):
        return T.cuda.func_call(_LOAD, stats.ptr_to([row, p, j]), source_code=_LOAD_SOURCE, return_type="float32")

    def wide(v):
        return T.cast(v, "float32") if spec.params_dtype != "float32" else v

    # pylint: disable=invalid-name
    @T.macro
    def normalize(O, stats, flags, gamma, beta, wg, tw, row0, col0, tile):
        # the thread's columns of gamma and beta (its accumulators 4q + 2h + j share column 8q +
        # 2 (tw % 4) + j), loaded before the barrier: their round trip overlaps the wait
        gs = T.alloc_local([acc_n // 2], spec.params_dtype)
        bs = T.alloc_local([acc_n // 2], spec.params_dtype)
        for q in T.unroll(acc_n // 4):
            for j in T.vectorized(2):
                if "gamma" in spec.params:
                    gs[2 * q + j] = gamma[col0 + fragment(tw, 4 * q + j)[1]]
                if "beta" in spec.params:
                    bs[2 * q + j] = beta[col0 + fragment(tw, 4 * q + j)[1]]
        T.ptx["bar.sync"](CONSUMER_BARRIER, 128 * cfg.consumers)  # every warpgroup's statistics are written
        if wg == 0:
            if tw == 0:
                T.evaluate(barrier(flags, tile, ctas))
        T.ptx["bar.sync"](CONSUMER_BARRIER, 128 * cfg.consumers)  # the row tile's CTAs have all written theirs
        mean = T.alloc_local([2], "float32")
        rstd = T.alloc_local([2], "float32")
        means = T.alloc_local([parts], "float32")  # a row's parts' means (softmax: maxima), each read once
        for h in T.unroll(2):  # the thread's rows: accumulators 4q + 2h + (0, 1)
            row = T.meta_var(T.min(row0 + fragment(tw, 2 * h)[0], m - 1))  # rows past M: not stored
            mean[h] = T.min_value("float32") if softmax else T.float32(0)
            for p in T.unroll(parts):
                means[p] = load(stats, row, p, 0)
                mean[h] = T.max(mean[h], means[p]) if softmax else mean[h] + means[p]
            if softmax:  # mean: the row's max; rstd: 1 / its sum of exponentials
                rstd[h] = T.float32(0)
                for p in T.unroll(parts):
                    rstd[h] = rstd[h] + load(stats, row, p, 1) * T.exp(means[p] - mean[h])
                rstd[h] = T.float32(1) / rstd[h]
            elif rms:
                mean[h] = mean[h] * T.float32(1.0 / parts)  # of squares
                rstd[h] = T.rsqrt(mean[h] + T.float32(spec.eps))
                mean[h] = T.float32(0)
            else:
                mean[h] = mean[h] * T.float32(1.0 / parts)
                rstd[h] = T.float32(0)
                for p in T.unroll(parts):
                    rstd[h] = rstd[h] + load(stats, row, p, 1) + T.float32(cols) * (means[p] - mean[h]) * (means[p] - mean[h])
                rstd[h] = T.rsqrt(rstd[h] * T.float32(1.0 / n) + T.float32(spec.eps))
        for q in T.unroll(acc_n // 4):
            for j in T.unroll(2):
                for h in T.unroll(2):
                    lrow, lcol = T.meta_var(fragment(tw, 4 * q + 2 * h + j))
                    at = T.meta_var((0, wg, *staged_at((lrow, lcol))))
                    v = T.meta_var((T.cast(O[at], "float32") - mean[h]) * rstd[h] * wide(gs[2 * q + j]))
                    if softmax:
                        O[at] = T.cast(T.exp(T.cast(O[at], "float32") - mean[h]) * rstd[h], spec.out_dtype)
                    elif rms:
                        O[at] = T.cast(v, spec.out_dtype)
                    else:
                        O[at] = T.cast(v + wide(bs[2 * q + j]), spec.out_dtype)

    return normalize
