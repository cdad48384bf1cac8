"""get_pipeline: vanilla TVM's Relax pipeline with ComFuse's fusion and scheduling inserted.

The order matters: FuseComputeMemory must see Relax operators (before LegalizeOps), and the
schedule stage must see the fused PrimFuncs (after FuseTIR). Everything else, library
dispatch, FuseOps for the rest of the graph, the dataflow lowering and finalisation, is TVM's
own per-target pipeline, so a module without fusion groups compiles exactly as vanilla TVM
compiles it.
"""

from __future__ import annotations

import importlib
import os

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.s_tir import meta_schedule as ms

from .errors import ComFuseError
from .schedule import GemmRowTile
from .target import is_gpu, parse_target
from .transform import AnnotateFusedBlocks, FuseComputeMemory


def load_database(database) -> ms.Database:
    """A MetaSchedule database from a Database or a directory of MetaSchedule JSON logs."""
    if isinstance(database, ms.Database):
        return database
    path = os.fspath(database)
    workload = os.path.join(path, "database_workload.json")
    records = os.path.join(path, "database_tuning_record.json")
    if not (os.path.isfile(workload) and os.path.isfile(records)):
        raise ComFuseError(
            f"{path!r} is not a MetaSchedule log directory (it needs database_workload.json and "
            "database_tuning_record.json). Pass the --work-dir that `comfuse tune` wrote, "
            "or a tvm.s_tir.meta_schedule.Database."
        )
    return ms.database.JSONDatabase(path_workload=workload, path_tuning_record=records, allow_missing=False)


def fusion_passes(target=None):
    """FuseComputeMemory, then the vanilla legalisation and fusion of the rest, then the
    annotation of the fused PrimFuncs: everything up to scheduling."""
    return [
        FuseComputeMemory(target=target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        AnnotateFusedBlocks(),
    ]


def schedule_passes(target: tvm.target.Target, database=None):
    """Tuned records first, then the ComFuse rules for fused groups, then DLight's defaults
    for what is still unscheduled (GPU only).

    CPU targets need no schedule to be correct; they compile the fused PrimFuncs as they are.
    """
    passes = []
    if database is not None:
        passes.append(_apply_database(load_database(database)))
    if is_gpu(target):
        passes.append(
            dl.ApplyDefaultSchedule(
                GemmRowTile(),
                dl.gpu.Matmul(),
                dl.gpu.GEMV(),
                dl.gpu.Reduction(),
                dl.gpu.GeneralReduction(),
                dl.gpu.Fallback(),
            )
        )
    return passes


def _apply_database(db: ms.Database):
    @tvm.transform.module_pass(opt_level=0, name="ComFuseApplyDatabase")
    def _apply(mod, _ctx):
        with db:
            return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)

    return _apply


def _backend(target: tvm.target.Target):
    """TVM's per-target pipeline module (its stages are not all re-exported in 0.27)."""
    name = {"cuda": "cuda", "rocm": "rocm", "llvm": "cpu_generic"}.get(target.kind.name)
    if name is None and is_gpu(target):
        name = "gpu_generic"
    if name is None:
        raise ComFuseError(
            f"target kind {target.kind.name!r} has no Relax pipeline in TVM; use a CUDA target "
            "(e.g. \"nvidia/nvidia-h100\") or \"llvm\"."
        )
    return importlib.import_module(f"tvm.relax.backend.{name}.pipeline")


def get_pipeline(target, database=None) -> tvm.transform.Pass:
    """The Relax pipeline for ``tvm.compile(mod, target, relax_pipeline=get_pipeline(target))``.

    Parameters
    ----------
    target : str, dict or tvm.target.Target
        A target tag (``"nvidia/nvidia-h100"``), a JSON dict (``{"kind": "cuda", "arch":
        "sm_90"}``) or ``"llvm"``.
    database : str, os.PathLike or tvm.s_tir.meta_schedule.Database, optional
        Tuning logs to apply before the defaults.
    """
    target = parse_target(target)
    backend = _backend(target)
    if database is not None:
        load_database(database)  # fail now, with the path in the message, not mid-compile

    @tvm.transform.module_pass(opt_level=0, name="ComFusePipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential(
                backend.library_dispatch_passes(target)
                + fusion_passes(target)
                + schedule_passes(target, database)
                + backend.dataflow_lower_passes(target)
                + backend.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline
