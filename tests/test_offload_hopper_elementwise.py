"""OffloadHopperElementwise on CPU: which GEMM + elementwise groups it takes, that the rewritten
graph computes the same values (the kernel's NumPy model in its place, on llvm), and that on
sm_90a the groups become wgmma kernels nvcc compiles without spills or accumulator hazards."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_comfuse as cf
from tvm_comfuse import codegen, runtime
from tvm_comfuse import workloads as wl
from tvm_comfuse.schedule import wgmma_elementwise as we
from tvm_comfuse.schedule import wgmma_mainloop as wm
from tvm_comfuse.schedule import wgmma_postnorm as wp
from tvm_comfuse.schedule.chain import ACTIVATIONS, Step
from tvm_comfuse.transform import FuseComputeMemory, OffloadHopperElementwise, OffloadHopperPostNorm
from tvm_comfuse.transform.offload_hopper_elementwise import match_elementwise

SM90A = {"kind": "cuda", "arch": "sm_90a"}
#: BERT's FFN1 as the importer and ToMixedPrecision leave it: fp16 GEMM rounded, an fp32 bias,
#: GELU in fp32, cast back.
FFN1 = we.Elementwise("float16", (Step("cast", "float16"), Step("cast", "float32"), Step("add", "float32", 0),
                                  Step("gelu", "float32"), Step("cast", "float16")), (("float32", False),), "float16")


def _bert(hidden=128):
    mod, _params, _module, _example = wl.bert_encoder(layers=1, hidden=hidden, heads=2, batch=2, seq=32, dtype="float16")
    return mod


def _outlined(mod, kind="gemm_elementwise"):
    with tvm.target.Target("llvm"):
        out = FuseComputeMemory(target="llvm")(mod)
    return out, [f for gv, f in out.functions_items() if gv.name_hint != "main" and kind in str(f.attrs)]


def _numpy_kernels(calls):
    """A ``build`` for the passes (the elementwise and post-norm ones) that registers the
    kernel's NumPy model under its symbol: the GEMM + elementwise kernel's, or what
    ``test_offload_hopper``'s stand-in models (the post-norm kernels, the split ones, the split's
    one-kernel form)."""
    from test_offload_hopper import _numpy_kernels as postnorm_kernels  # pylint: disable=import-outside-toplevel

    postnorm_build = postnorm_kernels(calls)

    def build(func, symbol, spec, mnk):
        if not isinstance(spec, we.Elementwise) or spec.stats:
            return postnorm_build(func, symbol, spec, mnk)

        def run(*args):
            args[-1].copyfrom(we.reference(spec, *[a.numpy() for a in args[:-1]]))
            calls.append(symbol)

        tvm.register_global_func(symbol, run, override=True)
        return None

    return build


def _random(params, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        scale = 1 / np.sqrt(shape[-1]) if len(shape) == 2 else 1.0
        out.append((rng.standard_normal(shape) * scale).astype(dtype))
    return out


def _run_llvm(mod, arrays):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    items = list(out) if isinstance(out, (tvm.ir.Array, list, tuple)) else [out]
    return [o.numpy().astype(np.float32) for o in items]


def test_bert_projections_and_ffn1_are_read_as_their_chains():
    """An imported BERT layer's GEMM + elementwise groups: Q, K and V (``x @ w.T + b``, fp32
    bias and output) and FFN1 (GELU, fp16 output), each with the parameter order the kernel
    takes (x, w, bias)."""
    _, groups = _outlined(_bert())
    found = [match_elementwise(f) for f in groups]
    assert len(found) == 4 and all(found)
    specs = sorted((m[0] for m in found), key=lambda s: len(s.steps))
    assert [s.out_dtype for s in specs] == ["float32"] * 3 + ["float16"]
    assert specs[-1] == FFN1 and {m[2] for m in found} == {(64, 128, 128), (64, 512, 128)}
    for func, (_spec, roles, _mnk, out_shape) in zip(groups, found):
        params = func.params
        assert [len(params[i].ty.shape) for i in roles] == [3, 2, 1] and out_shape[:2] == [2, 32]


def test_offloaded_bert_layer_computes_what_the_graph_does():
    """Both passes on an imported BERT layer: every GEMM chain is one kernel call, and the Q, K
    and V projections write the heads' layout attention reads (``[B * H, S, D]``, K as ``[B *
    H, D, S]``) in fp16, so the head-splitting transposes and casts after them are gone (Q and V
    share one kernel); the encoder's output matches vanilla TVM's with the kernels' NumPy models
    in their place."""
    mod = _bert()
    arrays = _random(mod["main"].params)
    grouped, _ = _outlined(mod)
    calls = []
    build = _numpy_kernels(calls)
    offloaded = OffloadHopperElementwise("llvm", build=build)(OffloadHopperPostNorm("llvm", build=build)(grouped))
    assert not [gv for gv, f in offloaded.functions_items() if isinstance(f, relax.Function) and "gemm_elementwise" in str(f.attrs)]
    script = offloaded["main"].script()
    assert grouped["main"].script().count("R.permute_dims") == 5 and script.count("R.permute_dims") == 1  # the heads' merge
    assert script.count('out_ty=R.Tensor((4, 32, 64), dtype="float16")') == 2  # Q and V
    assert script.count('out_ty=R.Tensor((4, 64, 32), dtype="float16")') == 1  # K, transposed
    got, want = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    ew = [c for c in calls if "_ew_" in c]
    assert len(ew) == 4 and len(set(ew)) == 3 and len(calls) == 6
    assert len(got) == len(want) and all(np.abs(g - w).max() <= 5e-2 for g, w in zip(got, want))


def test_layout_tails_stop_where_another_op_reads_them():
    """The tail ends before a value something else also reads, and a reshape that merges rows
    (not a split of N into heads) ends it at once: FFN1's output keeps its own layout."""
    from tvm_comfuse.transform.offload_hopper_elementwise import _tails  # pylint: disable=import-outside-toplevel

    grouped, groups = _outlined(_bert())
    names = [gv.name_hint for gv, f in grouped.functions_items() if "gemm_elementwise" in str(f.attrs)]
    tails = _tails(grouped, set(names))
    assert len(tails) == 3 and not any("gelu" in name for name in tails)
    layouts = sorted(layout for _vars, layout, _cast in tails.values())
    assert [axes for _dims, axes, _shape in layouts] == [(0, 2, 1, 3), (0, 2, 1, 3), (0, 2, 3, 1)]
    assert {cast for *_, cast in tails.values()} == {"float16"}


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_the_kernels_model_applies_activations_as_pytorch(act):
    """The NumPy model (the oracle of the tests above) against PyTorch's activations in fp32,
    with a residual tile added after the activation in fp16."""
    spec = we.Elementwise("float16", (Step("cast", "float32"), Step("add", "float32", 0), Step(act, "float32"),
                                      Step("add", "float16", 1)), (("float32", False), ("float16", True)), "float16")
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((64, 32)).astype("float16"), (rng.standard_normal((48, 32)) / 6).astype("float16")
    b, r = rng.standard_normal(48).astype("float32"), rng.standard_normal((64, 48)).astype("float16")
    f = {"gelu": torch.nn.functional.gelu, "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
         "relu": torch.relu, "silu": torch.nn.functional.silu}[act]
    y = f(torch.from_numpy(x).float() @ torch.from_numpy(w).float().T + torch.from_numpy(b))
    want = (y.half() + torch.from_numpy(r)).float().numpy()
    assert np.abs(we.reference(spec, x, w, b, r).astype(np.float32) - want).max() <= 1e-2


