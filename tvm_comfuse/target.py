"""Targets as users write them: a tag, a JSON dict or string, ``"llvm"``; errors that help."""

from __future__ import annotations

import json
import os

import tvm

from .errors import ComFuseError

_HINT = (
    'Use a target tag such as "nvidia/nvidia-h100", a JSON dict such as '
    '{"kind": "cuda", "arch": "sm_90"}, or "llvm" for the CPU. TVM 0.27 rejects '
    'command-line strings such as "cuda -arch=sm_90".'
)


def parse_target(target) -> tvm.target.Target:
    """A :class:`tvm.target.Target` from a Target, tag, kind name, JSON dict or JSON string."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str) and target.strip().startswith("{"):
        try:
            target = json.loads(target)
        except json.JSONDecodeError as err:
            raise ComFuseError(f"target {target!r} is not valid JSON ({err}). {_HINT}") from None
    if not isinstance(target, (str, dict)):
        raise ComFuseError(f"target must be a str, dict or tvm.target.Target, got {type(target).__name__}. {_HINT}")
    try:
        return tvm.target.Target(target)
    except Exception as err:  # TVM raises ValueError/TVMError with internal detail
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ComFuseError(f"cannot parse target {target!r}: {first}. {_HINT}") from None


def is_gpu(target: tvm.target.Target) -> bool:
    """True for targets whose kernels need thread bindings (CUDA, ROCm, Metal, ...)."""
    return "gpu" in target.keys


def tuning_target(target) -> tvm.target.Target:
    """``target`` as MetaSchedule measures on it: a CPU target without ``num-cores`` gets this
    machine's core count (MetaSchedule refuses an ``llvm`` target without one)."""
    target = parse_target(target)
    if target.kind.name == "llvm" and "num-cores" not in target.attrs:
        target = parse_target({**dict(target.export()), "num-cores": os.cpu_count() or 1})
    return target
