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
