"""OffloadHopperAttention on CPU: which attentions it takes, that the rewritten graph computes the
same values (the kernels' NumPy models in their place, on llvm) with no head split, merge,
softmax or batched matmul left as kernels of their own, and that the kernel compiles for sm_90a
without spills or accumulator hazards."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvm_comfuse import codegen
from tvm_comfuse import workloads as wl
from tvm_comfuse.schedule import wgmma_attention as wa
from tvm_comfuse.schedule import wgmma_mainloop as wm
from tvm_comfuse.transform import FuseComputeMemory, OffloadHopperAttention, OffloadHopperElementwise, OffloadHopperPostNorm
from tvm_comfuse.transform.offload_hopper_attention import _plans

from test_offload_hopper_elementwise import _numpy_kernels as _group_kernels
from test_offload_hopper_elementwise import SM90A, _random, _run_llvm


def _numpy_kernels(calls):
    """A ``build`` for the three passes: the attention kernel's NumPy model, or a group's."""
    groups = _group_kernels(calls)

    def build(func, symbol, spec, mnk):
        if not isinstance(spec, wa.Attention):
            return groups(func, symbol, spec, mnk)

        def run(*args):
            args[-1].copyfrom(wa.reference(spec, *[a.numpy() for a in args[:-1]]).reshape(args[-1].shape))
            calls.append(symbol)

        tvm.register_global_func(symbol, run, override=True)
        return None

    return build


def _bert(seq=64):
    return wl.bert_encoder(layers=1, hidden=128, heads=2, batch=2, seq=seq, dtype="float16")[0]


def _grouped(mod):
    """FuseComputeMemory as it groups for sm_90 (where the attention's scores are left to vanilla
    fusion): the module still compiles for llvm, where the tests run it."""
    with tvm.target.Target(SM90A):
        return FuseComputeMemory(target=SM90A, hopper=True)(mod)


def _attention(b=2, s=64, h=2, d=64, scale_op="multiply", extra_output=False, mask=False):
    return wl.attention(b, h, s, d, "float16", scale_op, extra_output, mask)


def test_bert_attention_is_read_as_the_kernel_describes_it():
    """An imported BERT layer's attention (split heads through reshape, two transposes, no-op
    broadcasts and casts; scores in fp16 scaled by 1/8; softmax in fp32) is one match."""
    (spec, sources, final, skipped), = _plans(_grouped(_bert()))
    assert spec == wa.Attention(2, 2, 64, 64, "float16", "float16", 0.125, "multiply", "float16")
    assert all(str(s.ty.dtype) == "float32" for s in sources)  # the projections' outputs, before their casts
    assert [int(x) for x in final.ty.shape.values] == [2, 64, 128] and len(skipped) > 20  # the heads merged, as the next GEMM reads them


@pytest.mark.parametrize("scale_op", ["multiply", "divide"])
def test_offloaded_attention_computes_what_the_graph_does(scale_op):
    """A standalone attention becomes one kernel call (and the casts and transpose of its inputs)
    and gives vanilla TVM's values with the kernel's NumPy model in its place."""
    mod = _attention(scale_op=scale_op)
    arrays = _random(mod["main"].params)
    calls = []
    offloaded = OffloadHopperAttention("llvm", build=_numpy_kernels(calls))(mod)
    script = offloaded["main"].script()
    assert "R.nn.softmax" not in script and "R.matmul" not in script and "call_dps_packed" in script
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert len(calls) == 1 and np.abs(got - want).max() <= 2e-2


def test_offloaded_bert_layer_runs_attention_and_projections_as_kernels():
    """All three passes on an imported BERT layer: the attention is one kernel, its inputs come
    from the projections' kernels in the layouts it reads (no head split or merge, softmax or
    batched matmul left in the graph), and the encoder's output matches vanilla TVM's."""
    mod = _bert()
    arrays = _random(mod["main"].params)
    calls = []
    build = _numpy_kernels(calls)
    out = _grouped(mod)
    for p in (OffloadHopperPostNorm("llvm", build=build), OffloadHopperAttention("llvm", build=build),
              OffloadHopperElementwise("llvm", build=build)):
        out = p(out)
    script = out["main"].script()
    for op in ("R.nn.softmax", "R.matmul", "R.permute_dims"):
        assert op not in script, op
    got, want = _run_llvm(out, arrays), _run_llvm(mod, arrays)
    assert len([c for c in calls if "attention" in c]) == 1 and len([c for c in calls if "_ew_" in c]) == 4
    assert all(np.abs(g - w).max() <= 5e-2 for g, w in zip(got, want))


def test_attentions_the_kernel_cannot_take_are_left_alone(caplog):
    """Probabilities also returned (an intermediate another op reads) are not matched; heads of 96
    (not a whole number of 64-column boxes) or 100 keys (v.T's rows not whole 16-byte units for
    TMA) are matched but declined, and the log says why."""
    assert _plans(_attention(extra_output=True)) == []
    for odd, why in ((_attention(d=96), "head dim 96"), (_attention(s=100), "sequence 100")):
        with caplog.at_level("INFO", logger="tvm_comfuse"):
            assert OffloadHopperAttention("llvm", build=_numpy_kernels([]))(odd).same_as(odd)
        assert why in caplog.text


def test_padding_masks_are_added_in_the_kernel():
    """A padding mask (``[B, 1, 1, S]``, a large negative value at padded keys, added to the
    scores in fp32 as HuggingFace encoders add it) is the kernel's fourth input: one call, the
    graph's values with the NumPy model in its place."""
    mod = _attention(b=2, s=128, mask=True)
    arrays = _random(mod["main"].params)
    arrays[3] = np.where(np.arange(128) >= 100, -10000.0, 0.0).astype("float32")[None, None, None].repeat(2, 0)
    (spec, sources, _, _), = _plans(mod)
    assert (spec.mask, spec.mask_batch, len(sources)) == ("keys", 2, 4)
    calls = []
    offloaded = OffloadHopperAttention("llvm", build=_numpy_kernels(calls))(mod)
    assert "R.nn.softmax" not in offloaded["main"].script()
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert len(calls) == 1 and np.abs(got - want).max() <= 2e-2


