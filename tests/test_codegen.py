"""CUDA code generation for sm_90 without a GPU: the fused groups' kernels compile with nvcc."""

import dataclasses
import re

import pytest

import tvm_comfuse as cf
from tvm_comfuse import codegen, runtime
from tvm_comfuse import workloads as wl

pytestmark = pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")


@pytest.mark.parametrize(
    "dtype, norm, linear",
    [("float16", "layer_norm", True), ("float16", "layer_norm", False), ("bfloat16", "rms_norm", True), ("float32", "softmax", True)],
)
def test_gemm_reduce_cuda_compiles_with_nvcc(dtype, norm, linear):
    mod = wl.post_norm(100, 72, 40, dtype, norm, linear=linear, residual_out=True)
    (group,) = [g for g in cf.analyze(mod) if g.fused]
    ex = runtime.compile_module(mod, {"kind": "cuda", "arch": "sm_90"})
    source = codegen.cuda_source(ex)
    kernels = codegen.kernel_names(source)
    assert any(k.startswith(group.name + "_kernel") for k in kernels), kernels
    cubin = codegen.compile_with_nvcc(source, "sm_90")
    assert len(cubin) > 0 and cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("norm", ["layer_norm", "softmax", "rms_norm_decomposed"])
def test_gemm_reduce_group_is_one_kernel(norm):
    """The ComFuse rule (``hopper=False``: on sm_90 the Hopper kernel is the default for this
    group), not DLight's fallback, schedules the group: one launch, and the normalisation's row
    statistics live in shared memory."""
    mod = wl.post_norm(4096, 768, 768, "float16", norm, linear=True)
    (group,) = [g for g in cf.analyze(mod) if g.fused]
    source = codegen.cuda_source(runtime.compile_module(mod, {"kind": "cuda", "arch": "sm_90"}, hopper=False))
    fused = [k for k in codegen.kernel_names(source) if k.startswith(group.name + "_kernel")]
    assert len(fused) == 1, fused
    assert "__shared__" in source and "__shfl" in source  # on-chip row tile, warp reductions


@pytest.mark.parametrize("dtype, norm, K, N", [("float16", "layer_norm", 256, 768), ("bfloat16", "rms_norm", 64, 72)])
def test_symbolic_m_is_one_kernel(dtype, norm, K, N):
    """M symbolic: the rule still schedules the group as one kernel (tensor cores for fp16),
    its on-chip buffers have constant sizes, and nvcc compiles it."""
    from tvm import tirx  # pylint: disable=import-outside-toplevel

    mod = wl.post_norm(tirx.Var("n", "int64"), K, N, dtype, norm, linear=True, residual_out=True)
    (group,) = [g for g in cf.analyze(mod, {"kind": "cuda", "arch": "sm_90"}) if g.fused]
    source = codegen.cuda_source(runtime.compile_module(mod, {"kind": "cuda", "arch": "sm_90"}))
    assert [k for k in codegen.kernel_names(source) if k.startswith(group.name)] == [group.name + "_kernel"]
    assert ("mma.sync" in source) == (dtype == "float16")
    codegen.compile_with_nvcc(source, "sm_90")


