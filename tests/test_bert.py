"""A HuggingFace BERT encoder through torch.export and TVM's PyTorch frontend."""

import numpy as np
import pytest
import tvm

import tvm_comfuse as cf
from tvm_comfuse import runtime as rt
from tvm_comfuse import workloads as wl

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LAYERS = 2


@pytest.fixture(scope="module")
def bert():
    return wl.bert_encoder(layers=LAYERS, hidden=48, heads=4, intermediate=80, batch=2, seq=13)


def test_every_post_norm_layer_norm_is_fused_with_its_dense(bert):
    mod = bert[0]
    groups = [g for g in cf.analyze(mod) if g.fused]
    layer_norms = sum(g.ops.count("relax.nn.layer_norm") for g in groups if g.kind == cf.GEMM_REDUCE)
    in_module = mod.script().count("R.nn.layer_norm(")
    assert in_module == 2 * LAYERS
    assert layer_norms == in_module  # every LayerNorm sits in a group with the dense before it
    for g in groups:
        if "relax.nn.layer_norm" in g.ops:
            assert g.ops[:2] == ("relax.permute_dims", "relax.matmul")
            assert g.ops.index("relax.add") < g.ops.index("relax.nn.layer_norm")


def test_compiled_encoder_matches_pytorch(bert):
    mod, params, module, example = bert
    x = torch.randn_like(example)  # fresh input, not the one used for export
    with torch.no_grad():
        ref = module(x).numpy()
    ex = rt.compile_module(mod, "llvm")
    dev = tvm.cpu()
    (out,) = rt.run(ex, rt.to_device([x.numpy()] + params, rt.param_dtypes(mod), dev), dev)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_half_encoder_matches_pytorch_as_closely_as_vanilla_tvm():
    """Imported all fp16 (``half``: inputs and weights too, what ``comfuse bench`` compiles), the
    encoder compiled by ComFuse on llvm matches the float32 PyTorch module within fp16's error
    and no worse than vanilla TVM's (which accumulates its fp16 GEMMs in fp16), its last
    LayerNorm widened to float32 once (the cast pair dropped)."""
    mod, params, module, example = wl.bert_encoder(layers=LAYERS, hidden=48, heads=4, intermediate=80, batch=2, seq=13,
                                                   dtype="float16", half=True)
    assert {p.dtype for p in params} == {np.dtype("float16")} and set(rt.param_dtypes(mod)) == {"float16"}
    x = torch.randn_like(example)
    with torch.no_grad():
        ref = module(x).numpy()
    dev = tvm.cpu()
    errors = {}
    for comfuse in (True, False):
        ex = rt.compile_module(mod, "llvm", comfuse=comfuse)
        (out,) = rt.run(ex, rt.to_device([x.numpy()] + params, rt.param_dtypes(mod), dev), dev)
        errors[comfuse] = np.abs(out - ref).max()
    assert errors[True] <= 1e-2 and errors[True] <= errors[False] + 2e-3, errors  # (measured 0.0027, vanilla 0.0034)
    with pytest.raises(ValueError, match="pass dtype='float16'"):  # fp16 inputs and weights of a float32 graph
        wl.bert_encoder(layers=1, hidden=48, heads=4, half=True)


def test_groups_the_gpu_rule_cannot_tile_stay_with_vanilla_fusion():
    """On a GPU target, the attention-score group (a 4-D batched GEMM, reshaped, then softmax)
    has no configuration of the gemm_reduce rule: left fused, DLight scheduled it as one
    function, and BERT-base ran 3.8x slower than vanilla TVM on the H200. It stays with vanilla
    fusion and says why; the LayerNorm groups stay fused."""
    mod = wl.bert_encoder(layers=1, hidden=64, heads=4, batch=2, seq=16, dtype="float16")[0]
    on_cpu = cf.analyze(mod)
    on_gpu = cf.analyze(mod, target="nvidia/nvidia-h100")
    softmax = [g for g in on_gpu if "relax.nn.softmax" in g.ops and g.kind == cf.GEMM_REDUCE]
    assert softmax and all(not g.fused and "cannot tile" in g.note for g in softmax)
    assert any(g.fused for g in on_cpu if "relax.nn.softmax" in g.ops and g.kind == cf.GEMM_REDUCE)
    norms = [g for g in on_gpu if "relax.nn.layer_norm" in g.ops and g.kind == cf.GEMM_REDUCE]
    assert len(norms) == 2 and all(g.fused for g in norms)
    fused = cf.FuseComputeMemory(target="nvidia/nvidia-h100")(mod)
    outlined = [gv.name_hint for gv, f in fused.functions_items() if "softmax" in gv.name_hint and (f.attrs or {}).get(cf.KIND_ATTR)]
    assert outlined == []
