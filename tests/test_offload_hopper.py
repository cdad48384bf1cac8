"""OffloadHopperPostNorm on CPU: which groups it takes, that the rewritten graph computes the
same values (a NumPy model of the kernel in its place, on llvm), and that on sm_90a the group
becomes the wgmma kernel that nvcc accepts."""

import dataclasses
import logging

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_comfuse as cf
from tvm_comfuse import codegen, runtime
from tvm_comfuse import workloads as wl
from tvm_comfuse.schedule import split_norm as sn
from tvm_comfuse.schedule import wgmma_elementwise as we
from tvm_comfuse.schedule import wgmma_postnorm as wp
from tvm_comfuse.transform import FuseComputeMemory, OffloadHopperPostNorm
from tvm_comfuse.transform.offload_hopper import SPLIT_MIN_K, match_postnorm, postnorm_kernel

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def _groups(mod, target=SM90A):
    with tvm.target.Target(target):
        out = FuseComputeMemory(target=target)(mod)
    return out, [f for gv, f in out.functions_items() if gv.name_hint != "main" and "gemm_reduce" in str(f.attrs)]


def _numpy_kernels(calls):
    """A ``build`` for the pass that registers the kernel's NumPy model under its symbol: the
    post-norm kernel's, a split post-norm's GEMM with row statistics and its norm, or the split's
    one-kernel form."""

    def build(_func, symbol, spec, _mnk):
        def run(*args):
            if isinstance(spec, sn.NormKernel):
                n_out = 2 if spec.spec.norm_out else 1
                y, stats, *params = [a.numpy() for a in args[:-n_out]]  # (gamma and beta, gamma, or none: softmax)
                values = sn.reference_norm(spec.spec, y, stats, *params, lead=y.shape[:-1])
            elif isinstance(spec, sn.ExchangeKernel):  # the split in one kernel: the norm, then its scratch statistics
                n_out = 2
                x, w, *rest = [a.numpy() for a in args[:-3]]  # (then the barrier's words)
                ops, params = rest[:len(spec.spec.operands)], rest[len(spec.spec.operands):]
                values = sn.reference_exchange(spec.spec, x, w, ops, spec.parts, *params)
            elif isinstance(spec, we.Elementwise):  # the split GEMM: y, then its row statistics
                n_out = 2
                y = we.reference(spec, *[a.numpy() for a in args[:-2]])
                values = [y, sn.row_statistics(y, args[-1].shape[1], spec.stats)]
            else:
                n_out = 2 if spec.norm_out else 1
                x, w, p0, p1, gamma, *beta = [a.numpy() for a in args[:-n_out]]
                values = wp.reference(spec, x, w, p0, p1, gamma, *beta)
            for t, value in zip(args[-n_out:], values):
                t.copyfrom(value)
            calls.append(symbol)

        tvm.register_global_func(symbol, run, override=True)
        return None

    return build


def _llvm_kernels(_func, symbol, spec, mnk):
    """A ``build`` for the pass that links an llvm kernel of the wgmma kernel's signature (TE:
    the GEMM, the chain as ``spec`` rounds it, LayerNorm): the external-module path on CPU."""
    from tvm import te  # pylint: disable=import-outside-toplevel

    m, n, k = mnk
    x, w = te.placeholder((m, k), spec.dtype, "x"), te.placeholder((n, k), spec.dtype, "w")
    ps = [te.placeholder((m, n) if tile else (n,), d, f"p{i}") for i, (d, tile) in enumerate(spec.operands)]
    gamma, beta = (te.placeholder((n,), spec.params_dtype, name) for name in ("gamma", "beta"))
    r = te.reduce_axis((0, k))
    acc = te.compute((m, n), lambda i, j: te.sum(x[i, r].astype("float32") * w[j, r].astype("float32"), axis=r))

    def chain(i, j):
        v = acc[i, j]
        for step in spec.steps:
            if step.op == "add":
                v = v + (ps[step.operand][i, j] if spec.operands[step.operand][1] else ps[step.operand][j]).astype("float32")
            v = v.astype(step.dtype).astype("float32")
        return v

    c = te.compute((m, n), chain)
    j1, j2 = te.reduce_axis((0, n)), te.reduce_axis((0, n))
    total = te.compute((m,), lambda i: te.sum(c[i, j1], axis=j1))
    sq = te.compute((m,), lambda i: te.sum((c[i, j2] - total[i] / n) * (c[i, j2] - total[i] / n), axis=j2))
    out = te.compute((m, n), lambda i, j: ((c[i, j] - total[i] / n) * te.rsqrt(sq[i] / n + spec.eps) * gamma[j].astype("float32")
                                           + beta[j].astype("float32")).astype(spec.out_dtype))
    func = te.create_prim_func([x, w, *ps, gamma, beta, out]).with_attr("global_symbol", symbol)
    return tvm.compile(tvm.IRModule({symbol: func}), target="llvm").mod