def test_a_relaid_out_tile_stays_with_vanilla_fusion_on_gpus():
    """A batch-splitting reshape inside a softmax group: the gemm_reduce rule cannot tile it, so
    on a GPU target the pass leaves it to vanilla fusion (fused, DLight would schedule GEMM and
    softmax as one slow function); the module still compiles, and nvcc takes it."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((8, 64, 32), "float16"))
    k = relax.Var("k", relax.TensorType((8, 32, 64), "float16"))
    with bb.function("main", [q, k]):
        with bb.dataflow():
            s = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(q, k)), (2, 4, 64, 64)))
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(s, axis=-1)))
        bb.emit_func_output(out)
    mod = bb.get()
    target = {"kind": "cuda", "arch": "sm_90"}
    (on_cpu,) = cf.analyze(mod)
    (on_gpu,) = cf.analyze(mod, target)
    assert on_cpu.fused and not on_gpu.fused and "cannot tile" in on_gpu.note
    source = codegen.cuda_source(runtime.compile_module(mod, target))
    assert not any(k.startswith(on_cpu.name) for k in codegen.kernel_names(source))
    codegen.compile_with_nvcc(source, "sm_90")


def test_fragment_index_fold_only_touches_mma_kernels():
    from tvm_comfuse.schedule.lowering import fold_fragment_indices  # pylint: disable=import-outside-toplevel

    i32 = "((((((((int)threadIdx.x) * 8) + 260) / 256) * 8) + 4))"
    i64 = "(((((((int64_t)threadIdx.x) * (int64_t)8) + (int64_t)260) / (int64_t)256) * (int64_t)8) + (int64_t)4)"
    big = "(((((((int)threadIdx.x) * 8) + 300) / 256) * 8) + 4)"  # 300 % 256 > 7: not foldable
    mma = 'extern "C" __global__ void k() { asm("mma.sync"); a[' + i32[1:-1] + "]; b[" + i64 + "]; c[" + big + "]; }"
    plain = 'extern "C" __global__ void g() { a[' + i64 + "]; }"
    out = fold_fragment_indices(mma + "\n" + plain)
    assert "a[(12)]" in out and "b[(12)]" in out  # (260 // 256) * 8 + 4
    assert big in out and plain in out


def test_every_configuration_of_the_space_builds():
    """The rule offers MetaSchedule only configurations that build: schedule, lower and nvcc
    every one for an odd shape (M not a multiple of any tile), and count the failures."""
    from tvm_comfuse.schedule.space_check import build_space  # pylint: disable=import-outside-toplevel

    results = build_space(333, 96, 136, "sm_90", limit=6)
    assert len(results) == 6
    assert [err for _, err in results if err] == []


@pytest.mark.parametrize("dtype, norm, B, S, residual_out", [
    ("float16", "layer_norm", 4, 128, False), ("float16", "layer_norm", 3, 100, True), ("bfloat16", "rms_norm", 2, 33, True),
])
def test_batched_rows_take_the_2d_kernel(dtype, norm, B, S, residual_out):
    """``x[B, S, K] @ w.T`` (a linear layer on 3-D activations): the rule iterates B * S rows, so
    fp16 takes the tensor-core mainloop in one kernel, as the 2-D form does. With S a multiple of
    the row tile the kernel is the 2-D form's: the same source line for line, except lines
    addressing the 3-D operands ``x`` and ``r`` (``x[r // S, r % S]``, which TVM's simplifier
    does not always fold back to row ``r``; for the bk-64 default, ptxas gives the 3-D kernel
    194 registers, the 2-D one 200)."""
    mod = wl.post_norm(S, 256, 768, dtype, norm, linear=True, batch=B, residual_out=residual_out)
    (group,) = [g for g in cf.analyze(mod, {"kind": "cuda", "arch": "sm_90"}, hopper=False) if g.fused]
    source = codegen.cuda_source(runtime.compile_module(mod, {"kind": "cuda", "arch": "sm_90"}, hopper=False))
    assert [k for k in codegen.kernel_names(source) if k.startswith(group.name)] == [group.name + "_kernel"]
    assert ("mma.sync" in source) == (dtype == "float16")
    if S % 32 == 0 and not residual_out:
        flat = wl.post_norm(B * S, 256, 768, dtype, norm, linear=True)
        lines = source.splitlines()
        flat_lines = codegen.cuda_source(runtime.compile_module(flat, {"kind": "cuda", "arch": "sm_90"}, hopper=False)).splitlines()
        assert len(lines) == len(flat_lines)
        differ = [line for pair in zip(lines, flat_lines) if pair[0] != pair[1] for line in pair]
        assert all("x_ptr" in line or "r_ptr" in line for line in differ), differ[:2]
    codegen.compile_with_nvcc(source, "sm_90")


@pytest.mark.parametrize("norm, residual_out", [("layer_norm", False), ("softmax", False), ("layer_norm_decomposed", True)])
def test_cluster_split_compiles_and_exchanges_statistics_on_chip(norm, residual_out):
    """A row split over a 4-CTA cluster: one kernel launched with clusters, each row reduction
    rfactored per column slice and its partials pushed through distributed shared memory
    (two exchanges for LayerNorm's mean and variance), no HBM workspace; nvcc accepts it."""
    import tvm  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule.config import MmaConfig  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.gemm_reduce import GemmRowTile, _schedule  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import build_kernel, fused_group  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    func = fused_group(wl.post_norm(512, 256, 768, "float16", norm, linear=True, residual_out=residual_out), target)
    cfg = MmaConfig(bm=128, bk=32, warps_m=2, warps_n=4, stages=3, splits=4, epilogue_vec=4)
    assert cfg in GemmRowTile().configs(tvm.s_tir.Schedule(func), target)  # offered to the tuner
    source = codegen.cuda_source(build_kernel(_schedule(tvm.s_tir.Schedule(func), cfg), target))
    (kernel,) = [k for k in source.split('extern "C" __global__')[1:] if "{" in k]
    assert kernel.startswith(" void __cluster_dims__(4, 1, 1)")
    exchanges = kernel.count("comfuse_cluster_allgather_")  # fp32 partials, fp16 for the decomposed fp16 mean
    assert exchanges == (1 if norm == "rms_norm" else 2), exchanges
    assert "st.shared::cluster" in source and "mapa.shared::cluster" in source
    assert codegen.compile_with_nvcc(source, "sm_90")[:4] == b"\x7fELF"


def test_cluster_split_needs_whole_row_tiles():
    """M not a multiple of the row tile (or symbolic): no cluster configuration is offered."""
    import tvm  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule.gemm_reduce import GemmRowTile  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import fused_group  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    for M, split in ((1000, False), (1024, True)):
        func = fused_group(wl.post_norm(M, 256, 768, "float16", "layer_norm", linear=True), target)
        configs = GemmRowTile().configs(tvm.s_tir.Schedule(func), target)
        assert any(c.splits > 1 for c in configs) == split, M
        assert all(M % c.bm == 0 for c in configs if c.splits > 1)


def test_vectorised_epilogue_is_offered_and_compiles():
    """``epilogue_vec=4``: the epilogue's global and shared accesses become 4-wide vectors in
    an unrolled per-thread loop (a tunable of the rule's space); the kernel still compiles."""
    import tvm  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule.config import MmaConfig  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.gemm_reduce import GemmRowTile, _schedule  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import build_kernel, fused_group  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    # M a multiple of the row tile: TVM scalarises a vector loop under the last tile's row predicate
    func = fused_group(wl.post_norm(1024, 256, 768, "float16", "layer_norm", linear=True, residual_out=True), target)
    plain = MmaConfig(bm=32, bk=32, warps_m=2, warps_n=8, stages=2)
    vec = MmaConfig(bm=32, bk=32, warps_m=2, warps_n=8, stages=2, epilogue_vec=4)
    assert vec in GemmRowTile().configs(tvm.s_tir.Schedule(func), target)
    sources = {c: codegen.cuda_source(build_kernel(_schedule(tvm.s_tir.Schedule(func), c), target)) for c in (plain, vec)}
    for source, vectorised in ((sources[plain], False), (sources[vec], True)):
        assert ("*(half4*)(r_ptr" in source) == vectorised  # the residual
        assert ("*(float4*)(((float*)buf_dyn_shmem_ptr)" in source) == vectorised  # the fp32 C tile
        assert ("*(half4*)(compute_intermediate" in source) == vectorised  # the normalised output
    assert codegen.compile_with_nvcc(sources[vec], "sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize("M, K", [(1000, 768), (1024, 64)])
def test_offered_configurations_fit_shared_memory_once_lowered(M, K):
    """The driver checks dynamic plus static shared memory against the per-block limit at
    launch (on the H200 a 224 KiB ring with 4 KiB of static reduction buffers failed): every
    tensor-core configuration offered for a 1024-wide row (M = 1024 adds the cluster-split
    ones), lowered, stays within 227 KiB, and the estimate the space is filtered by is an upper
    bound of what lowering allocates."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.config import SMEM_STATIC_RESERVE, MmaConfig, smem_limit  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import fused_group, shared_memory_bytes  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    func = fused_group(wl.post_norm(M, K, 1024, "float16", "layer_norm", linear=True), target)
    scheduled = [(c, s) for c, s in GemmRowTile().scheduled(tvm.s_tir.Schedule(func), target) if isinstance(c, MmaConfig)]
    assert len(scheduled) >= 6
    for cfg, sch in scheduled:
        sizes = shared_memory_bytes(sch, target)
        assert sizes["shared.dyn"] > 0, cfg
        assert sizes["shared.dyn"] + sizes["shared"] <= smem_limit("sm_90", dynamic=True), (cfg, sizes)
        assert sizes["shared.dyn"] + sizes["shared"] <= cfg.smem_bytes(1024) + SMEM_STATIC_RESERVE, (cfg, sizes)


def test_bert_groups_fit_shared_memory_once_lowered():
    """BERT's attention-output group keeps its fp32 LayerNorm output and also casts it (TVM's
    mixed precision): the cast recomputes it rather than reading a 96 KiB static copy, which
    failed to launch next to the dynamic ring on the H200. Every ComFuse-scheduled group of a
    BERT-base layer stays within the per-block limit once lowered."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.config import SMEM_STATIC_BYTES, smem_limit  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import shared_memory_bytes  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune.tasks import extract_tasks  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target("nvidia/nvidia-h100")
    mod, _, _, _ = wl.bert_encoder(layers=1, hidden=768, heads=12, batch=2, seq=64, dtype="float16")
    scheduled = [GemmRowTile().apply(t.mod["main"], target, False) for t in extract_tasks(mod, target, hopper=False)]
    scheduled = [s for s in scheduled if s is not None]
    assert len(scheduled) >= 2  # the attention-output and FFN-output LayerNorm groups
    for sch in scheduled:
        sizes = shared_memory_bytes(sch, target)
        assert sizes["shared"] <= SMEM_STATIC_BYTES, sizes
        assert sizes["shared.dyn"] + sizes["shared"] <= smem_limit("sm_90a", dynamic=True), sizes


def test_recomputed_rows_drop_the_row_tile_and_need_whole_row_tiles():
    """``MmaConfig(stage_rows=False)`` (the two-CTAs-per-SM experiment's kernel): it compiles,
    allocates no row tile (less shared memory than the staged kernel), and the rule declines it
    when M is not a multiple of the row tile (TVM would allocate the C tile for every row)."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.config import MmaConfig  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import build_kernel, fused_group, shared_memory_bytes  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    base = dict(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4)
    configs = [MmaConfig(**base), MmaConfig(**base, stage_rows=False)]
    func = fused_group(wl.post_norm(128, 64, 768, "float16", "layer_norm", linear=True), target)
    (_, staged), (_, recomputed) = GemmRowTile().scheduled(tvm.s_tir.Schedule(func), target, configs=configs)
    assert shared_memory_bytes(recomputed, target)["shared.dyn"] < shared_memory_bytes(staged, target)["shared.dyn"]
    codegen.compile_with_nvcc(codegen.cuda_source(build_kernel(recomputed, target)), "sm_90")
    partial = fused_group(wl.post_norm(100, 64, 768, "float16", "layer_norm", linear=True), target)
    assert GemmRowTile().scheduled(tvm.s_tir.Schedule(partial), target, configs=configs[1:]) == [(configs[1], None)]


def test_min_ctas_reaches_the_kernels_launch_bounds():
    """``MmaConfig(min_ctas=2)``: the rule's root-block annotation (replayed by MetaSchedule
    traces) becomes ``__launch_bounds__(threads, 2)`` on the fused kernel, and nvcc takes it;
    without it the bounds name the thread count only."""
    import re  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.config import MmaConfig  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.space_check import build_kernel, fused_group  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    base = dict(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4, stage_rows=False)
    func = fused_group(wl.post_norm(128, 64, 768, "float16", "layer_norm", linear=True), target)
    configs = [MmaConfig(**base), MmaConfig(**base, min_ctas=2)]
    sources = [codegen.cuda_source(build_kernel(sch, target))
               for _, sch in GemmRowTile().scheduled(tvm.s_tir.Schedule(func), target, configs=configs)]
    bounds = [set(re.findall(r"__launch_bounds__\(([^)]*)\)", src)) for src in sources]
    assert bounds == [{"256"}, {"256, 2"}]
    codegen.compile_with_nvcc(sources[1], "sm_90")


def test_two_ctas_per_sm_are_offered_only_where_both_fit():
    """The space's ``min_ctas=2`` configurations: two CTAs must share one SM's shared memory
    and registers. At N = 768 the recomputed bm 32 kernel (100 KiB, 96 accumulator registers
    of the 128 two 256-thread CTAs leave each thread) is offered on sm_90, the staged one
    (148 KiB) is not, nor any on sm_86 (100 KiB per SM) or at N = 1024 (128 accumulators)."""
    from tvm_comfuse.schedule.config import MmaConfig, candidates  # pylint: disable=import-outside-toplevel

    base = dict(bm=32, bk=32, warps_m=1, warps_n=8, stages=2, epilogue_vec=4, min_ctas=2)
    offered = candidates(MmaConfig, "sm_90a", 768)
    assert MmaConfig(**base, stage_rows=False) in offered
    assert MmaConfig(**base, stage_rows=False).fits(768, "sm_90")
    assert not MmaConfig(**base).fits(768, "sm_90")
    assert not MmaConfig(**base, stage_rows=False).fits(768, "sm_86")
    assert not any(c.min_ctas > 1 for c in candidates(MmaConfig, "sm_90a", 1024))
    for cfg in (c for c in offered if c.min_ctas > 1):
        assert cfg.min_ctas * (cfg.smem_bytes(768) + 9 * 1024) <= 228 * 1024, cfg


@pytest.mark.parametrize("dtype, cfg", [("float16", (128, 256, 4)), ("bfloat16", (64, 128, 3))])
def test_wgmma_mainloop_compiles_to_wgmma_for_sm90a(dtype, cfg):
    """The Hopper mainloop (issue 8): the tirx GEMM's PTX loads tiles by TMA into an mbarrier
    ring, issues wgmma.mma_async from shared-memory descriptors with one group kept in flight,
    gives the producer's registers to the consumers where the launch bound caps them, and ptxas
    accepts it for sm_90a."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    bm, bn, stages = cfg
    source = codegen.cuda_source(wm.build(wm.wgmma_gemm(256, 512, 320, dtype, wm.WgmmaConfig(bm, bn, stages))))
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    t = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    body = ptx[ptx.index(".entry"):]
    # 4 k16 steps per K step of 64, the K loop rolled or unrolled (5 K steps) by nvcc
    assert body.count(f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{t}.{t}") in (4, 20)
    assert "wgmma.wait_group.sync.aligned 1" in body and "mbarrier.try_wait.parity" in body
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in body
    # after the barriers' init, and in the epilogue: the consumers' sync once their mainloops are
    # done (the ring then stages the output) and a warpgroup's two around its staged tile; none in the K loop
    assert "cp.async.cg" not in body and body.count("bar.sync") == 4
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body and "st.global" not in body
    assert ("setmaxnreg.inc.sync.aligned.u32" in body) == (bm // 64 > 1)  # 384 threads: capped at 168 registers
    assert "CUtensorMap" in source and "__grid_constant__" in source
    assert codegen.compile_with_nvcc(source, "sm_90a")[:4] == b"\x7fELF"


def _ffn1(dtype="float16"):
    """BERT's FFN1 chain for the GEMM + elementwise kernel: fp32 bias, GELU, back to ``dtype``."""
    from tvm_comfuse.schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.chain import Step  # pylint: disable=import-outside-toplevel

    return we.Elementwise(dtype, (Step("cast", dtype), Step("cast", "float32"), Step("add", "float32", 0), Step("gelu", "float32"),
                                  Step("cast", dtype)), (("float32", False),), dtype)


@pytest.mark.parametrize("cfg, staged", [(dict(bm=64, bn=256, stages=3, bk=64, pingpong=True), True),
                                         (dict(bm=128, bn=256, stages=3, bk=64, persistent=True), True),
                                         (dict(bm=64, bn=256, stages=4, bk=64, pingpong=True), False)])
def test_wgmma_elementwise_persistent_ctas_stage_in_buffers_of_their_own(cfg, staged):
    """Persistent CTAs (session 16) loop over tiles through one ring that is never free, so each
    consumer warpgroup stages its output in a buffer of its own beside the ring and, before
    rewriting it, waits until its last TMA store has read it; no thread stores to global memory.
    Where ring and buffers do not fit together the accumulators leave from registers instead.
    Ping-pong groups take turns on two more mbarriers. Each compiles for sm_90a without spills
    and reads no accumulator before the last wgmma wait."""
    from tvm_comfuse.schedule import wgmma_elementwise as we, wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    spec, c = _ffn1(), wm.WgmmaConfig(**cfg)
    assert we.problems(4100, 3072, 768, spec, c) == [] and we.stages_output(spec, c) == staged
    source = codegen.cuda_source(wm.build(we.wgmma_elementwise(4100, 3072, 768, spec, c)))
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    body = ptx[ptx.index(".entry"):]
    assert ("cp.async.bulk.wait_group.read 0" in body) == staged and ("st.global" in body) != staged
    assert body.count("mbarrier.init.shared.b64") == 2 * c.stages + (2 if c.pingpong else 0)
    assert codegen.ptxas_usage(source)["spill"] == 0
    if codegen.nvdisasm() is not None:
        assert codegen.wgmma_hazards(codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))) == []


def test_wgmma_elementwise_refuses_what_persistent_ctas_cannot_run():
    """Ping-pong groups are one warpgroup of 64 rows; persistent CTAs run one an SM with a
    producer warpgroup; the resident B is the post-norm kernel's; a staged tile operand needs a
    tile in the output's dtype (FFN1 has none), and when it loads means nothing without one.
    Each refusal names the knob."""
    from tvm_comfuse.errors import ComFuseError  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import wgmma_elementwise as we, wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    for cfg, words in ((dict(bm=128, bn=128, stages=3, pingpong=True), "one warpgroup a tile"),
                       (dict(bm=64, bn=256, stages=2, bk=32, persistent=True, ctas_per_sm=2, producer_warps=1), "one an SM"),
                       (dict(bm=64, bn=256, stages=2, resident=True), "resident B"),
                       (dict(bm=128, bn=256, stages=3, persistent=True, stage_tiles=True), "stage_tiles"),
                       (dict(bm=128, bn=256, stages=3, tile_step=3), "tile_step")):
        found = we.problems(4096, 3072, 768, _ffn1(), wm.WgmmaConfig(**cfg))
        assert any(words in f for f in found), (cfg, found)
        with pytest.raises(ComFuseError, match=words):
            we.wgmma_elementwise(4096, 3072, 768, _ffn1(), wm.WgmmaConfig(**cfg))


@pytest.mark.parametrize("m, n, dtype, norm", [(8192, 4096, "float16", "layer_norm"), (1000, 8192, "bfloat16", "rms_norm"),
                                               (16384, 256, "float16", "layer_norm"),  # one part a row: nothing to combine
                                               (8192, 4096, "float16", "softmax")])
def test_split_postnorm_kernels_write_row_statistics_from_the_staged_sum(m, n, dtype, norm):
    """A post-norm too wide for a cluster (or run split): the GEMM kernel stages the sum (bias,
    residual) for its TMA stores, reads it back for each row's statistics over the warpgroup's
    256 columns (quad shuffles; two passes for LayerNorm, and for softmax: the max, then the sum
    of exponentials) and stores only those to global
    memory, persistent where its tiles take more than a wave, and by default loading the
    residual into the staging buffers by TMA while the mainloop runs (checked here with per-thread
    loads: the statistics' stores are then the only global stores); the norm kernel moves the
    row in 16-byte vectors, its statistics combined by each thread. Both compile for sm_90a without spills; the GEMM reads
    no accumulator before the last wgmma wait."""
    from tvm_comfuse.schedule import split_norm as sn, wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite(dtype, norm)
    cfg = sn.config(m, n, 1024, spec)
    assert cfg.persistent == (m // 128 * n // 256 > 132) and cfg.stage_tiles  # (one wave: staged too, session 23)
    gemm, norm_func, parts = sn.kernels(m, n, 1024, spec, dataclasses.replace(cfg, stage_tiles=False, tile_step=0))
    assert parts == n // 256
    source = codegen.cuda_source(wm.build(gemm))
    body = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    body = body[body.index(".entry"):]
    assert body.count("shfl.sync.bfly.b32") == (4 if norm == "rms_norm" else 8)  # 2 rows x 2 lanes x passes
    stores = [line for line in body.splitlines() if "st.global" in line]  # the statistics only: 2 rows x 2 values
    assert len(stores) == 4 and all(".f32" in line or ".u32" in line for line in stores)  # (RMSNorm's second is a 0)
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body
    assert codegen.ptxas_usage(source)["spill"] == 0
    if codegen.nvdisasm() is not None:
        assert codegen.wgmma_hazards(codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))) == []
    # persistent (the default): the residual loaded into the staging buffers by TMA while the
    # mainloop runs, four more boxes a warpgroup's part, and a third of the global loads left (the bias's)
    if cfg.persistent:
        source = codegen.cuda_source(wm.build(sn.kernels(m, n, 1024, spec)[0]))
        ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
        staged_body = ptx[ptx.index(".entry"):]
        tma = "cp.async.bulk.tensor.2d.shared::cluster.global"
        assert staged_body.count(tma) == body.count(tma) + 4 and 3 * staged_body.count("ld.global") == body.count("ld.global")
        assert codegen.ptxas_usage(source)["spill"] == 0
        if codegen.nvdisasm() is not None:
            assert codegen.wgmma_hazards(codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))) == []
    source = codegen.cuda_source(wm.build(norm_func, tir_pipeline="default"))
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4.u32" in ptx
    assert "bar.sync" not in ptx  # each thread combines its row's parts alone
    assert codegen.ptxas_usage(source)["spill"] == 0


