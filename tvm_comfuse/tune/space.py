"""The search space of a task, chosen per task kind and target family.

On GPUs a gemm_reduce task searches the ComFuse rule's own space
(:meth:`tvm_comfuse.schedule.GemmRowTile.space`: one complete schedule per configuration
that fits the target, so nothing is sampled that cannot build), a wgmma_postnorm task the
Hopper kernel's configurations (:mod:`.hopper`); every other task gets MetaSchedule's
default space for the target.

MetaSchedule's default LLVM rules crash on some fused gemm_reduce PrimFuncs (AutoInline
followed by MultiLevelTiling's consumer fusion fails ``reverse_compute_at`` because the
row reduction reads blocks outside the tile). So a space is validated by generating its
design spaces once, and the fallback, the defaults without AutoInline, is used instead when
that fails (tried first on CPU for ComFuse kinds: a failing probe takes ~25 s to render
its error); the summary records which space each task used.
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms

from ..graph.group import GEMM_REDUCE
from ..schedule import GemmRowTile
from ..target import is_gpu
from . import hopper

def _row_tile_space(target: tvm.target.Target, symbolic: tirx.PrimFunc | None = None) -> ms.space_generator.SpaceGenerator:
    """The gemm_reduce rule's configurations as a MetaSchedule space. Its schedules are
    complete (threads bound, tensorised), so no further rules, postprocessors or mutators.
    With ``symbolic`` (the task is its bound copy: ``comfuse tune --bind``), only the
    configurations that also apply to it: a record is worth keeping only if the compile of
    the symbolic module can use it (on the H200 the fastest of 16 trials could not, session 10)."""
    rule = GemmRowTile()

    def space(sch):
        pairs = rule.scheduled(sch, target)
        if symbolic is None:
            return [done for _, done in pairs]
        usable = rule.scheduled(s_tir.Schedule(symbolic), target, configs=[cfg for cfg, _ in pairs], quiet=True)
        return [done for (_, done), (_, sym) in zip(pairs, usable) if sym is not None]

    return ms.space_generator.ScheduleFn(space, sch_rules=[], postprocs=[], mutator_probs={})


#: ``(kind, "gpu"|"cpu") -> factory(target) -> SpaceGenerator``: ComFuse's own spaces.
SPACES: dict[tuple[str, str], Callable[[tvm.target.Target], ms.space_generator.SpaceGenerator]] = {
    (GEMM_REDUCE, "gpu"): _row_tile_space,
    **{(kind, "gpu"): hopper.space for kind in hopper.KINDS},
}


def _family(target: tvm.target.Target) -> str:
    return "gpu" if is_gpu(target) else "cpu"


def _without_auto_inline(target: tvm.target.Target) -> ms.space_generator.SpaceGenerator:
    rules = ms.schedule_rule.ScheduleRule.create("llvm" if not is_gpu(target) else "cuda")
    return ms.space_generator.PostOrderApply(
        sch_rules=[r for r in rules if not isinstance(r, ms.schedule_rule.AutoInline)]
    )


def candidates(kind: str, target: tvm.target.Target, symbolic: tirx.PrimFunc | None = None) -> list[tuple[str, Callable]]:
    """``(label, factory)`` spaces to try for a task of ``kind``, best first (``symbolic``:
    the symbolic function a bound task stands for, see :func:`_row_tile_space`)."""
    out = []
    if (kind, _family(target)) in SPACES:
        factory = SPACES[(kind, _family(target))]
        out.append((f"comfuse-{kind}", (lambda t: factory(t, symbolic)) if symbolic is not None else factory))
    if kind in hopper.KINDS:  # the kernel is not a schedule of its task's PrimFunc: no stock space applies
        return out
    defaults = [("default", lambda _t: "post-order-apply"), ("default-no-autoinline", _without_auto_inline)]
    if kind != "vanilla" and not is_gpu(target):
        defaults.reverse()  # the plain default crashes on fused LLVM functions, and failing costs ~25 s
    out.extend(defaults)
    return out


def space_for(kind: str, mod: tvm.IRModule, target: tvm.target.Target, symbolic: tirx.PrimFunc | None = None):
    """``(label, space generator)``: the first candidate that can generate a design space for ``mod``."""
    errors = []
    for label, factory in candidates(kind, target, symbolic):
        space = factory(target)
        ctx = ms.TuneContext(mod=mod, target=target, space_generator=space, task_name="probe", num_threads=1)
        try:
            if ctx.generate_design_space():
                return label, factory(target)  # a fresh generator: the probe's is bound to its context
        except Exception as err:  # pylint: disable=broad-except  (TVM ScheduleError / TVMError)
            errors.append(f"{label}: {str(err).strip().splitlines()[-1][:200]}")
    return None, errors