def _random(params, seed=0):
    import ml_dtypes  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    out = []
    for p in params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        scale = 1 / np.sqrt(shape[-1]) if len(shape) == 2 else 1.0  # weights: O(1) activations
        a = rng.standard_normal(shape) * scale
        out.append(a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))
    return out


def _expected(mod, arrays, norm):
    """What the post-norm block should give: vanilla TVM's answer, but for softmax the float64
    reference: vanilla TVM computes a 16-bit softmax in its dtype, and at 8192 columns its rows
    summed to 1.3-1.4 (ComFuse's group computes it in float32, as PyTorch does)."""
    if norm != "softmax":
        return _run_llvm(mod, arrays)
    return [r.astype(np.float32) for r in wl.post_norm_reference([a.astype(np.float32) for a in arrays], norm, linear=True)]


def _tolerance(dtype, norm, want):
    """Max abs error accepted: a few ulps of outputs up to ~8; softmax's outputs are
    probabilities (a row's sum is 1): 1% (fp16) or 5% (bf16) of the largest."""
    if norm == "softmax":
        return {"float16": 1e-2, "bfloat16": 5e-2}[dtype] * np.abs(want).max()  # (exp of a sum rounded to bf16)
    return {"float16": 2e-2, "bfloat16": 2e-1}[dtype]


def _run_llvm(mod, arrays):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    items = list(out) if isinstance(out, (tvm.ir.Array, list, tuple)) else [out]
    return [o.numpy().astype(np.float32) for o in items]


@pytest.mark.parametrize("dtype, norm, batch", [("float16", "layer_norm", None), ("bfloat16", "rms_norm", 2)])
def test_offloaded_suite_block_computes_what_the_graph_does(dtype, norm, batch):
    """``norm(x @ w.T + b + r)``, 2-D and 3-D: the rewritten graph (one call_dps_packed in place
    of the group) gives vanilla TVM's answer when the kernel's NumPy model runs in its place."""
    mod = wl.post_norm(64, 128, 128, dtype, norm, linear=True, batch=batch)
    arrays = _random(mod["main"].params)
    grouped, _ = _groups(mod, "llvm")
    calls = []
    offloaded = OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls))(grouped)
    assert [gv.name_hint for gv in offloaded.get_global_vars()] == ["main"]
    assert "call_dps_packed" in offloaded["main"].script()
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert len(calls) == 1
    assert np.abs(got - want).max() <= {"float16": 2e-2, "bfloat16": 2e-1}[dtype]  # a few ulps of outputs up to ~8


def test_offloaded_kernel_is_linked_into_the_executable():
    """The kernel module the pass builds travels in ``external_mods`` into the executable and the
    VM calls it (in DPS form: inputs, then the output): here an llvm kernel of the same
    signature, whose answer matches vanilla TVM's."""
    mod = wl.post_norm(64, 128, 128, "float16", "layer_norm", linear=True)
    arrays = _random(mod["main"].params)
    grouped, _ = _groups(mod, "llvm")
    offloaded = OffloadHopperPostNorm("llvm", build=_llvm_kernels)(grouped)
    assert len(offloaded.attrs["external_mods"]) == 1
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert np.abs(got - want).max() <= 2e-2