@pytest.mark.parametrize("m, n, k, dtype, norm", [(4096, 768, 3072, "float16", "layer_norm"), (4096, 1024, 4096, "float16", "layer_norm"),
                                                  (1000, 1024, 768, "bfloat16", "rms_norm"), (4096, 768, 768, "float16", "softmax")])
def test_split_postnorm_in_one_kernel_meets_its_row_tile_once_and_normalises_on_chip(m, n, k, dtype, norm):
    """The split post-norm's one-kernel form (``row_exchange``), where one wave of tiles covers the
    rows: no spills, no accumulator read before the last wgmma wait, one 64-bit atomic a CTA and
    its polls (acquire), the peers' statistics read at L2 (``ld.global.cg``: another SM wrote
    them), gamma and beta loaded before the barrier, and the norm stored by TMA with no
    per-thread global store but the statistics'. Grids of more than a wave, persistent CTAs and
    second outputs are refused with what to do."""
    from tvm_comfuse.errors import ComFuseError  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import split_norm as sn, wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite(dtype, norm)
    source = codegen.cuda_source(wm.build(sn.exchange_kernel(m, n, k, spec)))
    assert codegen.ptxas_usage(source)["spill"] == 0
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    body = ptx[ptx.index(".entry"):]
    assert body.count("atom.acq_rel.gpu.global.add.u64") == 1 and "ld.acquire.gpu.global.u64" in body
    parts = n // sn.config(m, n, k, spec).wg_cols
    assert body.count("ld.global.cg.f32") == 2 * parts * (1 if norm == "rms_norm" else 2)  # two rows' parts (and M2s or sums)
    if norm != "softmax":  # (which has no gamma)
        assert body.index("ld.global") < body.index("atom.acq_rel")  # gamma (and beta) before the barrier
    stores = [line for line in body.splitlines() if "st.global" in line]
    assert len(stores) == 4  # the statistics only: 2 rows x 2 values
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body
    if codegen.nvdisasm() is not None:
        assert codegen.wgmma_hazards(codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))) == []
    for m2, spec2, words in ((8192, spec, "one tile a CTA"), (m, dataclasses.replace(spec, norm_out=True), "a second output")):
        with pytest.raises(ComFuseError, match=words):
            sn.exchange_kernel(m2, n, k, spec2)


