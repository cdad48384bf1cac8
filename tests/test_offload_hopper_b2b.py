"""OffloadHopperB2B on CPU: which GEMM -> elementwise -> GEMM pairs it fuses into one kernel call,
that the rewritten graph computes the same values (the kernel's NumPy model in its place, on
llvm), and that on sm_90a the pair becomes one wgmma kernel nvcc compiles without spills or
accumulator hazards."""

import logging

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_comfuse as cf
from tvm_comfuse import codegen, runtime
from tvm_comfuse import workloads as wl
from tvm_comfuse.schedule import wgmma_b2b as wb
from tvm_comfuse.schedule import wgmma_mainloop as wm
from tvm_comfuse.transform import FuseComputeMemory, OffloadHopperB2B, OffloadHopperElementwise
from tvm_comfuse.transform.offload_hopper_b2b import planned_pairs

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def _grouped(mod):
    with tvm.target.Target("llvm"):
        return FuseComputeMemory(target="llvm")(mod)


def _numpy_kernels(calls):
    """A ``build`` for the Hopper passes that registers the kernel's NumPy model under its symbol."""
    from tvm_comfuse.schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel

    def build(_func, symbol, spec, _mnk):
        def run(*args):
            ins = [a.numpy() for a in args[:-1]]
            out = wb.reference(spec, *ins) if isinstance(spec, wb.B2B) else we.reference(spec, *ins)
            args[-1].copyfrom(out.reshape(args[-1].shape))  # the b2b kernel's output rows may be grouped as the graph's
            calls.append(symbol)

        tvm.register_global_func(symbol, run, override=True)

    return build