@pytest.mark.parametrize("kw", [dict(extra="multiply"), dict(extra="two_outputs")])
def test_chains_the_kernel_cannot_express_are_left_to_the_rule(kw):
    """An op outside the chain's vocabulary (a multiply), or a group returning two values: the
    matcher declines, so the gemm_elementwise rule keeps the group."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float16"))
    w = relax.Var("w", relax.TensorType((256, 128), "float16"))
    b = relax.Var("b", relax.TensorType((256,), "float16"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), b))
            z = bb.emit(relax.op.nn.gelu(y))
            out = bb.emit_output(relax.op.multiply(z, z) if kw["extra"] == "multiply" else relax.Tuple([z, y]))
        bb.emit_func_output(out)
    grouped, groups = _outlined(bb.get())
    assert groups and all(match_elementwise(f) is None for f in groups)
    assert OffloadHopperElementwise("llvm", build=_numpy_kernels([]))(grouped).same_as(grouped)


@pytest.mark.parametrize("dims, axes", [((2, 4, 3, 8), (0, 2, 1, 3)), ((2, 4, 3, 8), (0, 2, 3, 1)), ((8, 3, 8), (1, 0, 2)),
                                        ((2, 4, 3, 8), (3, 2, 1, 0))])
def test_layout_offsets_are_where_numpy_puts_each_element(dims, axes):
    """The kernel's output index for every element of the ``[M, N]`` result in a layout
    (``layout_offset``, the same code the kernel's stores are generated from) is its position
    in ``result.reshape(dims).transpose(axes)``, flattened."""
    m, n = int(np.prod(dims[:-2])), dims[-2] * dims[-1]
    positions = np.arange(m * n).reshape(m, n).reshape(dims).transpose(axes).reshape(-1)
    want = np.empty(m * n, dtype=np.int64)
    want[positions] = np.arange(m * n)  # where each element of the result went
    layout = (dims, axes, (m * n,))
    got = [we.layout_offset(layout, r, c) for r in range(m) for c in range(n)]
    assert got == want.tolist()


def test_default_tiles_fill_the_waves():
    """At M = 4096: N = 768 takes 128 x 192 tiles (128 CTAs, one wave of the 132 SMs; 128 x 256
    would leave 36 idle), N = 3072 the plain GEMM's fastest 128 x 256; any M is taken (a partial
    last row tile), a row no tile divides is declined with the reason."""
    assert (we.default_config(4096, 768, 768).bm, we.default_config(4096, 768, 768).bn) == (128, 192)
    assert (we.default_config(4096, 3072, 768).bm, we.default_config(4096, 3072, 768).bn) == (128, 256)
    assert we.default_config(100, 768, 768).bm == 64 and we.problems(100, 768, 768, FFN1) == []
    assert "no tile" in we.problems(4096, 96, 768, FFN1)[0]


def test_default_is_persistent_where_tiles_take_more_than_one_wave():
    """Persistent CTAs load the next tile while this one's chain and stores run (session 16:
    FFN1 4-6% faster on the H200), so the default takes them where there is a next tile (more
    tiles than SMs) and the output is staged beside a ring of three stages or more; one wave
    (the projections), and head layouts (stored from registers, unmeasured persistent), keep
    one tile a CTA."""
    ffn1 = we.default_config(4096, 3072, 768, FFN1)
    assert ffn1.persistent and ffn1.stages >= 3 and we.stages_output(FFN1, ffn1)
    assert ffn1.smem_bytes + 128 * 256 * 2 <= ffn1.smem_limit
    assert not we.default_config(4096, 768, 768, FFN1).persistent  # 128 tiles of 128 x 192: one wave
    heads = dataclasses.replace(FFN1, layout=((32, 128, 48, 64), (0, 2, 1, 3), (32 * 48, 128, 64)))
    assert not we.default_config(4096, 3072, 768, heads).persistent
    f32 = dataclasses.replace(FFN1, out_dtype="float32")  # twice the staging: a shallower ring of 32-deep steps
    cfg = we.default_config(4096, 3072, 768, f32)
    assert cfg.persistent and cfg.stages >= 3 and cfg.smem_bytes + 128 * 256 * 4 <= cfg.smem_limit


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_sm90a_compile_runs_the_groups_as_wgmma_kernels(caplog):
    """``get_pipeline(..., hopper_groups=(..., "elementwise"))`` on sm_90a: BERT's projections and FFN1
    become wgmma kernels beside the post-norm ones (linked, nvcc-compiled); without the flag
    they stay with the rule."""
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        ex = runtime.compile_module(_bert(), SM90A, hopper=True, hopper_groups=("post_norm", "elementwise"))
    names = codegen.kernel_names(codegen.cuda_source(ex))
    assert len([k for k in names if k.startswith("comfuse_wgmma_ew_")]) == 3
    assert "4 GEMM + elementwise group(s) run as 3 wgmma kernel(s), 3 writing the layout" in caplog.text
    ex = runtime.compile_module(_bert(), SM90A, hopper=True, hopper_groups=("post_norm",))
    assert not any(k.startswith("comfuse_wgmma_ew_") for k in codegen.kernel_names(codegen.cuda_source(ex)))


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
@pytest.mark.parametrize("mnk, spec, lead", [
    ((4096, 3072, 768), FFN1, (32, 128)),
    ((4096, 768, 768), we.Elementwise("float16", FFN1.steps[:3], FFN1.operands, "float32"), (32, 128)),
    # the projections as the pass builds them: K written as [B * H, D, S] in fp16
    ((4096, 768, 768), we.Elementwise("float16", FFN1.steps[:3] + (Step("cast", "float16"),), FFN1.operands, "float16",
                                      ((32, 128, 12, 64), (0, 2, 3, 1), (384, 64, 128))), (32, 128)),
    # 1000 rows (8 x 125): a partial last row tile, its stores guarded
    ((1000, 768, 768), we.Elementwise("float16", FFN1.steps[:3] + (Step("cast", "float16"),), FFN1.operands, "float16",
                                      ((8, 125, 12, 64), (0, 2, 1, 3), (96, 125, 64))), (8, 125)),
])
def test_bert_sized_kernels_compile_without_spills_or_hazards(mnk, spec, lead):
    """BERT-base's FFN1 and projections on their default tiles (and rows no tile divides):
    ptxas keeps every accumulator in registers (no spills, no serialised wgmmas) and no SASS instruction reads an
    accumulator a wgmma may still write. Row-major outputs leave by TMA stores only (staged in
    the ring once the mainloops are done), head layouts by each thread's stores."""
    if codegen.nvdisasm() is None:
        pytest.fail("nvdisasm is missing: pip install nvidia-cuda-nvdisasm (the test extra)")
    source = codegen.cuda_source(wm.build(we.wgmma_elementwise(*mnk, spec, lead=lead)))
    usage = codegen.ptxas_usage(source)
    assert usage["spill"] == 0 and usage["serialized"] == []
    sass = codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))
    assert "HGMMA" in sass and codegen.wgmma_hazards(sass) == []
    assert ("UTMASTG" in sass, " STG." in sass) == ((True, False) if not spec.layout else (False, True))