def test_offloaded_bert_layer_keeps_both_outputs_of_the_attention_block():
    """An imported BERT layer: both LayerNorm groups are taken, the attention one returning the
    float32 norm beside its fp16 cast (the kernel's second output), and the encoder's output
    matches vanilla TVM's (within its fp16 accumulation), with each group run split too, to
    within 1e-2 of the post-norm kernel (its chain ends in an fp32 residual add, which the split
    GEMM must apply: session 17 first dropped it): the attention's group, with its second output,
    as the GEMM and norm kernels, the other as one kernel (one wave of tiles covers its rows).
    Not closer than 1e-2: the attention group's float32 norm, computed in another order split,
    can flip an fp16 rounding of its cast, which the FFN's fp16 sums carry to ~1.5e-3 in the
    block's output (one row of 64 with some weights); a dropped residual add is off by O(1)."""
    mod, _params, _module, _example = wl.bert_encoder(layers=1, hidden=256, heads=4, batch=2, seq=32, dtype="float16")
    arrays = _random(mod["main"].params)
    grouped, groups = _groups(mod, "llvm")
    found = [match_postnorm(f) for f in groups]
    assert sorted(m[0].norm_out for m in found if m) == [False, True]
    want, got = _run_llvm(mod, arrays), {}
    for split, kernels in ((False, 2), (True, 3)):  # the post-norm kernel, or each group split (hopper_groups' "split_norm")
        calls = []
        got[split] = _run_llvm(OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls), split=split)(grouped), arrays)
        assert len(set(calls)) == kernels
        assert len(got[split]) == len(want) and all(np.abs(g - w).max() <= 0.1 for g, w in zip(got[split], want))  # vanilla: fp16 sums
    assert all(np.abs(s - c).max() <= 1e-2 for s, c in zip(got[True], got[False]))


def test_half_bert_layer_widens_its_last_norm_once_and_both_post_norms_are_taken():
    """A BERT layer imported all fp16 (``half``: inputs and weights too, what PyTorch runs after
    ``module.half()``) returns its last LayerNorm widened to float32. The group computes the
    norm in float32, and its cast back to fp16 is widened again: the pair is dropped, so the
    group returns the float32 norm (session 19: with the pair the matcher declined it, and
    BERT-large's last FFN2 fell back to the mma.sync rule). Both post-norms are taken, the
    last writing float32, and the offloaded layer computes what the grouped one does."""
    mod, _params, _module, _example = wl.bert_encoder(layers=1, hidden=256, heads=4, batch=2, seq=32, dtype="float16", half=True)
    arrays = _random(mod["main"].params)
    grouped, groups = _groups(mod, "llvm")
    found = [m for m in map(match_postnorm, groups) if m]  # (on llvm the attention scores' softmax is a group too)
    assert sorted(m[0].out_dtype for m in found) == ["float16", "float32"]
    calls = []
    got = _run_llvm(OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls))(grouped), arrays)
    want, vanilla = _run_llvm(grouped, arrays), _run_llvm(mod, arrays)
    assert len(set(calls)) == 2
    assert np.abs(got[0] - want[0]).max() <= 2e-2 and np.abs(want[0] - vanilla[0]).max() <= 0.1


@pytest.mark.parametrize("kw", [dict(act="relu"), dict(out_act="relu"), dict(act="relu", residual_out=True)])
def test_chains_the_kernel_cannot_express_are_left_to_the_rule(kw):
    """An activation before the residual, or an op after the norm: the matcher declines, so the
    gemm_reduce rule keeps the group."""
    _, groups = _groups(wl.post_norm(64, 128, 128, "float16", "layer_norm", linear=True, **kw))
    assert groups and all(match_postnorm(f) is None for f in groups)


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_sm90a_compile_runs_the_group_as_the_wgmma_kernel(caplog):
    """``get_pipeline(..., hopper=True)`` on sm_90a: a post-norm becomes the wgmma kernel
    (linked, nvcc-compiled); one whose M the kernel does not tile (100 rows) stays with the
    gemm_reduce rule and says why."""
    ex = runtime.compile_module(wl.post_norm(256, 256, 1024, "float16", "layer_norm", linear=True), SM90A, hopper=True)
    names = codegen.kernel_names(codegen.cuda_source(ex))
    assert len(names) == 1 and names[0].startswith("comfuse_wgmma_0_")
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        ex = runtime.compile_module(wl.post_norm(100, 256, 768, "float16", "layer_norm", linear=True), SM90A, hopper=True)
    assert not any("wgmma" in k for k in codegen.kernel_names(codegen.cuda_source(ex)))
    assert "multiples of bm = 64" in caplog.text


