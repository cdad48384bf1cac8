"""The tuning tasks of a module: the PrimFuncs ComFuse fused, as compile time will see them.

Tasks are extracted from the module after :func:`tvm_comfuse.pipeline.fusion_passes`, with
MetaSchedule's own extractor, so each task's IRModule is exactly what
``MetaScheduleApplyDatabase`` looks up when ``get_pipeline(target, database=DIR,
hopper=False)`` compiles the same module: a record tuned here is a record found there.

What MetaSchedule tunes is the gemm_reduce rule's design space (and, with ``include_vanilla``,
the stock rules'). The Hopper post-norm kernel, which ``get_pipeline`` uses on sm_90 by default,
is not a MetaSchedule task (its configuration follows the row width and the SM count), so tasks
are extracted with ``hopper=False``: on sm_90 the logs serve the rule, and any group the Hopper
kernel does not take.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.s_tir import meta_schedule as ms

from ..pipeline import fusion_passes
from ..transform.fuse_compute_memory import KIND_ATTR

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


def fused_module(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """``mod`` after ComFuse's fusion with the mma.sync rule's groups (and the vanilla fusion of
    the rest), before scheduling."""
    with target:
        return tvm.transform.Sequential(fusion_passes(target, hopper=False))(mod)


def extract_tasks(mod: tvm.IRModule, target: tvm.target.Target, include_vanilla: bool = False) -> list[Task]:
    """The fused PrimFuncs of ``mod`` (and, with ``include_vanilla``, all the others)."""
    tasks = []
    for extracted in ms.relax_integration.extract_tasks(fused_module(mod, target), target):
        func = extracted.dispatched[0]["main"]
        kind = func.attrs.get(KIND_ATTR) if func.attrs is not None else None
        if kind is None and not include_vanilla:
            continue
        tasks.append(Task(extracted.task_name, str(kind) if kind is not None else VANILLA, extracted.dispatched[0], int(extracted.weight)))
    return tasks
