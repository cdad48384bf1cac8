"""Tuning at a representative size: records measured with M bound serve a module whose M is symbolic.

Why: serving graphs have a symbolic batch x sequence (``R.Tensor(("n", 768))``). MetaSchedule
measures concrete shapes (a symbolic task crashes inside its search), and a record is found by
the exact PrimFunc, so a symbolic group could neither be tuned nor find a record. The
gemm_reduce rule's configurations do not depend on M (a symbolic M is offered those of any
static one, and is correct for every M), so:

* ``comfuse tune FILE --bind n=4096`` tunes the module with ``n`` bound to 4096, searching only
  the configurations the symbolic group can also be scheduled with (:func:`with_symbolic`;
  some recompute rows from a register tile, which needs a static M), and records the binding
  in the log directory's ``comfuse_meta.json``;
* ``get_pipeline(target, database=DIR)`` binds the same values to find each symbolic group's
  records (:func:`counterparts`), reads which of the rule's configurations they are
  (:func:`config_of`), and schedules the symbolic group with the fastest one that applies
  (:func:`apply_records`): tuned for 4096, correct for every n.

On CPU targets MetaSchedule's records are loop transformations of the static function, not
configurations: a symbolic group there compiles untuned (correct, as vanilla TVM's).
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from ..errors import ComFuseError
from ..schedule import GemmRowTile
from ..transform.fuse_compute_memory import KIND_ATTR

LOG = logging.getLogger("tvm_comfuse")


def symbolic_vars(mod: tvm.IRModule) -> list[str]:
    """Names of the symbolic shape variables of the module's Relax functions."""
    names = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            names += [str(v.name) for v in relax.analysis.defined_symbolic_vars(func) if str(v.name) not in names]
    return names


def parse_bind(items) -> dict:
    """``["n=4096", ...]`` (the CLI's ``--bind``) as ``{"n": 4096}``, or a clear error."""
    bind = {}
    for item in items or []:
        name, sep, value = str(item).partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise ComFuseError(f"--bind {item!r}: expected VAR=VALUE with a positive integer value, e.g. --bind n=4096")
        bind[name.strip()] = int(value)
    return bind


def bind_rows(mod: tvm.IRModule, bind: dict) -> tvm.IRModule:
    """``mod`` with the symbolic variables of ``bind`` replaced by its values; every symbolic
    variable must be bound (MetaSchedule measures concrete shapes only)."""
    names = symbolic_vars(mod)
    unknown = sorted(set(bind) - set(names))
    if unknown:
        raise ComFuseError(f"--bind names {unknown}, which the module does not have (its symbolic shape variables: "
                           f"{names or 'none'})")
    free = [n for n in names if n not in bind]
    if free:
        example = " ".join(f"--bind {n}=4096" for n in free)
        raise ComFuseError(f"the module's shapes are symbolic in {free}: tune at a representative size, e.g. {example} "
                           "(compiles from these logs apply the tuned configurations to every size)")
    return relax.transform.BindSymbolicVars(bind)(mod) if bind else mod


def with_symbolic(tasks: list, mod: tvm.IRModule, target: tvm.target.Target) -> None:
    """Give each task tuned at the representative size its symbolic group of ``mod`` (the
    module before binding): the tuner keeps to configurations that group can use."""
    from .tasks import fused_module  # pylint: disable=import-outside-toplevel

    groups = {gv.name_hint: f for gv, f in fused_module(mod, target).functions_items() if isinstance(f, tirx.PrimFunc)}
    for task in tasks:
        task.symbolic = groups.get(task.name)


def counterparts(mod: tvm.IRModule, target: tvm.target.Target, bind: dict) -> dict:
    """``{group name: the task module its records were tuned on}`` for the fused groups of
    ``mod`` (before fusion) that ``bind`` makes static; empty if ``bind`` names none of its
    variables (logs tuned for another module)."""
    from .tasks import extract_tasks  # pylint: disable=import-outside-toplevel  (tasks imports the pipeline)

    bind = {k: v for k, v in (bind or {}).items() if k in symbolic_vars(mod)}
    if not bind:
        return {}
    bound = relax.transform.BindSymbolicVars(bind)(mod)
    return {task.name: task.mod for task in extract_tasks(bound, target, hopper=False)}  # symbolic groups: the rule's


def config_of(trace, func: tirx.PrimFunc, target, space: list | None = None):
    """Which of the gemm_reduce rule's configurations ``trace`` (a record's, tuned on
    ``func``) is, or None; ``space`` (the rule's ``scheduled`` pairs for ``func``) if known."""
    space = GemmRowTile().scheduled(s_tir.Schedule(func), target) if space is None else space
    tuned = s_tir.Schedule(func)
    trace.apply_to_schedule(tuned, remove_postproc=False)
    return next((cfg for cfg, sch in space if tvm_ffi.structural_equal(sch.mod, tuned.mod)), None)


def apply_records(mod: tvm.IRModule, db, target: tvm.target.Target, static: dict) -> tuple[tvm.IRModule, int]:
    """Schedule each unscheduled fused group of ``mod`` named in ``static`` with the
    configuration of its counterpart's record in ``db``: ``(module, groups scheduled)``."""
    out, done = mod.clone(), 0
    for gv, func in mod.functions_items():
        attrs = func.attrs or {}
        if not isinstance(func, tirx.PrimFunc) or gv.name_hint not in static or KIND_ATTR not in attrs or attrs.get("tirx.is_scheduled", False):
            continue
        sch = _fastest_that_applies(db, gv.name_hint, static[gv.name_hint], func, target)
        if sch is None:
            LOG.warning("ComFuse: %s: no configuration tuned at the representative size applies to its symbolic shapes", gv.name_hint)
            continue
        out[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        done += 1
    return out, done


def _fastest_that_applies(db, name: str, task: tvm.IRModule, func: tirx.PrimFunc, target, limit: int = 64):
    """The symbolic ``func`` scheduled with the fastest configuration recorded for ``task``
    that applies to it, or None. Not always the fastest record's: on the H200 the best of 16
    trials at n = 4096 recomputed rows from a C tile kept in registers, which needs M a
    static multiple of the row tile (session 10, ``representative-tuning.json``)."""
    if not db.has_workload(task):
        return None
    space = GemmRowTile().scheduled(s_tir.Schedule(task["main"]), target)
    tried = []
    for record in db.get_top_k(db.commit_workload(task), limit):  # an existing workload: nothing is written
        cfg = config_of(record.trace, task["main"], target, space)
        if cfg is None or cfg in tried:
            continue
        tried.append(cfg)
        ((_, sch),) = GemmRowTile().scheduled(s_tir.Schedule(func), target, configs=[cfg], quiet=True)
        if sch is not None:
            LOG.info("ComFuse: %s takes the configuration recorded at %.1f us at the representative size: %s", name,
                     sum(float(s) for s in record.run_secs) / len(record.run_secs) * 1e6, cfg)
            return sch
    return None
