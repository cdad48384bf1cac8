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
from .tasks import fused_module

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


def applied_from_database(mod: tvm.IRModule, target, database) -> tuple[int, int]:
    """``(taken from the logs, total)`` PrimFuncs when ``mod`` compiles with ``database``.

    Runs the pipeline's fusion and database stages (what ``get_pipeline(target, database)``
    runs before lowering) and counts the PrimFuncs MetaScheduleApplyDatabase marked scheduled.
    """
    from ..target import parse_target  # pylint: disable=import-outside-toplevel

    target = parse_target(target)
    with target:
        scheduled = tvm.transform.Sequential(schedule_passes(target, database)[:1])(fused_module(mod, target))
    funcs = [f for _, f in scheduled.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return count_scheduled(funcs), len(funcs)