def test_opt_in_hopper_groups():
    """The pipeline adds the elementwise and attention passes only when ``hopper_groups`` names
    them, on a target where the Hopper offload runs (sm_90, ``hopper`` not False), the attention
    one first; an unknown group name is an error that lists the known ones."""

    def passes(target, **kw):
        return [type(p).__name__ for p in cf.pipeline.fusion_passes(tvm.target.Target(target), **kw) if "Offload" in type(p).__name__]

    assert passes(SM90A) == ["OffloadHopperPostNorm", "OffloadHopperAttention", "OffloadHopperB2B", "OffloadHopperElementwise"]
    assert passes(SM90A, hopper_groups=["post_norm"]) == ["OffloadHopperPostNorm"]
    assert passes(SM90A, hopper_groups=cf.pipeline.HOPPER_GROUPS) == ["OffloadHopperPostNorm", "OffloadHopperAttention",
                                                                     "OffloadHopperB2B", "OffloadHopperElementwise"]
    assert passes(SM90A, hopper_groups=["elementwise"]) == ["OffloadHopperElementwise"]
    assert passes(SM90A, hopper=False, hopper_groups=["elementwise"]) == [] and passes("llvm", hopper_groups=["attention"]) == []
    with pytest.raises(cf.ComFuseError, match="post_norm, attention, b2b, elementwise"):
        cf.pipeline.fusion_passes(tvm.target.Target(SM90A), hopper_groups=["softmax"])