def test_hopper_is_the_default_on_sm90_only():
    """The pipeline offloads on sm_90 targets unless ``hopper=False``, and never elsewhere (on
    other targets the pass is a no-op and the pipeline does not include it)."""
    mod = wl.post_norm(256, 256, 768, "float16", "layer_norm", linear=True)
    grouped, _ = _groups(mod, {"kind": "cuda", "arch": "sm_80"})
    assert OffloadHopperPostNorm({"kind": "cuda", "arch": "sm_80"})(grouped).same_as(grouped)

    def offloads(target, **kw):
        return any(isinstance(p, OffloadHopperPostNorm) for p in cf.pipeline.fusion_passes(tvm.target.Target(target), **kw))

    assert offloads(SM90A) and offloads("nvidia/nvidia-h100") and offloads({"kind": "cuda", "arch": "sm_90"})
    assert not offloads(SM90A, hopper=False)
    assert not offloads({"kind": "cuda", "arch": "sm_80"}) and not offloads("llvm")


def test_rows_too_wide_for_the_rule_are_fused_only_when_the_hopper_kernel_takes_them():
    """gpt-4k-proj (N = 4096) is too wide for the gemm_reduce rule: vanilla fusion keeps it, unless
    ``hopper`` is on, where the wgmma kernel slices each row over an 8-CTA cluster; a wide chain
    the kernel cannot express (an activation before the residual) stays with vanilla fusion."""
    mod = wl.post_norm(8192, 4096, 4096, "float16", "layer_norm", linear=True)
    assert [g.fused for g in cf.analyze(mod, SM90A, hopper=False)] == [False]
    (group,) = cf.analyze(mod, SM90A)
    assert group.fused and "Hopper wgmma" in cf.format_groups([group])
    assert 4096 // wp.default_config(4096, 8192).bn == 8
    relu = wl.post_norm(8192, 4096, 4096, "float16", "layer_norm", linear=True, act="relu")
    (group,) = cf.analyze(relu, SM90A)
    assert not group.fused and "wider than a thread block" in group.note


def test_long_k_and_one_wave_post_norms_run_split_and_walk_row_groups_where_x_outgrows_l2():
    """Session 18's defaults, from the H100 breakdown: the cluster kernel's groups with K >=
    SPLIT_MIN_K run split (gpt-4k); session 23's: so do those whose tiles fill one wave (BERT's
    four at 4096 rows, as the one-kernel form), while short K over more than a wave, or a grid of
    less than half the SMs, stays with the cluster kernel. The split GEMM walks row tiles in
    groups where x takes more than half of L2 beside the
    residual (gpt-4k's 64 MB), not where x fits or no tile operand streams beside it. Session
    20's: persistent CTAs load a streamed residual by TMA into their staging buffers
    (``stage_tiles``); session 23's: one tile a CTA (one wave) stages it too, on a ring of at
    least three stages, loading it once the ring is full; the plain GEMM stages nothing."""
    spec = wp.PostNorm.suite("float16")
    for (m, k, n), kernel, one_kernel in [((8192, 4096, 4096), "split", False), ((4096, 4096, 1024), "split", True),
                                          ((4096, 1024, 1024), "split", True), ((4096, 3072, 768), "split", True),
                                          ((4096, 768, 768), "split", True), ((16384, 256, 1024), "cluster", False),
                                          ((8192, 768, 768), "cluster", False), ((512, 768, 768), "cluster", True)]:
        assert postnorm_kernel(m, n, k, spec) == (kernel, []) and (not sn.exchange_problems(m, n, k, spec)) == one_kernel
    assert sn.config(8192, 4096, 4096, spec).group_rows == we.GROUP_ROWS
    assert sn.config(4096, 8192, 1024, spec).group_rows == 0  # x is 8 MB
    for m, k, n in ((8192, 4096, 4096), (4096, 1024, 8192)):  # persistent: loaded before the first K step
        cfg = sn.config(m, n, k, spec)
        assert cfg.persistent and cfg.stage_tiles and cfg.tile_step == 0
    for m, k, n, stages in ((4096, 3072, 768, 4), (4096, 4096, 1024, 3)):  # one wave: 128 x 192 keeps 4 stages, 128 x 256 3
        cfg = sn.config(m, n, k, spec)
        assert not cfg.persistent and cfg.stage_tiles and cfg.stages == cfg.tile_step == stages
    plain = we.default_config(8192, 4096, 4096, we.Elementwise())
    assert plain.persistent and plain.group_rows == 0 and not plain.stage_tiles  # no residual streams beside x
    assert not we.default_config(4096, 1024, 4096, we.Elementwise()).stage_tiles