def _inputs(mod, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in mod["main"].params:
        shape = [int(d) for d in p.ty.shape.values]
        scale = 1 / np.sqrt(shape[-1]) if p.name.startswith("w") else 1.0
        out.append((rng.standard_normal(shape) * scale).astype(str(p.ty.dtype)))
    return out


def _run_llvm(mod, arrays):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return [o.numpy().astype(np.float64) for o in out] if isinstance(out, (tvm.ir.Array, list, tuple)) else out.numpy().astype(np.float64)


def _offload(mod, calls):
    build = _numpy_kernels(calls)
    return OffloadHopperElementwise("llvm", build=build)(OffloadHopperB2B("llvm", build=build)(_grouped(mod)))


@pytest.mark.parametrize("kw", [dict(), dict(residual=True), dict(bias2=False), dict(batch=2, act="silu"),
                                dict(act="relu", bias2=False, residual=True), dict(act=None, dtype="bfloat16")])
def test_mlp_pairs_are_one_kernel_call(kw):
    """``act(x @ w1.T + b1) @ w2.T (+ b2) (+ r)``: the two GEMM groups (or the group and the plain
    second GEMM left in the caller) become one call of the b2b kernel, no group function is left,
    and the graph gives vanilla TVM's values with the kernel's NumPy model in its place (closer
    to fp64 than vanilla's, which accumulates fp16 GEMMs in fp16); M = 200 is not a multiple of
    the 128-row blocks."""
    mod = wl.mlp(100 if "batch" in kw else 200, 96, 64, 192, **kw)
    calls, arrays = [], _inputs(mod)
    offloaded = _offload(mod, calls)
    assert [gv.name_hint for gv, _ in offloaded.functions_items()] == ["main"]
    assert offloaded["main"].script().count("R.call_dps_packed") == 1
    got, want = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    ref = wl.mlp_reference([a.astype(np.float64) for a in arrays], kw.get("act", "gelu"))
    assert len(calls) == 1 and calls[0].startswith("comfuse_wgmma_b2b_")
    tol = 2e-1 if kw.get("dtype") == "bfloat16" else 5e-2
    assert np.abs(got - want).max() <= tol and np.abs(got - ref).max() <= np.abs(want - ref).max() + 1e-3


def _with_intermediate_returned():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((128, 64), "float16"))
    w1, w2 = relax.Var("w1", relax.TensorType((64, 64), "float16")), relax.Var("w2", relax.TensorType((64, 64), "float16"))
    b = relax.Var("b", relax.TensorType((64,), "float16"))
    with bb.function("main", [x, w1, b, w2]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w1)))), b))))
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w2)))), b))
            out = bb.emit_output(relax.Tuple([y, h]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("case, why", [
    ("n1_96", "N1 = 96"), ("n1_512", "N1 = 512"), ("n2_100", "bn2 = 64 for N2 = 100"), ("returned", None),
])
def test_pairs_the_kernel_cannot_take_stay_two_kernels(case, why, caplog):
    """An intermediate the kernel cannot hold (N1 not 64 to 256 in 64s), an output it cannot
    tile, or an intermediate something else also reads: the pass leaves both halves (the
    elementwise kernel then takes what it can) and says why where the pair was a candidate."""
    mod = {"n1_96": lambda: wl.mlp(128, 64, 96, 64), "n1_512": lambda: wl.mlp(128, 64, 512, 64),
           "n2_100": lambda: wl.mlp(128, 64, 64, 100), "returned": _with_intermediate_returned}[case]()
    calls = []
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        offloaded = _offload(mod, calls)
    assert "comfuse_wgmma_b2b" not in offloaded["main"].script()
    if why:
        assert "stay two kernels, the wgmma b2b kernel cannot take" in caplog.text and why in caplog.text
    arrays = _inputs(mod)
    got, want = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert all(np.abs(g - w).max() <= 5e-2 for g, w in zip(got, want))


def test_the_kernels_model_is_the_mlp():
    """The NumPy model the CPU tests put in the kernel's place computes PyTorch's MLP (fp32)
    within fp16 rounding, with the rounding of each step as the graph's."""
    rng = np.random.default_rng(1)
    x, w1, b1 = rng.standard_normal((300, 128)), rng.standard_normal((64, 128)) / 12, rng.standard_normal(64)
    w2, b2, r = rng.standard_normal((256, 64)) / 8, rng.standard_normal(256), rng.standard_normal((300, 256))
    ins = [a.astype(np.float16) for a in (x, w1, b1, w2, b2, r)]
    got = wb.reference(wb.B2B.mlp("float16", "gelu", residual=True), *ins).astype(np.float32)
    t = [torch.from_numpy(a.astype(np.float32)) for a in ins]
    want = torch.nn.functional.gelu(t[0] @ t[1].T + t[2]) @ t[3].T + t[4] + t[5]
    assert np.abs(got - want.numpy()).max() <= 5e-2


@pytest.mark.parametrize("n1, spec", [(64, wb.B2B.mlp()), (128, wb.B2B.mlp("bfloat16", "silu")), (192, wb.B2B.mlp(act="relu")),
                                      (256, wb.B2B.mlp(residual=True))])
def test_issue5_shapes_compile_without_spills_or_hazards(n1, spec):
    """Issue 5's MLP shapes (65536 tokens, width 1024) on their default configurations: no
    spills (ptxas), no accumulator read while a wgmma may still write it (SASS), the output by
    TMA stores only, no serialised wgmmas; persistent CTAs up to N1 = 128, one block a CTA above;
    above N1 = 64, 64-column output tiles (the H200 sweep, session 15), at N1 = 128 stored beside
    the next tile's wgmmas on a six-deep w2 ring, at 256 a four-deep one (session 26)."""
    if codegen.nvdisasm() is None:
        pytest.fail("nvdisasm is missing: pip install nvidia-cuda-nvdisasm (the test extra)")
    cfg = wb.default_config(65536, n1, 1024, 1024, spec.dtype)
    expected = {64: (128, 2, False), 128: (64, 6, True)}.get(n1, (64, 4, False))
    assert cfg.persistent == (n1 <= 128) and cfg.bm == 128 and (cfg.bn2, cfg.stages2, cfg.overlap) == expected
    source = codegen.cuda_source(wm.build(wb.wgmma_b2b(65536, n1, 1024, 1024, spec, cfg)))
    usage = codegen.ptxas_usage(source)
    assert usage["spill"] == 0 and usage["serialized"] == []
    sass = codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))
    assert "HGMMA" in sass and codegen.wgmma_hazards(sass) == [] and "UTMASTG" in sass and " STG." not in sass


