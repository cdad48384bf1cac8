"""The tuning tasks of a module: the PrimFuncs ComFuse fused, as compile time will see them.

Tasks are extracted from the module after :func:`tvm_comfuse.pipeline.fusion_passes`, with
MetaSchedule's own extractor, so each task's IRModule is exactly what
``MetaScheduleApplyDatabase`` looks up when ``get_pipeline(target, database=DIR,
hopper=False)`` compiles the same module: a record tuned here is a record found there.

What MetaSchedule tunes: on sm_90 targets (where ``get_pipeline`` runs post-norm groups as the
Hopper wgmma kernel by default) each group that kernel takes is a ``wgmma_postnorm`` task, its
configurations the space (:mod:`.hopper`); every other fused group is a task of the gemm_reduce
or gemm_elementwise rule's space (and, with ``include_vanilla``, the stock rules' for the
rest). ``hopper=False`` tunes the portable mma.sync rule for every group instead, what
``get_pipeline(target, hopper=False)`` compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..pipeline import fusion_passes
from ..transform import FuseComputeMemory
from ..transform.fuse_compute_memory import KIND_ATTR
from ..transform.offload_hopper import taken_groups, uses_hopper
from . import hopper

#: Task kind of PrimFuncs that ComFuse did not fuse (tuned only with ``include_vanilla``).
VANILLA = "vanilla"


@dataclass
class Task:
    """One tuning task: a PrimFunc (as ``task.mod``), its ComFuse kind and call-site weight."""

    name: str
    kind: str
    mod: tvm.IRModule
    weight: int
    #: The symbolic PrimFunc this task is the bound copy of (``comfuse tune --bind``), if any.
    symbolic: object = None


def fused_module(mod: tvm.IRModule, target: tvm.target.Target, hopper: bool | None = False) -> tvm.IRModule:
    """``mod`` after ComFuse's fusion (and the vanilla fusion of the rest), before scheduling;
    with ``hopper`` the groups the wgmma kernel takes are calls of it (not built here)."""
    with target:
        return tvm.transform.Sequential(fusion_passes(target, hopper, build=lambda *_: None))(mod)


def hopper_tasks(mod: tvm.IRModule, target: tvm.target.Target) -> list[Task]:
    """A ``wgmma_postnorm`` task per distinct post-norm group the Hopper kernel takes (weighted
    by its groups: a model's layers share one)."""
    with target:
        grouped = FuseComputeMemory(target=target, hopper=True)(mod)
    tasks = {}
    for gv, func, found in taken_groups(grouped):
        task_mod = hopper.workload(func, hopper.describe(found))
        key = tvm_ffi.structural_hash(task_mod)
        if key in tasks:
            tasks[key].weight += 1
        else:
            tasks[key] = Task(gv.name_hint, hopper.KIND, task_mod, 1)
    return list(tasks.values())


def extract_tasks(mod: tvm.IRModule, target: tvm.target.Target, include_vanilla: bool = False,
                  hopper: bool | None = None) -> list[Task]:
    """The fused PrimFuncs of ``mod`` (and, with ``include_vanilla``, all the others); the
    Hopper kernel's groups first where ``hopper`` (None: on sm_90 targets)."""
    use = uses_hopper(target, hopper)
    tasks = hopper_tasks(mod, target) if use else []
    for extracted in ms.relax_integration.extract_tasks(fused_module(mod, target, use), target):
        func = extracted.dispatched[0]["main"]
        kind = func.attrs.get(KIND_ATTR) if func.attrs is not None else None
        if kind is None and not include_vanilla:
            continue
        tasks.append(Task(extracted.task_name, str(kind) if kind is not None else VANILLA, extracted.dispatched[0], int(extracted.weight)))
    return tasks
