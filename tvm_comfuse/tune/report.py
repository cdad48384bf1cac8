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

from ..pipeline import load_database
from ..schedule import GemmRowTile
from ..schedule.wgmma_space import configs
from ..target import parse_target
from . import hopper
from .logs import META_FILE
from .representative import config_of


def decode(work_dir: str) -> dict:
    """``{"workload", "target", "default", "records": [{"us", "config"}]}`` for one work dir
    (fastest first; ``config`` None for a record that is not one of the rule's configurations)."""
    with open(os.path.join(work_dir, META_FILE), encoding="utf-8") as f:
        target = parse_target(json.load(f)["target"])
    db = load_database(work_dir, target)
    rows, default, spaces = [], None, {}
    for rec in db.get_all_tuning_records():
        func = rec.workload.mod
        desc = hopper.description_of(func)
        if desc is not None:  # the Hopper kernel's records name their configuration
            match = hopper.config_of(rec.trace)
            default = default or configs(*desc.mnk, desc.spec)[0]
        else:
            key = tvm_ffi.structural_hash(func)
            if key not in spaces:  # every configuration scheduled once per task, not once per record
                spaces[key] = GemmRowTile().scheduled(s_tir.Schedule(func), target)
                default = default or (spaces[key][0][0] if spaces[key] else None)
            match = config_of(rec.trace, func, target, spaces[key])
        secs = [float(s) for s in rec.run_secs or []]
        rows.append({"us": round(sum(secs) / len(secs) * 1e6, 2) if secs else None,
                     "config": dataclasses.asdict(match) if match else None})
    rows.sort(key=lambda r: float("inf") if r["us"] is None else r["us"])
    return {"workload": os.path.basename(os.path.normpath(work_dir)), "target": str(target.attrs.get("arch", "")),
            "default": dataclasses.asdict(default) if default else None, "records": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_comfuse.tune.report", description=__doc__.split("\n")[0])
    parser.add_argument("work_dirs", nargs="+", help="comfuse tune work directories")
    parser.add_argument("--out", help="write the decoded records as JSON")
    args = parser.parse_args(argv)
    reports = [decode(d) for d in args.work_dirs]
    for r in reports:
        default = r["default"]
        print(f"{r['workload']} ({r['target']}), untuned default {default}")
        for row in r["records"]:
            mark = "  <- default" if row["config"] == default else ""
            print(f"  {row['us'] if row['us'] is not None else 'failed':>10} us  {row['config']}{mark}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
