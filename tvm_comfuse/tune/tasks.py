"""The tuning tasks of a module: the PrimFuncs ComFuse fused, as compile time will see them.

Tasks are extracted from the module after :func:`tvm_comfuse.pipeline.fusion_passes`, with
MetaSchedule's own extractor, so each task's IRModule is exactly what
``MetaScheduleApplyDatabase`` looks up when ``get_pipeline(target, database=DIR,
hopper=False)`` compiles the same module: a record tuned here is a record found there.

What MetaSchedule tunes: on sm_90 targets (where ``get_pipeline`` runs post-norm groups as the
Hopper wgmma kernel by default) each group that kernel takes is a ``wgmma_postnorm`` task, its
configurations the space (:mod:`.hopper`; a post-norm that runs split is a
``wgmma_split_gemm`` task of its GEMM), and with ``hopper_groups`` naming ``elementwise`` each
GEMM + elementwise group the Hopper kernel takes a ``wgmma_elementwise`` task (naming
``b2b``, each GEMM -> elementwise -> GEMM pair a ``wgmma_b2b`` task); every other
fused group is a task of the gemm_reduce or gemm_elementwise rule's space (and, with
``include_vanilla``, the stock rules' for the rest). ``hopper=False`` tunes the portable
mma.sync rule for every group instead, what ``get_pipeline(target, hopper=False)`` compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..pipeline import resolve_hopper_groups, fusion_passes
from ..transform import FuseComputeMemory, OffloadHopperAttention, OffloadHopperB2B, OffloadHopperPostNorm
from ..transform.fuse_compute_memory import KIND_ATTR
from ..transform.offload_hopper import postnorm_groups, uses_hopper
from ..transform.offload_hopper_b2b import planned_pairs
from ..transform.offload_hopper_elementwise import planned_groups
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


def fused_module(mod: tvm.IRModule, target: tvm.target.Target, hopper: bool | None = False, hopper_groups=None) -> tvm.IRModule:
    """``mod`` after ComFuse's fusion (and the vanilla fusion of the rest), before scheduling;
    with ``hopper`` the groups the wgmma kernels of ``hopper_groups`` take are calls of them
    (not built here)."""
    with target:
        return tvm.transform.Sequential(fusion_passes(target, hopper, build=lambda *_: None, hopper_groups=hopper_groups))(mod)


def hopper_tasks(mod: tvm.IRModule, target: tvm.target.Target, hopper_groups=None) -> list[Task]:
    """A task per distinct group a Hopper kernel of ``hopper_groups`` (``get_pipeline``'s) takes
    and tuning has a space for, weighted by its groups (a model's layers share one): the
    post-norms' ``wgmma_postnorm`` tasks, the back-to-back GEMM pairs' ``wgmma_b2b`` ones, the
    GEMM + elementwise groups' ``wgmma_elementwise`` ones (as the compile will build them: after
    the other offloads, with the layouts their tails ask for)."""
    groups = resolve_hopper_groups(hopper_groups)
    with target:
        grouped = FuseComputeMemory(target=target, hopper="post_norm" in groups or "split_norm" in groups)(mod)
    tasks = {}

    def add(name, kind, task_mod):
        key = tvm_ffi.structural_hash(task_mod)
        if key in tasks:
            tasks[key].weight += 1
        else:
            tasks[key] = Task(name, kind, task_mod, 1)

    split, norms = "split_norm" in groups, "post_norm" in groups or "split_norm" in groups
    if norms:
        for gv, func, found, kernel in postnorm_groups(grouped, split):
            # a split one's task is its GEMM with the row statistics (its norm kernel has nothing to tune)
            desc = hopper.describe_split(found) if kernel == "split" else hopper.describe(found)
            add(gv.name_hint, desc.kind, hopper.task_module(func, desc))
    noop = lambda *_: None  # noqa: E731  (rewrite the graph as the compile does, build nothing)
    before = [OffloadHopperPostNorm(target, noop, split=split)] if norms else []
    before += [OffloadHopperAttention(target, noop)] if "attention" in groups else []
    with target:
        seen = tvm.transform.Sequential(before)(grouped)
    if "b2b" in groups:
        for first, _, spec, args, mnk, leads, _, pair in planned_pairs(seen):
            func = pair()
            if func is not None:
                add(f"b2b_{first.name_hint}", "wgmma_b2b", hopper.workload(func, hopper.describe_b2b(spec, mnk, leads, len(args))))
        with target:
            seen = OffloadHopperB2B(target, noop)(seen)  # the pairs it takes are not elementwise groups
    if "elementwise" in groups:
        for gv, func, spec, roles, mnk, out_shape, _ in planned_groups(seen):
            desc = hopper.describe_elementwise(spec, roles, mnk, out_shape)
            add(gv.name_hint, desc.kind, hopper.task_module(func, desc))
    return list(tasks.values())


def extract_tasks(mod: tvm.IRModule, target: tvm.target.Target, include_vanilla: bool = False,
                  hopper: bool | None = None, hopper_groups=None) -> list[Task]:
    """The fused PrimFuncs of ``mod`` (and, with ``include_vanilla``, all the others); the
    Hopper kernels' groups first where ``hopper`` (None: on sm_90 targets; ``hopper_groups`` as
    in ``get_pipeline``)."""
    use = uses_hopper(target, hopper)
    tasks = hopper_tasks(mod, target, hopper_groups) if use else []
    for extracted in ms.relax_integration.extract_tasks(fused_module(mod, target, use, hopper_groups), target):
        func = extracted.dispatched[0]["main"]
        kind = func.attrs.get(KIND_ATTR) if func.attrs is not None else None
        if kind is None and not include_vanilla:
            continue
        tasks.append(Task(extracted.task_name, str(kind) if kind is not None else VANILLA, extracted.dispatched[0], int(extracted.weight)))
    return tasks