def test_rewrite_agrees_with_vanilla_on_the_fuzz_family():
    """Differential check of the rewrite itself (matcher, layout tails, dtype chains, operands)
    on the ``hopper_gemm`` fuzz family: grouped as for sm_90, each group the kernel takes replaced
    by the kernel's NumPy model, the graph agrees with vanilla TVM on llvm (the fuzzer's oracle)."""
    from tvm_comfuse.testing import fuzz  # pylint: disable=import-outside-toplevel

    taken = heads = 0
    for seed in range(120):
        case = fuzz.generate_hopper_gemm(seed)
        if case.M * (case.batch or 1) * max(case.N, case.K) > 256 * 1024:
            continue
        mod, args = fuzz.build(case), fuzz.inputs(case)
        with tvm.target.Target(SM90A):
            grouped = FuseComputeMemory(target=SM90A, hopper=True)(mod)
        calls = []
        offloaded = OffloadHopperElementwise("llvm", build=_numpy_kernels(calls))(grouped)
        ours = [o.reshape(-1) for o in fuzz._run(tvm.compile(offloaded, target="llvm"), offloaded, args, "llvm")]  # pylint: disable=protected-access
        theirs = [o.reshape(-1) for o in fuzz._run(tvm.compile(mod, target="llvm"), mod, args, "llvm")]  # pylint: disable=protected-access
        ref = [r.reshape(-1) for r in fuzz.reference(case, args)]
        why = [fuzz._mismatch(o, t, r, fuzz.tolerance_dtype(case), fuzz.TOL) for o, t, r in zip(ours, theirs, ref)]  # pylint: disable=protected-access
        assert not any(why), (seed, case.describe(), why)
        taken += bool(calls)
        heads += bool(calls) and any(op[0] == "heads" for op in case.ops)
    assert taken >= 20 and heads >= 5