@pytest.mark.parametrize("m, k, n, split", [(128, 3072, 768, 4), (128, 4096, 1024, 2), (1, 4096, 4096, 2)])
def test_few_rows_split_k_over_a_cluster_and_gather_on_chip(m, k, n, split):
    """Where a GEMM's tiles fill under half the SMs (BERT at batch 1), the default splits K over a
    cluster (``WgmmaConfig.split_k``) with each split at least ``SPLIT_MIN_K`` and the grid one
    wave of co-resident clusters; its peers push their partials into rank 0's shared memory
    (``st.shared::cluster``, one a register, never a remote load) between the start barrier and
    one more; no spills. A post-norm group there runs as the split's one kernel."""
    from tvm_comfuse.errors import ComFuseError  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import row_exchange, split_norm as sn, wgmma_elementwise as we, wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.transform.offload_hopper import postnorm_kernel  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite()
    cfg = sn.config(m, n, k, spec)
    assert (cfg.bm, cfg.bn, cfg.split_k) == (64, 64, split) and k // split >= we.SPLIT_MIN_K
    assert row_exchange.tiles(m, n, cfg) <= wp.SM_COUNT and row_exchange.tiles(m, n, cfg) // split <= wp.ACTIVE_CLUSTERS[split]
    plain = we.default_config(4096, n, k, sn.gemm_spec(spec))
    assert plain.split_k == 1  # a full wave of tiles: no split
    if m % 64 == 0:
        assert postnorm_kernel(m, n, k, spec)[0] == "split" and not sn.exchange_problems(m, n, k, spec)
        func = sn.exchange_kernel(m, n, k, spec)
    else:
        func = we.wgmma_elementwise(m, n, k, we.Elementwise(), cfg)
    source = codegen.cuda_source(wm.build(func))
    assert codegen.ptxas_usage(source)["spill"] == 0
    body = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    body = body[body.index(".entry"):]
    assert body.count("st.shared::cluster.f32") == cfg.wg_cols // 2  # one push a register
    assert "ld.shared::cluster" not in body
    assert body.count("barrier.cluster.arrive") == 2 and body.count("barrier.cluster.wait") == 2
    for bad, words in ((dataclasses.replace(cfg, persistent=True), "split_k with a resident B, persistent"),
                       (dataclasses.replace(cfg, split_k=k // 64 + 1), "split_k"),
                       (dataclasses.replace(cfg, stages=64), "KiB")):
        assert any(words in p for p in we.problems(m, n, k, we.Elementwise(), bad)), bad
        with pytest.raises(ComFuseError):
            we.wgmma_elementwise(m, n, k, we.Elementwise(), bad)


def test_few_tiles_take_deeper_rings_and_many_tiles_keep_theirs():
    """A few tiles (BERT at batch 1) stream w alone, so the defaults give them deeper rings: the
    GEMM + elementwise kernel 64 x 64 tiles on 8 stages where those are one wave at most (session
    34: FFN1's 96), else its tile on 8 stages; a post-norm's split GEMM 64 x 64 tiles only where
    those still fill under half the SMs (its tile count routes the group); the cluster post-norm
    kernel up to 8 stages. At 4096 rows the defaults are what they were (no split, at most 4 stages)."""
    from tvm_comfuse.schedule import split_norm as sn, wgmma_elementwise as we, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    plain = we.Elementwise()
    few = {(768, 768): (64, 64, 8), (768, 3072): (64, 64, 8)}
    for (k, n), tile in few.items():
        cfg = we.default_config(128, n, k, plain)
        assert (cfg.bm, cfg.bn, cfg.stages, cfg.split_k) == (*tile, 1) and 128 // cfg.bm * (n // cfg.bn) <= wp.SM_COUNT  # one wave
        many = we.default_config(4096, n, k, plain)
        assert not we.few_tiles(4096, n, many) and many.split_k == 1 and many.stages <= 4 and many.bm == 128
    assert (we.default_config(512, 3072, 768, plain).bm, we.default_config(256, 3072, 768, plain).bn) == (128, 128)  # over a wave
    spec = wp.PostNorm.suite()
    stats = sn.config(512, 768, 768, spec)  # 96 tiles of 64 x 64 would not be few: its own on a deeper ring
    assert (stats.bn, stats.stages, stats.split_k) == (128, wp.FEW_CTAS_STAGES, 1)
    assert wp.default_config(768, 128, 3072, spec).stages == wp.FEW_CTAS_STAGES
    assert wp.default_config(768, 4096, 3072, spec).stages <= 4


@pytest.mark.parametrize("kernel", ["gemm", "gemm_one_step", "postnorm_768", "postnorm_768_bk32", "postnorm_512_cluster",
                                    "postnorm_1024", "rms_norm", "b2b", "b2b_bm64", "b2b_persistent", "postnorm_resident",
                                    "postnorm_two_rounds", "postnorm_2ctas", "postnorm_pingpong", "elementwise_pingpong",
                                    "elementwise_staged_mid", "b2b_overlap", "exchange_split_k"])
def test_wgmma_kernels_read_accumulators_only_after_the_last_wait(kernel):
    """No SASS instruction touches a wgmma accumulator while a wgmma group may still write it.
    ptxas hoists epilogue arithmetic above the final ``wait_group 0`` when the K loop leaves a
    group in flight: session 8's post-norm kernels were wrong on the H200 that way (max error ~1)
    while their PTX was in order; the mainloop's last step, issued outside the loop, prevents it.
    Nor does ptxas serialise their wgmmas (its C7514 warning: a wait after every group, where it
    cannot tell which accumulators a group writes; the b2b kernel's two accumulator sets in a
    loop drew it, session 26)."""
    from tvm_comfuse.schedule import split_norm as sn, wgmma_b2b as wb, wgmma_elementwise as we, wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    if codegen.nvdisasm() is None:
        pytest.fail("nvdisasm is missing: pip install nvidia-cuda-nvdisasm (the test extra)")
    ln = wp.PostNorm.suite()
    func = {
        "gemm": lambda: wm.wgmma_gemm(1024, 1024, 1024), "gemm_one_step": lambda: wm.wgmma_gemm(128, 256, 64, cfg=wm.WgmmaConfig(128, 256, 2)),
        "postnorm_768": lambda: wp.wgmma_postnorm(4096, 768, 768, ln),
        "postnorm_768_bk32": lambda: wp.wgmma_postnorm(4096, 768, 768, ln, wm.WgmmaConfig(64, 384, 6, 32, 2)),
        "postnorm_512_cluster": lambda: wp.wgmma_postnorm(4096, 512, 768, ln, wm.WgmmaConfig(64, 256, 4, 64, 1)),
        "postnorm_1024": lambda: wp.wgmma_postnorm(4096, 1024, 4096, ln),
        "rms_norm": lambda: wp.wgmma_postnorm(256, 256, 128, wp.PostNorm.suite("float16", "rms_norm")),
        "b2b": lambda: wb.wgmma_b2b(1024, 256, 1024, 1024, wb.B2B.mlp()),
        "b2b_bm64": lambda: wb.wgmma_b2b(1000, 64, 1024, 1024, wb.B2B.mlp(residual=True), wb.B2BConfig(64, 4, 64, 128, 2)),
        "b2b_persistent": lambda: wb.wgmma_b2b(65536, 128, 1024, 1024, wb.B2B.mlp(act="silu")),
        "postnorm_resident": lambda: wp.wgmma_postnorm(16384, 1024, 256, ln, wm.WgmmaConfig(64, 256, 3, 64, 2, resident=True)),
        "postnorm_two_rounds": lambda: wp.wgmma_postnorm(4096, 768, 768, ln, one_round=False, params=False),
        "postnorm_2ctas": lambda: wp.wgmma_postnorm(4096, 1024, 256, ln, wm.WgmmaConfig(64, 256, 3, 32, 2, ctas_per_sm=2, producer_warps=1)),
        "postnorm_pingpong": lambda: wp.wgmma_postnorm(16384, 768, 256, ln, wm.WgmmaConfig(64, 192, 4, 64, 1, resident=True, pingpong=True)),
        "elementwise_pingpong": lambda: we.wgmma_elementwise(4096, 4096, 1024, _ffn1(), wm.WgmmaConfig(64, 256, 7, 32, pingpong=True)),
        # one tile a CTA, the residual's TMA load issued inside the K loop (session 23)
        "elementwise_staged_mid": lambda: we.wgmma_elementwise(4096, 768, 3072, dataclasses.replace(sn.gemm_spec(ln), stats=""),
                                                               wm.WgmmaConfig(128, 192, 4, stage_tiles=True, tile_step=4)),
        "b2b_overlap": lambda: wb.wgmma_b2b(65536, 128, 1024, 1024, wb.B2B.mlp(), wb.B2BConfig(128, 4, 64, 64, 6, True, True)),
        # split-K (session 32): the partials leave the accumulators after the last wait too
        "exchange_split_k": lambda: sn.exchange_kernel(128, 768, 3072, ln),
    }[kernel]()
    source = codegen.cuda_source(wm.build(func))
    sass = codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))
    assert "HGMMA" in sass
    assert codegen.wgmma_hazards(sass) == []
    assert codegen.ptxas_usage(source)["serialized"] == []


