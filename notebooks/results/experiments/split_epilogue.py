"""The split post-norm's epilogue where one wave of tiles is all there is (issue 3's BERT shapes).

Why: at N <= 1024 the split's GEMM runs one tile a CTA, one wave (128 CTAs at 4096 x 3072 ->
768), so its epilogue is exposed: nothing of the next tile runs beside it. On the H100 (session
20, ``session20-h100-2026-12-05/split-norm-breakdown-bert-2cf77ac.json``) BERT-base's FFN2 took
27.5 us as a plain GEMM, 30.2 with the bias and residual (each thread loading its residual after
the mainloop) and 32.2 with the row statistics too (each thread reading its staged values back
twice), then 4.0 for the norm kernel: 36.2 against torch.compile's 33.4. Two changes:

- ``stats``: the statistics summed as the values are staged, one pass in registers
  (``wgmma_elementwise.statistics``, session 21), not read back;
- ``staged``: the one-wave tiles on the persistent kernel, one tile a CTA (``persistent=True``),
  whose ``stage_tiles`` loads the residual by TMA into its staging buffers while the mainloop runs
  (the persistent default since session 20), on the deepest ring that fits beside them.

Contenders per shape, one process: cuBLAS's GEMM alone and torch.compile; the cluster kernel
where it takes the shape; the split on session 20's default configuration (``one_tile`` at one
wave, else ``persistent``) and ``staged``, each built by two versions of the package: ``new``,
the one on the path, and ``head``, a copy of another version placed beside this script as
``tvm_comfuse_head`` (not committed; skipped where absent); the plain GEMM. Prediction (H100):
the statistics' cost falls from ~2 us to under 1 and staging takes ~2 us off the residual's
2.7, so FFN2 at BERT-base ~33 us (torch.compile 33.4) and at BERT-large ~52 (53.0).

Outcome (H100, session 21, ``session21-h100-2026-12-05/split-epilogue-402b508.json``: ``new`` is
commit 402b508 with both changes, ``head`` 878958e without; device us, all correct): refuted.
The GEMM kernel with its chain and statistics, one-pass against read back (one tile a CTA,
else persistent): 32.2 / 32.1 at BERT-base's FFN2, 51.9 / 50.2 at BERT-large's, 19.3 / 19.4
and 11.9 / 11.9 at the attention outputs, 451.2 / 456.2 at gpt-4k, 42.2 / 41.8 at 16384 x 256 ->
1024; staged against one tile a CTA (``head``): 31.9 / 32.1 at FFN2-base, 18.2 / 19.4 at 4096 x
1024 -> 1024, 11.3 / 11.9 at 4096 x 768 -> 768, but 54.3 / 50.2 at BERT-large's FFN2, whose 128
x 256 tiles keep three ring stages beside the staging buffers, not four. The
plain GEMM took 27.9 and 49.0: what the chain and statistics add at FFN2-base (4.2 us) is
neither the statistics' shared-memory reads nor the residual's loads. Both changes were
reverted; the split still loses to torch.compile at BERT-base's FFN2 (36.0 against 34.1) and the
cluster kernel (37.1) too. The configurations stay in the GPU tests (valid, tunable).

Run: ``bash .ci/gpu-run notebooks/results/experiments/split_epilogue.py`` (``$OUT/split-epilogue.json``).
"""

import dataclasses
import sys

import torch

from split_norm import split  # the same directory: sys.path[0] when run as a script
from wgmma_gemm import cluster_cases, measure, save

from tvm_comfuse.schedule import split_norm as sn, wgmma_postnorm as wp
from tvm_comfuse.schedule.wgmma_elementwise import Elementwise, wgmma_elementwise

try:
    from tvm_comfuse_head.schedule import split_norm as head  # session 20's package, copied beside this script
except ImportError:
    head = None

#: BERT-base's FFN2 and attention output, BERT-large's, then shapes whose split is persistent anyway
SHAPES = [(4096, 3072, 768), (4096, 4096, 1024), (4096, 1024, 1024), (4096, 768, 768), (16384, 256, 1024), (8192, 4096, 4096)]


def variants(m, n, k, spec):
    """``(name, config)`` of the split's GEMM to time: session 20's default (``one_tile`` where
    one wave takes the tiles, else ``persistent``) and, at one wave, the same tile on persistent
    CTAs of one tile with the residual staged, on the deepest ring that fits (``staged``)."""
    cfg = dataclasses.replace(sn.config(m, n, k, spec), persistent=False, stage_tiles=False, group_rows=0)
    if sn.problems(m, n, k, spec, cfg) or m // cfg.bm * (n // cfg.bn) > wp.SM_COUNT:  # more than one wave: persistent
        return [("persistent", sn.config(m, n, k, spec))]
    cfg = dataclasses.replace(cfg, stages=4)
    found = [("one_tile", cfg if not sn.problems(m, n, k, spec, cfg) else sn.config(m, n, k, spec))]
    for stages in (4, 3):
        looped = dataclasses.replace(cfg, persistent=True, stage_tiles=True, stages=stages)
        if not sn.problems(m, n, k, spec, looped):
            return found + [("staged", looped)]
    return found


def main():
    rows = []
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a] or SHAPES
    for m, k, n, spec, inputs, ref, base, out in cluster_cases(shapes, rows):
        for name, cfg in variants(m, n, k, spec):
            for tag, mod in (("head", head), ("new", sn)):
                if mod is not None:  # the configuration as the module's own class
                    mcfg = type(mod.config(m, n, k, mod.PostNorm.suite("float16")))(**dataclasses.asdict(cfg))
                    row = split(m, n, k, mod.PostNorm.suite("float16"), mcfg, inputs, out, ref, base, sn=mod,
                                contender=f"split_{tag}_{name}")
                    row["default"] = mcfg == mod.config(m, n, k, mod.PostNorm.suite("float16"))
                    rows.append(row)
        cfg = dataclasses.replace(variants(m, n, k, spec)[0][1], stage_tiles=False)  # (no tile operand to stage)
        row = measure(dict(base, contender="gemm_plain", config=dataclasses.asdict(cfg)),
                      lambda: wgmma_elementwise(m, n, k, Elementwise(out_dtype="float16"), cfg),  # noqa: B023
                      inputs[:2], torch.empty(m, n, device="cuda", dtype=torch.float16), inputs[0].float() @ inputs[1].float().T)
        print(f"  gemm_plain {cfg}: {row.get('kernel_us', row.get('error'))}", flush=True)
        rows.append(row)
        save("split-epilogue.json", rows)


if __name__ == "__main__":
    main()