def test_sm90a_compile_runs_the_pair_as_one_kernel(caplog):
    """``get_pipeline(..., hopper_groups=("b2b",))`` on sm_90a: the MLP compiles to one launch,
    the b2b kernel (linked, nvcc-compiled), as with the default groups; the post-norm kernel
    alone leaves it two GEMM kernels."""
    from tvm_comfuse import PASS_CONFIG, pipeline  # pylint: disable=import-outside-toplevel

    mod = wl.mlp(1000, 256, 128, 512, residual=True)
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        ex = runtime.compile_module(mod, SM90A, hopper_groups=("b2b",))
    assert "1 GEMM -> elementwise -> GEMM pair(s) run as 1 wgmma b2b kernel(s)" in caplog.text
    assert [k for k in codegen.kernel_names(codegen.cuda_source(ex)) if k.startswith("comfuse_wgmma_b2b_")]
    launched = {}
    for groups in (("post_norm",), ("b2b",), None):
        with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
            launched[groups] = codegen.launches(pipeline.get_pipeline(SM90A, hopper_groups=groups)(mod))
    assert len(launched[("b2b",)]) == 1 and launched[("b2b",)][0].startswith("comfuse_wgmma_b2b_")
    assert launched[None] == launched[("b2b",)]
    assert len(launched[("post_norm",)]) == 2 and not any("b2b" in k for k in launched[("post_norm",)])


def test_analysis_names_the_kernel_that_takes_b2b_groups():
    """``analyze`` still lists a narrow GEMM chain feeding a GEMM as a ``b2b_gemm`` candidate and
    says how to run it as one kernel."""
    (b2b,) = [g for g in cf.analyze(wl.mlp(128, 64, 64, 64)) if g.kind == cf.B2B_GEMM]
    assert "'b2b' Hopper group" in b2b.note and not b2b.fused


def test_rewrite_agrees_with_vanilla_on_the_fuzz_family():
    """Differential check of the pair rewrite (matching, both chains, operands, the plain second
    GEMM) on the ``b2b`` fuzz family: grouped as for sm_90, each pair the kernel takes replaced
    by the kernel's NumPy model (the halves it does not take by the elementwise kernel's), the
    graph agrees with vanilla TVM on llvm (the fuzzer's oracle), NaN and Inf inputs included."""
    from tvm_comfuse.testing import fuzz  # pylint: disable=import-outside-toplevel

    taken = apart = 0
    for seed in range(80):
        case = fuzz.generate_b2b(seed)
        if case.M * (case.batch or 1) * 1024 > 1024 * 1024:
            continue
        mod, args = fuzz.build(case), fuzz.inputs(case)
        with tvm.target.Target(SM90A):
            grouped = FuseComputeMemory(target=SM90A, hopper=True)(mod)
        calls = []
        build = _numpy_kernels(calls)
        offloaded = OffloadHopperElementwise("llvm", build=build)(OffloadHopperB2B("llvm", build=build)(grouped))
        ours = [o.reshape(-1) for o in fuzz._run(tvm.compile(offloaded, target="llvm"), offloaded, args, "llvm")]  # pylint: disable=protected-access
        theirs = [o.reshape(-1) for o in fuzz._run(tvm.compile(mod, target="llvm"), mod, args, "llvm")]  # pylint: disable=protected-access
        ref = [r.reshape(-1) for r in fuzz.reference(case, args)]
        why = [fuzz._mismatch(o, t, r, fuzz.tolerance_dtype(case), fuzz.TOL) for o, t, r in zip(ours, theirs, ref)]  # pylint: disable=protected-access
        assert not any(why), (seed, case.describe(), why)
        b2b = any(c.startswith("comfuse_wgmma_b2b_") for c in calls)
        taken, apart = taken + b2b, apart + (not b2b)
    assert taken >= 30 and apart >= 2


