"""What a tuning run leaves for people: ``summary.txt``, and the "tuned vs default" count.

The logs are the truth and are never rewritten; ``summary.txt`` is regenerated from them
after every run (best latency and record counts over all runs so far) plus what this run
measured (wall time, build-error rate), so it is always consistent with the logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm


from ..pipeline import count_scheduled, schedule_passes
from .logs import FAILED_SECS, WorkDir
from .tasks import fused_module, hopper_tasks

SUMMARY_FILE = "summary.txt"


@dataclass
class TaskReport:
    """One task's part of a run."""

    name: str
    kind: str
    share: int  # trials this task should have in total
    measured: int = 0  # this run
    build_errors: int = 0  # this run
    wall_s: float = 0.0  # this run
    space: str | None = None
    error: str | None = None


def _fmt_us(secs: float | None) -> str:
    return f"{secs * 1e6:10.2f} us" if secs is not None else "         - "


def write_summary(work: WorkDir, tasks: list, reports: list, target) -> str:
    """Write ``summary.txt`` in the work directory; return its text."""
    lines = [f"comfuse tune summary: {work.path}", f"target: {target}", f"TVM {tvm.__version__}", ""]
    lines.append(f"{'task':<60} {'kind':<16} {'best':>13} {'records':>8} {'failed':>7} {'this run':>8} {'wall s':>7} {'build err':>9}  space")
    by_name = {r.name: r for r in reports}
    for task in tasks:
        secs = work.run_secs_for(task.mod)
        good = [s for s in secs if s < FAILED_SECS]
        rep = by_name.get(task.name, TaskReport(task.name, task.kind, 0))
        rate = f"{rep.build_errors / rep.measured:8.0%}" if rep.measured else "       -"
        lines.append(
            f"{task.name[:60]:<60} {task.kind:<16} {_fmt_us(min(good) if good else None):>13} {len(secs):>8} "
            f"{len(secs) - len(good):>7} {rep.measured:>8} {rep.wall_s:>7.1f} {rate:>9}  {rep.space or '-'}"
            + (f"  (not tuned: {rep.error})" if rep.error else "")
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(work.path, SUMMARY_FILE), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def applied_from_database(mod: tvm.IRModule, target, database, hopper: bool | None = None, hopper_groups=None) -> tuple[int, int]:
    """``(taken from the logs, total)`` kernels when ``mod`` compiles with ``database``: the
    Hopper kernels' groups (``hopper`` and ``hopper_groups`` as in ``get_pipeline``) with a tuned
    configuration, and
    the PrimFuncs MetaScheduleApplyDatabase marks scheduled when the pipeline's fusion and
    database stages run (what ``get_pipeline(target, database)`` runs before lowering)."""
    from ..pipeline import load_database  # pylint: disable=import-outside-toplevel
    from ..target import parse_target  # pylint: disable=import-outside-toplevel
    from ..transform.offload_hopper import uses_hopper  # pylint: disable=import-outside-toplevel
    from . import hopper as wgmma  # pylint: disable=import-outside-toplevel

    target = parse_target(target)
    use, db = uses_hopper(target, hopper), load_database(database, target)
    groups = [(task.weight, wgmma.tuned_config(db, task.mod) is not None)
              for task in (hopper_tasks(mod, target, hopper_groups) if use else [])]
    with target:
        scheduled = tvm.transform.Sequential(schedule_passes(target, db)[:1])(fused_module(mod, target, use, hopper_groups))
    funcs = [f for _, f in scheduled.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return count_scheduled(funcs) + sum(w for w, tuned in groups if tuned), len(funcs) + sum(w for w, _ in groups)
