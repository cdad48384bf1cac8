"""Structure of the pass: what is grouped, what is not, second outputs, fallbacks, annotations."""

import pytest
import tvm
from tvm import relax

import tvm_comfuse as cf
from tvm_comfuse import workloads as wl
from tvm_comfuse.pipeline import fusion_passes
from tvm_comfuse.transform import GROUPS_ATTR, KIND_ATTR, ROLE_ATTR

LN = ("relax.matmul", "relax.add", "relax.add", "relax.nn.layer_norm")


def _fused(mod):
    return [g for g in cf.analyze(mod) if g.fused]


@pytest.mark.parametrize(
    "norm, tail",
    [
        ("layer_norm", ("relax.nn.layer_norm",)),
        ("rms_norm", ("relax.nn.rms_norm",)),
        ("softmax", ("relax.nn.softmax",)),
        (
            "layer_norm_decomposed",
            ("relax.mean", "relax.subtract", "relax.multiply", "relax.mean", "relax.add",
             "relax.rsqrt", "relax.multiply", "relax.multiply", "relax.add"),
        ),
        (
            "rms_norm_decomposed",
            ("relax.astype", "relax.power", "relax.mean", "relax.add", "relax.rsqrt",
             "relax.multiply", "relax.astype", "relax.multiply"),
        ),
    ],
)
def test_each_norm_forms_one_gemm_reduce_group(norm, tail):
    groups = _fused(wl.post_norm(33, 40, 24, norm=norm))
    assert len(groups) == 1
    g = groups[0]
    assert g.kind == cf.GEMM_REDUCE
    assert g.ops == ("relax.matmul", "relax.add", "relax.add") + tail
    assert g.gemm == (1, 33, 24, 40)
    assert len(g.outputs) == 1


def test_linear_form_pulls_the_weight_transpose_in():
    (g,) = _fused(wl.post_norm(33, 40, 24, linear=True))
    assert g.ops == ("relax.permute_dims",) + LN


def test_batched_3d_activations():
    (g,) = _fused(wl.post_norm(7, 40, 24, batch=3, linear=True))
    assert g.kind == cf.GEMM_REDUCE and g.gemm == (3, 7, 24, 40)


def test_activation_after_norm_joins_the_group():
    (g,) = _fused(wl.post_norm(33, 40, 24, out_act="gelu"))
    assert g.ops == LN + ("relax.nn.gelu",)


def test_residual_read_elsewhere_becomes_a_second_output():
    (g,) = _fused(wl.post_norm(33, 40, 24, residual_out=True))
    assert g.ops == LN
    assert [o.shape for o in g.outputs] == [(33, 24), (33, 24)]
    mod = cf.FuseComputeMemory()(wl.post_norm(33, 40, 24, residual_out=True))
    fused = [f for gv, f in mod.functions_items() if gv.name_hint == g.name][0]
    assert len(fused.ret_ty.fields) == 2  # both the norm and the residual sum come out


def test_activation_before_the_residual_joins_the_group():
    (g,) = _fused(wl.post_norm(33, 40, 24, act="relu"))
    assert g.ops == ("relax.matmul", "relax.add", "relax.nn.relu", "relax.add", "relax.nn.layer_norm")