@pytest.mark.parametrize("dtype, norm, batch", [("float16", "layer_norm", None), ("bfloat16", "rms_norm", 2), ("float16", "softmax", None)])
def test_rows_wider_than_a_cluster_split_into_a_gemm_with_row_statistics_and_a_norm(dtype, norm, batch):
    """N = 8192 (no cluster holds the row), rows over more than one wave of tiles: the group
    becomes the GEMM kernel writing the sum and each row's statistics over its 256-column parts,
    then the norm kernel combining them; with both kernels' NumPy models in place the graph gives
    vanilla TVM's answer (the residual's mean far from 0: a naive sum of squares would cancel)."""
    mod = wl.post_norm(1024 if batch is None else 512, 64, 8192, dtype, norm, linear=True, batch=batch)
    arrays = _random(mod["main"].params)
    arrays[3] = (arrays[3].astype(np.float32) + 4).astype(arrays[3].dtype)  # the residual
    assert wp.problems(1024, 8192, 64, wp.PostNorm.suite(dtype, norm))  # the one-kernel post-norm cannot
    assert sn.exchange_problems(1024, 8192, 64, wp.PostNorm.suite(dtype, norm))  # nor the split's one-kernel form
    grouped, _ = _groups(mod, "llvm")
    calls = []
    offloaded = OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls))(grouped)
    assert offloaded["main"].script().count("call_dps_packed") == 2
    (got,), (want,) = _run_llvm(offloaded, arrays), _expected(mod, arrays, norm)
    assert len(calls) == 2 and calls[0].endswith("_gemm") and calls[1].endswith("_norm")
    assert np.abs(got - want).max() <= _tolerance(dtype, norm, want)


