"""The Relax functions of a module the graph rewrites apply to: the user's, not outlined groups.

A function marked ``Primitive``, ``Composite`` or ``Codegen`` is a group some pass outlined
(FuseComputeMemory's, FuseOps', a BYOC partition): its body is what the group computes, and
rewriting it would change the group out from under the pass that made it.
"""

from __future__ import annotations

import tvm
from tvm import relax

OUTLINED = ("Primitive", "Composite", "Codegen")


def user_functions(mod: tvm.IRModule):
    """``(global var, function)`` of each user-level Relax function of ``mod``."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and not any(key in (func.attrs or {}) for key in OUTLINED):
            yield gv, func


def rewrite_user_functions(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    """``mod`` with ``rewrite(function)`` in place of each user-level Relax function."""
    out = mod.clone()
    for gv, func in user_functions(mod):
        out[gv] = rewrite(func)
    return out