def test_an_exported_bert_with_a_padding_mask_is_matched():
    """A HuggingFace BERT encoder exported with an additive padding mask (its extended mask,
    ``(1 - mask[:, None, None, :]) * -10000``): each layer's attention, mask included, is one match."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel  # pylint: disable=import-outside-toplevel
    from tvm.relax.frontend.torch import from_exported_program  # pylint: disable=import-outside-toplevel

    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, vocab_size=128,
                        max_position_embeddings=64, attn_implementation="eager")
    bert = BertModel(config, add_pooling_layer=False).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = bert.encoder

        def forward(self, hidden, mask):
            return self.encoder(hidden, attention_mask=(1.0 - mask[:, None, None, :].to(hidden.dtype)) * -10000.0)[0]

    with torch.no_grad():
        exported = torch.export.export(Encoder().eval(), (torch.randn(2, 64, 128), torch.ones(2, 64, dtype=torch.long)))
    mod = relax.transform.ToMixedPrecision(out_dtype="float16")(from_exported_program(exported, keep_params_as_input=True))
    plans = _plans(_grouped(mod))
    assert len(plans) == 2 and all(spec.mask == "keys" and spec.mask_batch == 2 for spec, *_ in plans)


def test_any_sequence_length_is_taken():
    """104 keys with a padding mask (no block divides them: the kernel masks the last block's
    keys past S and does not store the last tile's rows past S): one kernel call, the graph's
    values with the NumPy model in its place."""
    mod = _attention(b=2, s=104, mask=True)
    arrays = _random(mod["main"].params)
    arrays[3] = np.where(np.arange(104) >= 90, -10000.0, 0.0).astype("float32")[None, None, None].repeat(2, 0)
    calls = []
    offloaded = OffloadHopperAttention("llvm", build=_numpy_kernels(calls))(mod)
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert len(calls) == 1 and np.abs(got - want).max() <= 2e-2


def test_long_sequences_are_taken_in_key_blocks():
    """512 keys: the attention becomes one kernel call (the kernel walks four blocks of 128 keys
    with an online softmax) and gives vanilla TVM's values with the NumPy model in its place."""
    mod = _attention(b=1, s=512, h=2)
    arrays = _random(mod["main"].params)
    calls = []
    offloaded = OffloadHopperAttention("llvm", build=_numpy_kernels(calls))(mod)
    (got,), (want,) = _run_llvm(offloaded, arrays), _run_llvm(mod, arrays)
    assert len(calls) == 1 and np.abs(got - want).max() <= 2e-2


def test_the_kernels_model_is_attention():
    """The NumPy model (the oracle above) against PyTorch's softmax attention in fp32."""
    spec = wa.Attention(2, 3, 64, 64)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 64, 3, 64)).astype("float16") for _ in range(3))
    vt = v.transpose(0, 2, 3, 1).reshape(2 * 3 * 64, 64)
    got = wa.reference(spec, q.reshape(128, 192), k.reshape(128, 192), vt).astype(np.float32)
    qt, kt, vv = (torch.from_numpy(a).float().permute(0, 2, 1, 3) for a in (q, k, v))
    want = (torch.softmax(qt @ kt.transpose(-1, -2) * 0.125, -1) @ vv).permute(0, 2, 1, 3).reshape(128, 192)
    assert np.abs(got - want.numpy()).max() <= 1e-2


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
@pytest.mark.parametrize("spec", [wa.Attention(32, 12, 128), wa.Attention(4, 2, 64),
                                  wa.Attention(2, 4, 128, 128, "bfloat16", "bfloat16", 8.0, "divide"),
                                  wa.Attention(2, 16, 1024), wa.Attention(2, 4, 512, 128),
                                  wa.Attention(32, 12, 128, mask="keys", mask_batch=32),
                                  wa.Attention(4, 2, 104, mask="keys", mask_batch=4), wa.Attention(2, 4, 200, 128), wa.Attention(2, 2, 32),
                                  wa.Attention(1, 12, 128, q_rows=64), wa.Attention(2, 2, 200, 128, q_rows=64)])