@pytest.mark.parametrize("dtype, norm, batch", [("float16", "layer_norm", None), ("bfloat16", "rms_norm", 2), ("bfloat16", "softmax", 2)])
def test_rows_one_wave_covers_run_split_in_one_kernel(dtype, norm, batch):
    """N = 8192 over 64 rows: one wave of tiles, so the split post-norm is one kernel
    (``row_exchange``: the row tile's CTAs combine their statistics themselves), called with the
    barrier's words as a zero constant of the module and its statistics as scratch; with its
    NumPy model in place the graph gives vanilla TVM's answer. Rows over more than a wave keep
    the two kernels (the test above)."""
    mod = wl.post_norm(64 if batch is None else 32, 64, 8192, dtype, norm, linear=True, batch=batch)
    arrays = _random(mod["main"].params)
    arrays[3] = (arrays[3].astype(np.float32) + 4).astype(arrays[3].dtype)  # the residual
    spec = wp.PostNorm.suite(dtype, norm)
    assert wp.problems(64, 8192, 64, spec) and not sn.exchange_problems(64, 8192, 64, spec)
    grouped, _ = _groups(mod, "llvm")
    calls = []
    offloaded = OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls))(grouped)
    (call,) = [b.value for block in offloaded["main"].body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_dps_packed"]
    flags = call.args[1].fields[-1]  # (the call's inputs, then its barrier's words)
    assert isinstance(flags, tvm.ir.expr.Constant) and not flags.value.numpy().any()
    assert tuple(flags.value.shape) == sn.flags_shape(64, 8192, 64, spec) and flags.value.dtype == "int32"
    (got,), (want,) = _run_llvm(offloaded, arrays), _expected(mod, arrays, norm)
    assert len(calls) == 1 and not calls[0].endswith(("_gemm", "_norm"))
    assert np.abs(got - want).max() <= _tolerance(dtype, norm, want)


def test_the_split_norm_kernel_computes_the_norm_from_the_row_statistics_on_llvm():
    """The norm kernel's PrimFunc as TVM lowers it (before its GPU schedule, which only moves
    loops) against the NumPy model, LayerNorm with its float32 second output over 3-D rows."""
    spec = dataclasses.replace(wp.PostNorm.suite("float16"), norm_out=True)
    rng = np.random.default_rng(1)
    y = (rng.standard_normal((2, 48, 1024)) * 3 + 5).astype("float16")
    stats = sn.row_statistics(y, 4, "layer_norm")
    gamma, beta = (rng.standard_normal(1024).astype("float16") for _ in range(2))
    want = sn.reference_norm(spec, y, stats, gamma, beta, lead=(2, 48))
    lib = tvm.compile(tvm.IRModule({"main": sn.norm_func(96, 1024, 4, spec, lead=(2, 48))}), target="llvm")
    args = [tvm.runtime.tensor(a) for a in (y, stats, gamma, beta, np.zeros(y.shape, "float16"), np.zeros(y.shape, "float32"))]
    lib["main"](*args)
    assert np.abs(args[4].numpy().astype(np.float32) - want[0].astype(np.float32)).max() <= 2e-3
    assert np.abs(args[5].numpy() - want[1]).max() <= 1e-4
    full = y.astype(np.float32).reshape(96, 1024)
    exact = (full - full.mean(1, keepdims=True)) / np.sqrt(full.var(1, keepdims=True) + spec.eps)
    assert np.abs(args[5].numpy().reshape(96, 1024) - (exact * gamma.astype(np.float32) + beta.astype(np.float32))).max() <= 1e-3


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_sm90a_compile_splits_rows_wider_than_a_cluster():
    """On sm_90a an RMSNorm over rows of 8192 compiles to the wgmma GEMM kernel writing the
    row statistics and the norm kernel (nvcc accepts both), where the post-norm kernel alone
    cannot take it; where one wave of tiles covers the rows, to one kernel that combines the
    statistics across each row tile's CTAs (a 64-bit count and its polls)."""
    ex = runtime.compile_module(wl.post_norm(1024, 256, 8192, "bfloat16", "rms_norm", linear=True), SM90A)
    source = codegen.cuda_source(ex)
    names = sorted(codegen.kernel_names(source))
    assert len(names) == 2 and names[0].endswith("_gemm_kernel") and names[1].endswith("_norm_kernel")
    assert "stats" in source and "wgmma.mma_async" in source
    source = codegen.cuda_source(runtime.compile_module(wl.post_norm(256, 256, 8192, "bfloat16", "rms_norm", linear=True), SM90A))
    assert len(codegen.kernel_names(source)) == 1 and "wgmma.mma_async" in source
    assert "atom.acq_rel.gpu.global.add.u64" in source and "ld.acquire.gpu.global.u64" in source


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_softmax_post_norms_run_where_layer_norms_do_on_sm90a():
    """``softmax(x @ w.T + b + r)`` runs on the kernel the same LayerNorm runs on: the one-kernel
    form at 4096 rows (one wave), the GEMM + norm kernels at gpt-4k's rows of 4096 (K >= 4096)
    and rows of 8192 over more than a wave, which the mma.sync rule cannot take (gpt-4k's fell
    back to vanilla TVM's DLight kernels, 8.2x cuBLAS's GEMM on the H100), and since session 25 the cluster kernel at 16384 x 256 -> 1024
    (a resident W, ping-pong groups: one kernel where session 24's split took two). The
    statistics are a max and a sum of exponentials: shuffles by max in the GEMM's epilogue,
    exponentials after the exchange (the cluster kernel: each thread's values' exponentials
    about its max, rescaled once the row's max is known)."""
    softmax, layer_norm = wp.PostNorm.suite("float16", "softmax"), wp.PostNorm.suite("float16")
    assert not softmax.problems() and softmax.params == () and not wp.problems(16384, 1024, 256, softmax)
    for m, k, n in ((16384, 256, 1024), (4096, 768, 768), (8192, 4096, 4096)):
        assert postnorm_kernel(m, n, k, softmax) == postnorm_kernel(m, n, k, layer_norm)
    for m, k, n, kind, kernels in ((4096, 768, 768, "exchange", 1), (2048, 512, 8192, "split", 2), (16384, 256, 1024, "cluster", 1)):
        mod = wl.post_norm(m, k, n, "float16", "softmax", linear=True)
        with tvm.target.Target(SM90A):
            grouped = FuseComputeMemory(target=SM90A, hopper=True)(mod)  # (kept whole for the Hopper kernels)
        (name,) = [gv.name_hint for gv in grouped.get_global_vars() if gv.name_hint != "main"]
        assert cf.transform.offload_hopper.hopper_takes(grouped[name], tvm.target.Target(SM90A)) == kind
        source = codegen.cuda_source(runtime.compile_module(mod, SM90A))
        assert len(codegen.kernel_names(source)) == kernels and "wgmma.mma_async" in source
        assert ("stats" in source) == (kind != "cluster")
        if kernels == 1:  # (the two kernels' sources each carry the CUDA headers: nvcc takes them one by one)
            ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
            assert "max.ftz" in ptx and "ex2.approx" in ptx
            assert codegen.ptxas_usage(source)["spill"] == 0


@pytest.mark.parametrize("batch", [None, 2])
def test_a_pre_norm_blocks_residual_stream_comes_from_the_split_gemm(batch):
    """``(norm(x @ w.T + b + r), x @ w.T + b + r)``: a pre-norm block keeps the sum for its next
    residual. The one-kernel post-norm cannot write it; the split kernels do (the GEMM kernel
    writes it anyway), at any width: both outputs match a float64 reference within fp16
    rounding (vanilla TVM accumulates this GEMM in fp16: it is no reference)."""
    mod = wl.post_norm(64, 64, 256, "float16", "rms_norm", linear=True, batch=batch, residual_out=True)
    arrays = _random(mod["main"].params)
    grouped, groups = _groups(mod, "llvm")
    (found,) = [match_postnorm(f) for f in groups]
    assert found[0].sum_out and found[4] == ("out", "sum") and wp.problems(*found[2], found[0])
    calls = []
    offloaded = OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls))(grouped)
    got = _run_llvm(offloaded, arrays)
    want = wl.post_norm_reference([a.astype(np.float32) for a in arrays], "rms_norm", linear=True, residual_out=True)
    assert len(calls) == 2 and len(got) == 2
    assert np.abs(got[0] - want[0]).max() <= 1e-2 and np.abs(got[1] - want[1]).max() <= 1e-2  # a few ulps of values up to ~8