def test_wgmma_hazard_check_finds_accumulators_read_in_flight():
    """The check itself: an HGMMA whose accumulators are converted before the final wait (as in
    session 8's SASS) is reported; the same after ``DEPBAR.LE gsb0, 0x0`` is not."""
    sass = """
        /*0eb0*/                   HGMMA.64x192x16.F32 R24, gdesc[UR8], R24, gsb0 ;
        /*0ec0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1430*/                   F2FP.F16.F32.PACK_AB R135, R119, R118 ;
        /*1730*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1740*/                   F2FP.F16.F32.PACK_AB R136, R117, R116 ;
    """
    assert codegen.wgmma_hazards(sass) == ["F2FP.F16.F32.PACK_AB R135, R119, R118"]


def test_ptxas_report_reads_serialised_wgmmas():
    """The check itself: ptxas's C7514 line (the b2b kernel's first overlapped version, session 26)
    is reported by its code beside the registers; a clean report has none."""
    text = """ptxas info    : Used 168 registers, used 16 barriers, 1024 bytes smem
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions
reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'b2b_gemm_kernel'"""
    assert codegen.ptxas_report(text) == {"registers": 168, "spill": 0, "smem": 1024, "serialized": ["C7514"]}
    assert codegen.ptxas_report(text.splitlines()[0])["serialized"] == []


