"""CUDA code generation for sm_90 without a GPU: the fused groups' kernels compile with nvcc."""

import pytest

import tvm_comfuse as cf
from tvm_comfuse import codegen, runtime
from tvm_comfuse import workloads as wl

pytestmark = pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")


@pytest.mark.parametrize("dtype, norm", [("float16", "layer_norm"), ("bfloat16", "rms_norm"), ("float32", "softmax")])
def test_gemm_reduce_cuda_compiles_with_nvcc(dtype, norm):
    mod = wl.post_norm(100, 72, 40, dtype, norm, linear=True, residual_out=True)
    (group,) = [g for g in cf.analyze(mod) if g.fused]
    ex = runtime.compile_module(mod, {"kind": "cuda", "arch": "sm_90"})
    source = codegen.cuda_source(ex)
    kernels = codegen.kernel_names(source)
    assert any(k.startswith(group.name + "_kernel") for k in kernels), kernels
    cubin = codegen.compile_with_nvcc(source, "sm_90")
    assert len(cubin) > 0 and cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("norm", ["layer_norm", "softmax", "rms_norm_decomposed"])
def test_gemm_reduce_group_is_one_kernel(norm):
    """The ComFuse rule, not DLight's fallback, schedules the group: one launch, and the
    normalisation's row statistics live in shared memory."""
    mod = wl.post_norm(4096, 768, 768, "float16", norm, linear=True)
    (group,) = [g for g in cf.analyze(mod) if g.fused]
    source = codegen.cuda_source(runtime.compile_module(mod, {"kind": "cuda", "arch": "sm_90"}))
    fused = [k for k in codegen.kernel_names(source) if k.startswith(group.name + "_kernel")]
    assert len(fused) == 1, fused
    assert "__shared__" in source and "__shfl" in source  # on-chip row tile, warp reductions
