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

4. A kernel that should run several CTAs per SM (``MmaConfig.min_ctas``) needs
   ``__launch_bounds__(threads, min_ctas)``, which TVM's CUDA codegen prints from the device
   function's ``tirx.launch_bounds_min_blocks_per_sm`` attribute. The rule annotates the root
   block (:data:`MIN_CTAS_ATTR`, so MetaSchedule traces replay it); the pipeline moves it onto
   the PrimFunc first, and onto its kernels once SplitHostDevice has made them.

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
#: Root-block annotation (and then PrimFunc attribute): CTAs per SM the kernel is built for.
MIN_CTAS_ATTR = "comfuse.min_ctas"
_KERNEL_MIN_BLOCKS = "tirx.launch_bounds_min_blocks_per_sm"


@tvm.transform.module_pass(opt_level=0, name="ComFuseMinCtasToAttr")
def _min_ctas_to_attr(mod, _ctx):
    """The root block's :data:`MIN_CTAS_ATTR` annotation as a PrimFunc attribute."""
    updates = {}
    for gv, func in mod.functions_items():
        block = getattr(func.body, "block", None) if isinstance(func, tirx.PrimFunc) else None
        if block is not None and MIN_CTAS_ATTR in block.annotations:
            updates[gv] = func.with_attr(MIN_CTAS_ATTR, int(block.annotations[MIN_CTAS_ATTR]))
    if not updates:
        return mod
    mod = mod.clone()
    for gv, func in updates.items():
        mod.update_func(gv, func)
    return mod


@tvm.transform.module_pass(opt_level=0, name="ComFuseMinCtasToKernels")
def _min_ctas_to_kernels(mod, _ctx):
    """After SplitHostDevice: each kernel of a PrimFunc with :data:`MIN_CTAS_ATTR` (named
    ``<function>_kernel...`` by SplitHostDevice) gets the launch-bounds attribute."""
    wanted = {gv.name_hint: int(f.attrs[MIN_CTAS_ATTR]) for gv, f in mod.functions_items()
              if isinstance(f, tirx.PrimFunc) and f.attrs is not None and MIN_CTAS_ATTR in f.attrs}
    if not wanted:
        return mod
    mod = mod.clone()
    for gv, func in list(mod.functions_items()):
        host = next((h for h in wanted if gv.name_hint.startswith(f"{h}_kernel")), None)
        if host is not None and isinstance(func, tirx.PrimFunc):
            mod.update_func(gv, func.with_attr(_KERNEL_MIN_BLOCKS, wanted[host]))
    return mod


def _pipeline():
    from tvm.s_tir.pipeline import default_s_tir_pipeline  # pylint: disable=import-outside-toplevel

    s_tir_main, finalize_host, finalize_device = default_s_tir_pipeline()
    main = tvm.transform.Sequential([_min_ctas_to_attr, s_tir_main, _min_ctas_to_kernels])

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
