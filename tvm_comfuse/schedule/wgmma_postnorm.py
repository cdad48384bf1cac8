"""Hopper fused post-norm (issue 8, step 2): ``norm(x @ w.T + b + r)`` on the wgmma mainloop.

ComFuse's row epilogue on :mod:`.wgmma_mainloop`'s accumulators. A CTA owns ``bm`` rows (64
or 128: one or two row warpgroups) of a column slice of ``bn`` columns, split over ``wg_n``
warpgroups (``bn / wg_n <= 256``, wgmma's N); the ``N / bn`` CTAs of a thread-block cluster own
the whole row, so the GEMM result never leaves the chip: the elementwise chain (casts, bias and
residual adds, as the graph rounds them: :class:`PostNorm`) runs on the fp32 accumulators in
registers, each thread sums its share of its two rows, the partial sums meet in shared memory
(4 quad lanes x ``wg_n`` warpgroups per row) and then across the cluster through distributed
shared memory (``mapa`` + ``ld.shared::cluster`` between cluster barriers), and the normalised
row is written once.
LayerNorm takes two passes over the registers and one exchange (each thread's mean and centred
sum of squares, combined by Chan et al.'s formula: no cancellation), RMSNorm one of each. The
bias, gamma and beta are copied into shared memory by the idle producer warpgroup during the K
loop (:func:`stages_params`; session 12: up to 3.6% at short K).

Why slices: a CTA holds at most :data:`MAX_ROW` columns of 64 rows in registers (half as many
of 128), and whole-row CTAs at M = 4096 would be only 64 for 132 SMs. :func:`default_config`
slices rows over the fewest CTAs that fill the SMs. Why 128 rows can pay: every K step brings
a ``bn``-row slice of W into shared memory for ``bm`` rows of output, so 128 x 256 tiles
(cuBLAS's shape) read W from L2 half as often per output as 64 x 512 ones. Why they are not the
default: at N = 768 and 1024 they need four-CTA clusters, which ran in two waves on the H200
(:data:`DEFAULT_ROWS`).
:class:`~tvm_comfuse.transform.OffloadHopperPostNorm` puts the kernel in the Relax pipeline
(the default on sm_90). The epilogue runs in the consumer warpgroups of the warp-specialised
mainloop, their barriers named (the producer warpgroup leaves once its loads are issued). The
epilogue's tiles move by TMA where they fit (:class:`Staging`): the residual is loaded into
shared memory while the K loop runs and the output leaves by TMA stores, which took the kernel
from 18.4 to 14.0 us at 4096x768x768 and from 78.2 to 53.9 at 16384x256x1024 on the H200
(session 9, ``notebooks/results/session9-h200-2026-12-04/``).

Short K, many rows (``WgmmaConfig.resident``, session 11): one wave of clusters, each CTA's W
slice loaded once into shared memory, the CTA looping over row blocks while its producer
streams x through the ring and, from a second warp, the next block's residual into the other of
two staged sets; the row partials then cross the cluster by ``st.async`` onto mbarriers (the
producer, a block ahead, never meets a cluster barrier). The default where it measured faster
(:func:`resident_pays`). With ``WgmmaConfig(pingpong=True)`` (session 12; the resident default
since session 13, where it measured 8-16% faster than the resident kernel without it) its two
consumer warpgroups each own a whole block's slice and take alternate row blocks, their
mainloops in turn (the ``turn`` mbarriers), so one's epilogue runs beside the other's wgmmas;
each has its own named barrier and two exchange sets of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm.script
from tvm.script import tirx as T

from ..errors import ComFuseError
from .chain import Step, chain_value, np_chain, np_dtype
from .wgmma_mainloop import (TMA_LOAD, Ring, WgmmaConfig, box_rows, consumer_sync, fragment, load_resident, mainloop, roles,
                             tensor_map)

#: The row norms a :class:`PostNorm` describes. Softmax is a row norm too: its statistics are
#: the row's max and its sum of exponentials, combined across parts by rescaling (``S = sum_p
#: S_p exp(max_p - max)``, the online softmax's rule): in the split kernels since session 24
#: (:mod:`.split_norm`, :mod:`.row_exchange`), in this one since session 25 (one round, as
#: LayerNorm's mean and centred squares).
NORMS = ("layer_norm", "rms_norm", "softmax")
#: Consumer warpgroups of the default configurations (a third would leave each of the three under
#: the 154 registers ptxas needs for a 256-wide wgmma, once the producer warpgroup has its 40).
#: A given configuration may have up to four narrower ones, as the registers allow: measured
#: slower on the H200 (session 11, ``experiments/resident_weight.py``).
MAX_CONSUMERS = 2
#: Widest row slice a 64-row CTA holds in registers: two consumer warpgroups of 256 columns.
MAX_ROW = MAX_CONSUMERS * 256
#: Rows a CTA owns by default (:func:`default_config`). 128 (two row warpgroups:
#: ``default_config(..., bm=128)``) is correct but measured slower on the H200 (session 10,
#: ``experiments/row_tiles.py``): at N = 768 and 1024 its rows need clusters of four
#: 1-CTA-per-SM CTAs, of which only 30 fit the GPCs at once, so a second wave runs (ffn2 58.5
#: against 35.2 us, though its plain GEMM is faster: 30.8 against 35.1).
DEFAULT_ROWS = 64
#: CTAs a row may be sliced over (a thread-block cluster; 8 is the portable maximum).
CLUSTER_SIZES = (1, 2, 3, 4, 8)
#: Those the defaults choose from. Not three: at N = 768 a cluster of three 128 x 256 CTAs
#: (cuBLAS's tile) covers M = 4096 in one wave of 32 clusters, but measured slower than two
#: 64 x 384 CTAs (ffn2 37.6 against 32.9 us, attnout 15.8 against 13.4; its plain GEMM too:
#: 96 CTAs leave 36 SMs idle; session 12, ``experiments/tile_occupancy.py``).
DEFAULT_CLUSTER_SIZES = (1, 2, 4, 8)
#: SMs of the sm_90 parts ComFuse targets (H100 SXM, H200): what ``default_config`` fills.
SM_COUNT = 132
#: Deepest ring of the Hopper kernels' defaults where their CTAs are few (:func:`few_ctas`): they
#: stream w alone, and a CTA's loads in flight bound its bandwidth (session 32).
FEW_CTAS_STAGES = 8
#: Clusters of a one-CTA-per-SM kernel the H200 runs at once, by cluster size
#: (``cudaOccupancyMaxActiveClusters``, session 10: ``experiments/cluster_occupancy.py``; the
#: H100 SXM gave the same counts in session 21): the grid of a kernel whose clusters loop over
#: row blocks (a resident W slice).
ACTIVE_CLUSTERS = {1: 132, 2: 66, 3: 39, 4: 30, 8: 15}
#: Shared memory a thread block may use on sm_90, dynamic and static together: what a resident
#: configuration's buffers and its exchange buffers (:func:`static_bytes`) must fit.
SMEM_TOTAL = 227 * 1024
#: Columns of one staged box: a 128-byte swizzled row of 2-byte elements (TMA's widest swizzle).
BOX_COLS = 64
TMA_STORE = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"


def few_ctas(ctas: int) -> bool:
    """Whether a grid of ``ctas`` one-per-SM CTAs fills at most half the SMs: where the K loop's
    latency, not the tensor cores, bounds a CTA (a few rows: BERT at batch 1)."""
    return 2 * ctas <= SM_COUNT


@dataclass(frozen=True)
class PostNorm:
    """The fused group: ``out = norm(chain(x @ w.T)) * gamma (+ beta)``, cast to ``out_dtype``
    (softmax: ``out = softmax(chain(x @ w.T))``, no gamma or beta; ``eps`` unused).

    ``operands`` are the two added tensors' ``(dtype, is_tile)``: a tile is ``[M, N]`` (the
    residual), else ``[N]`` (the bias). The norm runs in fp32 (the graph's input to it must be
    fp32; gamma and beta are read in ``params_dtype`` and widened)."""

    dtype: str = "float16"
    steps: tuple = (Step("cast", "float16"), Step("add", "float16", 0), Step("add", "float16", 1), Step("cast", "float32"))
    operands: tuple = (("float16", False), ("float16", True))
    norm: str = "layer_norm"
    eps: float = 1e-5
    params_dtype: str = "float16"
    out_dtype: str = "float16"
    #: Also write the norm's float32 result (before the cast to ``out_dtype``) as a second
    #: output: BERT keeps it for the next residual while the next GEMM reads the cast copy.
    norm_out: bool = False
    #: Also write the sum the norm reads (the chain's value before its cast to fp32, in that
    #: dtype): a pre-norm transformer's residual stream. Only the split kernels write it
    #: (:mod:`.split_norm`, whose GEMM kernel writes the sum anyway).
    sum_out: bool = False

    @property
    def params(self) -> tuple:
        """The norm's parameters, in the kernels' order: gamma and beta (LayerNorm), gamma
        (RMSNorm), none (softmax)."""
        return {"layer_norm": ("gamma", "beta"), "rms_norm": ("gamma",)}.get(self.norm, ())

    @classmethod
    def suite(cls, dtype: str = "float16", norm: str = "layer_norm") -> PostNorm:
        """``workloads.post_norm(..., linear=True)`` as ComFuse outlines it: the GEMM rounded
        to ``dtype``, bias then residual added in ``dtype``, the norm in fp32, cast back."""
        return cls(dtype, (Step("cast", dtype), Step("add", dtype, 0), Step("add", dtype, 1), Step("cast", "float32")),
                   ((dtype, False), (dtype, True)), norm, 1e-5, dtype, dtype)

    def problems(self, two_operands: bool = True) -> list:
        """What the kernel cannot compute of this description (empty if nothing); with
        ``two_operands`` False, any number of added operands, each added once (the split
        kernels', :mod:`.split_norm`)."""
        found = []
        if self.norm not in NORMS:
            found.append(f"norm {self.norm!r} (one of {NORMS})")
        used = sorted(s.operand for s in self.steps if s.op == "add")
        if used != list(range(len(self.operands))) or (two_operands and len(self.operands) != 2):
            found.append("a chain without exactly two added operands (a bias and a residual)" if two_operands else
                         f"added operands {used} (each of the {len(self.operands)} operands once)")
        if any(s.op not in ("cast", "add") for s in self.steps):
            found.append(f"ops {sorted({s.op for s in self.steps} - {'cast', 'add'})} in the chain (casts and adds only)")
        if (self.steps[-1].dtype if self.steps else "float32") != "float32":
            found.append("a norm whose input is not float32")
        return found


def reference(spec: PostNorm, x, w, p0, p1, gamma=None, beta=None) -> list:
    """NumPy model of what the kernel computes for ``spec``: fp32 accumulation, each chain step
    rounded to its dtype, the norm in fp32; ``[out]`` (``[out, norm]`` with ``norm_out``). The
    oracle of the offload's CPU tests, which run it in the kernel's place."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    f32 = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
    v = np_chain(f32(x).reshape(-1, x.shape[-1]) @ f32(w).T, spec.steps, (f32(p0), f32(p1)))
    if spec.norm == "layer_norm":
        mean = v.mean(-1, keepdims=True)
        y = (v - mean) / np.sqrt(((v - mean) ** 2).mean(-1, keepdims=True) + spec.eps) * f32(gamma) + f32(beta)
    elif spec.norm == "softmax":
        e = np.exp(v - v.max(-1, keepdims=True))
        y = e / e.sum(-1, keepdims=True)
    else:
        y = v / np.sqrt((v**2).mean(-1, keepdims=True) + spec.eps) * f32(gamma)
    y = y.reshape(*x.shape[:-1], v.shape[1]).astype(np.float32)
    out = y.astype(np_dtype(spec.out_dtype))
    return [out, y] if spec.norm_out else [out]


@dataclass(frozen=True)
class Staging:
    """How the epilogue's tiles move (session 9): ``tiles`` are the operands (indices) the
    producer loads by TMA into shared memory while the K loop runs, so the epilogue reads them
    from shared memory instead of waiting on global loads in the accumulator layout after it;
    ``store`` says the output goes back the same way (written in place into the first staged
    region, or a region of its own, then one TMA store per box). Either needs the GEMM's
    (2-byte) dtype and slices of whole 64-column boxes: 128-byte swizzled rows, conflict-free
    in the fragment layout (a warp's 8 rows land in 8 different 16-byte chunks)."""

    tiles: tuple = ()
    store: bool = False

    @property
    def regions(self) -> int:
        return max(len(self.tiles), int(self.store))

    def smem_bytes(self, cfg: WgmmaConfig) -> int:
        """Their bytes, once a set (:func:`staged_sets`)."""
        return self.regions * cfg.bm * cfg.bn * 2 * staged_sets(cfg)


def staged_sets(cfg: WgmmaConfig) -> int:
    """Sets of staged tiles: two for a CTA that loops over row blocks (the next block's tiles
    load while this one's are read and stored), one a group where groups take turns (a group's
    next block's tiles load while the other groups' mainloops run), else one."""
    return cfg.turns if cfg.pingpong else 2 if cfg.resident else 1


def groups(cfg: WgmmaConfig) -> int:
    """Groups of consumer warpgroups with epilogues of their own: those taking turns, or one."""
    return cfg.turns if cfg.pingpong else 1


def staging(spec: PostNorm, cfg: WgmmaConfig, stage: bool | None = None) -> Staging:
    """What the epilogue of ``cfg`` stages for ``spec``: everything it can (``stage`` True,
    or None where it also fits shared memory beside the ring, and always with a resident W),
    or nothing (False)."""
    if stage is False or cfg.bn % BOX_COLS:
        return Staging()
    tiles = tuple(j for j, (d, tile) in enumerate(spec.operands) if tile and d == spec.dtype)
    full = Staging(tiles, spec.out_dtype == spec.dtype)
    return full if stage or cfg.resident or cfg.smem_bytes + full.smem_bytes(cfg) <= cfg.smem_limit else Staging()


def static_bytes(cfg: WgmmaConfig, ranks: int) -> int:
    """The epilogue's static shared memory: per row the partial sums of ``4 * wg_n`` threads
    (two passes), the cluster's row partials (two passes; with a resident W each CTA receives
    all ``ranks`` of them, for two row blocks in turn), and the mbarriers."""
    exchange = 2 * 2 * ranks * cfg.bm * 4 * groups(cfg) if cfg.resident else 2 * cfg.bm * 4
    return 2 * cfg.bm * 4 * cfg.wg_n * 4 * groups(cfg) + exchange + 256


def shared_bytes(cfg: WgmmaConfig, n: int, k: int, stg: Staging) -> int:
    """All the kernel's shared memory but the staged parameters: the ring, a resident W, the
    staged tiles and the static exchange buffers (at most :data:`SMEM_TOTAL`)."""
    return cfg.smem_bytes + cfg.resident_bytes(k) + stg.smem_bytes(cfg) + static_bytes(cfg, n // cfg.bn)


def params_bytes(spec: PostNorm, cfg: WgmmaConfig) -> int:
    """Shared memory of the staged bias, gamma and beta (:func:`stages_params`): the slice's
    columns of each added vector in its dtype, and of gamma (and beta) widened to fp32."""
    vectors = sum(2 if d in ("float16", "bfloat16") else 4 for d, tile in spec.operands if not tile)
    return cfg.bn * (vectors + 4 * len(spec.params))


def stages_params(spec: PostNorm, cfg: WgmmaConfig, n: int, k: int, stg: Staging) -> bool:
    """Whether the producer warpgroup's third warp stages the bias, gamma and beta into shared
    memory for the epilogue (where they fit beside everything else, and the producer is a
    warpgroup). Measured on the H200 together with :func:`wgmma_postnorm`'s ``one_round``
    (session 12, ``experiments/epilogue_rounds.py``): 3.6% faster at 16384x256x1024, 3.5% with
    a resident W, 1.2% at 8192x4096x4096, within 1.2% either way on the other suite shapes."""
    return cfg.producer_warps == 0 and shared_bytes(cfg, n, k, stg) + params_bytes(spec, cfg) <= SMEM_TOTAL


def resident_config(n: int, m: int, k: int, spec: PostNorm, pingpong: bool = True) -> WgmmaConfig | None:
    """The configuration whose clusters loop over row blocks with their W slice resident in
    shared memory (:data:`ACTIVE_CLUSTERS` of them, one wave), or None where none fits: 64 rows, the
    fewest CTAs a row whose ``N / ranks x K`` slice, two sets of staged tiles and a ring of A
    fit beside each other, ``bk`` 64 where K allows. Two consumer warpgroups: with ``pingpong``
    (where a slice is one wgmma tile, at most 256 columns) each owns a whole slice and they take
    alternate row blocks, on a ring of 64-deep K steps where three or four stages fit, else the
    deepest of up to eight 32-deep ones (else two of 64); otherwise (or where no ping-pong
    configuration fits) they split each block's slice, a ring of at least three stages.
    The 32-deep ring (session 21): at 16384 x 256 -> 1024, whose 256-column slices left room
    for two 64-deep stages, five 32-deep ones took the kernel from 49.3 to 41.7 us on the H100
    (``comfuse bench``, the default against the shipped H200 tuning log's best, one process;
    torch.compile 58.0); the H200's tuning had measured five, four and three 32-deep stages at
    38.8, 41.8 and 44.9 us (``tuning_logs/cuda-sm_90a/wide-short-k``).

    Why (session 10): at 16384x256x1024 the streaming kernel reads its 256 KiB W slice from L2
    for every 64 rows, 128 MiB in all against 72 MiB of HBM traffic, and took 54 us where
    cuBLAS's GEMM alone takes 19; resident, W is read once per CTA and the kernel moves only
    x, the residual and the output. Why ping-pong (session 13, ``experiments/pingpong.py``): with
    the groups splitting a block, the tensor cores idle through every epilogue; taking turns,
    one group's epilogue runs beside the other's wgmmas (see :func:`resident_pays`).
    Where three or four groups fit a slice's registers (``turns``, session 25: slices of at
    most 192 columns) the most that fit take turns, on the deepest ring of up to six 64-deep
    stages, though their slices need more CTAs a row: measured on the H100
    (``experiments/turns.py``, ``session25-h100-2026-12-06/turns-16aee22.json``, device us) at
    16384 x 256 -> 1024 four groups in eight-CTA clusters of 128 columns 36.7, three 38.2, the
    two-group default (four CTAs of 256) 41.7, two groups of 128 columns 42.4; at 16384 x 256 ->
    768 three groups of 192 columns 30.7 against two 33.1 (torch.compile 58.3 and 40.2)."""
    for turns in (4, 3):
        cfg = _resident_config(n, m, k, spec, pingpong, turns)
        if cfg is not None:
            return cfg
    return _resident_config(n, m, k, spec, pingpong)


def _resident_config(n: int, m: int, k: int, spec: PostNorm, pingpong: bool, turns: int = 2) -> WgmmaConfig | None:
    """:func:`resident_config` with ``turns`` ping-pong groups (None where none fits; beyond two,
    only ping-pong configurations)."""
    bk = 64 if k % 64 == 0 else 32
    if turns > 2:  # ping-pong groups only, on up to six 64-deep stages
        deep = [(64, s) for s in (6, 5, 4, 3) if bk == 64]
    else:  # ping-pong: 64-deep steps where three stages fit, else the deepest ring of 32-deep ones, else two of 64
        deep = [(64, s) for s in (4, 3) if bk == 64] + [(32, s) for s in range(8, 2, -1)] + [(bk, 2)]
    for ranks in DEFAULT_CLUSTER_SIZES:
        bn = n // ranks
        if n % ranks or bn % BOX_COLS or bn > MAX_ROW or (m // 64) < 2 * ACTIVE_CLUSTERS[ranks]:
            continue
        rings = [(1, True, s, b) for b, s in deep if pingpong and bn <= 256]
        rings += [(2, False, s, bk) for s in (4, 3)] if turns == 2 else []
        for wg_n, takes_turns, stages, step in rings:
            cfg = WgmmaConfig(bm=64, bn=bn, stages=stages, bk=step, wg_n=wg_n, resident=True, pingpong=takes_turns, turns=turns)
            if not problems(m, n, k, spec, cfg):
                return cfg
    return None


def resident_pays(cfg: WgmmaConfig, m: int, n: int, k: int) -> bool:
    """Whether a resident configuration is the default: where each cluster has eight row blocks
    or more to spread its W slice's load over, and either its consumer groups take turns
    (ping-pong) or its ring holds all of a row block's K steps (so the producer loads the next
    block's x while this block's epilogue runs).
    On the H200, session 11 (``experiments/resident_weight.py``), without ping-pong: with
    ``stages >= K / bk`` it beat the streaming kernel by 15% and 22% (16384 and 65536 x 256 x
    768: 33.8 against 39.8 us, 116.4 against 149.9); with a shallower ring it lost at all four
    measured shapes (16384x256x1024 52.8 against 49.7; K = 512 and 1024; M = 4096). The wins had
    8.5 and 34 blocks a cluster; at 16384x256x1024 eight-CTA clusters lost too (55.4 against
    50.1), so :func:`resident_config` takes the fewest CTAs a row. Session 13
    (``experiments/pingpong.py``, ``session13-h200-2026-12-04/pingpong-8ef18ad.json``): ping-pong
    beat both at all three measured shapes, a two-stage ring included: 30.1 against 32.6
    (resident) and 38.7 (streaming) at 16384x256x768, 94.6 against 112.2 and 144.5 at
    65536x256x768, 43.3 against 50.6 and 48.5 at 16384x256x1024. All three had clusters of four
    CTAs and slices of 192 or 256 columns; where the resident kernel lost by most without it
    (16384x512x1024 in eight-CTA clusters, 89.0 against 64.8; 16384x1024x256 in 64-column slices,
    55.8 against 25.0) ping-pong is unmeasured, so it is the default only in clusters of at
    most four CTAs with slices of 128 columns or more, or where three or more groups take turns
    (session 25: eight-CTA clusters of 128 columns, measured faster) (``comfuse tune`` measures the rest)."""
    blocks = m // cfg.bm / ACTIVE_CLUSTERS[n // cfg.bn]
    turns = cfg.pingpong and (n // cfg.bn <= 4 or cfg.turns > 2) and cfg.bn >= 128
    return cfg.resident and (turns or cfg.stages >= k // cfg.bk) and blocks >= 8


def slices(n: int, rows: int = DEFAULT_ROWS) -> list:
    """The cluster sizes of :data:`DEFAULT_CLUSTER_SIZES` that slice a row of ``n`` into CTAs of
    ``rows`` rows whose accumulators fit their registers (empty: the row is too wide for a
    cluster, :mod:`.split_norm`'s case)."""
    widest = MAX_ROW * 64 // rows
    return [r for r in DEFAULT_CLUSTER_SIZES if n % r == 0 and (n // r) % 16 == 0 and n // r <= widest]


def default_config(n: int, m: int | None = None, k: int | None = None, spec: PostNorm | None = None,
                   bm: int | None = None, resident: bool | None = None) -> WgmmaConfig:
    """A CTA owns ``bm`` rows (:data:`DEFAULT_ROWS` unless given) of a ``bn``-column slice of
    the row, ``n / bn`` CTAs of a cluster the whole row: the fewest slices whose accumulators fit one CTA's registers and,
    given ``m``, whose CTAs fill the SMs; in a slice the fewest warpgroups with wgmma N <= 256,
    and the deepest ring (up to 4 stages, :data:`FEW_CTAS_STAGES` where the CTAs fill under half
    the SMs; no deeper than ``k``'s K steps) that fits shared
    memory beside the staged epilogue tiles of ``spec`` (given): ``bk`` 64 where three stages
    fit, else 32. Three, because a consumer holds two slots (the step it issues and the one in
    flight): with two the producer cannot load ahead, and on the H200 (session 9) the staged
    N = 1024 kernel took 85.8 us with two 64-deep stages against 61.4 with four 32-deep.
    ``resident``: the :func:`resident_config` (True: raise where none fits; False: never; None,
    the default: where it measured faster, see :func:`resident_pays`)."""
    if resident is not False:
        cfg = resident_config(n, m, k, spec) if isinstance(m, int) and isinstance(k, int) and spec is not None and bm in (None, 64) else None
        if cfg is None and resident:
            raise ComFuseError(f"wgmma post-norm: no resident W slice fits M, N, K = {m}, {n}, {k} (needs static M, K and the spec)")
        if cfg is not None and (resident or resident_pays(cfg, m, n, k)):
            return cfg
    rows = bm or DEFAULT_ROWS
    widest = MAX_ROW * 64 // rows  # columns of `rows` rows one CTA's registers hold
    ranks = slices(n, rows)
    if not ranks:
        raise ComFuseError(f"wgmma post-norm cannot slice N = {n} over at most {CLUSTER_SIZES[-1]} CTAs of {widest} columns")
    if m is not None:
        ranks = [r for r in ranks if m // rows * r >= 0.9 * SM_COUNT] or ranks[-1:]
    bn = n // ranks[0]
    wg_n = next((w for w in range(1, 9) if bn % w == 0 and (bn // w) % 16 == 0 and bn // w <= 256 and rows // 64 * w <= MAX_CONSUMERS),
                None)
    if wg_n is None:
        raise ComFuseError(f"wgmma post-norm cannot split a {bn}-column slice into warpgroup tiles (a multiple of 16 up to 256 each)")
    ring = WgmmaConfig(rows, bn, 2, 32, wg_n)  # staged where the tiles fit beside the smallest ring
    staged = staging(spec, ring) if spec is not None else Staging()
    # a few CTAs (under half the SMs: a few rows) stream w alone, their loads in flight bounding
    # their bandwidth: up to 8 stages (session 32, the split form's mainloop, w cold: 12.8 against
    # 17.9 us at 128 x 3072 -> 768, 8.0 against 8.8 at 128 x 768 -> 768; this kernel: not measured)
    few = isinstance(m, int) and few_ctas(-(-m // rows) * (n // bn))
    for bk, least in ((64, 3), (32, 3), (32, 2)):
        stages = min(FEW_CTAS_STAGES if few else 4, (ring.smem_limit - staged.smem_bytes(ring)) // ((rows + bn) * bk * 2))
        if k is not None:
            stages = min(stages, max(2, k // bk))
        if stages >= min(least, max(2, k // bk) if k is not None else least):
            return WgmmaConfig(bm=rows, bn=bn, stages=stages, bk=bk, wg_n=wg_n)
    raise ComFuseError(f"wgmma post-norm: a {rows} x {bn} tile does not fit shared memory twice over")


def problems(m, n, k, spec: PostNorm, cfg: WgmmaConfig | None = None, stage: bool | None = None) -> list:
    """Everything that keeps :func:`wgmma_postnorm` from this GEMM shape and chain."""
    found = spec.problems()
    if spec.sum_out:
        found.append("the sum before the norm as an output too (the split GEMM + norm kernels write it)")
    if not all(isinstance(d, int) for d in (m, n, k)):
        return found + [f"symbolic shape M, N, K = {m}, {n}, {k} (static only)"]
    try:
        cfg = cfg or default_config(n, m, k, spec, resident=False if stage is False else None)
    except ComFuseError as err:
        return found + [str(err)]
    if cfg.bm * cfg.bn > 64 * MAX_ROW or n % cfg.bn or n // cfg.bn not in CLUSTER_SIZES:
        found.append(f"{cfg} (a CTA owns 64 rows of an N / {list(CLUSTER_SIZES)} slice of at most {MAX_ROW} columns, "
                     f"or 128 rows of at most {MAX_ROW // 2})")
    stg = staging(spec, cfg, stage)
    if (stage or cfg.resident) and cfg.bn % BOX_COLS:
        found.append(f"staged epilogue tiles with bn = {cfg.bn} (whole {BOX_COLS}-column boxes)")
    elif cfg.smem_bytes + cfg.resident_bytes(k) + stg.smem_bytes(cfg) > cfg.smem_limit:
        found.append(f"{cfg} with its staged epilogue tiles: over {cfg.smem_limit // 1024} KiB of shared memory (fewer stages)")
    elif cfg.resident:
        total = shared_bytes(cfg, n, k, stg)
        if stage is False or not stg.store or len(stg.tiles) != sum(tile for _, tile in spec.operands):
            found.append(f"a resident W with an epilogue not staged whole (its tiles in {spec.dtype} and the output in "
                         f"{spec.dtype}, by TMA): the streaming kernel")
        elif total > SMEM_TOTAL:
            found.append(f"{cfg}: {total // 1024} KiB of shared memory with the exchange buffers "
                         f"(at most {SMEM_TOTAL // 1024}: fewer stages)")
        if cfg.bm != 64:
            found.append(f"a resident W with bm = {cfg.bm} (64 rows a block)")
        if cfg.ctas_per_sm != 1:
            found.append("a resident W with two CTAs an SM (its grid is one wave of one-CTA-per-SM clusters)")
        if cfg.producer_warps == 1:
            found.append("a resident W with one producer warp (its staged tiles load from a second: 0 or 2)")
    if cfg.pingpong and (not cfg.resident or cfg.bm != 64 or cfg.wg_n != 1):
        found.append(f"{cfg}: ping-pong consumer warpgroups take alternate row blocks of a resident W, 64 rows and the "
                     f"whole slice each (resident, bm = 64, wg_n = 1)")
    if cfg.persistent:
        found.append("persistent = True (this kernel's CTAs loop over row blocks with a resident W: resident = True)")
    if cfg.stage_tiles:
        found.append("stage_tiles = True (the GEMM + elementwise kernel's knob: this kernel stages its tiles by Staging)")
    if cfg.split_k != 1:
        found.append(f"split_k = {cfg.split_k} (the GEMM + elementwise kernel's knob: this kernel's clusters slice the row)")
    ranks = n // cfg.bn if cfg.bn and n % cfg.bn == 0 else 1
    if cfg.multicast and (ranks == 1 or (cfg.bm // ranks) % 8):
        found.append(f"multicast over {ranks} CTA(s) of {cfg.bm} rows (a cluster of 2 or more, each loading a multiple of 8 "
                     f"of the tile's rows: one swizzle atom)")
    return found + cfg.problems(m, n, k, spec.dtype)


def wgmma_postnorm(m: int, n: int, k: int, spec: PostNorm = PostNorm(), cfg: WgmmaConfig | None = None, lead=None,
                   stage: bool | None = None, one_round: bool = True, params: bool | None = None):
    """The fused kernel, a tirx PrimFunc for sm_90a with parameters ``(x[*lead, k], w[n, k],
    operand 0, operand 1, gamma[n], beta[n] (LayerNorm only), out[*lead, n], norm[*lead, n]
    (``spec.norm_out`` only))``: ``lead`` are the row dimensions (``(m,)`` by default; ``(B,
    S)`` for 3-D activations, read as ``B * S`` rows through 2-D views of the same memory, so
    the caller needs no reshape). ``stage``: whether tiles move through shared memory by TMA
    (:func:`staging`; None: where they fit). ``one_round``: LayerNorm's statistics cross the
    CTA and the cluster in one round (each thread's mean and centred squares, combined by
    :func:`combine`), not two (the sum, then the squares about the mean). ``params``: the bias,
    gamma and beta staged in shared memory (None or True: where :func:`stages_params` says)."""
    found = problems(m, n, k, spec, cfg, stage)
    if found:
        raise ComFuseError("wgmma post-norm cannot take " + "; ".join(found))
    cfg = cfg or default_config(n, m, k, spec, resident=False if stage is False else None)
    acc_n, wg_cols, parts = cfg.wg_cols // 2, cfg.wg_cols, 4 * cfg.wg_n
    rms, softmax = spec.norm == "rms_norm", spec.norm == "softmax"
    bm, wg_m, wg_n, slice_n, ranks = cfg.bm, cfg.bm // 64, cfg.wg_n, cfg.bn, n // cfg.bn
    stg, boxes = staging(spec, cfg, stage), cfg.bn // BOX_COLS
    params = params is not False and stages_params(spec, cfg, n, k, stg)
    vec_ops = [j for j, (_, tile) in enumerate(spec.operands) if not tile]  # the added vectors (the bias)
    res, kt, blocks = cfg.resident, k // cfg.bk, m // bm
    # a resident W: the cluster loops over row blocks, its tiles staged in ``bufs`` sets
    grid, bufs = (min(blocks, ACTIVE_CLUSTERS[ranks]) if res else blocks), staged_sets(cfg)
    ring_elems, tile_bytes = cfg.smem_bytes // 2, bm * slice_n * 2
    staged_elems = stg.smem_bytes(cfg) // 2
    produce, consume = mainloop(cfg, k, spec.dtype, ranks=ranks)
    load_w = load_resident(cfg, k)
    init = Ring(cfg.stages, cfg.slot_readers, cfg.loading_ranks(ranks)).init()
    producer, consumer = roles(cfg)
    sync = consumer_sync(cfg)
    pingpong, turns = cfg.pingpong, groups(cfg)
    lead = tuple(lead or (m,))
    if math.prod(lead) != m:
        raise ComFuseError(f"wgmma post-norm: row dimensions {lead} do not multiply to M = {m}")
    shape = [(*lead, n) if tile else (n,) for _, tile in spec.operands]
    shape2 = [(m, n) if tile else (n,) for _, tile in spec.operands]
    # tensor maps: the GEMM's operands in the ring's boxes, the staged tiles in 64 x 64 boxes
    # (with multicast, a rank loads its share of the rows of x's tile for the whole cluster)
    maps = {"x": tensor_map(m, k, box_rows(bm // cfg.loading_ranks(ranks)), cfg.bk, spec.dtype), "w": tensor_map(n, k, box_rows(slice_n), cfg.bk, spec.dtype)}
    maps.update({f"p{j}": tensor_map(m, n, 64, BOX_COLS, spec.operands[j][0]) for j in stg.tiles})
    if stg.store:
        maps["out"] = tensor_map(m, n, 64, BOX_COLS, spec.out_dtype)

    def swizzled(row, col):
        """Where element ``(row, col)`` of the CTA's ``bm x slice_n`` tile lies in a region of
        ``R`` (``[bm / 64, boxes, 64, 64]``, TMA's 128-byte swizzle: 16-byte chunk ``c`` of row
        ``r`` at ``c ^ r % 8``)."""
        return row // 64, col // BOX_COLS, row % 64, (col % BOX_COLS // 8 ^ row % 8) * 8 + col % 8

    region = {j: r for r, j in enumerate(stg.tiles)}  # staged operand -> its region of R (in a set of regions)
    regions = max(1, stg.regions)

    # the 64-row forms are the same values, spelled as before 128-row CTAs: their generated
    # code stays the one measured (session 9)
    def column_part(tx):  # which of the row's wg_n column warpgroups consumer thread tx is in
        return tx // 128 % wg_n if wg_m > 1 else tx // 128

    def leads_rows(tx):  # whether it is in its rows' first column warpgroup
        return tx // 128 % wg_n == 0 if wg_m > 1 else tx < 128

    def first_row(tx):  # the first row of its warpgroup in the CTA's tile (0 for 64-row CTAs)
        return tx // 128 // wg_n * 64 if wg_m > 1 else 0

    def chain(v, p0, p1, R, row, col, lrow, lcol, slot):
        """The elementwise chain on fp32 value ``v`` at global ``(row, col)``, local ``(lrow,
        lcol)`` in the CTA's tile (plain Python, run while the kernel is parsed: one expression
        per accumulator: :func:`~.chain.chain_value`); staged operands are read from their region of
        ``R``'s set ``slot``."""

        def read(j):
            buf, tile = (p0, p1)[j], spec.operands[j][1]
            return (R[(slot * regions + region[j], *swizzled(lrow, lcol))] if j in region else buf[row, col] if tile
                    else buf[lcol] if params else buf[col])

        v, cur = chain_value(v, spec.steps, [d for d, _ in spec.operands], read)
        return v if cur == "float32" else T.cast(v, "float32")

    def first(total, v):  # the first pass: a sum of the values (LayerNorm's mean), of their squares (RMSNorm's), or their max
        return T.max(total, v) if softmax else total + (v * v if rms else v)

    def shift(y, beta, col, lcol):  # LayerNorm's beta; RMSNorm has none
        return y if beta is None else y + (beta[1, lcol] if params else T.cast(beta[col], "float32"))

    def scale(gamma, col, lcol):  # gamma, from global memory or widened in the staged copy
        return gamma[0, lcol] if params else T.cast(gamma[col], "float32")

    @T.macro
    def store(out, out2, R, row, col, lrow, lcol, y, slot):
        if stg.store:  # in place of the first staged tile: each element is one thread's
            half, box, srow, scol = T.meta_var(swizzled(lrow, lcol))
            R[slot * regions, half, box, srow, scol] = T.cast(y, spec.out_dtype)
        else:
            out[row, col] = T.cast(y, spec.out_dtype)
        if out2 is not None:
            out2[row, col] = y

    @T.macro
    def load_tile(t_map, R, r, rfull, bx, rk, slot):
        for h in T.unroll(wg_m):
            for b in T.unroll(boxes):
                T.ptx[TMA_LOAD](R.ptr_to([slot * regions + r, h, b, 0, 0]), T.address_of(t_map), rk * slice_n + b * BOX_COLS,
                                bx * bm + h * 64, rfull.ptr_to([slot]))

    @T.macro
    def stage_in(t0_map, t1_map, R, rfull, bx, rk, slot):
        """The producer's loads of the staged tiles of row block ``bx``, slice ``rk``, into
        region set ``slot`` of ``R``, on ``rfull[slot]``."""
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(rfull.ptr_to([slot]), T.uint32(len(stg.tiles) * tile_bytes))
        if len(stg.tiles) > 0:
            load_tile(t0_map, R, 0, rfull, bx, rk, slot)
        if len(stg.tiles) > 1:
            load_tile(t1_map, R, 1, rfull, bx, rk, slot)

    @T.macro
    def stage_out(out_map, R, remp, tx, grp, bx, rk, slot):
        """The output tile from the first region of set ``slot`` of ``R`` to global memory, one
        TMA store per box, after every consumer thread's writes are visible to the async proxy;
        with a resident W, the set is then handed back to the producer (``remp[slot]``)."""
        T.ptx["fence.proxy.async.shared::cta"]()
        sync(grp)
        if tx == 0:
            for h in T.unroll(wg_m):
                for b in T.unroll(boxes):
                    T.ptx[TMA_STORE](T.address_of(out_map), rk * slice_n + b * BOX_COLS, bx * bm + h * 64,
                                     R.ptr_to([slot * regions, h, b, 0, 0]))
            T.ptx["cp.async.bulk.commit_group"]()
            T.ptx["cp.async.bulk.wait_group.read"](0)  # the CTA's shared memory outlives the reads
            if res:
                T.ptx.mbarrier.arrive.shared.b64(remp.ptr_to([slot]), T.uint32(1))

    # pylint: disable=invalid-name,unused-variable,too-many-locals,too-many-arguments
    @T.macro
    def combine(stat, h, got, p, cnt, count, per):
        """``stat[h, p ..]`` from the ``count`` partials ``got[p .., i]`` of one row: their sum
        (``cnt`` 1), or (``cnt`` 2: LayerNorm's one round) the mean and the centred sum of
        squares of the union of ``count`` equal parts of ``per`` values each, from each part's
        mean and centred sum of squares (Chan et al.: ``M2 = sum M2_i + per * sum (mean_i -
        mean)^2``, no cancellation); softmax's (``cnt`` 2) the row's max and its sum of
        exponentials, each part's sum about its own max rescaled (``S = sum S_i exp(max_i - max)``)."""
        if softmax:
            stat[h, p] = got[p, 0]
            for i in T.unroll(count):
                stat[h, p] = T.max(stat[h, p], got[p, i])
            stat[h, p + 1] = T.float32(0)
            for i in T.unroll(count):
                stat[h, p + 1] = stat[h, p + 1] + got[p + 1, i] * T.exp(got[p, i] - stat[h, p])
        else:
            stat[h, p] = T.float32(0)
            for i in T.unroll(count):
                stat[h, p] = stat[h, p] + got[p, i]
            if cnt == 2:
                stat[h, p] = stat[h, p] * T.float32(1.0 / count)
                stat[h, p + 1] = T.float32(0)
                for i in T.unroll(count):
                    stat[h, p + 1] = stat[h, p + 1] + got[p + 1, i] + T.float32(per) * (got[p, i] - stat[h, p]) * (got[p, i] - stat[h, p])

    @T.macro
    def push_rows(rowx, xbar, peer, got, tx, stat, p, cnt, rk, slot, phase):
        """With a resident W (the producer never meets a cluster barrier: it runs a block
        ahead), the row partials ``stat[h, p .. p + cnt)`` go to every CTA of the cluster by
        ``st.async``, each landing in the receiver's ``rowx[slot, p .., rk]`` and completing bytes
        on its mbarrier ``xbar[2 * slot + p]``; every CTA then combines the ``ranks`` partials in
        rank order, as the barrier exchange does. ``slot`` alternates between row blocks, so a
        CTA a block ahead writes where nobody still reads: it has received this CTA's partials of
        the block in between."""
        r0 = T.meta_var(first_row(tx) + fragment(tx, 0)[0])
        if leads_rows(tx) and tx % 4 == 0:
            for h in T.unroll(2):
                for v in T.unroll(cnt):
                    for q in T.unroll(ranks):
                        T.ptx["mapa.shared::cluster.u32"](peer[0], T.cuda.cvta_generic_to_shared(rowx.ptr_to([slot, p + v, rk, r0 + 8 * h])),
                                                          T.uint32(q))
                        T.ptx["mapa.shared::cluster.u32"](peer[1], T.cuda.cvta_generic_to_shared(xbar.ptr_to([2 * slot + p])), T.uint32(q))
                        T.ptx["st_async.shared::cluster.mbarrier::complete_tx::bytes.f32"](peer[0], stat[h, p + v], peer[1])
        if tx == 0:
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(xbar.ptr_to([2 * slot + p]), T.uint32(cnt * ranks * bm * 4))
        T.cuda.mbarrier_wait(xbar.ptr_to([2 * slot + p]), phase)
        for h in T.unroll(2):
            for v in T.unroll(cnt):
                for q in T.unroll(ranks):
                    got[p + v, q] = rowx[slot, p + v, q, r0 + 8 * h]
            combine(stat, h, got, p, cnt, ranks, slice_n)

    @T.macro
    def row_total(part, rowpart, xbar, peer, got, tx, grp, s, stat, p, cnt, rk, slot, phase):
        """``stat[h, p .. p + cnt)``: over the whole row ``r0 + 8h``, what the threads hold in
        ``s[p .., h]`` combined (:func:`combine`): across quad lanes and the row's warpgroups
        through ``part``, across the cluster's CTAs (the row's column slices) through
        distributed shared memory (read after a cluster barrier, or pushed: :func:`push_rows`)."""
        r0 = T.meta_var(first_row(tx) + fragment(tx, 0)[0])  # in the CTA's tile
        for h in T.unroll(2):
            for v in T.unroll(cnt):
                part[grp, p + v, r0 + 8 * h, column_part(tx) * 4 + tx % 4] = s[p + v, h]
        sync(grp)
        for h in T.unroll(2):
            for v in T.unroll(cnt):
                for j in T.unroll(parts):
                    got[p + v, j] = part[grp, p + v, r0 + 8 * h, j]
            combine(stat, h, got, p, cnt, parts, wg_cols // 4)
        if ranks > 1 and res:
            push_rows(rowpart, xbar, peer, got, tx, stat, p, cnt, rk, slot, phase)
        elif ranks > 1:
            if leads_rows(tx) and tx % 4 == 0:  # one writer per row: quad leaders of its first warpgroup
                for h in T.unroll(2):
                    for v in T.unroll(cnt):
                        rowpart[p + v, r0 + 8 * h] = stat[h, p + v]
            T.cuda.cluster_sync()
            for h in T.unroll(2):
                for v in T.unroll(cnt):
                    for q in T.unroll(ranks):
                        T.ptx["mapa.shared::cluster.u32"](peer[0], T.cuda.cvta_generic_to_shared(rowpart.ptr_to([p + v, r0 + 8 * h])), T.uint32(q))
                        T.ptx["ld.shared::cluster.f32"](got[p + v, q], peer[0])
                combine(stat, h, got, p, cnt, ranks, slice_n)

    @T.macro
    def epilogue(P0, P1, gamma, beta, out, out2, out_map, R, rfull, remp, xbar, pfull, acc, tx, grp, bx, rk, slot, phase):
        """The chain and the norm on the accumulators of consumer thread ``tx`` of group ``grp``
        (0; with ping-pong consumers the group's index), rows of row block ``bx``, columns of its
        slice ``rk``; staged tiles in set ``slot`` of ``R``, in their ``phase`` (0 without a
        resident W: one block a CTA). With ping-pong groups, ``phase`` is the group's block
        count: its staged set alternates phases, and its row partials alternate between two
        exchange sets of its own, so that, as without groups, a CTA pushes into a set only after
        it has received every peer's partials of the group's block in between."""
        if pingpong:
            rphase, xslot, xphase = T.meta_var((phase % 2, 2 * slot + phase % 2, phase // 2 % 2))
        else:
            rphase, xslot, xphase = T.meta_var((phase, slot, phase))
        part = T.alloc_shared([turns, 2, bm, parts], "float32")  # [group, pass, row, 4 quad lanes x wg_n warpgroups]
        # per row: this CTA's slice, read by the cluster (a resident W: every rank's, pushed, for two blocks in turn)
        rowpart = T.alloc_shared([2 * turns, 2, ranks, bm] if res else [2, bm], "float32")
        s = T.alloc_local([2, 2], "float32")  # [pass, row half]: this thread's partials of its rows r0 and r0 + 8
        stat = T.alloc_local([2, 2], "float32")  # [row half, mean / rstd]
        peer = T.alloc_local([2 if res else 1], "uint32")
        got = T.alloc_local([2, max(parts, ranks)], "float32")  # one row's partials, as they are combined
        l0 = T.meta_var(column_part(tx) * wg_cols)  # the warpgroup's first column in the slice
        lr = T.meta_var(first_row(tx))  # and its first row in the CTA's tile
        c0 = T.meta_var(rk * slice_n + l0)
        for h in T.unroll(2):
            s[0, h] = T.min_value("float32") if softmax else T.float32(0)
        if len(stg.tiles) > 0:
            T.cuda.mbarrier_wait(rfull.ptr_to([slot]), rphase)
        if params:
            T.cuda.mbarrier_wait(pfull.ptr_to([0]), 0)
        # accumulators 2q and 2q + 1 are one row's adjacent columns: vector loads and stores
        for q in T.unroll(acc_n // 2):
            for j in T.vectorized(2):
                row, col = T.meta_var(fragment(tx, 2 * q + j))
                acc[2 * q + j] = chain(acc[2 * q + j], P0, P1, R, bx * bm + lr + row, c0 + col, lr + row, l0 + col, slot)
        for i in T.unroll(acc_n):
            s[0, i // 2 % 2] = first(s[0, i // 2 % 2], acc[i])
        # LayerNorm in one round: the thread's mean and the centred squares of its values, combined;
        # softmax likewise: its max and its values' exponentials about it, summed (kept: ``exp(v -
        # max)`` is then one multiply each, by ``exp(thread max - row max) / row sum``).
        # (A CTA looping over row blocks rewrites ``part`` only after stage_out's consumer barrier.)
        if softmax:
            for h in T.unroll(2):
                s[1, h] = T.float32(0)
            for i in T.unroll(acc_n):
                acc[i] = T.exp(acc[i] - s[0, i // 2 % 2])
                s[1, i // 2 % 2] = s[1, i // 2 % 2] + acc[i]
            row_total(part, rowpart, xbar, peer, got, tx, grp, s, stat, 0, 2, rk, xslot, xphase)
        elif one_round and not rms:
            for h in T.unroll(2):
                s[0, h] = s[0, h] * T.float32(4.0 / wg_cols)
                s[1, h] = T.float32(0)
            for i in T.unroll(acc_n):
                s[1, i // 2 % 2] = s[1, i // 2 % 2] + (acc[i] - s[0, i // 2 % 2]) * (acc[i] - s[0, i // 2 % 2])
            row_total(part, rowpart, xbar, peer, got, tx, grp, s, stat, 0, 2, rk, xslot, xphase)
        else:
            row_total(part, rowpart, xbar, peer, got, tx, grp, s, stat, 0, 1, rk, xslot, xphase)
            for h in T.unroll(2):
                stat[h, 0] = stat[h, 0] / T.float32(n)  # mean, or mean square for RMSNorm
            if not rms:
                for h in T.unroll(2):
                    s[1, h] = T.float32(0)
                for i in T.unroll(acc_n):
                    s[1, i // 2 % 2] = s[1, i // 2 % 2] + (acc[i] - stat[i // 2 % 2, 0]) * (acc[i] - stat[i // 2 % 2, 0])
                row_total(part, rowpart, xbar, peer, got, tx, grp, s, stat, 1, 1, rk, xslot, xphase)
        for h in T.unroll(2):
            if softmax:
                stat[h, 1] = T.exp(s[0, h] - stat[h, 0]) / stat[h, 1]
            elif rms:
                stat[h, 1] = T.rsqrt(stat[h, 0] + T.float32(spec.eps))
                stat[h, 0] = T.float32(0)
            else:
                stat[h, 1] = T.rsqrt(stat[h, 1] / T.float32(n) + T.float32(spec.eps))
        for q in T.unroll(acc_n // 2):
            for j in T.vectorized(2):
                row, col = T.meta_var(fragment(tx, 2 * q + j))
                if softmax:
                    store(out, out2, R, bx * bm + lr + row, c0 + col, lr + row, l0 + col, acc[2 * q + j] * stat[q % 2, 1], slot)
                else:
                    y = T.meta_var((acc[2 * q + j] - stat[q % 2, 0]) * stat[q % 2, 1] * scale(gamma, c0 + col, l0 + col))
                    store(out, out2, R, bx * bm + lr + row, c0 + col, lr + row, l0 + col, shift(y, beta, c0 + col, l0 + col), slot)
        if stg.store:
            stage_out(out_map, R, remp, tx, grp, bx, rk, slot)
        if ranks > 1 and not res:
            T.cuda.cluster_sync()  # no CTA leaves while the cluster may still read its rowpart

    @T.macro
    def load_params(P0, P1, gamma, beta, E0, E1, Eg, pfull, tw, rk):
        """The producer warpgroup's third warp copies the slice's bias, gamma and beta into
        shared memory (gamma and beta widened to fp32) while the K loop runs, then arrives on
        ``pfull`` (32 arrivals): the epilogue reads them there, one instruction each at a fixed
        offset, instead of a 64-bit address and a global load per column pair."""
        if tw >= 64 and tw < 96:
            for i in T.serial((slice_n + 31) // 32):
                if i * 32 + tw - 64 < slice_n:
                    if gamma is not None:
                        Eg[0, i * 32 + tw - 64] = T.cast(gamma[rk * slice_n + i * 32 + tw - 64], "float32")
                    if beta is not None:
                        Eg[1, i * 32 + tw - 64] = T.cast(beta[rk * slice_n + i * 32 + tw - 64], "float32")
                    if 0 in vec_ops:
                        E0[i * 32 + tw - 64] = P0[rk * slice_n + i * 32 + tw - 64]
                    if 1 in vec_ops:
                        E1[i * 32 + tw - 64] = P1[rk * slice_n + i * 32 + tw - 64]
            T.ptx.mbarrier.arrive.shared.b64(pfull.ptr_to([0]), T.uint32(1))

    @T.macro
    def body(x_map, w_map, t0_map, t1_map, out_map, P0, P1, gamma, beta, out, out2):
        if ranks > 1:
            bx = T.cluster_id([grid])
            rk = T.cta_id_in_cluster([ranks])
        else:
            bx = T.cta_id([grid])
            rk = 0
        if cfg.producer_warps > 0:  # producer warps after the consumers: role 0 all the same, its threads 0, 1, ...
            warp = T.warp_id([cfg.threads // 32])
            lane = T.lane_id([32])
            wg = T.meta_var((warp // 4 + 1) % (cfg.consumers + 1))
            tw = T.meta_var(warp % 4 * 32 + lane)
        else:
            wg = T.warpgroup_id([cfg.consumers + 1])
            tw = T.thread_id_in_wg([128])
        # one dynamic buffer (tirx allows one): the ring, the staged regions, the resident W (1 KiB aligned)
        flat = T.alloc_shared([ring_elems + staged_elems + cfg.resident_bytes(k) // 2], spec.dtype, scope="shared.dyn", align=1024)
        S = T.decl_buffer([cfg.stages, bm + (0 if res else slice_n), cfg.bk], spec.dtype, data=flat.data, scope="shared.dyn")
        R = T.decl_buffer([regions * bufs, wg_m, max(1, boxes), 64, BOX_COLS], spec.dtype, data=flat.data,
                          elem_offset=ring_elems, scope="shared.dyn")
        W = T.decl_buffer([kt, slice_n, cfg.bk], spec.dtype, data=flat.data, elem_offset=ring_elems + staged_elems, scope="shared.dyn")
        full = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        empty = T.alloc_shared([cfg.stages], "uint64", scope="shared", align=8)
        rfull = T.alloc_shared([bufs], "uint64", scope="shared", align=8)
        pfull = T.alloc_shared([1], "uint64", scope="shared", align=8)  # the staged bias, gamma and beta
        # what the epilogue reads the bias, gamma and beta from: their staged copies, or global memory
        if params:
            if gamma is not None:
                Eg = T.alloc_shared([2 if beta is not None else 1, slice_n], "float32")
            else:
                Eg = T.meta_var(None)
            Eb = T.meta_var(Eg if beta is not None else None)
            E0 = T.alloc_shared([slice_n], spec.operands[0][0]) if 0 in vec_ops else T.meta_var(P0)
            E1 = T.alloc_shared([slice_n], spec.operands[1][0]) if 1 in vec_ops else T.meta_var(P1)
        else:
            Eg, Eb, E0, E1 = T.meta_var((gamma, beta, P0, P1))
        acc = T.alloc_local([acc_n], "float32")
        da = T.alloc_local([1], "uint64")
        db = T.alloc_local([1], "uint64")
        if not res:
            if wg * 128 + tw == 0:  # before the ring's init: its fence and CTA barrier cover this one
                T.ptx.mbarrier.init.shared.b64(rfull.ptr_to([0]), T.uint32(1))
                if params:
                    T.ptx.mbarrier.init.shared.b64(pfull.ptr_to([0]), T.uint32(32))
            init(full, empty, wg * 128 + tw)
            if cfg.multicast:
                T.cuda.cluster_sync()  # every rank's ring exists before a peer's loads land in it
            if wg == 0:
                producer()
                if tw == 0:
                    if len(stg.tiles) > 0:
                        stage_in(t0_map, t1_map, R, rfull, bx, rk, 0)
                    produce(x_map, w_map, S, S, full, empty, bx * bm, rk * slice_n, 0, 0, rk)
                if params:
                    load_params(P0, P1, gamma, beta, E0, E1, Eg, pfull, tw, rk)
            else:
                consumer()
                consume(S, S, full, empty, acc, da, db, wg - 1, tw, 0)
                # (no set of its own to hand back nor pushed partials: rfull stands in for remp and xbar)
                epilogue(E0, E1, Eg, Eb, out, out2, out_map, R, rfull, rfull, rfull, pfull, acc, (wg - 1) * 128 + tw, 0,
                         bx, rk, 0, 0)
        else:
            remp = T.alloc_shared([bufs], "uint64", scope="shared", align=8)  # a staged set's store has read it
            # [set, pass]: the cluster's row partials (ping-pong: a group's two sets apart from the other's)
            xbar = T.alloc_shared([4 * turns], "uint64", scope="shared", align=8)
            wfull = T.alloc_shared([1], "uint64", scope="shared", align=8)
            if pingpong:
                turn = T.alloc_shared([turns], "uint64", scope="shared", align=8)  # [group]: the group before's mainloop is done
            else:
                turn = T.meta_var(None)
            if wg * 128 + tw == 0:
                for j in T.unroll(bufs):
                    T.ptx.mbarrier.init.shared.b64(rfull.ptr_to([j]), T.uint32(1))
                    T.ptx.mbarrier.init.shared.b64(remp.ptr_to([j]), T.uint32(1))
                for j in T.unroll(4 * turns):
                    T.ptx.mbarrier.init.shared.b64(xbar.ptr_to([j]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(wfull.ptr_to([0]), T.uint32(1))
                if pingpong:
                    for j in T.unroll(turns):
                        T.ptx.mbarrier.init.shared.b64(turn.ptr_to([j]), T.uint32(1))
                if params:
                    T.ptx.mbarrier.init.shared.b64(pfull.ptr_to([0]), T.uint32(32))
            init(full, empty, wg * 128 + tw)
            if ranks > 1:
                T.cuda.cluster_sync()  # every CTA's barriers exist before a peer pushes to them
            iters = T.meta_var((blocks - 1 - bx) // grid + 1)  # row blocks bx, bx + grid, ...
            if wg == 0:
                producer()
                if tw == 0:  # the W slice once, then A block after block through the ring
                    load_w(w_map, W, wfull, rk * slice_n)
                    for it in T.serial(iters):
                        produce(x_map, w_map, S, W, full, empty, (bx + it * grid) * bm, rk * slice_n, it * kt, 0, rk)
                if tw == 32:  # the staged tiles, a block ahead (a second warp: its waits do not hold up A)
                    for it in T.serial(iters):
                        T.cuda.mbarrier_wait(remp.ptr_to([it % bufs]), (it // bufs) % 2 ^ 1)
                        stage_in(t0_map, t1_map, R, rfull, bx + it * grid, rk, it % bufs)
                if params:
                    load_params(P0, P1, gamma, beta, E0, E1, Eg, pfull, tw, rk)
            else:
                consumer()
                T.cuda.mbarrier_wait(wfull.ptr_to([0]), 0)
                if pingpong:  # group wg - 1 takes blocks wg - 1, wg - 1 + turns, ...: the groups' mainloops in turn
                    for j in T.serial((iters + turns - wg) // turns):
                        # the block before (the group before's) has left the ring: that group's j-th block,
                        # or (the first group) its (j - 1)-th
                        if turns == 2:  # (two groups: the expressions measured since session 13)
                            if j + wg - 2 >= 0:
                                T.cuda.mbarrier_wait(turn.ptr_to([wg - 1]), (j + wg - 2) % 2)
                        elif turns * j + wg - 2 >= 0:
                            T.cuda.mbarrier_wait(turn.ptr_to([wg - 1]), (j + T.min(wg - 1, 1) - 1) % 2)
                        consume(S, W, full, empty, acc, da, db, 0, tw, (wg - 1 + turns * j) * kt)
                        if tw == 0:
                            T.ptx.mbarrier.arrive.shared.b64(turn.ptr_to([2 - wg if turns == 2 else wg % turns]), T.uint32(1))
                        epilogue(E0, E1, Eg, Eb, out, out2, out_map, R, rfull, remp, xbar, pfull, acc, tw, wg - 1,
                                 bx + (wg - 1 + turns * j) * grid, rk, wg - 1, j)
                else:
                    for it in T.serial(iters):
                        consume(S, W, full, empty, acc, da, db, wg - 1, tw, it * kt)
                        epilogue(E0, E1, Eg, Eb, out, out2, out_map, R, rfull, remp, xbar, pfull, acc, (wg - 1) * 128 + tw, 0,
                                 bx + it * grid, rk, it % 2, (it // 2) % 2)
            if ranks > 1:
                T.cuda.cluster_sync()  # no CTA leaves while a peer may still push to it

    # the parameter list depends on the spec (beta, a second output): the signature is
    # generated, the body is the macro above
    signature = [("x", (*lead, k), spec.dtype, (m, k)), ("w", (n, k), spec.dtype, None)]
    signature += [(f"p{j}", shape[j], d, shape2[j]) for j, (d, _) in enumerate(spec.operands)]
    signature += [(p, (n,), spec.params_dtype, None) for p in spec.params]
    signature += [("out", (*lead, n), spec.out_dtype, (m, n))] + ([("norm", (*lead, n), "float32", (m, n))] if spec.norm_out else [])
    lines = [f"def {spec.norm}_postnorm({', '.join(f'{p}_h: T.handle' for p, *_ in signature)}):"]
    lines += [f"    {p}_p = T.match_buffer({p}_h, {shp}, {dt!r}, align=16)" for p, shp, dt, _ in signature]
    lines += [f"    {p}_map: T.let[T.handle('tensormap')] = T.tvm_stack_alloca('tensormap', 1)" for p in maps]
    lines += [f"    encode_{p}({p}_map, {p}_p.data)" for p in maps] + ["    T.device_entry()"]
    if cfg.ctas_per_sm > 1:  # __launch_bounds__(threads, ctas_per_sm)
        lines += [f"    T.attr({{'tirx.launch_bounds_min_blocks_per_sm': {cfg.ctas_per_sm}}})"]
    lines += [f"    {p} = T.decl_buffer({view}, {dt!r}, data={p}_p.data)" if view else f"    {p} = {p}_p" for p, _, dt, view in signature[2:]]
    names = [p for p, *_ in signature]
    tiles = [f"p{j}_map" for j in stg.tiles] + ["None"] * (2 - len(stg.tiles))
    lines += [f"    body(x_map, w_map, {', '.join(tiles)}, {'out_map' if stg.store else 'None'}, p0, p1, "
              f"{', '.join(p if p in names else 'None' for p in ('gamma', 'beta', 'out'))}, {'norm' if 'norm' in names else 'None'})"]
    return tvm.script.from_source("@T.prim_func\n" + "\n".join(lines),
                                  extra_vars={"T": T, "body": body, **{f"encode_{p}": enc for p, enc in maps.items()}})
