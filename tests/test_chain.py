"""The elementwise chain's activations as the Hopper kernels compute them (CPU: ``llvm``, nvcc)."""

import math

import numpy as np
import pytest

from tvm_comfuse import codegen


def _run_on_llvm(fn, x):
    """``fn`` (an fp32 TIR expression of one fp32 value) applied to the float32 array ``x`` on ``llvm``."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import te  # pylint: disable=import-outside-toplevel

    a = te.placeholder(x.shape, "float32", "a")
    b = te.compute(x.shape, lambda i: fn(a[i]), name="b")
    kernel = tvm.compile(te.create_prim_func([a, b]), target="llvm")
    out = tvm.runtime.tensor(np.empty_like(x))
    kernel(tvm.runtime.tensor(x), out)
    return out.numpy()


def test_gelu_is_within_a_micro_of_the_exact_gelu_and_keeps_the_graphs_non_finite_values():
    """``chain.gelu`` (the kernels' GELU: A&S 7.1.28's erfc, one reciprocal), run as the same TIR
    expression on ``llvm`` (IEEE division in place of CUDA's ``rcp.approx``), against GELU in
    float64 with an exact erf: within 1e-6 everywhere on [-12, 12], and relatively within 5e-5
    where |GELU| > 0.01 (a tenth of an fp16 ulp; the legalised formula's ``0.5 + 0.5 erf``
    cancels to the same order in the negative tail); and the non-finite values TVM's legalised
    formula ``v * (0.5 + erf(v / sqrt 2) * 0.5)`` gives (and PyTorch): ``gelu(inf) = inf``,
    ``gelu(-inf)`` and ``gelu(NaN)`` NaN."""
    from tvm_comfuse.schedule.chain import gelu  # pylint: disable=import-outside-toplevel

    finite = np.concatenate([np.linspace(-12, 12, 400001, dtype=np.float32), np.float32([0.0, -0.0, 1e-30, -1e-30, 6e4, -6e4])])
    out = _run_on_llvm(lambda v: gelu(v, reciprocal=lambda p: 1 / p), np.append(finite, np.float32([np.inf, -np.inf, np.nan])))
    got, special = out[:finite.size].astype(np.float64), out[finite.size:]
    exact = finite * 0.5 * (1 + np.vectorize(math.erf)(finite.astype(np.float64) / math.sqrt(2)))
    err = np.abs(got - exact)
    assert err.max() < 1e-6, (err.max(), finite[err.argmax()])
    big = np.abs(exact) > 1e-2
    assert (err[big] / np.abs(exact[big])).max() < 5e-5
    assert special[0] == np.inf and np.isnan(special[1]) and np.isnan(special[2])


@pytest.mark.skipif(not codegen.have_nvcc(), reason="nvcc is not installed")
def test_kernels_compute_gelu_with_one_approximate_reciprocal_and_no_erff():
    """The b2b kernel's GELU in CUDA: no ``erff`` call (two ranges' polynomials a value), its
    reciprocal ``rcp.approx.ftz.f32`` in the PTX, and no float division of any kind (``div.rn``
    without fast math: a slow-path branch a value)."""
    import re  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import wgmma_b2b as wb, wgmma_mainloop as wm  # pylint: disable=import-outside-toplevel

    source = codegen.cuda_source(wm.build(wb.wgmma_b2b(128, 128, 256, 192, wb.B2B.mlp())))
    assert "erff" not in source and "erf(" not in source.split("extern \"C\"", 1)[1]
    ptx = codegen.compile_with_nvcc(source, "sm_90a", fmt="ptx").decode()
    body = ptx[ptx.index(".entry"):]
    assert len(re.findall(r"rcp\.approx\.ftz\.f32", body)) > 0 and not re.search(r"\bdiv\.\w+(\.ftz)?\.f32", body)
