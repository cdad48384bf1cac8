"""Compile a Relax module with or without ComFuse and run it: the one place both are built."""

from __future__ import annotations

import importlib

import numpy as np
import tvm
from tvm import relax

from .pipeline import get_pipeline, vanilla_fusion_passes
from .schedule.lowering import PASS_CONFIG, TIR_PIPELINE
from .target import parse_target, tuning_target


def compile_module(mod: tvm.IRModule, target, comfuse: bool = True, database=None, hopper: bool | None = None,
                   hopper_groups=None):
    """``tvm.compile`` with ComFuse's Relax and TIR pipelines, or TVM's defaults (``comfuse=False``).

    The TIR pipeline and pass config carry the TVM 0.27 workarounds the tensor-core kernels
    need (:mod:`tvm_comfuse.schedule.lowering`); the rest of the module lowers as usual.
    ``hopper``: the wgmma kernels for the post-norm groups they take (``None``: on sm_90; see
    ``get_pipeline``); ``hopper_groups``: which groups (``get_pipeline``'s).
    """
    target = parse_target(target)
    if not comfuse:
        return tvm.compile(mod, target=target, relax_pipeline="default")
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
        return tvm.compile(mod, target=target, relax_pipeline=get_pipeline(target, database, hopper, hopper_groups),
                           tir_pipeline=TIR_PIPELINE)


def compile_vanilla_tuned(mod: tvm.IRModule, target, trials_per_task: int, work_dir: str):
    """Vanilla TVM tuned by MetaSchedule with its stock rules (XGBoost cost model), then built
    from that database (DLight for what it did not tune): the "vanilla TVM MetaSchedule"
    contender of ``comfuse bench``, given the trial budget per task ComFuse's tuning gets.

    ``work_dir`` receives MetaSchedule's logs. The tasks are vanilla fusion's PrimFuncs, so the
    GEMM and its normalisation are tuned as separate kernels, as TVM users get them today.

    The builder is TVM's own (stock build function) with ComFuse's build timeout,
    :data:`~tvm_comfuse.tune.measure.BUILD_TIMEOUT_S`, so both contenders get the same time to
    build; at LocalBuilder's default 30 s, the GPU machine's batches of sixteen nvcc builds
    most likely timed out (session 27: every LayerNorm candidate failed; NOTES, session 29)."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    from .tune.measure import BUILD_TIMEOUT_S  # pylint: disable=import-outside-toplevel

    target = tuning_target(target)
    if "cuda" in target.kind.name:  # the stock tensor-core rules need TVM's CUDA intrinsics registered
        importlib.import_module("tvm.s_tir.tensor_intrin.cuda")
    with target:
        fused = tvm.transform.Sequential(vanilla_fusion_passes())(mod)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    database = ms.relax_integration.tune_relax(
        fused, params={}, target=target, work_dir=work_dir, max_trials_global=trials_per_task * max(len(tasks), 1),
        max_trials_per_task=trials_per_task, num_trials_per_iter=min(64, trials_per_task),
        builder=ms.builder.LocalBuilder(timeout_sec=BUILD_TIMEOUT_S),
    )
    return ms.relax_integration.compile_relax(database, mod, target, params=None)


def to_device(arrays, dtypes, device):
    """NumPy arrays cast to ``dtypes`` (bf16 through ml_dtypes) as TVM tensors on ``device``."""
    import ml_dtypes  # pylint: disable=import-outside-toplevel

    out = []
    for a, dtype in zip(arrays, dtypes):
        a = np.asarray(a).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        out.append(tvm.runtime.tensor(a, device))
    return out


def run(executable, inputs, device, entry: str = "main") -> list:
    """Run ``entry`` on TVM tensors; return the outputs as float64 NumPy arrays."""
    vm = relax.VirtualMachine(executable, device)
    result = vm[entry](*inputs)
    items = list(result) if isinstance(result, (tvm.ir.Array, list, tuple)) else [result]
    return [np.asarray(r.numpy()).astype(np.float64) for r in items]


def param_dtypes(mod: tvm.IRModule, entry: str = "main") -> list:
    """The dtypes of ``mod[entry]``'s parameters."""
    return [str(p.ty.dtype) for p in mod[entry].params]