def test_wgmma_mainloop_rejects_tiles_it_cannot_run():
    """A tile that does not divide the GEMM or does not fit shared memory is refused with what to change."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    with pytest.raises(cf.ComFuseError, match="multiples of bm = 128"):
        wm.wgmma_gemm(100, 256, 256)
    with pytest.raises(cf.ComFuseError, match="shared memory"):
        wm.wgmma_gemm(256, 256, 256, cfg=wm.WgmmaConfig(128, 256, 6))
    with pytest.raises(cf.ComFuseError, match="dtype float32"):
        wm.wgmma_gemm(256, 256, 256, "float32")


@pytest.mark.parametrize("N, K, norm", [(768, 768, "layer_norm"), (256, 128, "rms_norm")])
def test_wgmma_postnorm_is_one_kernel_on_wgmma(N, K, norm):
    """The fused Hopper post-norm (issue 8): GEMM on wgmma and the row normalisation in one
    kernel; its only global stores are the normalised output (the un-normalised row stays in
    registers), and ptxas accepts it for sm_90a. Staged (the default where it fits), the
    residual arrives by TMA during the K loop and the output leaves by TMA stores from shared
    memory; unstaged, both are plain fp16 global accesses."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite("float16", norm)
    cfg = wp.default_config(N, 4096, K, spec)
    for stage in (None, False):
        source = codegen.cuda_source(wm.build(wp.wgmma_postnorm(4096, N, K, spec, stage=stage)))
        assert len(codegen.kernel_names(source)) == 1
        ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
        assert f"wgmma.mma_async.sync.aligned.m64n{cfg.wg_cols}k16.f32.f16.f16" in ptx
        stores = re.findall(r"st\.global\S*", ptx)
        assert all(re.fullmatch(r"st\.global(\.v[24])?\.[ub]16", st) for st in stores), set(stores)  # fp16 only
        staged = wp.staging(spec, cfg, stage)
        assert staged == (wp.Staging((1,), True) if stage is None and cfg.bn % 64 == 0 else wp.Staging())
        # staged: no global store left, one TMA store per 64 x 64 box of the CTA's tile
        assert (len(stores) == 0, ptx.count("cp.async.bulk.tensor.2d.global.shared::cta")) == \
            ((True, cfg.bm // 64 * cfg.bn // 64) if staged.store else (False, 0))
        assert codegen.compile_with_nvcc(source, "sm_90a")[:4] == b"\x7fELF"


@pytest.mark.parametrize("M, N, ranks", [(4096, 768, 2), (16384, 1024, 2), (128, 256, 8)])
def test_wgmma_postnorm_slices_rows_over_a_cluster(M, N, ranks):
    """Rows are sliced over a thread-block cluster, enough CTAs to fill the SMs, each slice's
    accumulators within one CTA's registers: the kernel is launched with clusters and its row
    sums meet through distributed shared memory (mapa + ld.shared::cluster, cluster barriers)."""
    import tvm  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    cfg = wp.default_config(N, M)
    assert N // cfg.bn == ranks and cfg.bn <= wp.MAX_ROW
    spec = wp.PostNorm.suite("float16", "layer_norm")  # the streaming kernel (16384 rows would take the resident W's)
    func = wp.wgmma_postnorm(M, N, 256, spec, wp.default_config(N, M, 256, spec, resident=False))
    lower, _, _ = tvm.tirx.compilation_pipeline.tirx_pipeline()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    with target:
        lowered = lower(tvm.tirx.transform.BindTarget(target)(tvm.IRModule({"main": func})))
    (kernel,) = [f for gv, f in lowered.functions_items() if gv.name_hint.endswith("_kernel")]
    assert "clusterCtaIdx.x" in [str(p) for p in kernel.attrs["tirx.kernel_launch_params"]]
    ptx = codegen.compile_with_nvcc(codegen.cuda_source(wm.build(func)), "sm_90a", fmt="ptx").decode()
    assert "mapa.shared::cluster" in ptx and "ld.shared::cluster.f32" in ptx and "barrier.cluster.wait" in ptx


@pytest.mark.parametrize("M, K, N", [(4096, 768, 768), (4096, 4096, 1024), (16384, 256, 1024), (8192, 4096, 4096)])
def test_wgmma_postnorm_default_ring_loads_ahead_of_a_staged_epilogue(M, K, N):
    """The streaming kernel's default configuration stages the residual and the output, and
    still leaves the ring three stages (a consumer holds two: with two the producer cannot load
    ahead, 39% slower on the H200 at 4096x4096x1024), all within shared memory. (At
    16384x256x1024 the default is now the resident W's ping-pong kernel, whose other group's
    mainloop runs while a group waits: two stages measured fastest there, session 13.)"""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite()
    cfg = wp.default_config(N, M, K, spec, resident=False)
    staged = wp.staging(spec, cfg)
    assert staged == wp.Staging((1,), True)
    assert cfg.stages >= 3 and cfg.smem_bytes + staged.smem_bytes(cfg) <= wm.SMEM_LIMIT
    assert wp.problems(M, N, K, spec) == []


def test_wgmma_postnorm_resident_weight_loops_over_row_blocks():
    """A resident W (session 11): one wave of clusters (the H200's 30 four-CTA clusters), each
    CTA's W slice loaded once by TMA beside a ring that carries x only, the staged tiles twice
    over, and the row partials pushed to every CTA of the cluster by st.async onto mbarriers: the
    only cluster barriers are the one after the barriers' init and the one before exit."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite()
    cfg = wp.resident_config(1024, 16384, 256, spec, pingpong=False)
    assert cfg == wm.WgmmaConfig(64, 256, 3, 64, 2, resident=True)
    # without ping-pong the default only where the ring holds a row block's four K steps (measured faster), not three
    assert not wp.resident_pays(cfg, 16384, 1024, 256)
    assert wp.resident_pays(wm.WgmmaConfig(64, 192, 4, 64, 2, resident=True), 16384, 768, 256)
    assert not wp.default_config(768, 16384, 256, spec, resident=False).resident
    assert cfg.smem_bytes == 3 * 64 * 64 * 2 and cfg.resident_bytes(256) == 256 * 256 * 2
    source = codegen.cuda_source(wm.build(wp.wgmma_postnorm(16384, 1024, 256, spec, cfg)))
    assert "(255 - tvm_builtin_ptx_fetch_register_clusterid_x()) / 30" in source  # 256 row blocks over 30 clusters
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32" in ptx and "ld.shared::cluster" not in ptx
    assert ptx.count("barrier.cluster.arrive") == 2
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ptx


def test_wgmma_postnorm_layer_norm_statistics_cross_the_cluster_once():
    """LayerNorm's mean and centred sum of squares cross the CTA and the cluster in one round
    (each thread's pair, combined by Chan et al.'s formula; session 12), as RMSNorm's one sum
    does: one named barrier and one cluster barrier for the statistics, not two. A resident W
    pushes both of a row's partials onto one mbarrier."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    def ptx(spec, m=4096, n=768, k=768, **kw):
        return codegen.compile_with_nvcc(codegen.cuda_source(wm.build(wp.wgmma_postnorm(m, n, k, spec, **kw))), "sm_90a", fmt="ptx").decode()

    ln, rms = wp.PostNorm.suite("float16", "layer_norm"), wp.PostNorm.suite("float16", "rms_norm")
    counts = {name: (code.count("barrier.cluster.arrive"), code.count("bar.sync")) for name, code in
              (("ln", ptx(ln)), ("rms", ptx(rms)), ("ln_two_rounds", ptx(ln, one_round=False)))}
    assert counts["ln"] == counts["rms"] and counts["ln_two_rounds"] == (counts["ln"][0] + 1, counts["ln"][1] + 1)
    res = wm.WgmmaConfig(64, 256, 3, 64, 2, resident=True)
    one, two = (ptx(ln, 16384, 1024, 256, cfg=res, one_round=r) for r in (True, False))
    assert one.count("mbarrier.arrive.expect_tx") == two.count("mbarrier.arrive.expect_tx") - 1  # one push round a block


def test_wgmma_postnorm_stages_bias_gamma_beta_in_shared_memory():
    """The producer warpgroup's third warp copies the slice's bias, gamma and beta into shared
    memory during the K loop (session 12): the epilogue reads them there, so gamma is read from
    global memory only by that copy; ptxas's static shared memory stays within what
    ``static_bytes + params_bytes`` accounts for, and the whole within the 227 KiB a CTA may have.
    Without a producer warpgroup (producer warps) they stay in global memory."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    for norm, (m, n, k) in (("layer_norm", (4096, 768, 3072)), ("rms_norm", (16384, 1024, 256)), ("layer_norm", (8192, 4096, 4096))):
        spec = wp.PostNorm.suite("float16", norm)
        cfg = wp.default_config(n, m, k, spec)
        stg = wp.staging(spec, cfg)
        assert wp.stages_params(spec, cfg, n, k, stg)
        staged, direct = (codegen.cuda_source(wm.build(wp.wgmma_postnorm(m, n, k, spec, params=p))) for p in (None, False))
        # the epilogue's vector loads of gamma (one a column pair) are gone: the copy's scalar one remains
        assert staged.count("gamma_ptr[") == 1 and "(gamma_ptr +" not in staged and direct.count("(gamma_ptr +") >= cfg.wg_cols // 8
        static = codegen.ptxas_usage(staged)["smem"]
        assert static <= wp.static_bytes(cfg, n // cfg.bn) + wp.params_bytes(spec, cfg) + 1024  # + alignment
        assert cfg.smem_bytes + cfg.resident_bytes(k) + stg.smem_bytes(cfg) + static <= wp.SMEM_TOTAL
    warps = wm.WgmmaConfig(64, 384, 3, 64, 2, producer_warps=2)
    assert not wp.stages_params(spec, warps, 768, 768, wp.staging(spec, warps))


def test_wgmma_config_register_budget_is_ptxas_budget():
    """ptxas compiles the whole kernel within the launch bounds' registers (whatever setmaxnreg
    grants later), an SM's threads rounded up to a multiple of 128: ``compiled_regs`` predicts it,
    and ``problems`` refuses a 256-column consumer warpgroup two CTAs an SM with a producer
    warpgroup (128 registers) while accepting it with a producer warp (168), whose launch bounds
    name the two CTAs."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    group, warp = wm.WgmmaConfig(64, 256, 3, 32, 1, ctas_per_sm=2), wm.WgmmaConfig(64, 256, 3, 32, 1, ctas_per_sm=2, producer_warps=1)
    assert (group.threads, group.compiled_regs, warp.threads, warp.compiled_regs) == (256, 128, 160, 168)
    assert any("registers" in p for p in group.problems(1024, 1024, 1024, "float16"))
    assert warp.problems(1024, 1024, 1024, "float16") == []
    source = codegen.cuda_source(wm.build(wm.wgmma_gemm(1024, 1024, 1024, cfg=warp)))
    assert "__launch_bounds__(160, 2)" in source and "setmaxnreg" not in source.split("__launch_bounds__")[1]
    assert codegen.ptxas_usage(source)["registers"] <= warp.compiled_regs
    assert wm.WgmmaConfig(128, 256).compiled_regs == 168 and wm.WgmmaConfig(128, 256).consumer_regs == 232


def test_wgmma_postnorm_pingpong_groups_take_alternate_row_blocks():
    """Ping-pong consumers on a resident W (session 12): two warpgroups, each a whole 64-row
    block's slice (one wgmma tile), take alternate row blocks; their mainloops alternate on two
    mbarriers, each has its own named barrier (bar.sync 1 + group, 128 threads) and its own two
    exchange sets (eight mbarriers for the cluster's row partials), and each ring slot has one
    reader. Elsewhere it is refused with the reason."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite()
    cfg = wm.WgmmaConfig(64, 192, 4, 64, 1, resident=True, pingpong=True)
    assert (cfg.consumers, cfg.slot_readers, cfg.threads) == (2, 1, 384) and wp.problems(16384, 768, 256, spec, cfg) == []
    source = codegen.cuda_source(wm.build(wp.wgmma_postnorm(16384, 768, 256, spec, cfg)))
    assert "turn_ptr[2]" in source and "xbar_ptr[8]" in source
    assert "bar_sync_count_sync(((uint)1 + ((uint)((warp_id_in_cta >> 2) - 1))), (uint)128)" in source
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    assert "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16" in ptx and ptx.count("barrier.cluster.arrive") == 2
    # every slot's "empty" barrier expects one arrival a use (one group reads it)
    assert "(&(empty_ptr[0]))), (uint)1);" in source
    streaming = wm.WgmmaConfig(64, 192, 4, 64, 1, pingpong=True)
    assert any("ping-pong" in p for p in wp.problems(4096, 768, 768, spec, streaming))
    assert any("ping-pong" in p for p in wp.problems(16384, 768, 256, spec, wm.WgmmaConfig(64, 192, 4, 64, 2, resident=True, pingpong=True)))
    # the default where it measured faster (session 13), with the most groups that fit taking turns (session 25, H100:
    # 30.7 against 33.1 us, and 36.7 against 41.7 for two groups of 256 columns on five 32-deep stages, session 21's)
    assert wp.default_config(768, 16384, 256, spec) == wm.WgmmaConfig(64, 192, 5, 64, 1, resident=True, pingpong=True, turns=3)
    assert wp.default_config(1024, 16384, 256, spec) == wm.WgmmaConfig(64, 128, 6, 64, 1, resident=True, pingpong=True, turns=4)
    # not where it is unmeasured and the resident kernel lost without it: eight-CTA clusters, 64-column slices
    assert not wp.default_config(1024, 16384, 512, spec).resident and not wp.default_config(256, 16384, 1024, spec).resident
    assert not wp.default_config(1024, 4096, 256, spec).resident  # two blocks a cluster


def test_wgmma_postnorm_resident_weight_refuses_what_it_cannot_hold():
    """Where no W slice fits shared memory beside the ring and the staged tiles, or the epilogue
    is not staged, the resident kernel is refused with the reason."""
    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite()
    assert wp.resident_config(768, 4096, 3072, spec) is None
    with pytest.raises(cf.ComFuseError, match="no resident W slice fits"):
        wp.default_config(768, 4096, 3072, spec, resident=True)
    cfg = wm.WgmmaConfig(64, 256, 3, 64, 2, resident=True)
    assert any("not staged whole" in p for p in wp.problems(16384, 1024, 256, spec, cfg, stage=False))
    assert any("shared memory" in p for p in wp.problems(16384, 1024, 512, spec, cfg))


@pytest.mark.parametrize("M, K, N, resident", [(16384, 256, 1024, None), (4096, 768, 768, False)])
def test_wgmma_postnorm_multicast_loads_x_once_for_the_cluster(M, K, N, resident):
    """With ``multicast`` (session 34) each rank loads ``bm / ranks`` rows of x's tile by TMA
    multicast into every rank's slot (one load a K step, the whole cluster in its mask), and its
    consumers release a slot on every rank's "empty" barrier, which counts all ranks' consumers;
    those remote arrives are ``release.cta`` (``.release.cluster`` put a MEMBAR.ALL.GPU before each:
    1.8-13x slower on the H100), and the kernel keeps the default's registers, no spills, no hazards.
    Refused without a cluster, with fewer than 8 rows a rank, and in the GEMM + elementwise kernel."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import wgmma_elementwise as we, wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite()
    base = wp.default_config(N, M, K, spec, resident=resident)
    cfg, ranks = dataclasses.replace(base, multicast=True), N // base.bn
    assert wp.problems(M, N, K, spec, cfg) == []
    source = codegen.cuda_source(wm.build(wp.wgmma_postnorm(M, N, K, spec, cfg)))
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    loads = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\S*", ptx)
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster" in loads
    assert f"(ushort){(1 << ranks) - 1});" in source  # every rank in the mask
    assert f"(&(empty_ptr[0]))), (uint){ranks * base.slot_readers});" in source  # every rank's consumers release a slot
    assert ptx.count("mbarrier.arrive.shared::cluster.b64") >= ranks and "arrive.release.cluster" not in ptx
    sass = codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))
    plain = codegen.sass(codegen.compile_with_nvcc(codegen.cuda_source(wm.build(wp.wgmma_postnorm(M, N, K, spec, base))), "sm_90a"))
    assert sass.count("MEMBAR.ALL.GPU") <= plain.count("MEMBAR.ALL.GPU") + 1  # (the streaming kernel's cluster barrier after init)
    usage = codegen.ptxas_usage(source)
    assert usage["spill"] == 0 and codegen.wgmma_hazards(sass) == []
    assert any("multicast over 1 CTA" in p for p in wp.problems(M, base.bn, K, spec, cfg))
    assert any("multiple of 8" in p for p in wp.problems(128, 1024, 256, spec, wm.WgmmaConfig(64, 64, 4, 64, 1, multicast=True)))
    assert any("multicast" in p for p in we.problems(4096, 768, 768, we.Elementwise("float16", (), (), "float16"),
                                                     wm.WgmmaConfig(128, 128, 4, multicast=True)))