def test_attention_kernel_compiles_without_spills_or_hazards(spec):
    """BERT-base's attention (and a 64-key, a bf16 128-wide-head one, 512 and 1024 keys in
    blocks, a padding mask, sequences no block divides, 64 query rows a CTA at 128 and 200 keys):
    ptxas keeps the scores, probabilities and outputs in registers
    without serialising the wgmmas, and no SASS
    instruction reads an accumulator a wgmma may still write; the softmax's quad reductions are
    shuffles."""
    if codegen.nvdisasm() is None:
        pytest.fail("nvdisasm is missing: pip install nvidia-cuda-nvdisasm (the test extra)")
    source = codegen.cuda_source(wm.build(wa.wgmma_attention(spec)))
    usage = codegen.ptxas_usage(source)
    assert usage["spill"] == 0 and usage["serialized"] == [] and source.count("__shfl_xor_sync") == 8
    sass = codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))
    assert "HGMMA" in sass and codegen.wgmma_hazards(sass) == []


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_sm90a_compile_runs_bert_on_the_hopper_kernels(caplog):
    """``get_pipeline(..., hopper_groups=HOPPER_GROUPS)`` on sm_90a: the layer's attention is one
    wgmma kernel, its projections and FFN1 three GEMM + elementwise ones (Q and K share one),
    all linked and compiled by nvcc."""
    from tvm_comfuse import pipeline, runtime  # pylint: disable=import-outside-toplevel

    with caplog.at_level("INFO", logger="tvm_comfuse"):
        ex = runtime.compile_module(_bert(), SM90A, hopper=True, hopper_groups=pipeline.HOPPER_GROUPS)
    names = codegen.kernel_names(codegen.cuda_source(ex))
    assert len([k for k in names if k.startswith("comfuse_wgmma_attention_")]) == 1
    assert len([k for k in names if k.startswith("comfuse_wgmma_ew_")]) == 3
    assert "1 attention(s) run as 1 wgmma kernel(s)" in caplog.text


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_a_bert_layer_on_every_hopper_kernel_launches_eight_kernels():
    """Weights bound (as a deployment and the bench compile): the default sm_90 pipeline launches
    a softmax, batched matmuls and head transposes of vanilla TVM's beside ComFuse's kernels;
    with every Hopper group, the layer is the input's cast and seven ComFuse kernels."""
    from tvm_comfuse import PASS_CONFIG, pipeline  # pylint: disable=import-outside-toplevel

    mod, params, _module, _example = wl.bert_encoder(layers=1, hidden=128, heads=2, batch=2, seq=128, dtype="float16")
    names = [p.name for p in mod["main"].params[1:]]
    mod = relax.transform.BindParams("main", dict(zip(names, (tvm.runtime.tensor(p) for p in params))))(mod)
    launched = {}
    for groups in (("post_norm",), None):  # the post-norm kernel alone (the default before session 15), the default
        with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
            lowered = pipeline.get_pipeline(SM90A, hopper_groups=groups)(mod)
        launched[groups] = codegen.launches(lowered)
    alone = launched[("post_norm",)]
    assert any("softmax" in k for k in alone) and any("transpose" in k for k in alone)
    everything = launched[None]
    assert len(everything) == 8 and all(k.startswith("comfuse_wgmma_") for k in everything[1:]), everything


def test_layouts_compare_where_elements_come_from():
    """``Layout``: a chain of reshapes keeps the memory order, a head split with its transpose
    does not, two spellings of the same arrangement agree; issue 5's longest attention (B x H
    256, 1024 keys: 268 M probabilities) is matched from its shapes alone, without an index array
    of that size."""
    import time  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.transform.offload_hopper_attention import Layout  # pylint: disable=import-outside-toplevel

    split = Layout([2, 8, 12]).reshape([2, 8, 3, 4]).transpose([0, 2, 1, 3]).reshape([6, 8, 4])
    assert Layout([2, 8, 12]).reshape([16, 12]).same_as(Layout([192]), shape=False)
    assert not split.same_as(Layout([6, 8, 4]))
    twice = Layout([2, 8, 12]).reshape([2, 8, 3, 4]).transpose([0, 2, 3, 1]).transpose([0, 1, 3, 2]).reshape([6, 8, 4])
    assert twice.same_as(split)
    start = time.perf_counter()
    (spec, *_), = _plans(wl.attention(32, 8, 1024))
    assert spec.seq == 1024 and time.perf_counter() - start < 30
