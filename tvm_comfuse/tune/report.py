"""Which configuration each tuning record is: the rule's space, decoded from the logs.

A ``gemm_reduce`` record on a GPU is one of the rule's configurations (its trace replays the
rule's schedule), but the trace does not name it. This re-schedules the task with every
configuration of the space and matches the results (a ``wgmma_postnorm`` record names its
configuration in its trace), so a tuning run can be read as "config X
took Y µs" — what is needed to choose per-architecture defaults in ``schedules/``.

CLI: ``python -m tvm_comfuse.tune.report tuning_logs/cuda-sm_90a/* --out report.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from ..pipeline import load_database, register_tensor_intrinsics
from ..schedule import GemmRowTile
from ..target import parse_target
from . import hopper
from .logs import FAILED_SECS, META_FILE, RECORD_FILE, WORKLOAD_FILE, mean_secs
from .representative import config_of


def _in_measured_order(work_dir: str):
    """The records of a log directory in the order they were measured (the database's own
    listing is sorted by time)."""
    with open(os.path.join(work_dir, WORKLOAD_FILE), encoding="utf-8") as f:
        workloads = [ms.database.Workload.from_json(json.loads(line)) for line in f if line.strip()]
    with open(os.path.join(work_dir, RECORD_FILE), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                index, record = json.loads(line)
                yield ms.database.TuningRecord.from_json(record, workloads[index])


def _mean_us(rec) -> float | None:
    """A record's mean measured time in us, or None for a failed build or run."""
    secs = mean_secs(rec.run_secs)
    return secs * 1e6 if secs < FAILED_SECS else None


def decode(work_dir: str) -> dict:
    """``{"workload", "target", "tasks": [{"kind", "default", "records": [{"us", "trial",
    "config"}], "best_trial", "default_over_best"}]}`` for one work dir: a task per tuned kernel
    (a directory may hold the wgmma kernel's records and the mma.sync rule's), its records fastest
    first; ``trial`` is a record's place in the order it was measured (1 = first), ``config``
    None for a record that is not one of the space's configurations."""
    with open(os.path.join(work_dir, META_FILE), encoding="utf-8") as f:
        target = parse_target(json.load(f)["target"])
    load_database(work_dir, target)  # checks the logs, registers the intrinsics their traces name
    tasks, spaces = {}, {}
    for rec in _in_measured_order(work_dir):
        func = rec.workload.mod
        key = tvm_ffi.structural_hash(func)
        desc = hopper.description_of(func)
        if key not in spaces:  # every configuration listed (or scheduled) once per task, not once per record
            spaces[key] = desc.configs() if desc is not None else GemmRowTile().scheduled(s_tir.Schedule(func), target)
            first = spaces[key][0] if spaces[key] else None
            default = first if desc is not None else (first[0] if first else None)
            tasks[key] = {"kind": desc.kind if desc is not None else "gemm_reduce",
                          "default": dataclasses.asdict(default) if default else None, "records": []}
        # the Hopper kernel's records name their configuration; the rule's are matched by schedule
        match = hopper.config_of(rec.trace, desc.family) if desc is not None else config_of(rec.trace, func, target, spaces[key])
        us = _mean_us(rec)
        us = round(us, 2) if us is not None else None
        rows = tasks[key]["records"]
        rows.append({"us": us, "trial": len(rows) + 1, "config": dataclasses.asdict(match) if match else None})
    for task in tasks.values():
        rows = task["records"]
        rows.sort(key=lambda r: float("inf") if r["us"] is None else r["us"])
        best = rows[0]["us"] if rows else None
        at_default = next((r["us"] for r in rows if r["config"] == task["default"]), None)
        task["best_trial"] = rows[0]["trial"] if best is not None else None
        task["default_over_best"] = round(at_default / best, 3) if best and at_default else None
    return {"workload": os.path.basename(os.path.normpath(work_dir)), "target": str(target.attrs.get("arch", "")),
            "tasks": list(tasks.values())}


def best_so_far(work_dir: str) -> dict:
    """``{task: [best us after trial 1, 2, ...]}`` for any MetaSchedule log directory:
    ``comfuse tune``'s, or the vanilla MetaSchedule logs ``comfuse bench --vanilla-logs`` keeps
    (notebook 04 plots both against trials); inf until a trial of the task ran. MetaSchedule keeps
    no task name, so a task is named by its kernel (the Hopper kernels: ``wgmma_postnorm``, ...)
    or by its PrimFunc's blocks (``T_layer_norm``, ``matmul+T_add+T_add``)."""
    register_tensor_intrinsics(os.path.join(work_dir, RECORD_FILE))  # the traces name them
    curves, names = {}, {}
    for rec in _in_measured_order(work_dir):
        key = tvm_ffi.structural_hash(rec.workload.mod)
        if key not in names:
            names[key] = _task_name(rec.workload.mod, names.values())
        us = _mean_us(rec)
        us = us if us is not None else float("inf")
        curve = curves.setdefault(names[key], [])
        curve.append(min(us, curve[-1]) if curve else us)
    return curves


def _task_name(mod, taken) -> str:
    """A task's name for :func:`best_so_far`, numbered where two tasks would share one."""
    desc = hopper.description_of(mod)
    if desc is not None:
        name = desc.kind
    else:
        sch = s_tir.Schedule(mod)
        name = "+".join(sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root")))
    taken = list(taken)
    return name if name not in taken else f"{name} ({sum(t.startswith(name) for t in taken) + 1})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_comfuse.tune.report", description=__doc__.split("\n")[0])
    parser.add_argument("work_dirs", nargs="+", help="comfuse tune work directories")
    parser.add_argument("--out", help="write the decoded records as JSON")
    parser.add_argument("--top", type=int, default=5, help="records to print per task (default 5)")
    args = parser.parse_args(argv)
    reports = [decode(d) for d in args.work_dirs]
    for r in reports:
        for task in r["tasks"]:
            rows = task["records"]
            failed = sum(row["us"] is None for row in rows)
            print(f"{r['workload']} ({r['target']}, {task['kind']}): {len(rows)} records, {failed} failed, best at trial "
                  f"{task['best_trial']}, untuned default "
                  + (f"{task['default_over_best']}x the best" if task["default_over_best"] else "not measured"))
            for row in rows[:args.top] + [row for row in rows[args.top:] if row["config"] == task["default"]]:
                mark = "  <- default" if row["config"] == task["default"] else ""
                print(f"  {row['us'] if row['us'] is not None else 'failed':>10} us  trial {row['trial']:>3}  {row['config']}{mark}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
