"""The tensor-core mainloop: mma.sync m16n8k16 (fp16 in, fp32 accumulate) for a row tile.

Per thread block, a ``bm x bn`` tile (``bn`` covers the whole padded row for gemm_reduce):

    global --cp.async 16 B, zero-filled tails--> shared.dyn (``stages``-deep ring, XOR swizzle)
    shared --ldmatrix(.trans)--> warp fragments --mma.sync--> fp32 warp accumulators
    accumulators --mma store--> shared.dyn fp32 C tile --> epilogue block (returned)

Warps are a ``warps_m x warps_n`` grid fused into ``threadIdx.y``; lanes are ``threadIdx.x``.
``pad_einsum`` pads M, N and K to the tile, so any M (1, not a multiple of ``bm``) works;
N and K must be multiples of 8 (each cp.async moves 16 aligned bytes).
Lower with :mod:`.lowering` (TIR pipeline ``"comfuse"`` and its pass config).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_producers

from .blocks import uses_var
from .config import MmaConfig


def gemm_maps(stmt):
    """``(b_nk, maps)`` normalising ``C[i, j] += A[i, k] * B[k, j]`` (or ``B[j, k]``) to
    ``C[0, I, J] += A[0, I, K] * B[0, J, K]`` (built by hand: DLight's maps reject M == 1)."""
    ivs = [iv.var for iv in stmt.iter_vars]
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    if len(ivs) != 3 or kinds.count(tirx.IterVar.CommReduce) != 1:
        return None
    k_var = ivs[kinds.index(tirx.IterVar.CommReduce)]
    out = {w.source for w in stmt.writes}
    a, b = [r for r in stmt.reads if r.source not in out][:2]
    a_idx, b_idx = [r.min for r in a.region], [r.min for r in b.region]
    c_idx = [r.min for r in stmt.writes[0].region]
    i_var = next(v for v in ivs if uses_var(a_idx[0], v))
    j_var = next(v for v in ivs if uses_var(c_idx[-1], v))
    role = {"i": i_var, "j": j_var, "k": k_var}

    def fmap(used, outs):
        used = sorted(used, key=lambda r: ivs.index(role[r]))

        def f(*args):
            named = dict(zip(used, args))
            return (tirx.const(0, str(args[0].ty)), *[named[r] for r in outs])

        return {2: lambda x, y: f(x, y), 3: lambda x, y, z: f(x, y, z)}[len(used)]

    return uses_var(b_idx[1], k_var), (fmap("ijk", "ijk"), fmap("ik", "ik"), fmap("jk", "jk"), fmap("ij", "ij"))


def schedule_mma_mainloop(sch: s_tir.Schedule, mm, n: int, cfg: MmaConfig):
    """Tensorise the GEMM block ``mm`` (2-D, fp16) with a ``cfg.bm x bn`` tile per block.

    Returns ``(bx, c_tile)``: the ``blockIdx.x`` loop and the block that copies the fp32 C tile
    out of shared memory (the epilogue is inlined into it by the caller). None if ``mm`` is
    not a plain 2-D GEMM.
    """
    # registering TVM's CUDA tensor intrinsics takes ~20 s: only when a kernel needs them
    from tvm.s_tir.tensor_intrin.cuda import (  # pylint: disable=import-outside-toplevel
        get_mma_intrin_group,
        shared_16x16_to_ldmatrix_32x8_layout,
    )

    stmt = sch.get(mm)
    found = gemm_maps(stmt)
    if found is None:
        return None
    b_nk, (mm_map, a_map, b_map, c_map) = found
    bm, bk, bn = cfg.bm, cfg.bk, cfg.bn(n)
    wm, wn = bm // cfg.warps_m, bn // cfg.warps_n

    sch.transform_layout(sch.reindex(mm, ("read", 0)), ("write", 0), a_map)
    sch.transform_layout(sch.reindex(mm, ("read", 1)), ("write", 0), b_map)
    sch.transform_layout(sch.reindex(mm, ("write", 0)), ("read", 0), c_map)
    sch.transform_block_layout(mm, mm_map)
    sch.pad_einsum(mm, [1, bm, bn, bk])

    s, i, j, k = sch.get_loops(mm)
    i, ii = sch.split(i, [None, 16])
    j, ji = sch.split(j, [None, 16])
    k, ki = sch.split(k, [None, 16])
    sch.reorder(i, j, k, ii, ji, ki)
    inner, outer = mm, sch.blockize(ii)
    i0, i1, i2 = sch.split(i, [None, cfg.warps_m, wm // 16])
    j0, j1, j2 = sch.split(j, [None, cfg.warps_n, wn // 16])
    k0, k1 = sch.split(k, [None, bk // 16])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    if cfg.splits > 1:  # the row's column slices: the CTAs of one cluster
        bx = sch.fuse(s, i0)
        sch.bind(bx, "blockIdx.y")
        sch.bind(j0, "blockIdx.x")
        cta = j0
    else:
        bx = cta = sch.fuse(s, i0, j0)
        sch.bind(bx, "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")

    def fetch(idx: int, k_major: bool):
        sh = sch.cache_read(outer, idx, "shared.dyn")
        sch.compute_at(sh, k0)
        auto_inline_producers(sch, sh)
        if k_major:  # B[K, N] in global: keep it K-major in shared, ldmatrix.trans
            l0, l1 = sch.get_loops(sh)[-2:]
            sch.reorder(l1, l0)
            sch.transform_layout(sh, ("write", 0), lambda s_, x, kk: (s_, kk, x))
        _, fy, fx, fv = sch.split(sch.fuse(*sch.get_loops(sh)[-2:]), [None, cfg.warps, 32, cfg.vec])
        sch.bind(fy, "threadIdx.y")
        sch.bind(fx, "threadIdx.x")
        sch.vectorize(fv)
        sch.annotate(sh, "permuted_layout", 1)
        wp = sch.cache_read(outer, idx, "warp")
        sch.compute_at(wp, k1)
        return wp

    def to_ldmatrix_layout(block, buffer, swizzle=True):
        l0, l1 = sch.get_loops(block)[-2:]
        l0o, l0i = sch.split(l0, [None, 16])
        l1o, l1i = sch.split(l1, [None, 16])
        sch.reorder(l0o, l1o, l0i, l1i)
        sch.transform_layout(
            block, buffer,
            lambda s_, a, b: (s_, a // 16, b // 16, *shared_16x16_to_ldmatrix_32x8_layout(a % 16, b % 16)),
        )
        tile = sch.blockize(sch.get_loops(block)[-2])
        if swizzle:
            sch.annotate(tile, "permuted_layout", 1)
        return l0o, l1o

    a_wp, b_wp = fetch(0, False), fetch(1, not b_nk)
    unrolled = [*to_ldmatrix_layout(a_wp, ("write", 0)), *to_ldmatrix_layout(b_wp, ("write", 0))]

    c_tile = sch.cache_write(outer, 0, "shared.dyn")
    c_wp = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_wp, warp)
    sch.reverse_compute_at(c_tile, cta)
    # the C tile is padded, not swizzled: the epilogue that reads it is inlined by the caller,
    # and a swizzle would have to be applied to every block touching the tile
    sch.storage_align(c_wp, 0, axis=-2, factor=32, offset=4)
    to_ldmatrix_layout(c_wp, ("read", 0), swizzle=False)

    init = sch.decompose_reduction(outer, k0)
    group = get_mma_intrin_group(
        load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16", out_dtype="float32",
        trans_a=False, trans_b=b_nk,
    )
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], group["init"])
    sch.tensorize(sch.get_loops(a_wp)[-2], group["load_a"])
    sch.tensorize(sch.get_loops(b_wp)[-2], group["load_b"])
    sch.tensorize(sch.get_loops(inner)[-3], group["compute"])
    sch.tensorize(sch.get_loops(c_wp)[-2], group["store"])

    for loop in (*unrolled, i2, j2, k1):
        sch.unroll(loop)
    # k0 body: [cp.async A, cp.async B, k1 loop]; k1 is pipelined too (ldmatrix of step k1+1
    # before the mma of k1), which InjectSoftwarePipeline expands first: 5 stages on k0.
    pipelined_k1 = bk // 16 > 1
    if pipelined_k1:
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    n_compute = 3 if pipelined_k1 else 1
    sch.annotate(k0, "software_pipeline_stage", [0, 0] + [cfg.stages - 1] * n_compute)
    sch.annotate(k0, "software_pipeline_order", list(range(2 + n_compute)))
    sch.annotate(k0, "software_pipeline_async_stages", [0])
    return bx, cta, c_tile