@pytest.mark.parametrize("dtype, bits, low, top", [("float16", 11, -24, 65504.0), ("bfloat16", 8, -133, 3.3895313892515355e38)])
def test_sixteen_bit_adds_equal_the_fp32_sum_rounded(dtype, bits, low, top):
    """The post-norm chain adds 16-bit operands to a value already rounded to 16 bits with one
    16-bit add: that it equals the graph's fp32 add rounded to 16 bits is the double-rounding
    theorem (24 >= 2 * 11 + 2). Checked here against the exact sum (fp64 holds any sum of two
    fp16 or bf16 values exactly) rounded once, to nearest even, by hand (``bits`` significant
    bits, quantum at least 2^``low``, overflow past ``top``), over random pairs of every
    magnitude, subnormals included."""
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    d = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    raw = np.random.default_rng(0).integers(0, 1 << 16, size=(2, 1 << 20), dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # the NaN bit patterns among them (dropped below)
        a, b = (v.view(d).astype(np.float64) for v in raw)
    ok = np.isfinite(a) & np.isfinite(b)
    exact = a[ok] + b[ok]
    quantum = np.exp2(np.maximum(np.frexp(exact)[1] - bits, low))
    once = np.rint(exact / quantum) * quantum  # round half to even, once
    once = np.where(np.abs(once) > top, np.copysign(np.inf, exact), once)
    with np.errstate(over="ignore"):
        via_fp32 = (a[ok].astype(np.float32) + b[ok].astype(np.float32)).astype(d).astype(np.float64)
    assert np.array_equal(once, via_fp32), np.flatnonzero(once != via_fp32)[:5]


def test_wgmma_postnorm_refuses_rows_it_cannot_hold():
    """Rows wider than eight CTAs' registers hold, or an unknown norm, are refused with the reason."""
    from tvm_comfuse.schedule import wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    with pytest.raises(cf.ComFuseError, match="cannot slice N = 6400"):
        wp.wgmma_postnorm(128, 6400, 256)
    with pytest.raises(cf.ComFuseError, match="group_norm"):
        wp.wgmma_postnorm(128, 256, 256, wp.PostNorm(norm="group_norm"))


def test_wgmma_b2b_keeps_the_intermediate_in_registers():
    """Back-to-back GEMM on Hopper (issue 5): the first GEMM's activated accumulators become the
    second GEMM's register A operand (wgmma's register-A form, fed by cvt.f16x2 packs), so the
    intermediate is never stored; the output leaves by TMA stores from shared memory (no global
    store instruction at all), and ptxas accepts it for sm_90a."""
    from tvm_comfuse.schedule import wgmma_b2b as wb, wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    source = codegen.cuda_source(wm.build(wb.wgmma_b2b(128, 128, 256, 192, wb.B2B.mlp())))
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    body = ptx[ptx.index(".entry"):]
    assert re.search(r"wgmma\.mma_async\S*m64n128k16\S*\s+\{[^}]*\},\s+%rd", body)  # GEMM 1: A from shared memory
    assert re.search(r"wgmma\.mma_async\S*m64n64k16\S*\s+\{[^}]*\},\s+\{%r", body)  # GEMM 2 (64-column tiles): A from registers
    assert "cvt.rn.f16x2.f32" in body and "st.global" not in body
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body
    assert codegen.compile_with_nvcc(source, "sm_90a")[:4] == b"\x7fELF"
    with pytest.raises(cf.ComFuseError, match="N1 = 320"):
        wb.wgmma_b2b(128, 320, 256, 192)
    with pytest.raises(cf.ComFuseError, match="bn2 = 64 for N2 = 96"):
        wb.wgmma_b2b(128, 128, 96, 192)
    with pytest.raises(cf.ComFuseError, match="intermediate in float32"):
        wb.wgmma_b2b(128, 128, 256, 192, wb.B2B(first=wb.Elementwise("float16", (), (), "float32")))
