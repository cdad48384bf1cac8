"""Lowering the tensor-core kernels with TVM 0.27: two workarounds and the pass config.

1. ``LowerWarpMemory`` lowers only the first ``warp``-scope buffer of each statement list and
   then stops, so the other mma fragments stay 32x-oversized per-thread arrays (local-memory
   spills). The ``"comfuse"`` TIR pipeline is TVM's ``s_tir`` pipeline with that pass repeated
   until no warp buffer is left.
2. After it, the second m16n8 half of each fragment is addressed as
   ``((tx*8 + c) / 256) * m + a`` (truncdiv), which TVM's simplifier does not fold, so nvcc
   would index the register array dynamically. With ``threadIdx.x < 32`` and ``c % 256 <= 7``
   the quotient is ``c // 256``; a CUDA post-processing hook folds it, only inside kernels
   that issue ``mma.sync`` (ComFuse's: their ``threadIdx.x`` extent is 32 by construction).

3. Rows split over a thread-block cluster (:mod:`.cluster`) need the kernel launched with
   clusters. TVM 0.27's ``clusterCtaIdx`` binding is rejected by the s_tir lowering passes
   (ThreadSync's thread-scope check), so the same CUDA hook gives each kernel that calls the
   ``allgather`` intrinsic the compile-time attribute ``__cluster_dims__(ranks, 1, 1)``;
   cluster rank is then ``blockIdx.x``, which is how the rule binds the column slices.

``cp.async`` additionally needs ``tirx.use_async_copy``, and CSE must not hide the fragment
offsets from LowerWarpMemory (``tirx.disable_cse_tir``): :data:`PASS_CONFIG`.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import tirx

TIR_PIPELINE = "comfuse"
PASS_CONFIG = {"tirx.use_async_copy": True, "tirx.disable_cse_tir": True}


def _pipeline():
    from tvm.s_tir.pipeline import default_s_tir_pipeline  # pylint: disable=import-outside-toplevel

    main, finalize_host, finalize_device = default_s_tir_pipeline()

    @tvm.transform.module_pass(opt_level=0, name="RepeatLowerWarpMemory")
    def _lower_warp(mod, _ctx):
        for _ in range(64):
            if 'scope="warp"' not in mod.script(show_meta=False):
                break
            mod = tirx.transform.LowerWarpMemory()(mod)
        return mod

    return main, finalize_host, lambda: tvm.transform.Sequential([_lower_warp, finalize_device()])


tirx.compilation_pipeline.register_tir_pipeline(TIR_PIPELINE, _pipeline)

_C = r"(?:\(int64_t\))?"  # int64 indices (Relax-legalised PrimFuncs) print a cast on every literal
_TRUNCDIV = re.compile(
    rf"\(\(\(\(\(\(\((?:int|int64_t)\)threadIdx\.x\) \* {_C}8\) \+ {_C}(\d+)\) / {_C}256\) \* {_C}(\d+)\) \+ {_C}(\d+)\)"
)
_KERNEL_START = re.compile(r'(?=extern "C" __global__)')


def _fold(match) -> str:
    c, mul, add = (int(g) for g in match.groups())
    return f"({(c // 256) * mul + add})" if c % 256 <= 7 else match.group(0)


_CLUSTER_CALL = re.compile(r"comfuse_cluster_allgather_\w+_x(\d+)\(")
_KERNEL_NAME = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(')


def add_cluster_dims(code: str) -> str:
    """Give every kernel that exchanges row statistics across a cluster its cluster shape."""
    dims = {}
    for part in _KERNEL_START.split(code):
        ranks = set(_CLUSTER_CALL.findall(part.split("{", 1)[-1]))
        name = _KERNEL_NAME.match(part)
        if name and ranks:
            if len(ranks) != 1:
                raise ValueError(f"kernel {name.group(1)} mixes cluster sizes {sorted(ranks)}")
            dims[name.group(1)] = ranks.pop()

    def _attr(match):
        ranks = dims.get(match.group(1))
        head = match.group(0)
        return head.replace("__global__ void ", f"__global__ void __cluster_dims__({ranks}, 1, 1) ", 1) if ranks else head

    return _KERNEL_NAME.sub(_attr, code) if dims else code


def fold_fragment_indices(code: str) -> str:
    """Fold the fragment-half truncdiv in every kernel that issues mma.sync (see module doc)."""
    parts = _KERNEL_START.split(code)
    return "".join(_TRUNCDIV.sub(_fold, p) if "mma.sync" in p else p for p in parts)


@tvm_ffi.register_global_func("tvm_callback_cuda_postproc", override=True)
def _cuda_postproc(code, target=None):  # pylint: disable=unused-argument
    return add_cluster_dims(fold_fragment_indices(code))
