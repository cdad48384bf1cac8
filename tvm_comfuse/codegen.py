"""CUDA source of compiled modules, and nvcc: how we check GPU code on machines without a GPU."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile

import tvm
from tvm.support import nvcc


def cuda_source(executable) -> str:
    """The CUDA C source of every device kernel in a compiled Relax executable ("" if none)."""
    sources, stack = [], [executable.mod]
    while stack:
        module = stack.pop()
        if module.kind == "cuda" and module.inspect_source() not in sources:
            sources.append(module.inspect_source())
        stack.extend(module.imports)
    return "\n".join(sources)


def launches(mod: tvm.IRModule, func: str = "main") -> list:
    """The kernels ``func`` of a Relax module lowered by a whole pipeline (``get_pipeline(t)(mod)``)
    launches, in order: its PrimFunc calls and its packed calls other than the VM's builtins (a
    reshape that became a view, ``vm.builtin.reshape``, launches nothing). What a graph costs in
    kernels, where ``kernel_names`` lists every kernel generated, used or not."""
    import re  # pylint: disable=import-outside-toplevel

    script = mod[func].script()
    calls = re.findall(r'R\.call_packed\("([\w.]+)"|^\s+(?:\w+: R\.\w+ = )?(\w+)\((?!.*R\.)', script, re.M)
    return [packed or prim for packed, prim in calls if not (packed or prim).startswith("vm.builtin") and (packed or prim) != "R"]


def kernel_names(source: str) -> list:
    """Names of the ``__global__`` functions in CUDA source, in order."""
    return list(dict.fromkeys(_KERNEL.findall(source)))


_KERNEL = re.compile(r"__global__\s+void\s+(?:__cluster_dims__\([\d, ]+\)\s+)?(?:__launch_bounds__\(\d+\)\s+)?(\w+)\s*\(")


def have_nvcc() -> bool:
    """True when nvcc is on PATH."""
    return shutil.which("nvcc") is not None


def compile_with_nvcc(source: str, arch: str = "sm_90", fmt: str = "cubin") -> bytes:
    """Compile CUDA source to a cubin (or ``fmt="ptx"``) for ``arch`` with nvcc; raise
    RuntimeError on failure."""
    with tvm.target.Target({"kind": "cuda", "arch": arch}):  # nvcc.compile_cuda reads it
        return bytes(nvcc.compile_cuda(source, target_format=fmt, arch=arch, compiler="nvcc"))


def ptxas_usage(source: str, arch: str = "sm_90a") -> dict:
    """What ptxas reports for the CUDA ``source`` (``nvcc -Xptxas -v``): ``registers`` per
    thread, ``spill`` bytes stored, ``smem`` bytes of static shared memory and ``serialized``,
    the codes of its wgmma performance warnings (C7514 and kin: ptxas waits for every wgmma
    group where it cannot prove the accumulators untouched in flight; session 26 met it with the
    b2b kernel's output tiles in a loop); raise RuntimeError when nvcc fails."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.cu"), "w", encoding="utf-8") as f:
            f.write(source)
        run = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", os.path.join(tmp, "k.cubin"),
                              os.path.join(tmp, "k.cu")], capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"nvcc failed: {run.stderr.strip()[-2000:]}")
    return ptxas_report(run.stderr)


def ptxas_report(text: str) -> dict:
    """:func:`ptxas_usage`'s fields read from ptxas's ``-v`` output ``text``."""
    number = lambda pattern: int(getattr(re.search(pattern, text), "group", lambda _: 0)(1))  # noqa: E731  (absent: 0)
    return {"registers": number(r"Used (\d+) registers"), "spill": number(r"(\d+) bytes spill stores"), "smem": number(r"(\d+) bytes smem"),
            "serialized": re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma", text)}


def nvdisasm() -> str | None:
    """Path of nvdisasm: on PATH, or from the ``nvidia-cuda-nvdisasm`` wheel (the ``test`` extra)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    paths = [p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))]
    return paths[0] if paths else None


def sass(cubin: bytes) -> str:
    """The SASS of a cubin (nvdisasm); raise RuntimeError without nvdisasm."""
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


_HGMMA = re.compile(r"HGMMA\.64x(\d+)x16\.F32\S*\s+R(\d+),")


def wgmma_hazards(code: str) -> list:
    """SASS instructions that touch an HGMMA accumulator register while an HGMMA group may still
    be writing it: after an HGMMA and before the next ``WARPGROUP.DEPBAR.LE gsb0, 0x0``, in
    program order. ptxas (CUDA 13.0) hoists epilogue arithmetic on the accumulators above the
    final wait when the K loop leaves a group in flight (session 8: wrong post-norm results on
    the H200); the wgmma mainloop ends with a step of its own to prevent that, and this is the check."""
    found, live = [], set()
    for line in code.splitlines():
        ins = re.sub(r"/\*[0-9a-f]+\*/", "", line.split(";")[0]).strip()
        hgmma = _HGMMA.search(ins)
        if hgmma:
            base = int(hgmma.group(2))
            live = set(range(base, base + int(hgmma.group(1)) // 2))
        elif "DEPBAR.LE gsb0, 0x0" in ins:
            live = set()
        elif live and {int(r) for r in re.findall(r"\bR(\d+)\b", ins)} & live:
            found.append(ins)
    return found