def test_a_llama_style_block_without_bias_runs_split():
    """``h = x @ w.T + r; (rms_norm(h), h)`` with no bias (LLaMA's output projections): one added
    operand, which the one-kernel post-norm does not take and the split kernels do; both outputs
    match a float64 reference."""
    bb = relax.BlockBuilder()
    x, w, r = (relax.Var(n, relax.TensorType(s, "float16")) for n, s in (("x", (64, 64)), ("w", (512, 64)), ("r", (64, 512))))
    gamma = relax.Var("gamma", relax.TensorType((512,), "float16"))
    with bb.function("main", [x, w, r, gamma]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)))), r))
            out = bb.emit(relax.op.nn.rms_norm(h, gamma, axes=[-1], epsilon=1e-5))
            result = bb.emit_output(relax.Tuple([out, h]))
        bb.emit_func_output(result)
    mod = bb.get()
    arrays = _random(mod["main"].params)
    grouped, groups = _groups(mod, "llvm")
    (found,) = [match_postnorm(f) for f in groups]
    assert len(found[0].operands) == 1 and found[0].sum_out and not sn.problems(*found[2], found[0])
    calls = []
    got = _run_llvm(OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls))(grouped), arrays)
    s = arrays[0].astype(np.float64) @ arrays[1].astype(np.float64).T + arrays[2]
    want = s / np.sqrt((s**2).mean(-1, keepdims=True) + 1e-5) * arrays[3].astype(np.float64)
    assert len(calls) == 2 and np.abs(got[0] - want).max() <= 1e-2 and np.abs(got[1] - s).max() <= 1e-2


def test_split_norm_is_opt_in_and_then_splits_what_the_cluster_kernel_would_take():
    """``hopper_groups`` with ``"split_norm"`` (not among the defaults until measured) runs a
    post-norm the cluster kernel takes as the split kernels instead, with the same answer: as
    their one-kernel form where one wave of tiles covers the rows (64 rows), else as two (16384)."""
    assert "split_norm" in cf.pipeline.HOPPER_GROUPS and "split_norm" not in cf.pipeline.DEFAULT_HOPPER_GROUPS
    passes = cf.pipeline.fusion_passes(tvm.target.Target(SM90A), hopper_groups=("split_norm",))
    assert [p.split for p in passes if isinstance(p, OffloadHopperPostNorm)] == [True]
    for m, split_kernels in ((64, 1), (16384, 2)):
        mod = wl.post_norm(m, 128, 512, "float16", "layer_norm", linear=True)
        arrays = _random(mod["main"].params)
        grouped, _ = _groups(mod, "llvm")
        symbols = {}
        for split, kernels in ((False, 1), (True, split_kernels)):
            calls = []
            (got,), (want,) = _run_llvm(OffloadHopperPostNorm("llvm", build=_numpy_kernels(calls), split=split)(grouped), arrays), \
                _run_llvm(mod, arrays)
            symbols[split] = calls
            assert len(calls) == kernels and np.abs(got - want).max() <= 2e-2
        assert not set(symbols[False]) & set(symbols[True])
