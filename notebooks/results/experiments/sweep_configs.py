"""Time given MmaConfigs on the suite shapes, all on the same inputs (each checked against a
float32 reference first), and write ``$OUT/<name>.json``: the shared body of the
configuration experiments in this folder."""

import json
import os

from tvm_comfuse.bench import environment
from tvm_comfuse.schedule.space_check import time_space

SHAPES = [(4096, 768, 768), (4096, 3072, 768), (16384, 256, 1024), (4096, 4096, 1024)]


def sweep(name: str, configs: list, shapes=SHAPES) -> dict:
    """Time the ``configs`` that fit each shape; the first is the baseline of the printed ratios."""
    report = {"environment": environment(), "shapes": []}
    for M, K, N in shapes:
        fitting = [c for c in configs if c.fits(N, "sm_90") and (c.splits == 1 or M % c.bm == 0)]
        rows = time_space(M, K, N, configs=fitting)
        report["shapes"].append({"M": M, "K": K, "N": N, "rows": rows})
        with open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    for shape in report["shapes"]:
        base = shape["rows"][0].get("us")
        for r in shape["rows"]:
            c = r["config"]
            label = (f"bm{c['bm']} {c['warps_m']}x{c['warps_n']} st{c['stages']} S{c['splits']} vec{c['epilogue_vec']}"
                     + ("" if c.get("stage_rows", True) else " recomputed") + (f" {c['min_ctas']} CTAs/SM" if c.get("min_ctas", 1) > 1 else ""))
            us = r.get("us")
            print(f"{shape['M']}x{shape['K']}x{shape['N']} {label:48s} "
                  + (f"{us:7.1f} us  x{base / us:4.2f}  err {r['max_abs_err']:.3g}" if us and base else r.get("error", "")))
    return report
