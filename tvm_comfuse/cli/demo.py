"""``comfuse demo``: the main job. Fuse, check, generate CUDA, and time on a GPU if there is one.

On any machine: build a post-norm block and a small HuggingFace BERT encoder, print their
fusion groups, compile them with ``llvm`` through ComFuse and through vanilla TVM, check both
against the reference, and generate the CUDA source of the ComFuse build for sm_90 (compiled
with nvcc when it is installed). With a CUDA GPU it also times vanilla TVM against ComFuse on
the GPU. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import tvm

from . import subcommand
from .. import codegen, runtime, workloads
from ..transform import analyze
from ..graph import format_groups

EXAMPLES = """examples:
  comfuse demo                        CPU checks + CUDA codegen (+ GPU timing with a GPU)
  comfuse demo --out build/demo       also write each workload's CUDA source there
  comfuse demo --skip-bert            only the post-norm block (no torch/transformers needed)
"""

#: Max |ComFuse - reference| accepted per dtype (fp32 storage on CPU; see tests for fp16/bf16).
TOLERANCE = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 1e-1}


@dataclass
class Case:
    """One demo workload: a module, its inputs and the reference outputs."""

    name: str
    mod: tvm.IRModule
    inputs: list
    reference: list


def add_parser(sub) -> None:
    p = subcommand(sub, "demo", "fuse, check and generate CUDA for a post-norm block and a small BERT encoder", __doc__, EXAMPLES, run)
    p.add_argument("--out", help="directory to write the generated CUDA source (<workload>.cu)")
    p.add_argument("--arch", default="sm_90", help="CUDA architecture for code generation (default sm_90)")
    p.add_argument("--skip-bert", action="store_true", help="skip the HuggingFace BERT encoder")


def _cases(skip_bert: bool) -> list:
    mod = workloads.post_norm(200, 96, 80, "float32", "layer_norm", linear=True, residual_out=True)
    args = workloads.random_inputs(mod, seed=0)
    cases = [Case("post-norm LN(x@w.T+b+r)", mod, args, workloads.post_norm_reference(args, "layer_norm", linear=True, residual_out=True))]
    if skip_bert:
        return cases
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("note: torch/transformers are not installed, BERT skipped (pip install 'tvm-comfuse[models]')")
        return cases
    bert, params, module, example = workloads.bert_encoder(layers=2, hidden=128, heads=4, batch=2, seq=32)
    with torch.no_grad():
        ref = module(example).numpy().astype(np.float64)
    cases.append(Case("BERT encoder (2 layers, h=128)", bert, [example.numpy()] + params, [ref]))
    return cases


def _check(case: Case, comfuse: bool) -> float:
    ex = runtime.compile_module(case.mod, "llvm", comfuse=comfuse)
    dev = tvm.cpu()
    out = runtime.run(ex, runtime.to_device(case.inputs, runtime.param_dtypes(case.mod), dev), dev)
    return max(float(np.abs(o - r).max()) for o, r in zip(out, case.reference))


def _cuda(case: Case, groups: list, arch: str, out_dir: str | None) -> str:
    ex = runtime.compile_module(case.mod, {"kind": "cuda", "arch": arch})
    source = codegen.cuda_source(ex)
    kernels = codegen.kernel_names(source)
    names = {g.name for g in groups if g.fused}
    fused = [k for k in kernels if any(k.startswith(n + "_kernel") for n in names)]
    verdict = f"{len(kernels)} kernels, {len(fused)} of them for the {len(names)} fused groups"
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "".join(c if c.isalnum() else "_" for c in case.name) + ".cu")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        verdict += f", written to {path}"
    if codegen.have_nvcc():
        codegen.compile_with_nvcc(source, arch)
        verdict += f", nvcc {arch}: ok"
    else:
        verdict += ", nvcc not found: not compiled"
    return verdict


def _time_gpu(case: Case) -> str:
    target = tvm.target.Target.from_device(tvm.cuda(0))
    dev = tvm.cuda(0)
    times = {}
    for comfuse in (False, True):
        ex = runtime.compile_module(case.mod, target, comfuse=comfuse)
        vm = tvm.relax.VirtualMachine(ex, dev)
        inputs = runtime.to_device(case.inputs, runtime.param_dtypes(case.mod), dev)
        timer = vm.time_evaluator("main", dev, number=20, repeat=5, min_repeat_ms=50)
        times[comfuse] = float(np.median(timer(*inputs).results)) * 1e6
    return f"vanilla {times[False]:.1f} us, ComFuse {times[True]:.1f} us ({times[False] / times[True]:.2f}x)"


def run(args) -> int:
    ok = True
    for case in _cases(args.skip_bert):
        print(f"\n== {case.name}")
        groups = analyze(case.mod)
        print(format_groups(groups))
        start = time.perf_counter()
        err, vanilla_err = _check(case, True), _check(case, False)
        passed = err <= TOLERANCE["float32"]
        ok &= passed
        print(
            f"llvm: max |ComFuse - reference| = {err:.2e}, vanilla TVM {vanilla_err:.2e} "
            f"[{'PASS' if passed else 'FAIL'}] ({time.perf_counter() - start:.1f}s)"
        )
        try:
            print(f"cuda {args.arch}: {_cuda(case, groups, args.arch, args.out)}")
        except RuntimeError as err_:  # nvcc failure: report it and fail the run
            ok = False
            print(f"cuda {args.arch}: FAIL: {str(err_).splitlines()[0]}")
        if tvm.cuda(0).exist:
            print(f"gpu {tvm.cuda(0).device_name}: {_time_gpu(case)}")
        else:
            print("gpu: none found, timing skipped")
    print("\ndemo: " + ("all checks passed" if ok else "SOME CHECKS FAILED"))
    return 0 if ok else 1
