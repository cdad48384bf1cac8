"""The Hopper kernels' configurations for one shape: what ``comfuse tune`` searches.

:func:`~.wgmma_postnorm.default_config` picks one configuration by rules measured on the
H200; this is every configuration :func:`~.wgmma_postnorm.problems` accepts for a shape, so
MetaSchedule can measure the rest on the user's GPU (issues 4 and 8). The knobs are those of
:class:`~.wgmma_mainloop.WgmmaConfig` that change the kernel's speed and not its validity:

- rows a CTA (``bm`` 64 or 128) and the cluster's slices (``bn = N / ranks``);
- consumer warpgroups a slice (``wg_n``), ring depth (``stages``) and K step (``bk``);
- a resident W slice, with or without ping-pong consumer groups, two to four of them taking
  turns (:data:`TURNS`; more than two fit the registers only with narrow slices).

Left out, measured slower on the H200 and kept as opt-in knobs: two CTAs an SM and producer
warps (session 12: both spill or lose their overlap), ``inflight = 0`` (session 8), clusters of
three (allowed, with 39 active clusters, but never faster in session 12), x's tile multicast over
the cluster (``multicast``: slower at all seven shapes tried on the H100, session 34), and more than
:data:`~.wgmma_postnorm.MAX_CONSUMERS` consumer warpgroups a tile (``bm = 128`` with ``wg_n =
2``): in session 13's H200 tuning logs every one of those 51 candidates was 1.48-5.3x slower than
its shape's best, and one of them, 128 x 96 tiles with a three-stage ring of 32-deep K steps,
failed to run at both shapes it was tried at (``tuning_logs/cuda-sm_90a/bert-base-*``; not yet
understood: the same tile ran with 2, 4, 5 and 6 stages).
Only configurations that pass ``problems`` (registers as ptxas budgets them, shared memory
with the staged tiles and exchange buffers, cluster and TMA box limits) are listed, so
nothing is proposed that cannot build.
"""

from __future__ import annotations

import dataclasses
import itertools

from . import wgmma_b2b as wb
from . import wgmma_elementwise as we
from .wgmma_mainloop import WgmmaConfig
from .wgmma_postnorm import DEFAULT_CLUSTER_SIZES, MAX_CONSUMERS, PostNorm, default_config, problems

ROWS = (64, 128)
WARPGROUPS = (1, 2)
STAGES = (2, 3, 4, 5, 6)
K_STEPS = (64, 32)
#: Ping-pong consumer groups taking turns on a resident W (session 25: three or four, each with
#: its staged set, so two or three epilogues run beside each mainloop).
TURNS = (2, 3, 4)
#: Split-K CTAs and ring depths of the GEMM + elementwise kernel where its default's tiles are few.
SPLITS = (1, 2, 4, 8)
FEW_TILE_STAGES = (4, 6, 8)


def configs(m: int, n: int, k: int, spec: PostNorm) -> list[WgmmaConfig]:
    """The configurations the kernel can run for ``m x n x k`` and ``spec``, the untuned
    default first (none where the kernel cannot take the shape at all)."""
    if problems(m, n, k, spec):
        return []
    found = [default_config(n, m, k, spec)]
    for bm, ranks, wg_n, stages, bk in itertools.product(ROWS, DEFAULT_CLUSTER_SIZES, WARPGROUPS, STAGES, K_STEPS):
        if n % ranks or bm // 64 * wg_n > MAX_CONSUMERS:
            continue
        for resident, pingpong, turns in ((False, False, 2), (True, False, 2)) + tuple((True, True, t) for t in TURNS):
            cfg = WgmmaConfig(bm=bm, bn=n // ranks, stages=stages, bk=bk, wg_n=wg_n, resident=resident, pingpong=pingpong, turns=turns)
            if cfg not in found and not problems(m, n, k, spec, cfg):
                found.append(cfg)
    return found


def elementwise_configs(m: int, n: int, k: int, spec: we.Elementwise) -> list[WgmmaConfig]:
    """The GEMM + elementwise kernel's configurations for ``m x n x k``: its tiles
    (:data:`~.wgmma_elementwise.TILES`, one consumer warpgroup a 64-row slice), ring depths and
    K steps, one tile a CTA or persistent CTAs, either loading a residual tile by TMA (sessions
    17 and 23: one tile a CTA issues it once its ring is full) or not, the untuned default first
    (none where the kernel cannot take the shape).
    Ping-pong warpgroups are left out: on the H200 (session 16) their 64-row tiles were slower
    than the default at every shape measured (3-35%). Where the default's tiles are few
    (:func:`~.wgmma_elementwise.few_tiles`: a few rows), 64 x 64 and 64 x 128 tiles on rings of up
    to 8 stages, K split over up to 8 CTAs, are candidates too."""
    default = we.default_config(m, n, k, spec)
    if default is None or we.problems(m, n, k, spec, default):
        return []
    found = [default]
    walks = ((False, False), (False, True), (True, False), (True, True))
    for (bm, bn), stages, bk, (persistent, stage_tiles) in itertools.product(we.TILES, STAGES, K_STEPS, walks):
        cfg = WgmmaConfig(bm=bm, bn=bn, stages=stages, bk=bk, persistent=persistent)
        cfg = we.staging(cfg) if stage_tiles else cfg
        cfg = dataclasses.replace(cfg, group_rows=we.group_rows(m, k, spec, cfg))  # the default's walk
        # a persistent ring that leaves no room for its staging buffers stores from registers (34%
        # slower for FFN1 on the H200, session 15): left out where the output could be staged
        register_stores = persistent and not spec.layout and not we.stages_output(spec, cfg)
        if cfg not in found and not register_stores and not we.problems(m, n, k, spec, cfg):
            found.append(cfg)
    if we.few_tiles(m, n, default):  # a few tiles (session 32): narrow tiles, deeper rings, split-K over 2 to 8 CTAs
        for bn, split, stages in itertools.product((64, 128), SPLITS, FEW_TILE_STAGES):
            cfg = WgmmaConfig(bm=64, bn=bn, stages=stages, bk=64, split_k=split)
            if cfg not in found and not we.problems(m, n, k, spec, cfg):
                found.append(cfg)
    return found


def b2b_configs(m: int, n1: int, n2: int, k: int, spec: wb.B2B) -> list[wb.B2BConfig]:
    """The back-to-back kernel's configurations for the pair: rows a block, GEMM 1's ring depth
    and K step, the output tile and w2's ring depth, persistent CTAs or not, two accumulator sets
    or one (``overlap``); the untuned default first (none where the kernel cannot take the pair)."""
    default = wb.default_config(m, n1, n2, k, spec.dtype, spec.out_dtype)
    if default is None or wb.problems(m, n1, n2, k, spec, default):
        return []
    found = [default]
    rings = ((2, 64), (3, 64), (4, 64), (4, 32), (5, 32), (6, 32))  # GEMM 1's (stages, bk)
    walks = ((False, False), (True, False), (True, True))  # (persistent, overlap): overlap lost one block a CTA (session 26)
    for bm, (stages, bk), bn2, stages2, (persistent, overlap) in itertools.product(ROWS, rings, (128, 64), (2, 3, 4, 6), walks):
        cfg = wb.B2BConfig(bm, stages, bk, bn2, stages2, persistent, overlap)
        if cfg not in found and not wb.problems(m, n1, n2, k, spec, cfg):
            found.append(cfg)
    return found
