"""CUDA source of compiled modules, and nvcc: how we check GPU code on machines without a GPU."""

from __future__ import annotations

import re
import shutil

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