@pytest.mark.parametrize("residual", [True, False])
def test_an_exported_pytorch_mlp_is_one_kernel(residual):
    """A PyTorch MLP block as ``torch.export`` and TVM's frontend import it (3-D rows regrouped
    around each linear, ToMixedPrecision's fp32 biases, GELU, residual and output): the rows'
    reshapes between the halves are looked through, the fp32 output is the kernel's own (staged in
    fp32), and the block gives vanilla TVM's values with the kernel's NumPy model in its place."""
    mod, params, module, example = wl.mlp_encoder(residual=residual)
    with tvm.target.Target(SM90A):
        grouped = FuseComputeMemory(target=SM90A, hopper=True)(mod)
    calls = []
    build = _numpy_kernels(calls)
    offloaded = OffloadHopperElementwise("llvm", build=build)(OffloadHopperB2B("llvm", build=build)(grouped))
    script = offloaded["main"].script()
    assert script.count("R.call_dps_packed") == 1 and 'out_ty=R.Tensor((2, 100, 256), dtype="float32")' in script
    arrays = [example.numpy(), *params]
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert len(calls) == 1 and calls[0].startswith("comfuse_wgmma_b2b_") and np.abs(got - want).max() <= 5e-2
    assert np.abs(got - module(example).detach().numpy()).max() <= 5e-2


def test_the_exported_mlp_compiles_for_sm90a_as_one_kernel():
    """The exported block (weights bound, as a deployment compiles it) on sm_90a with the b2b
    group: one launch besides the input's cast, its code free of spills and accumulator hazards."""
    from tvm_comfuse import PASS_CONFIG, pipeline  # pylint: disable=import-outside-toplevel

    mod, params, _module, _example = wl.mlp_encoder(batch=4, seq=1000)
    names = [p.name for p in mod["main"].params[1:]]
    mod = relax.transform.BindParams("main", dict(zip(names, map(tvm.runtime.tensor, params))))(mod)
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
        lowered = pipeline.get_pipeline(SM90A, hopper_groups=("post_norm", "b2b"))(mod)
    launched = codegen.launches(lowered)
    assert len(launched) == 2 and launched[1].startswith("comfuse_wgmma_b2b_"), launched  # the input's cast, the MLP
    with tvm.target.Target(SM90A):
        grouped = FuseComputeMemory(target=SM90A, hopper=True)(mod)
    ((_, _, spec, _, mnk, leads, _, _),) = planned_pairs(grouped)
    assert spec.out_dtype == "float32" and leads == ((4, 1000), (4, 1000))
    source = codegen.cuda_source(wm.build(wb.wgmma_b2b(*mnk, spec, None, *leads)))
    assert codegen.ptxas_usage(source)["spill"] == 0
    assert codegen.wgmma_hazards(codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))) == []


def _three_linears():
    """``gelu(gelu(x @ w0.T + b0) @ w1.T + b1) @ w2.T + b2``, widths 256 -> 64 -> 128 -> 256:
    two overlapping pair candidates (the middle GEMM ends one and starts the next)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((200, 256), "float16"))
    ws = [relax.Var(f"w{i}", relax.TensorType(s, "float16")) for i, s in enumerate([(64, 256), (128, 64), (256, 128)])]
    bs = [relax.Var(f"b{i}", relax.TensorType((n,), "float16")) for i, n in enumerate([64, 128, 256])]
    with bb.function("main", [x, *ws, *bs]):
        with bb.dataflow():
            h = x
            for i in range(3):
                h = bb.emit(relax.op.add(bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(ws[i])))), bs[i]))
                h = bb.emit(relax.op.nn.gelu(h)) if i < 2 else h
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


def test_a_chain_of_three_linears_takes_one_pair():
    """Pairs do not overlap: the first two GEMMs become the b2b kernel, the third (whose input
    is that kernel's output) goes to the elementwise kernel, and the graph gives vanilla TVM's
    values (a middle GEMM taken twice would leave a variable undefined)."""
    mod, calls = _three_linears(), []
    offloaded = _offload(mod, calls)
    arrays = _inputs(mod)
    got, want = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert [c.split("_")[2] for c in calls] == ["b2b", "ew"] and np.abs(got - want).max() <= 5e-2