def test_elementwise_only_is_gemm_elementwise():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((33, 40), "float32"))
    w = relax.Var("w", relax.TensorType((40, 24), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            y = bb.emit(relax.op.nn.silu(bb.emit(relax.op.multiply(y, relax.const(0.5)))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    (g,) = _fused(bb.get())
    assert g.kind == cf.GEMM_ELEMENTWISE
    assert g.ops == ("relax.matmul", "relax.multiply", "relax.nn.silu")


def _single(build):
    """A module from ``build(bb, x, w) -> output expr`` with x[33,40], w[40,24]."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((33, 40), "float32"))
    w = relax.Var("w", relax.TensorType((40, 24), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x, w))
        bb.emit_func_output(out)
    return bb.get()


def test_plain_gemm_is_not_a_group():
    assert cf.analyze(_single(lambda bb, x, w: bb.emit(relax.op.matmul(x, w)))) == []


def test_column_reduction_stops_the_chain():
    def build(bb, x, w):
        y = bb.emit(relax.op.matmul(x, w))
        return bb.emit(relax.op.sum(bb.emit(relax.op.exp(y)), axis=[0], keepdims=True))

    (g,) = _fused(_single(build))
    assert g.ops == ("relax.matmul", "relax.exp") and g.kind == cf.GEMM_ELEMENTWISE


def test_layout_change_stops_the_chain_and_trailing_reshape_stays_outside():
    def build(bb, x, w):
        y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.matmul(x, w))))
        t = bb.emit(relax.op.permute_dims(y))
        return bb.emit(relax.op.reshape(bb.emit(relax.op.exp(t)), (24 * 33,)))

    (g,) = _fused(_single(build))
    assert g.ops == ("relax.matmul", "relax.nn.relu")


def test_a_path_leaving_and_reentering_is_not_fused_into_a_cycle():
    def build(bb, x, w):
        y = bb.emit(relax.op.matmul(x, w))
        outside = bb.emit(relax.op.permute_dims(bb.emit(relax.op.permute_dims(y))))
        return bb.emit(relax.op.nn.softmax(bb.emit(relax.op.add(y, outside)), axis=-1))

    mod = _single(build)
    assert _fused(mod) == []  # the add reads y through an op outside the group
    cf.FuseComputeMemory()(mod)  # and outlining does not fail


def test_int_gemm_falls_back():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 16), "int32"))
    w = relax.Var("w", relax.TensorType((16, 8), "int32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(bb.emit(relax.op.add(y, y)))
        bb.emit_func_output(out)
    (group,) = cf.analyze(bb.get())
    assert not group.fused and "int32" in group.note  # reported, left to vanilla fusion


def test_several_groups_share_one_input():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((33, 40), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((40, 24), "float32")) for i in range(2)]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.nn.softmax(bb.emit(relax.op.matmul(x, w)), axis=-1)) for w in ws]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    groups = _fused(bb.get())
    assert [g.kind for g in groups] == [cf.GEMM_REDUCE, cf.GEMM_REDUCE]
    assert len({g.name for g in groups}) == 2


def _mlp(width):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    w1 = relax.Var("w1", relax.TensorType((32, width), "float32"))
    w2 = relax.Var("w2", relax.TensorType((width, 32), "float32"))
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.gelu(bb.emit(relax.op.matmul(x, w1))))
            out = bb.emit_output(bb.emit(relax.op.matmul(h, w2)))
        bb.emit_func_output(out)
    return bb.get()


def test_b2b_detected_when_narrow_and_left_to_vanilla():
    groups = cf.analyze(_mlp(128))
    b2b = [g for g in groups if g.kind == cf.B2B_GEMM]
    assert len(b2b) == 1 and not b2b[0].fused and b2b[0].note
    assert b2b[0].ops == ("relax.matmul", "relax.nn.gelu", "relax.matmul")
    assert [g.kind for g in groups if g.fused] == [cf.GEMM_ELEMENTWISE]
    kinds = {str(v) for v in dict(cf.FuseComputeMemory()(_mlp(128)).attrs[GROUPS_ATTR]).values()}
    assert kinds == {cf.GEMM_ELEMENTWISE}


def test_b2b_not_detected_when_the_intermediate_is_wide():
    assert [g.kind for g in cf.analyze(_mlp(1024))] == [cf.GEMM_ELEMENTWISE]


def test_analyze_does_not_change_the_module():
    mod = wl.post_norm(33, 40, 24, linear=True, residual_out=True)
    before = mod.script()
    cf.analyze(mod)
    assert mod.script() == before


def test_pass_is_idempotent():
    once = cf.FuseComputeMemory()(wl.post_norm(33, 40, 24))
    twice = cf.FuseComputeMemory()(once)
    assert twice.script() == once.script()


def test_fused_primfunc_is_annotated_with_kind_and_roles():
    mod = tvm.transform.Sequential(fusion_passes())(wl.post_norm(33, 40, 24, linear=True))
    (name,) = mod.attrs[GROUPS_ATTR].keys()
    func = mod[str(name)]
    assert str(func.attrs[KIND_ATTR]) == cf.GEMM_REDUCE
    roles = dict(cf.transform.block_roles(func))
    sch = tvm.s_tir.Schedule(func)
    blocks = [sch.get(rv) for rv in sch.get_child_blocks(sch.get_sblock("root"))]
    assert {b.name_hint: str(b.annotations[ROLE_ATTR]) for b in blocks} == roles
    order = list(roles.values())
    assert order[0] == "prologue" and order.count("mainloop") == 1
    assert order.index("mainloop") < order.index("epilogue") < order.index("reduction") < order.index("normalize")


def test_row_splitting_reshape_is_hoisted_out_of_the_group():
    """PyTorch's 3-D linear: reshape(matmul(x2d, w) + b, [B, S, N]) + r -> LayerNorm."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((6, 40), "float32"))
    w = relax.Var("w", relax.TensorType((40, 24), "float32"))
    b = relax.Var("b", relax.TensorType((24,), "float32"))
    r = relax.Var("r", relax.TensorType((2, 3, 24), "float32"))
    g = relax.Var("g", relax.TensorType((24,), "float32"))
    with bb.function("main", [x, w, b, r, g]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, w)), b))
            y = bb.emit(relax.op.add(bb.emit(relax.op.reshape(y, (2, 3, 24))), r))
            out = bb.emit_output(bb.emit(relax.op.nn.rms_norm(y, g, axes=[-1])))
        bb.emit_func_output(out)
    (group,) = _fused(bb.get())
    assert group.ops == ("relax.matmul", "relax.add", "relax.add", "relax.nn.rms_norm")
    assert group.gemm == (2, 3, 24, 40)


def test_rows_too_wide_for_the_gpu_rule_stay_vanilla():
    """On a GPU target a 4096-wide row cannot live in one thread block of the mma.sync rule: not
    outlined; on sm_90 the Hopper kernel (the default there) slices it over a cluster instead."""
    wide = wl.post_norm(64, 64, 4096, "float16", linear=True)
    (g,) = cf.analyze(wide, target="nvidia/nvidia-h100", hopper=False)
    assert not g.fused and "no one-kernel schedule" in g.note
    (g,) = cf.analyze(wide, target="nvidia/nvidia-h100")
    assert g.fused and "Hopper" in g.note
    (g,) = cf.analyze(wide, target={"kind": "cuda", "arch": "sm_80"})
    assert not g.fused
    assert cf.analyze(wide)[0].fused  # llvm: fused
    mod = cf.FuseComputeMemory(target="nvidia/nvidia-h100")(wide)
    assert GROUPS_ATTR not in (mod.attrs or {})
    (narrow,) = cf.analyze(wl.post_norm(64, 64, 768, "float16", linear=True), target="nvidia/nvidia-h100")
    assert narrow.fused


def test_weight_cast_after_transpose_joins_the_group():
    """TVM's mixed precision casts a linear weight after its transpose; CastBeforeTranspose
    swaps them so the group keeps the transpose (the [N, K] layout the tensor cores read)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 32), "float16"))
    w = relax.Var("w", relax.TensorType((24, 32), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            wt = bb.emit(relax.op.astype(bb.emit(relax.op.permute_dims(w)), "float16"))
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(bb.emit(relax.op.matmul(x, wt)), axis=-1)))
        bb.emit_func_output(out)
    (group,) = cf.analyze(bb.get())
    assert group.fused and group.ops[0] == "relax.permute_dims"


def _written_out_rms_norm(dtype, n=256):
    """``x * rsqrt(mean(x ** 2, -1) + eps) * gamma`` in ``dtype`` of ``x @ w.T + r``, as
    torch.nn.RMSNorm exports under TVM's mixed precision (an fp16 GEMM, the sum and the norm
    in ``dtype``), returning the sum too, as a pre-norm block keeps it."""
    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType((64, 96), "float16")), relax.Var("w", relax.TensorType((n, 96), "float16"))
    r, gamma = relax.Var("r", relax.TensorType((64, n), dtype)), relax.Var("gamma", relax.TensorType((n,), dtype))
    op = relax.op
    with bb.function("main", [x, w, r, gamma]):
        with bb.dataflow():
            y = bb.emit(op.astype(bb.emit(op.matmul(x, bb.emit(op.permute_dims(w)))), dtype))
            h = bb.emit(op.add(y, r))
            ms = bb.emit(op.mean(bb.emit(op.power(h, relax.const(2.0, dtype))), axis=[1], keepdims=True))
            inv = bb.emit(op.rsqrt(bb.emit(op.add(ms, relax.const(1e-5, dtype)))))
            out = bb.emit_output(relax.Tuple([bb.emit(op.multiply(bb.emit(op.multiply(h, inv)), gamma)), h]))
        bb.emit_func_output(out)
    return bb.get()


def test_an_rms_norm_written_out_in_float32_is_folded_exactly():
    """FoldRMSNorm turns the arithmetic into ``nn.rms_norm`` in float32, where TVM lowers both to
    the same result, bit for bit; the group then ends in the norm the Hopper kernels read (here
    the split ones, as the sum is returned too). In float16 it leaves the arithmetic alone
    (``nn.rms_norm`` would sum in float32: not the same result)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.transform import FoldRMSNorm  # pylint: disable=import-outside-toplevel

    mod = _written_out_rms_norm("float32")
    folded = FoldRMSNorm()(mod)
    assert "R.nn.rms_norm" in folded["main"].script() and "R.power" not in folded["main"].script()
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor((rng.standard_normal([int(d) for d in p.ty.shape.values]) + 2).astype(str(p.ty.dtype)))
            for p in mod["main"].params]
    run = lambda m: [o.numpy() for o in relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())["main"](*args)]  # noqa: E731
    assert all((a == b).all() for a, b in zip(run(folded), run(mod)))
    (group,) = cf.analyze(mod, {"kind": "cuda", "arch": "sm_90a"})
    assert group.fused and group.ops[-1] == "relax.nn.rms_norm" and "then a norm kernel" in group.note
    assert "R.power" in FoldRMSNorm()(_written_out_rms_norm("float16"))["main"].script()


def test_an_exported_pytorch_pre_norm_stack_reaches_the_hopper_kernels():
    """A pre-norm residual stream exported from PyTorch (:func:`~tvm_comfuse.workloads.prenorm_stack`:
    ``h = h + proj(n); n = RMSNorm(h)``, ``torch.nn.RMSNorm`` arriving written out): FoldRMSNorm
    folds each norm, and on sm_90 each projection's group runs split, those that keep the stream
    ``h`` for the next layer as the GEMM and norm kernels, and the last, whose bias-less chain the
    post-norm kernel does not express, as the split's one-kernel form (one wave covers its rows)."""
    pytest.importorskip("torch")
    mod = wl.prenorm_stack(layers=3)[0]
    assert "R.power" in mod["main"].script()
    groups = [g for g in cf.analyze(mod, {"kind": "cuda", "arch": "sm_90a"}) if g.fused]
    assert len(groups) == 3 and all("relax.nn.rms_norm" in g.ops for g in groups)
    assert sorted((len(g.outputs), "then a norm kernel" in g.note, "one Hopper wgmma kernel" in g.note) for g in groups) == \
        [(1, False, True), (2, True, False), (2, True, False)]
