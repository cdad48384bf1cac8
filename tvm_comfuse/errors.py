"""User-facing errors: say what was wrong and what to do, never a TVM-internal traceback."""

from __future__ import annotations

import tvm
from tvm import relax


class ComFuseError(ValueError):
    """A bad input to a ComFuse entry point (module, target, database, CLI argument)."""


def check_module(mod, who: str) -> None:
    """Raise :class:`ComFuseError` unless ``mod`` is an IRModule with a Relax function."""
    if not isinstance(mod, tvm.IRModule):
        raise ComFuseError(
            f"{who}: expected a tvm.IRModule holding a Relax function, got {type(mod).__name__}. "
            "Wrap a function with tvm.IRModule({'main': func}) or import a model with "
            "tvm.relax.frontend."
        )
    if not any(isinstance(f, relax.Function) for _, f in mod.functions_items()):
        raise ComFuseError(
            f"{who}: the module has no Relax function (only "
            f"{sorted(gv.name_hint for gv in mod.get_global_vars()) or 'nothing'}). "
            "ComFuse rewrites Relax graphs; build or import the model as Relax first."
        )