@pytest.mark.parametrize("cfg", [wm.WgmmaConfig(128, 256, 3, 64, persistent=True), wm.WgmmaConfig(64, 256, 3, 64, pingpong=True),
                                 wm.WgmmaConfig(128, 128, 3, 64, wg_n=2, persistent=True),
                                 wm.WgmmaConfig(128, 256, 3, 64, persistent=True, group_rows=16),
                                 wm.WgmmaConfig(64, 256, 3, 64, pingpong=True, group_rows=3)])
@pytest.mark.parametrize("m, n", [(4100, 3072), (1000, 768), (64, 256), (8192, 4096)])
def test_persistent_ctas_compute_every_tile_once(cfg, m, n):
    """The persistent kernel's walk (``tile_walk``, ``tile_origin``: the definitions its loops
    are generated from), replayed in Python over every CTA and consumer warpgroup: each 64-row
    part of each tile is computed exactly once, whatever the CTAs' tile counts (odd, even, one)
    and the row tiles past M. Session 16's first ping-pong kernel wrote its second group's
    tiles 64 rows low (NaN rows on the H200): this walk would have counted them twice."""
    tiles_m = -(-m // cfg.bm)
    tiles = tiles_m * (n // cfg.bn)
    grid = min(tiles, wp.SM_COUNT)
    done = {}
    for bx in range(grid):
        iters = (tiles - 1 - bx) // grid + 1
        for wg in range(1, cfg.consumers + 1):
            first, step, cw = we.tile_walk(cfg, wg)
            for j in range((iters - first + step - 1) // step):
                origin = we.tile_origin(cfg, tiles_m, n // cfg.bn, bx + (first + step * j) * grid, cw)
                done[origin] = done.get(origin, 0) + 1
    parts = {(r, c) for r in range(0, tiles_m * cfg.bm, 64) for c in range(0, n, cfg.wg_cols)}
    assert set(done) == parts and set(done.values()) == {1}
